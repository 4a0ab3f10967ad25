// CUDA kernel of mpkern::adamw_step_ (contract in csrc/cpu/adamw_cpu.cpp).
//
// The kernel is specialised at compile time on (param dtype, grad dtype, moment dtype, master
// mode): one launch per dtype combination present in the list (usually one), never one per
// tensor. Each thread updates 8 elements at a time with 16-byte loads and stores (two for fp32
// buffers); a tensor whose buffers are not all 16-byte aligned at a common element gets scalar
// head and tail elements around the vector body, or the scalar loop when no common alignment
// exists; the read-only grad may sit at any offset (aligned blocks and shifts). A one-block launch
// first computes each tensor's constants for the step (fp64, once per tensor), then bumps the step
// counters; both launches read found_inf on the device and do nothing when it is set: no host sync.
// The metadata table is cached on the device (multi_tensor.cuh): a step can be captured in a CUDA
// graph. 8-bit moments (math.h mom8_*) and the 4-bit exp_avg (mom4_*): 8 consecutive elements per
// lane, wide loads, four lanes per 32-group (its amax in two shuffles); unaligned tensors and a
// tensor's last pass use per-element loads (adam_mom_chunk).
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../adamw_common.h"
#include "../kernels.h"
#include "multi_tensor.cuh"

namespace mpkern {
namespace cuda {

namespace {

constexpr int kAdamBlock = 256;
constexpr int kVE = 8;  // elements per thread-iteration of the vector body
constexpr int kMomSpan = 32 * kVE;  // compact moments: elements of one warp pass (8 groups of 32)
static_assert(kChunk % kMomSpan == 0 && kAdamBlock % 32 == 0 && kVE * 4 == kMom8Group,
              "compact moments: four lanes per group, whole passes per chunk");

// The launch shape of the update kernel, chosen per GPU arch (kArchConfigs) or set for a sweep
// (set_adamw_config): threads per block (a multiple of 32, at most kAdamBlock, the launch bound the
// kernels are compiled for), grid blocks per SM (the grid is min(chunks, SMs x grid_per_sm) blocks
// striding over the chunks), elements per chunk (a multiple of kMomSpan, at most kChunk), and the
// compact kernels' load stages (1: a warp pass's loads in registers; 2: the next pass's loads copied
// into shared memory while the current one updates, mom_wide_passes_staged). Every shape gives the
// same results bit for bit: the arithmetic and the random bits are per element.
struct AdamConfig {
  int block, grid_per_sm;
  int64_t chunk;
  int stages;
};
// The measured best shape per arch (major, minor; minor -1: any of that major), with the run that
// measured it: `python -m tools.gpu_check.sweep` (the sweep_adamw stage of gpu_check.sh --profile scale)
// prints the row to put here. The last row, arch 0, is the default of every other arch.
struct ArchConfig {
  int major, minor;
  AdamConfig config;
  const char* source;
};
constexpr ArchConfig kArchConfigs[] = {
    {0, -1, {kAdamBlock, 8, kChunk, 1}, "built-in default: no sweep of this arch recorded yet"},
};

struct AdamMeta {
  int64_t p, g, m, v, vmax, master, step;  // addresses (vmax / master may be 0)
  int64_t sm, sv;       // 8-bit moments: addresses of the bf16 scales (one per 32 elements); else 0
  int64_t numel;
  int64_t chunk_begin;  // first chunk, counted within this tensor's launch
  int64_t offset;       // global index of element 0 in its random stream (elem_offsets)
  int32_t head;         // elements before the first element at which every buffer but the grad (any offset:
                        // load8_shifted) is 16-byte aligned, -1: none; compact moments: 0 or -1 (element 0)
  uint32_t stream;      // random stream id (stream_ids; default: position in the caller's list)
};
static_assert(sizeof(AdamMeta) == 104, "AdamMeta layout");

struct AdamScalars {
  double lr;  // used when lr_ptr is null; kept in double like the CPU and Triton backends and torch.optim
  const float* lr_ptr;
  const float* factor;
  const float* found_inf;
  double beta1, beta2, eps, weight_decay;
  bool maximize, sr;
  uint32_t seed;
  int64_t chunk;  // elements per chunk (AdamConfig)
  int stages;     // the compact kernels' load stages (AdamConfig)
};

struct TensorConsts {  // a tensor's constants for this step, computed once per tensor by prep_kernel
  AdamWConsts c;
  uint32_t step;  // the step count after the increment
};
static_assert(sizeof(TensorConsts) == 32, "TensorConsts layout");

// Whether the param/master store draws on the element's random word (field A: param SR or the
// 8-bit master correction); bf16 / 8-bit moments use its fields B and C (math.h, rng_key): one
// word per element per step serves every rounding.
template <int PDT, int SDT, int MODE>
__device__ __forceinline__ bool needs_word0(bool sr) {
  return MODE == kMaster8bit || (MODE == kMasterNone && PDT == kBF16 && sr);
}

// The fp32 master of element i (the param itself in mode 0).
template <int PDT, int MODE>
__device__ __forceinline__ float load_w(const AdamMeta& t, int64_t i) {
  const void* P = reinterpret_cast<const void*>(t.p);
  if constexpr (MODE == kMasterF32) {
    return reinterpret_cast<const float*>(t.master)[i];
  } else if constexpr (MODE == kMasterRemainder) {
    return join_master(static_cast<const uint16_t*>(P)[i], reinterpret_cast<const int16_t*>(t.master)[i]);
  } else if constexpr (MODE == kMaster8bit) {
    return master8_decode(static_cast<const uint16_t*>(P)[i], reinterpret_cast<const int8_t*>(t.master)[i], PDT);
  } else {
    return load_as_f32(P, i, PDT);
  }
}

// Store the updated master p of element i and the param; r0 = the element's random word (when w0).
template <int PDT, int MODE>
__device__ __forceinline__ void store_w(const AdamMeta& t, int64_t i, float p, uint32_t r0, bool w0) {
  void* P = reinterpret_cast<void*>(t.p);
  if constexpr (MODE == kMasterF32) {
    reinterpret_cast<float*>(t.master)[i] = p;
    store_from_f32(P, i, PDT, p);
  } else if constexpr (MODE == kMasterRemainder) {
    uint16_t hi;
    int16_t rem;
    split_master(p, hi, rem);
    static_cast<uint16_t*>(P)[i] = hi;
    reinterpret_cast<int16_t*>(t.master)[i] = rem;
  } else if constexpr (MODE == kMaster8bit) {
    uint16_t h;
    int8_t c;
    master8_encode(p, PDT, r0, h, c);
    static_cast<uint16_t*>(P)[i] = h;
    reinterpret_cast<int8_t*>(t.master)[i] = c;
  } else if (w0) {
    static_cast<uint16_t*>(P)[i] = f32_to_bf16_sr(p, rand_a16(r0));
  } else {
    store_from_f32(P, i, PDT, p);
  }
}

// One element, scalar loads and stores.
template <int PDT, int GDT, int SDT, int MODE>
__device__ __forceinline__ void adam_scalar(const AdamMeta& t, int64_t i, const AdamWConsts& cs, float factor,
                                            bool sr, const RngKeys& keys) {
  void *M = reinterpret_cast<void*>(t.m), *V = reinterpret_cast<void*>(t.v);
  float* VMAX = reinterpret_cast<float*>(t.vmax);
  const uint64_t e = static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(i);
  const bool w0 = needs_word0<PDT, SDT, MODE>(sr);
  const uint32_t r0 = (w0 || SDT == kBF16) ? rng_word(keys, e) : 0u;
  const float g = load_as_f32(reinterpret_cast<const void*>(t.g), i, GDT) * factor;
  float p = load_w<PDT, MODE>(t, i);
  float m = load_as_f32(M, i, SDT);
  float v = load_as_f32(V, i, SDT);
  p = adamw_update(p, g, m, v, VMAX ? VMAX + i : nullptr, cs);
  if constexpr (SDT == kBF16) {
    static_cast<uint16_t*>(M)[i] = f32_to_bf16_sr(m, rand_b16(r0));
    static_cast<uint16_t*>(V)[i] = f32_to_bf16_sr(v, rand_c16(r0));
  } else {
    static_cast<float*>(M)[i] = m;
    static_cast<float*>(V)[i] = v;
  }
  store_w<PDT, MODE>(t, i, p, r0, w0);
}

// The random keys of a compact-moment chunk's elements (rng_key of their high index half): a chunk
// (fewer than 2^32 elements) spans at most two halves, so both keys are computed once per chunk and
// no element needs the key's inputs again.
struct ChunkKeys {
  uint32_t hi;    // the high index half of the chunk's first element
  uint32_t key;   // its key
  uint32_t next;  // the key of half hi + 1 (= key when the chunk stays in one half)
  bool one_half;  // every element of the chunk is in half hi
};

// `last`: the global index of the chunk's last element.
__device__ __forceinline__ ChunkKeys chunk_keys(const RngKeys& k, uint64_t last) {
  ChunkKeys c{k.hi, k.key, k.key, static_cast<uint32_t>(last >> 32) == k.hi};
  if (!c.one_half) c.next = rng_key(k.seed, k.stream, k.step, k.hi + 1u);
  return c;
}

// The random words of elements e .. e + kVE - 1 of the chunk, one each: rng_word's. SAME_HI: the
// caller knows that the eight elements' high index half is the chunk's first (keys.hi).
template <bool SAME_HI>
__device__ __forceinline__ void rng_words8(const ChunkKeys& keys, uint64_t e, uint32_t (&rw)[kVE]) {
  const uint32_t lo = static_cast<uint32_t>(e);
  if constexpr (SAME_HI) {
#pragma unroll
    for (int k = 0; k < kVE; ++k) rw[k] = rng_bits(keys.key, lo + k);
  } else {
    const uint32_t k0 = static_cast<uint32_t>(e >> 32) == keys.hi ? keys.key : keys.next;
#pragma unroll
    for (int k = 0; k < kVE; ++k) rw[k] = rng_bits(lo + k < lo ? keys.next : k0, lo + k);  // wrapped: half hi + 1
  }
}

// rng_words8<true> where e is a multiple of kVE (math.h, rng_bits8_base / rng_bits8_at).
__device__ __forceinline__ void rng_words8_aligned(const ChunkKeys& keys, uint64_t e, uint32_t (&rw)[kVE]) {
  const uint32_t base = rng_bits8_base(keys.key, static_cast<uint32_t>(e));
#pragma unroll
  for (int k = 0; k < kVE; ++k) rw[k] = rng_bits8_at(base, static_cast<uint32_t>(k));
}

// 16-byte words holding kVE elements' masters (or params): two for fp32 masters or params and for the
// bf16 param + remainder pair, one else (the 8-bit master's param, its correction bytes beside it).
template <int PDT, int MODE>
constexpr int master_words() {
  return (MODE == kMasterF32 || MODE == kMasterRemainder || (MODE == kMasterNone && PDT == kF32)) ? 2 : 1;
}

// The fp32 masters of kVE elements from their bytes: w (master_words of them) and c, the 8-bit corrections.
template <int PDT, int MODE>
__device__ __forceinline__ void masters8_from_raw(const uint4 (&w)[2], const uint2 c, float (&p)[kVE]) {
  if constexpr (MODE == kMasterF32 || (MODE == kMasterNone && PDT == kF32)) {
    float a[4], b[4];
    vec_from_raw<kF32>(w[0], a);
    vec_from_raw<kF32>(w[1], b);
#pragma unroll
    for (int k = 0; k < 4; ++k) { p[k] = a[k]; p[k + 4] = b[k]; }
  } else if constexpr (MODE == kMasterRemainder) {
    uint16_t hi[kVE], lo[kVE];
    unpack16(w[0], hi);
    unpack16(w[1], lo);
#pragma unroll
    for (int k = 0; k < kVE; ++k) p[k] = join_master(hi[k], static_cast<int16_t>(lo[k]));
  } else if constexpr (MODE == kMaster8bit && PDT == kBF16) {
    // master8_decode's (h << 16) + 256 c as (h << 16 | (c ^ 0x80) << 8) - 0x8000: the correction bytes
    // offset by 128 (one xor per four, and two masks), then each element's param half and byte put
    // together by one byte permute (a zero byte beside each correction byte: even ones from
    // c & 0x00ff00ff, odd ones from c & 0xff00ff00) and one subtract -- the same bits
    const uint32_t ws[4] = {w[0].x, w[0].y, w[0].z, w[0].w};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t cw = h == 0 ? c.x : c.y;
      const uint32_t cx = cw ^ 0x80808080u, even = cx & 0x00ff00ffu, odd = cx & 0xff00ff00u;
      // byte permutes: [zero, c_k, param bytes], for k = 0..3 of the word
      p[4 * h + 0] = f32_from_bits(__byte_perm(ws[2 * h], even, 0x1045u) - 0x8000u);
      p[4 * h + 1] = f32_from_bits(__byte_perm(ws[2 * h], odd, 0x3254u) - 0x8000u);
      p[4 * h + 2] = f32_from_bits(__byte_perm(ws[2 * h + 1], even, 0x1067u) - 0x8000u);
      p[4 * h + 3] = f32_from_bits(__byte_perm(ws[2 * h + 1], odd, 0x3276u) - 0x8000u);
    }
  } else if constexpr (MODE == kMaster8bit) {
    uint16_t hi[kVE];
    unpack16(w[0], hi);
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      const int8_t ck = static_cast<int8_t>(((k < 4 ? c.x : c.y) >> (8 * (k & 3))) & 0xffu);
      p[k] = master8_decode(hi[k], ck, PDT);
    }
  } else {
    vec_from_raw<PDT>(w[0], p);
  }
}

// Where kVE elements' master bytes starting at i are: the master_words 16-byte words and the 8 bytes of
// 8-bit corrections (null where the mode has none).
struct MasterSrc {
  const char* w[2];
  const char* c;
};
template <int PDT, int MODE>
__device__ __forceinline__ MasterSrc master_src(const AdamMeta& t, int64_t i) {
  const char* P = reinterpret_cast<const char*>(t.p);
  const char* W = reinterpret_cast<const char*>(t.master);
  if constexpr (MODE == kMasterF32) return {{W + 4 * i, W + 4 * i + 16}, nullptr};
  if constexpr (MODE == kMasterRemainder) return {{P + 2 * i, W + 2 * i}, nullptr};
  if constexpr (MODE == kMaster8bit) return {{P + 2 * i, nullptr}, W + i};
  return {{P + elem_bytes<PDT>() * i, PDT == kF32 ? P + 4 * i + 16 : nullptr}, nullptr};
}

// The fp32 masters of kVE elements starting at i (every buffer aligned there).
template <int PDT, int MODE>
__device__ __forceinline__ void load8_w(const AdamMeta& t, int64_t i, float (&p)[kVE]) {
  const MasterSrc src = master_src<PDT, MODE>(t, i);
  uint4 w[2] = {*reinterpret_cast<const uint4*>(src.w[0]), {}};
  if constexpr (master_words<PDT, MODE>() == 2) w[1] = *reinterpret_cast<const uint4*>(src.w[1]);
  uint2 c = {};
  if constexpr (MODE == kMaster8bit) c = __ldcg(reinterpret_cast<const uint2*>(src.c));
  masters8_from_raw<PDT, MODE>(w, c, p);
}

// Store the updated masters p of kVE elements starting at i and the params; rw = their random words.
// NUM: no p is NaN (the 8-bit master of bf16 params skips the NaN case).
template <int PDT, int MODE, bool NUM = false>
__device__ __forceinline__ void store8_w(const AdamMeta& t, int64_t i, const float (&p)[kVE],
                                         const uint32_t (&rw)[kVE], bool w0) {
  void* P = reinterpret_cast<void*>(t.p);
  uint16_t hi[kVE];
  if constexpr (MODE == kMasterF32) {
    store8<kF32>(reinterpret_cast<void*>(t.master), i, p);
    store8<PDT>(P, i, p);
  } else if constexpr (MODE == kMasterRemainder) {
    uint16_t lo[kVE];
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      int16_t rem;
      split_master(p[k], hi[k], rem);
      lo[k] = static_cast<uint16_t>(rem);
    }
    store8_u16(P, i, hi);
    store8_u16(reinterpret_cast<void*>(t.master), i, lo);
  } else if constexpr (MODE == kMaster8bit) {
    uint32_t cw[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      int8_t c;
      if (NUM && PDT == kBF16) {
        master8_encode_bf16_num(p[k], rw[k] & 0xffu, hi[k], c);
      } else {
        master8_encode(p[k], PDT, rw[k], hi[k], c);
      }
      cw[k >> 2] |= static_cast<uint32_t>(static_cast<uint8_t>(c)) << (8 * (k & 3));
    }
    store8_u16(P, i, hi);
    __stcg(reinterpret_cast<uint2*>(reinterpret_cast<int8_t*>(t.master) + i), make_uint2(cw[0], cw[1]));
  } else if (w0) {
#pragma unroll
    for (int k = 0; k < kVE; ++k) hi[k] = f32_to_bf16_sr(p[k], rand_a16(rw[k]));
    store8_u16(P, i, hi);
  } else {
    store8<PDT>(P, i, p);
  }
}

// One lane's kVE elements [i, i + kVE) of a compact-moment tensor (SDT kMom8, or kMom4: the 4-bit
// exp_avg, two codes per byte), loaded: grads times factor, masters, codes (byte k of cm / cv is
// element i + k's; kMom4: nibble k of cm.x), the group's old scales. WIDE: the buffers are aligned
// and the elements inside the tensor: one access per buffer, the grad's too when GA (it is 16-byte
// aligned at i; else it may sit at any offset: load8_shifted); else per-element loads of the elements
// before `end` (the others read as 0).
struct MomLane {
  float g[kVE], w[kVE];
  uint2 cm, cv;
  float sm, sv;
};

template <int PDT, int GDT, int SDT, int MODE, bool WIDE, bool GA = false>
__device__ __forceinline__ void mom_load(const AdamMeta& t, int64_t i, int64_t end, float factor, MomLane& x) {
  constexpr bool kM4 = SDT == kMom4;
  const uint8_t* __restrict__ CM = reinterpret_cast<const uint8_t*>(t.m);
  const uint8_t* __restrict__ CV = reinterpret_cast<const uint8_t*>(t.v);
  const void* G = reinterpret_cast<const void*>(t.g);
  const bool in = WIDE || i < end;  // a lane past the end reads no scale (its group may not exist)
  const uint64_t grp = static_cast<uint64_t>(i) / kMom8Group;  // i >= 0: a shift
  x.sm = in ? bf16_to_f32(reinterpret_cast<const uint16_t*>(t.sm)[grp]) : 0.f;
  x.sv = in ? bf16_to_f32(reinterpret_cast<const uint16_t*>(t.sv)[grp]) : 0.f;
  if constexpr (WIDE) {
    if constexpr (GA) {
      load8<GDT>(G, i, x.g);
    } else {
      load8_shifted<GDT>(G, i, x.g);
    }
    load8_w<PDT, MODE>(t, i, x.w);
    x.cm = kM4 ? make_uint2(__ldcg(reinterpret_cast<const unsigned int*>(CM + (i >> 1))), 0u)
               : __ldcg(reinterpret_cast<const uint2*>(CM + i));
    x.cv = __ldcg(reinterpret_cast<const uint2*>(CV + i));
  } else {
    uint32_t cm[2] = {0u, 0u}, cv[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      const bool act = i + k < end;
      x.g[k] = act ? load_as_f32(G, i + k, GDT) : 0.f;
      x.w[k] = act ? load_w<PDT, MODE>(t, i + k) : 0.f;
      if (act) cv[k >> 2] |= static_cast<uint32_t>(CV[i + k]) << (8 * (k & 3));
      if (act && kM4 && (k & 1) == 0) cm[0] |= static_cast<uint32_t>(CM[(i + k) >> 1]) << (4 * k);
      if (act && !kM4) cm[k >> 2] |= static_cast<uint32_t>(CM[i + k]) << (8 * (k & 3));
    }
    x.cm = make_uint2(cm[0], cm[1]), x.cv = make_uint2(cv[0], cv[1]);
  }
#pragma unroll
  for (int k = 0; k < kVE; ++k) x.g[k] *= factor;
}

__device__ __forceinline__ uint32_t code_byte(uint2 w, int k) { return ((k < 4 ? w.x : w.y) >> 8 * (k & 3)) & 0xffu; }

// Nibble k of w in the top nibble, the bits below other nibbles': one shift, opaque to the compiler
// (which would otherwise fold it into a shift and mask for each use, the sign's and the magnitude's).
__device__ __forceinline__ uint32_t nibble_top(uint32_t w, int k) {
  if (k == 7) return w;
  uint32_t y;
  asm("shl.b32 %0, %1, %2;" : "=r"(y) : "r"(w), "r"(28 - 4 * k));
  return y;
}

// The low bytes of a, b, c, d as one word (three byte permutes).
__device__ __forceinline__ uint32_t pack_low_bytes(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return __byte_perm(__byte_perm(a, b, 0x0040u), __byte_perm(c, d, 0x0040u), 0x5410u);
}

// Per float of a, b, c, d a byte 0xff where its sign bit is set, else 0 (three byte permutes: PTX prmt's
// selector values 8..15 replicate the selected byte's top bit, which __byte_perm does not offer).
__device__ __forceinline__ uint32_t sign_bytes(float a, float b, float c, float d) {
  uint32_t ab, cd, r;
  asm("prmt.b32 %0, %1, %2, 0x00fb;" : "=r"(ab) : "r"(f32_bits(a)), "r"(f32_bits(b)));
  asm("prmt.b32 %0, %1, %2, 0x00fb;" : "=r"(cd) : "r"(f32_bits(c)), "r"(f32_bits(d)));
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(r) : "r"(ab), "r"(cd));
  return r;
}

// Code byte k of w in the top byte, the others zero, for ladder_decode_top: one byte permute (a shift
// would be folded by the compiler into a shift and mask per use, the sign's and the magnitude's).
__device__ __forceinline__ uint32_t code_top(uint2 w, int k) {
  return __byte_perm(k < 4 ? w.x : w.y, 0u, 0x0444u | (static_cast<uint32_t>(k & 3) << 12));
}

// The lane's new moments from the elements loaded by mom_load, with what the step and the group scales
// need: the largest |m| and v of the lane's elements before `end` (am, av, bit patterns) and, WIDE,
// whether the pass may take the main loop's forms (`fast`): the step without the IEEE square root's and
// division's rare cases (math.h, adamw_step_in_range_ok) and, for the 8-bit master of bf16 params, the
// master's encoder without its NaN case (every old master is finite, so -- the step's values being in
// range, the quotient finite -- no new one is NaN).
struct MomMid {
  float m[kVE], v[kVE];
  uint32_t am, av;
  bool fast;
};

template <int PDT, int SDT, int MODE, bool WIDE>
__device__ __forceinline__ MomMid mom_moments(int64_t i, int64_t end, MomLane& x, const AdamWConsts& cs) {
  constexpr bool kM4 = SDT == kMom4;
  constexpr bool kNan = MODE == kMaster8bit && PDT == kBF16;
  MomMid y;
  y.am = 0u, y.av = 0u;
  uint32_t m_lo = 0xffffffffu, v_lo = 0xffffffffu;
  bool nan = false;
#pragma unroll
  for (int k = 0; k < kVE; ++k) {
    // mom4_decode_m / mom8_decode_m / mom8_decode_v from the code words (nibble k of cm.x, byte k)
    y.m[k] = kM4 ? ladder_decode_top<4, ladder_m4().mbits, true>(nibble_top(x.cm.x, k), x.sm)
                 : ladder_decode_top<8, ladder_m8().mbits, true>(code_top(x.cm, k), x.sm);
    y.v[k] = ladder_decode_top<8, ladder_v8().mbits, false, true>(code_top(x.cv, k), x.sv);
    adamw_moments(x.g[k], y.m[k], y.v[k], cs);
    if (WIDE || i + k < end) {
      y.am = max(y.am, f32_bits(y.m[k]) & 0x7fffffffu);
      y.av = max(y.av, f32_bits(y.v[k]) & 0x7fffffffu);
    }
    if (WIDE) {
      m_lo = min(m_lo, (f32_bits(y.m[k]) & 0x7fffffffu) - 1u);
      v_lo = min(v_lo, f32_bits(y.v[k]));
      if (kNan) nan |= !(fabsf(x.w[k]) < INFINITY);  // (not the NaN test: inf * a zero decay is NaN)
    }
  }
  y.fast = WIDE & !nan & adamw_step_in_range_ok(m_lo, y.am, v_lo, y.av, cs);  // (no branches)
  return y;
}

// The step of the lane's masters: FAST (every lane's y.fast) without the IEEE rare cases, else the IEEE
// operations -- the same bits.
template <bool FAST>
__device__ __forceinline__ void mom_step(MomLane& x, const MomMid& y, const AdamWConsts& cs) {
#pragma unroll
  for (int k = 0; k < kVE; ++k)
    x.w[k] = FAST ? adamw_step_in_range(x.w[k], y.m[k], y.v[k], cs) : adamw_step(x.w[k], y.m[k], y.v[k], cs);
}

// After the step: take the group's amax over its four lanes (lane quads are groups: the elements of a
// pass start at a multiple of 32), encode and store. Every lane of the warp calls it (the shuffles);
// elements at or past `end` contribute 0 to the amax and are not stored. The first lane of a quad writes
// the group's scales. WIDE: also, every element of the pass has the chunk key's high index half
// (mom_wide_passes). FAST: every lane's y.fast (the masters' encoder without its NaN case) and the
// tensor's stream offset a multiple of kVE (the random words from one mix32 first step per lane).
template <int PDT, int GDT, int SDT, int MODE, bool WIDE, bool FAST = false>
__device__ __forceinline__ void mom_finish(const AdamMeta& t, int64_t i, int64_t end, int lane, MomLane& x,
                                           const MomMid& y, bool sr, const ChunkKeys& keys) {
  constexpr bool kM4 = SDT == kMom4;
  const float* m = y.m;
  const float* v = y.v;
  uint32_t am = y.am, av = y.av;
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    am = max(am, __shfl_xor_sync(0xffffffffu, am, o));
    av = max(av, __shfl_xor_sync(0xffffffffu, av, o));
  }
  const uint32_t bm = ladder_scale_bits(am, kM4 ? ladder_m4() : ladder_m8()), bv = ladder_scale_bits(av, ladder_v8());
  const float im = ladder_inv_scale(bm), iv = ladder_inv_scale(bv);
  uint32_t rw[kVE];
  const uint64_t e = static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(i);
  if constexpr (FAST) {
    rng_words8_aligned(keys, e, rw);  // the main loop runs only where t.offset is a multiple of kVE
  } else {
    rng_words8<WIDE>(keys, e, rw);
  }
  uint32_t cm[2], cv[2], qm[kVE], qv[kVE];
#pragma unroll
  for (int k = 0; k < kVE; ++k) {
    const uint32_t r = rand_b16(rw[k]);
    qm[k] = ladder_encode(fabsf(m[k]), im, r, kM4 ? ladder_m4().mbits : ladder_m8().mbits);
    if constexpr (FAST) {  // every v >= 2^-101 (adamw_step_in_range_ok): mom8_encode_v's rule is max(q, 1)
      const uint32_t q = ladder_encode(v[k], iv, rand_c16(rw[k]), ladder_v8().mbits);
      asm("max.u32 %0, %1, 1;" : "=r"(qv[k]) : "r"(q));  // (one VIMNMX, not a compare and select)
    } else {
      qv[k] = mom8_encode_v(v[k], iv, rand_c16(rw[k]));
    }
  }
  // the codes' bytes four at a time, the signs of m as bytes: mom8_encode_m's q | sign << 7; kMom4,
  // mom4_encode_m's nibbles q | sign << 3, two per byte (q < 8 for a finite m; a group with another m
  // has the NaN scale, its codes zeroed below)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    cv[h] = pack_low_bytes(qv[4 * h], qv[4 * h + 1], qv[4 * h + 2], qv[4 * h + 3]);
    if constexpr (!kM4)
      cm[h] = pack_low_bytes(qm[4 * h], qm[4 * h + 1], qm[4 * h + 2], qm[4 * h + 3]) |
              (sign_bytes(m[4 * h], m[4 * h + 1], m[4 * h + 2], m[4 * h + 3]) & 0x80808080u);
  }
  if constexpr (kM4) {
    cm[0] = pack_low_bytes(qm[0] | qm[1] << 4, qm[2] | qm[3] << 4, qm[4] | qm[5] << 4, qm[6] | qm[7] << 4) |
            (sign_bytes(m[0], m[2], m[4], m[6]) & 0x08080808u) |  // even elements: bit 3 of the byte
            (sign_bytes(m[1], m[3], m[5], m[7]) & 0x80808080u);   // odd ones: bit 7
    cm[1] = 0u;
  }
  if (bm == kMom8NaNScale) cm[0] = cm[1] = 0u;  // a NaN group's codes are 0
  if (bv == kMom8NaNScale) cv[0] = cv[1] = 0u;
  const bool w0 = needs_word0<PDT, SDT, MODE>(sr);
  uint8_t* __restrict__ CM = reinterpret_cast<uint8_t*>(t.m);
  uint8_t* __restrict__ CV = reinterpret_cast<uint8_t*>(t.v);
  if constexpr (WIDE) {
    store8_w<PDT, MODE, FAST>(t, i, x.w, rw, w0);
    if constexpr (kM4) {
      __stcg(reinterpret_cast<unsigned int*>(CM + (i >> 1)), cm[0]);
    } else {
      __stcg(reinterpret_cast<uint2*>(CM + i), make_uint2(cm[0], cm[1]));
    }
    __stcg(reinterpret_cast<uint2*>(CV + i), make_uint2(cv[0], cv[1]));
  } else {
    const uint2 cmw = make_uint2(cm[0], cm[1]), cvw = make_uint2(cv[0], cv[1]);
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      if (i + k >= end) continue;
      store_w<PDT, MODE>(t, i + k, x.w[k], rw[k], w0);
      CV[i + k] = static_cast<uint8_t>(code_byte(cvw, k));
      // kMom4: the byte of an even element and its odd neighbour (0 past the end)
      if (kM4 && (k & 1) == 0) CM[(i + k) >> 1] = static_cast<uint8_t>(code_byte(cmw, k >> 1));
      if (!kM4) CM[i + k] = static_cast<uint8_t>(code_byte(cmw, k));
    }
  }
  __syncwarp();  // every lane of the group has read the old scales (they are in registers) before one writes
  if ((lane & 3) == 0 && i < end) {
    const uint64_t grp = static_cast<uint64_t>(i) / kMom8Group;
    reinterpret_cast<uint16_t*>(t.sm)[grp] = static_cast<uint16_t>(bm);
    reinterpret_cast<uint16_t*>(t.sv)[grp] = static_cast<uint16_t>(bv);
  }
}

// One pass with the IEEE step (the tail passes: elements loaded one by one).
template <int PDT, int GDT, int SDT, int MODE, bool WIDE>
__device__ __forceinline__ void mom_update(const AdamMeta& t, int64_t i, int64_t end, int lane, MomLane& x,
                                           const AdamWConsts& cs, bool sr, const ChunkKeys& keys) {
  const MomMid y = mom_moments<PDT, SDT, MODE, WIDE>(i, end, x, cs);
  mom_step<false>(x, y, cs);
  mom_finish<PDT, GDT, SDT, MODE, WIDE>(t, i, end, lane, x, y, sr, keys);
}

// The whole warp passes of an aligned compact-moment tensor from wb (this warp's first pass) up to
// `end`, in a chunk whose elements all have the chunk key's high index half: wide accesses, and the
// random words from the chunk's key without a per-element check of the half. GA: the grad is 16-byte
// aligned at every pass (one access), else load8_shifted. Returns the first pass not done.
// Indices are 32-bit offsets into chunk_view's buffers.
template <int PDT, int GDT, int SDT, int MODE, bool GA>
__device__ __forceinline__ uint32_t mom_wide_passes(const AdamMeta& t, uint32_t wb, uint32_t end, int warps, int lane,
                                                    const AdamWConsts& cs, float factor, bool sr,
                                                    const ChunkKeys& keys) {
  const uint32_t stride = static_cast<uint32_t>(warps) * kMomSpan;
  const bool off8 = (t.offset & (kVE - 1)) == 0;  // (mom_finish<..., FAST>'s random words)
  for (;;) {
    MomLane x;
    MomMid y;
    for (;;) {  // the main loop: passes whose lanes are all fast (MomMid), of a tensor with off8
      if (wb + kMomSpan > end) return wb;
      mom_load<PDT, GDT, SDT, MODE, true, GA>(t, wb + lane * kVE, end, factor, x);
      y = mom_moments<PDT, SDT, MODE, true>(wb + lane * kVE, end, x, cs);
      if (__builtin_expect(!__all_sync(0xffffffffu, y.fast & off8), 0)) break;
      mom_step<true>(x, y, cs);
      mom_finish<PDT, GDT, SDT, MODE, true, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
      wb += stride;
    }
    // a pass with a value outside them (a zero or tiny v, a non-finite moment, ...): the IEEE step,
    // outside the main loop
    mom_step<false>(x, y, cs);
    mom_finish<PDT, GDT, SDT, MODE, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
    wb += stride;
  }
}

// ---- the compact kernels' wide passes with the next pass's loads in flight (AdamConfig::stages 2) ----
// The compact instances fit 2 blocks per SM in registers (more spill: RESULTS "Issue 43, stop 48"), and a
// lane holds one pass's loads (~56 bytes) in registers: ~15-17 KB in flight per SM where an H200 needs
// ~25 KB (RESULTS "The CUDA AdamW step on paper"). Staged, each lane copies its bytes of the warp's next
// pass into its own shared-memory slots (cp.async: LDGSTS, no registers held) before it updates the
// current pass, so two passes' loads are in flight. Only the lane that copied a slot reads it: a wait on
// the lane's own copy groups, no barrier. The arithmetic is mom_update's: the same bits as one stage.

// One asynchronous copy of N (4, 8 or 16) bytes from global src to shared dst (both N-byte aligned);
// before sm_80 (no cp.async) a plain copy. cp_async_commit closes the lane's current group of copies;
// cp_async_wait<K> returns when at most K of its groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(N) : "memory");
  }
#else
  if constexpr (N == 16) {
    *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
  } else if constexpr (N == 8) {
    *static_cast<uint2*>(dst) = *static_cast<const uint2*>(src);
  } else {
    *static_cast<uint32_t*>(dst) = *static_cast<const uint32_t*>(src);
  }
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int K>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(K) : "memory");
#endif
}

// A block's two stages of slots, one per thread and field: the 16-bit grad (16 bytes), the master or
// param words (one or two 16-byte words: fp32 masters or params, or the bf16 param and its remainder;
// the 8-bit master's param, with its correction bytes in c), the exp_avg codes (8 bytes; kMom4: 4), the
// exp_avg_sq codes and the 4-byte words that hold the group's two bf16 scales. Field-major: a warp's
// 16-byte reads of one field are 512 contiguous bytes (no bank conflict). It lives in the launch's
// dynamic shared memory, which the host gives only a two-stage launch (mom_stage_bytes): a one-stage
// launch reserves none, as before the stages existed.
template <int PDT, int MODE>
struct MomStage {
  uint4 g[2][kAdamBlock];
  uint4 w[2][master_words<PDT, MODE>()][kAdamBlock];
  uint2 c[2][MODE == kMaster8bit ? kAdamBlock : 1];
  uint2 cm[2][kAdamBlock];
  uint2 cv[2][kAdamBlock];
  uint32_t sc[2][2][kAdamBlock];
};

// Lane copies of the kVE elements at i (a whole pass of an aligned tensor, its grad 16-byte aligned at i,
// its scale buffers 4-byte aligned) into stage b, as one copy group.
template <int PDT, int SDT, int MODE>
__device__ __forceinline__ void mom_stage_issue(const AdamMeta& t, int64_t i, MomStage<PDT, MODE>& st, int b,
                                                int tid) {
  cp_async<16>(&st.g[b][tid], reinterpret_cast<const char*>(t.g) + 2 * i);
  const MasterSrc src = master_src<PDT, MODE>(t, i);
  cp_async<16>(&st.w[b][0][tid], src.w[0]);
  if constexpr (master_words<PDT, MODE>() == 2) cp_async<16>(&st.w[b][1][tid], src.w[1]);
  if constexpr (MODE == kMaster8bit) cp_async<8>(&st.c[b][tid], src.c);
  if constexpr (SDT == kMom4) {
    cp_async<4>(&st.cm[b][tid], reinterpret_cast<const char*>(t.m) + (i >> 1));
  } else {
    cp_async<8>(&st.cm[b][tid], reinterpret_cast<const char*>(t.m) + i);
  }
  cp_async<8>(&st.cv[b][tid], reinterpret_cast<const char*>(t.v) + i);
  const uint64_t pair = (static_cast<uint64_t>(i) / kMom8Group) & ~uint64_t{1};  // the scale's 4-byte word
  cp_async<4>(&st.sc[b][0][tid], reinterpret_cast<const uint16_t*>(t.sm) + pair);
  cp_async<4>(&st.sc[b][1][tid], reinterpret_cast<const uint16_t*>(t.sv) + pair);
  cp_async_commit();
}

// mom_load's MomLane (WIDE, GA) of the kVE elements at i from stage b: the same values from the same bytes.
template <int PDT, int GDT, int SDT, int MODE>
__device__ __forceinline__ void mom_stage_read(const MomStage<PDT, MODE>& st, int b, int tid, int64_t i, float factor,
                                               MomLane& x) {
  vec_from_raw<GDT>(st.g[b][tid], x.g);
  const uint4 w[2] = {st.w[b][0][tid], master_words<PDT, MODE>() == 2 ? st.w[b][master_words<PDT, MODE>() - 1][tid]
                                                                      : uint4{}};
  masters8_from_raw<PDT, MODE>(w, MODE == kMaster8bit ? st.c[b][tid] : uint2{}, x.w);
  x.cm = SDT == kMom4 ? make_uint2(st.cm[b][tid].x, 0u) : st.cm[b][tid];
  x.cv = st.cv[b][tid];
  const uint32_t shift = static_cast<uint32_t>((static_cast<uint64_t>(i) / kMom8Group) & 1u) * 16u;
  x.sm = bf16_to_f32(static_cast<uint16_t>(st.sc[b][0][tid] >> shift));
  x.sv = bf16_to_f32(static_cast<uint16_t>(st.sc[b][1][tid] >> shift));
#pragma unroll
  for (int k = 0; k < kVE; ++k) x.g[k] *= factor;
}

// mom_wide_passes<..., GA = true> with two stages: pass wb + stride's copies are issued before pass wb is
// updated. Returns the first pass not done; no copy is in flight on return (the next chunk reuses the slots).
template <int PDT, int GDT, int SDT, int MODE>
__device__ __forceinline__ uint32_t mom_wide_passes_staged(const AdamMeta& t, uint32_t wb, uint32_t end, int warps,
                                                           int lane, const AdamWConsts& cs, float factor, bool sr,
                                                           const ChunkKeys& keys) {
  extern __shared__ uint4 mom_stage_smem[];  // mom_stage_bytes(PDT, MODE) of dynamic shared memory
  MomStage<PDT, MODE>& st = *reinterpret_cast<MomStage<PDT, MODE>*>(mom_stage_smem);
  const int tid = threadIdx.x;
  const uint32_t stride = static_cast<uint32_t>(warps) * kMomSpan;
  if (wb + kMomSpan <= end) mom_stage_issue<PDT, SDT, MODE>(t, wb + lane * kVE, st, 0, tid);
  const bool off8 = (t.offset & (kVE - 1)) == 0;
  int b = 0;
  for (;;) {
    MomLane x;
    MomMid y;
    for (;;) {  // as in mom_wide_passes: the passes whose lanes are all fast, of a tensor with off8
      if (wb + kMomSpan > end) return wb;
      if (wb + stride + kMomSpan <= end) {
        mom_stage_issue<PDT, SDT, MODE>(t, wb + stride + lane * kVE, st, b ^ 1, tid);
        cp_async_wait<1>();  // this lane's copies of pass wb have landed (the next pass's may not have)
      } else {
        cp_async_wait<0>();
      }
      mom_stage_read<PDT, GDT, SDT, MODE>(st, b, tid, wb + lane * kVE, factor, x);
      y = mom_moments<PDT, SDT, MODE, true>(wb + lane * kVE, end, x, cs);
      if (__builtin_expect(!__all_sync(0xffffffffu, y.fast & off8), 0)) break;
      mom_step<true>(x, y, cs);
      mom_finish<PDT, GDT, SDT, MODE, true, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
      wb += stride, b ^= 1;
    }
    mom_step<false>(x, y, cs);  // the IEEE step, outside the main loop
    mom_finish<PDT, GDT, SDT, MODE, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
    wb += stride, b ^= 1;
  }
}

// t with every buffer moved to element `begin` (a multiple of kMomSpan: alignments and scale-word parities
// are kept) and its stream offset advanced to match: the wide passes then address a chunk's elements by
// 32-bit offsets (one IMAD.WIDE.U32 per address instead of a 64-bit add and its carry).
template <int PDT, int GDT, int SDT, int MODE>
__device__ __forceinline__ AdamMeta chunk_view(const AdamMeta& t, int64_t begin) {
  AdamMeta c = t;
  c.p += begin * elem_bytes<PDT>();
  c.g += begin * elem_bytes<GDT>();
  c.m += SDT == kMom4 ? begin / 2 : begin;
  c.v += begin;
  if (MODE != kMasterNone) c.master += begin * (MODE == kMasterF32 ? 4 : MODE == kMasterRemainder ? 2 : 1);
  c.sm += 2 * (begin / kMom8Group);
  c.sv += 2 * (begin / kMom8Group);
  c.numel -= begin;
  c.offset += begin;
  return c;
}

// The compact-moment elements [begin, end) of a chunk: warp passes of kMomSpan elements from the
// chunk's start, lane l taking [pass + 8l, pass + 8l + 8) (a pass is 8 whole groups). Whole passes of
// an aligned tensor use wide accesses (mom_wide_passes: for 16-bit grads a loop per grad alignment, so
// the hot one has no alignment switch); a tensor's last pass, every pass of an unaligned one and every
// pass of a chunk that crosses a multiple of 2^32 elements of its random stream use per-element loads.
// (Two passes per iteration, loads first, took 114-162 registers and spilled.)
template <int PDT, int GDT, int SDT, int MODE>
__device__ __forceinline__ void adam_mom_chunk(const AdamMeta& t, int64_t begin, int64_t end, const AdamWConsts& cs,
                                               float factor, bool sr, const ChunkKeys& keys, int stages) {
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  int64_t wb = begin + (threadIdx.x >> 5) * kMomSpan;
  // wide passes need every element of the chunk in its first element's high index half (keys.hi): a
  // chunk that crosses into the next half (once in 2^32 elements of a stream) takes the per-element path
  if (t.head == 0 && keys.one_half) {
    // fp32 grads: one loop, load8_shifted's (a second loop took a kernel past its 128 registers: its
    // chunk counter spilled)
    const bool aligned_grad = GDT != kF32 && (t.g & 15) == 0;
    const AdamMeta tc = chunk_view<PDT, GDT, SDT, MODE>(t, begin);
    uint32_t w = static_cast<uint32_t>(wb - begin);
    const uint32_t e = static_cast<uint32_t>(end - begin);  // a chunk: at most kChunk elements
    if constexpr (GDT != kF32) {
      // two stages: the scales' 4-byte words copied whole (a scale buffer at an odd bf16 offset: one stage)
      if (aligned_grad && stages == 2 && ((t.sm | t.sv) & 3) == 0) {
        w = mom_wide_passes_staged<PDT, GDT, SDT, MODE>(tc, w, e, warps, lane, cs, factor, sr, keys);
      } else if (aligned_grad) {
        w = mom_wide_passes<PDT, GDT, SDT, MODE, true>(tc, w, e, warps, lane, cs, factor, sr, keys);
      } else {
        w = mom_wide_passes<PDT, GDT, SDT, MODE, false>(tc, w, e, warps, lane, cs, factor, sr, keys);
      }
    } else {
      w = mom_wide_passes<PDT, GDT, SDT, MODE, false>(tc, w, e, warps, lane, cs, factor, sr, keys);
    }
    wb = begin + w;
  }
  for (; wb < end; wb += warps * kMomSpan) {
    MomLane x;
    mom_load<PDT, GDT, SDT, MODE, false>(t, wb + lane * kVE, end, factor, x);
    mom_update<PDT, GDT, SDT, MODE, false>(t, wb + lane * kVE, end, lane, x, cs, sr, keys);
  }
}

// kVE elements starting at i, where every buffer is 16-byte aligned (an int8 buffer: 8-byte accesses).
template <int PDT, int GDT, int SDT, int MODE>
__device__ __forceinline__ void adam_vec(const AdamMeta& t, int64_t i, const AdamWConsts& cs, float factor,
                                         bool sr, const RngKeys& keys) {
  void* M = reinterpret_cast<void*>(t.m);
  void* V = reinterpret_cast<void*>(t.v);
  float g[kVE], p[kVE], m[kVE], v[kVE];
  load8_shifted<GDT>(reinterpret_cast<const void*>(t.g), i, g);  // the grad may be at any offset
  load8_w<PDT, MODE>(t, i, p);
  load8<SDT>(M, i, m);
  load8<SDT>(V, i, v);
  if (t.vmax != 0) {
    float vm[kVE];
    load8<kF32>(reinterpret_cast<const void*>(t.vmax), i, vm);
#pragma unroll
    for (int k = 0; k < kVE; ++k) p[k] = adamw_update(p[k], g[k] * factor, m[k], v[k], &vm[k], cs);
    store8<kF32>(reinterpret_cast<void*>(t.vmax), i, vm);
  } else {
#pragma unroll
    for (int k = 0; k < kVE; ++k) p[k] = adamw_update(p[k], g[k] * factor, m[k], v[k], nullptr, cs);
  }
  // the elements' random words, one each, for every rounding below
  const bool w0 = needs_word0<PDT, SDT, MODE>(sr);
  uint32_t rw[kVE] = {};
  if (SDT == kBF16 || w0) {
    const uint64_t e = static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(i);
#pragma unroll
    for (int k = 0; k < kVE; ++k) rw[k] = rng_word(keys, e + k);
  }
  if constexpr (SDT == kBF16) {
    uint16_t hm[kVE], hv[kVE];
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      hm[k] = f32_to_bf16_sr(m[k], rand_b16(rw[k]));
      hv[k] = f32_to_bf16_sr(v[k], rand_c16(rw[k]));
    }
    store8_u16(M, i, hm);
    store8_u16(V, i, hv);
  } else {
    store8<SDT>(M, i, m);
    store8<SDT>(V, i, v);
  }
  store8_w<PDT, MODE>(t, i, p, rw, w0);
}

// Blocks per SM asked of ptxas (0: its own choice, which targets 64 registers = 4 blocks of 256 for
// every instance). The no-master fp32-moment instances spill 4 bytes at 64 registers on sm_90: they
// may use up to 80 (3 blocks of 256 per SM), spill-free. The compact-moment instances (8 elements
// per lane) take 100-112 registers spill-free and spill at 80: 2 blocks (512 threads, each with
// ~60 bytes of loads in flight: ~30 KB per SM).
constexpr int adam_min_blocks(int sdt, int mode) {
  return moment_grouped(sdt) ? 2 : (sdt == kF32 && mode == kMasterNone ? 3 : 0);
}

template <int PDT, int GDT, int SDT, int MODE>
__global__ void __launch_bounds__(kAdamBlock, adam_min_blocks(SDT, MODE))
    adamw_kernel(const AdamMeta* __restrict__ meta, const TensorConsts* __restrict__ consts, int count,
                 int64_t total_chunks, AdamScalars s) {
  if (*s.found_inf != 0.f) return;
  // maximize: -(g * factor) == g * (-factor) exactly (sign flips commute with rounding)
  const float factor = s.maximize ? -*s.factor : *s.factor;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    // every thread finds the chunk's tensor (the same loads across the block: broadcasts, no barrier)
    const int ti = find_tensor(meta, count, c);
    const AdamMeta t = meta[ti];
    const AdamWConsts cs = consts[ti].c;
    const int64_t begin = (c - t.chunk_begin) * s.chunk;
    const int64_t end = min(t.numel, begin + s.chunk);
    // random keys for this chunk's elements (math.h, rng_keys): a few multiplies per thread and chunk
    RngKeys keys{};
    if (SDT == kBF16 || moment_grouped(SDT) || needs_word0<PDT, SDT, MODE>(s.sr))
      keys = rng_keys(s.seed, t.stream, consts[ti].step,
                      static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(begin));
    if constexpr (moment_grouped(SDT)) {
      const ChunkKeys ck = chunk_keys(keys, static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(end - 1));
      adam_mom_chunk<PDT, GDT, SDT, MODE>(t, begin, end, cs, factor, s.sr, ck, s.stages);
      continue;
    }
    // vector body [vb, ve): starts at the tensor's common aligned element (chunks are multiples of kVE)
    const int64_t vb = t.head < 0 ? end : min(end, begin + t.head);
    const int64_t ve = vb + (end - vb) / kVE * kVE;
    for (int64_t i = begin + threadIdx.x; i < vb; i += blockDim.x)
      adam_scalar<PDT, GDT, SDT, MODE>(t, i, cs, factor, s.sr, keys);
    for (int64_t i = vb + threadIdx.x * kVE; i < ve; i += blockDim.x * kVE)
      adam_vec<PDT, GDT, SDT, MODE>(t, i, cs, factor, s.sr, keys);
    for (int64_t i = ve + threadIdx.x; i < end; i += blockDim.x)
      adam_scalar<PDT, GDT, SDT, MODE>(t, i, cs, factor, s.sr, keys);
  }
}

// One block before the update: every tensor's constants for this step from its step count (fp64,
// once per tensor instead of once per chunk), then -- after all counts are read, so a counter shared
// by two rows is read before either increment, as before -- the counters' increment.
constexpr int kPrepBlock = 512;
__global__ void __launch_bounds__(kPrepBlock) prep_kernel(const AdamMeta* __restrict__ meta, int count, AdamScalars s,
                                                          TensorConsts* __restrict__ out) {
  if (*s.found_inf != 0.f) return;
  const double lr = s.lr_ptr ? static_cast<double>(*s.lr_ptr) : s.lr;
  for (int t = threadIdx.x; t < count; t += blockDim.x) {
    const double step = static_cast<double>(*reinterpret_cast<const float*>(meta[t].step)) + 1.0;
    out[t].c = adamw_consts(lr, s.beta1, s.beta2, s.eps, s.weight_decay, step);
    out[t].step = static_cast<uint32_t>(step);
  }
  __syncthreads();
  for (int t = threadIdx.x; t < count; t += blockDim.x) *reinterpret_cast<float*>(meta[t].step) += 1.f;
}

using AdamKernel = void (*)(const AdamMeta*, const TensorConsts*, int, int64_t, AdamScalars);

// The dynamic shared memory of a two-stage compact launch: its instance's MomStage (by param dtype and
// master mode; 28-37 KB, under the 48 KB a launch may ask without opting in).
template <int MODE>
size_t mom_stage_bytes_m(int32_t pdt) {
  switch (pdt) {
    case kF32: return sizeof(MomStage<kF32, MODE>);
    case kF16: return sizeof(MomStage<kF16, MODE>);
    default: return sizeof(MomStage<kBF16, MODE>);
  }
}
size_t mom_stage_bytes(int32_t pdt, int64_t mode) {
  switch (mode) {
    case kMasterF32: return mom_stage_bytes_m<kMasterF32>(pdt);
    case kMasterRemainder: return mom_stage_bytes_m<kMasterRemainder>(pdt);
    case kMaster8bit: return mom_stage_bytes_m<kMaster8bit>(pdt);
    default: return mom_stage_bytes_m<kMasterNone>(pdt);
  }
}
static_assert(sizeof(MomStage<kF32, kMasterF32>) <= 48 * 1024 && sizeof(MomStage<kBF16, kMaster8bit>) <= 48 * 1024,
              "a two-stage launch asks at most 48 KB of dynamic shared memory (no opt-in attribute)");

template <int PDT, int GDT, int MODE>
AdamKernel pick_s(int32_t sdt) {
  if (sdt == kMom8) return &adamw_kernel<PDT, GDT, kMom8, MODE>;
  if (sdt == kMom4) return &adamw_kernel<PDT, GDT, kMom4, MODE>;
  return sdt == kF32 ? &adamw_kernel<PDT, GDT, kF32, MODE> : &adamw_kernel<PDT, GDT, kBF16, MODE>;
}
template <int PDT, int MODE>
AdamKernel pick_g(int32_t gdt, int32_t sdt) {
  switch (gdt) {
    case kF32: return pick_s<PDT, kF32, MODE>(sdt);
    case kF16: return pick_s<PDT, kF16, MODE>(sdt);
    default: return pick_s<PDT, kBF16, MODE>(sdt);
  }
}
template <int MODE>
AdamKernel pick_p(int32_t pdt, int32_t gdt, int32_t sdt) {
  switch (pdt) {
    case kF32: return pick_g<kF32, MODE>(gdt, sdt);
    case kF16: return pick_g<kF16, MODE>(gdt, sdt);
    default: return pick_g<kBF16, MODE>(gdt, sdt);
  }
}
AdamKernel pick(int32_t pdt, int32_t gdt, int32_t sdt, int64_t mode) {
  if (mode == kMasterRemainder) return pick_g<kBF16, kMasterRemainder>(gdt, sdt);  // bf16 params (checked)
  if (mode == kMaster8bit)  // bf16 or fp16 params (checked)
    return pdt == kF16 ? pick_g<kF16, kMaster8bit>(gdt, sdt) : pick_g<kBF16, kMaster8bit>(gdt, sdt);
  return mode == kMasterF32 ? pick_p<kMasterF32>(pdt, gdt, sdt) : pick_p<kMasterNone>(pdt, gdt, sdt);
}

int64_t addr(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

// Smallest h in [0, kVE) such that element h of every buffer (address, element size) is 16-byte
// aligned; -1 if there is none.
int32_t common_head(const int64_t (&ptrs)[6], const int (&sizes)[6]) {
  for (int h = 0; h < kVE; ++h) {
    bool ok = true;
    for (int k = 0; k < 6; ++k) ok = ok && (ptrs[k] == 0 || ((ptrs[k] + h * sizes[k]) & 15) == 0);
    if (ok) return h;
  }
  return -1;
}

int esize(const at::Tensor& t) { return static_cast<int>(t.element_size()); }
// Compact moments: 0 when element 0 of every buffer is aligned for the lanes' 8-element accesses
// (16 bytes for 16/32-bit buffers, 8 for 8-bit codes and corrections, 4 for 4-bit codes), else -1.
int32_t compact_head(const int64_t (&ptrs)[6], const int (&sizes)[6], bool mom4) {
  const int64_t need[6] = {16, 1, mom4 ? 4 : 8, 8, 16, sizes[5] == 1 ? 8 : 16};  // grad: load8_shifted
  for (int k = 0; k < 6; ++k) if (ptrs[k] % need[k] != 0) return -1;
  return 0;
}

// The shape set for a sweep (set_adamw_config), if any; else the device's row of kArchConfigs, looked up
// once per device. No allocation: this runs on every step.
struct ConfigChoice {
  AdamConfig config;
  const char* source;  // the row's, or "set_adamw_config"
};
std::mutex g_config_mutex;
std::optional<AdamConfig> g_config_override;
ConfigChoice config_for(int device_index) {
  static const ArchConfig* per_device[64] = {};
  const std::lock_guard<std::mutex> lock(g_config_mutex);
  if (g_config_override.has_value()) return {*g_config_override, "set_adamw_config"};
  TORCH_CHECK(device_index >= 0 && device_index < 64, "mpkern: CUDA device index ", device_index, " out of range");
  const ArchConfig*& row = per_device[device_index];
  if (row == nullptr) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device_index);
    // this arch's row, else its major's (minor -1), else the default (the last row)
    row = &kArchConfigs[sizeof(kArchConfigs) / sizeof(kArchConfigs[0]) - 1];
    for (const ArchConfig& a : kArchConfigs)
      if (a.major == prop->major && a.minor < 0) row = &a;
    for (const ArchConfig& a : kArchConfigs)
      if (a.major == prop->major && a.minor == prop->minor) row = &a;
  }
  return {row->config, row->source};
}

}  // namespace

std::tuple<int64_t, int64_t, int64_t, int64_t, std::string> adamw_config(int64_t device_index) {
  const ConfigChoice c = config_for(static_cast<int>(device_index));
  return {c.config.block, c.config.grid_per_sm, c.config.chunk, c.config.stages, std::string(c.source)};
}

void set_adamw_config(int64_t block, int64_t grid_per_sm, int64_t chunk, int64_t stages) {
  TORCH_CHECK_VALUE(block >= 32 && block <= kAdamBlock && block % 32 == 0, "set_adamw_config: block must be a "
                    "multiple of 32 in [32, ", kAdamBlock, "] (the kernels' launch bound), got ", block);
  TORCH_CHECK_VALUE(grid_per_sm >= 1 && grid_per_sm <= 64, "set_adamw_config: grid_per_sm must be in [1, 64], got ",
                    grid_per_sm);
  TORCH_CHECK_VALUE(chunk >= kMomSpan && chunk <= kChunk && chunk % kMomSpan == 0, "set_adamw_config: chunk must be a "
                    "multiple of ", kMomSpan, " in [", kMomSpan, ", ", kChunk, "], got ", chunk);
  TORCH_CHECK_VALUE(stages == 1 || stages == 2, "set_adamw_config: stages must be 1 or 2, got ", stages);
  const std::lock_guard<std::mutex> lock(g_config_mutex);
  g_config_override = AdamConfig{static_cast<int>(block), static_cast<int>(grid_per_sm), chunk,
                                 static_cast<int>(stages)};
}

void clear_adamw_config() {
  const std::lock_guard<std::mutex> lock(g_config_mutex);
  g_config_override.reset();
}

void adamw_step_cuda_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                      at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                      const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2, double eps,
                      double weight_decay, bool maximize, int64_t master_mode, int64_t moment_mode,
                      bool stochastic_rounding,
                      int64_t seed, at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets,
                      const std::optional<at::TensorList>& exp_avg_scales_opt,
                      const std::optional<at::TensorList>& exp_avg_sq_scales_opt) {
  const at::TensorList exp_avg_scales = list_or_empty(exp_avg_scales_opt);
  const at::TensorList exp_avg_sq_scales = list_or_empty(exp_avg_sq_scales_opt);
  // arguments checked by the registered op (csrc/ops.cpp, adamw_step_op)
  if (params.empty()) return;
  const c10::Device dev = params[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  // the moment modes this kernel has variants for (pick_s): anything else is refused before any launch
  TORCH_CHECK_NOT_IMPLEMENTED(moment_mode == kMomF32 || moment_mode == kMomBF16 || moment_mode == kMom8 ||
                                  moment_mode == kMom4,
                              "mpkern::adamw_step_: the CUDA kernel has no variant for moment mode ", moment_mode);
  const AdamConfig cfg = config_for(dev.index()).config;
  const size_t n = params.size();
  // Rows grouped by dtype combination (one launch each), in list order inside a group. Every
  // tensor has a row (empty ones too: their step counters still advance); only non-empty ones
  // own chunks.
  struct Launch {
    int32_t pdt, gdt, sdt;
    int first = 0, count = 0;
    int64_t chunks = 0;
  };
  std::vector<Launch> launches;
  std::vector<int> launch_of(n);
  for (size_t i = 0; i < n; ++i) {
    const int32_t pdt = dtype_code(params[i].scalar_type()), gdt = dtype_code(grads[i].scalar_type()),
                  sdt = static_cast<int32_t>(moment_mode);
    size_t l = 0;
    while (l < launches.size() && !(launches[l].pdt == pdt && launches[l].gdt == gdt && launches[l].sdt == sdt)) ++l;
    if (l == launches.size()) launches.push_back({pdt, gdt, sdt});
    launch_of[i] = static_cast<int>(l);
    launches[l].count++;
  }
  for (size_t l = 1; l < launches.size(); ++l) launches[l].first = launches[l - 1].first + launches[l - 1].count;
  std::vector<AdamMeta> rows(n);
  std::vector<int> filled(launches.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    Launch& L = launches[launch_of[i]];
    AdamMeta& a = rows[L.first + filled[launch_of[i]]++];
    a.p = addr(params[i]);
    a.g = addr(grads[i]);
    a.m = addr(exp_avgs[i]);
    a.v = addr(exp_avg_sqs[i]);
    a.vmax = max_exp_avg_sqs.empty() ? 0 : addr(max_exp_avg_sqs[i]);
    a.master = masters.empty() ? 0 : addr(masters[i]);
    a.step = addr(steps[i]);
    a.sm = exp_avg_scales.empty() ? 0 : addr(exp_avg_scales[i]);
    a.sv = exp_avg_sq_scales.empty() ? 0 : addr(exp_avg_sq_scales[i]);
    a.numel = params[i].numel();
    a.chunk_begin = L.chunks;
    const int64_t ptrs[6] = {a.p, 0, a.m, a.v, a.vmax, a.master};  // any grad offset: load8_shifted
    const int sizes[6] = {esize(params[i]), esize(grads[i]), esize(exp_avgs[i]), esize(exp_avg_sqs[i]), 4,
                          masters.empty() ? 4 : esize(masters[i])};
    a.head = moment_grouped(L.sdt) ? compact_head(ptrs, sizes, moment_codes_per_byte(L.sdt) == 2)
                                    : common_head(ptrs, sizes);
    a.offset = static_cast<int64_t>(offset_of(elem_offsets, i));
    a.stream = stream_of(stream_ids, i);
    L.chunks += (a.numel + cfg.chunk - 1) / cfg.chunk;
  }
  const AdamMeta* meta = cached_rows(dev, rows);
  AdamScalars s;
  s.lr = lr;
  s.lr_ptr = lr_tensor.has_value() ? lr_tensor->data_ptr<float>() : nullptr;
  s.factor = grad_factor.data_ptr<float>();
  s.found_inf = found_inf.data_ptr<float>();
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.eps = eps;
  s.weight_decay = weight_decay;
  s.maximize = maximize;
  s.sr = stochastic_rounding;
  s.seed = static_cast<uint32_t>(seed);
  s.chunk = cfg.chunk;
  s.stages = cfg.stages;
  auto stream = at::cuda::getCurrentCUDAStream();
  // the step's per-tensor constants: a stream-ordered scratch buffer (from the graph pool under capture)
  const int count = static_cast<int>(n);
  at::Tensor scratch = at::empty({static_cast<int64_t>(n * sizeof(TensorConsts))},
                                 params[0].options().dtype(at::kByte));
  auto* consts = reinterpret_cast<TensorConsts*>(scratch.data_ptr());
  prep_kernel<<<1, kPrepBlock, 0, stream>>>(meta, count, s, consts);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  for (const Launch& L : launches) {
    if (L.chunks == 0) continue;
    // two stages: the compact kernels' slots (only a 16-bit grad's kernel stages its loads)
    const size_t smem = cfg.stages == 2 && moment_grouped(L.sdt) && L.gdt != kF32 ? mom_stage_bytes(L.pdt, master_mode)
                                                                                  : 0;
    pick(L.pdt, L.gdt, L.sdt, master_mode)<<<grid_for(L.chunks, cfg.grid_per_sm), cfg.block, smem, stream>>>(
        meta + L.first, consts + L.first, L.count, L.chunks, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace mpkern

// registered by csrc/ops.cpp (the schema's codecs parsed there; see csrc/kernels.h)
