// The AdamW kernels' per-lane building blocks (csrc/cuda/adamw_cuda.cu includes this first): the kernel
// constants, the metadata row of a tensor and the step's scalars, and what the dense and the compact
// kernels both use -- masters loaded and stored one element or kVE elements at a time, the random words.
// Internal to the one translation unit adamw_cuda.cu.
#pragma once

#include "../adamw_common.h"
#include "multi_tensor.cuh"

namespace mpkern {
namespace cuda {
namespace {

constexpr int kAdamBlock = 256;
constexpr int kVE = 8;              // elements per thread-iteration of the vector body
constexpr int kMomSpan = 32 * kVE;  // compact moments: elements of one warp pass (8 groups of 32)
static_assert(kChunk % kMomSpan == 0 && kAdamBlock % 32 == 0 && kVE * 4 == kMom8Group,
              "compact moments: four lanes per group, whole passes per chunk");

struct AdamMeta {
  int64_t p, g, m, v, vmax, master, step;  // addresses (vmax / master may be 0)
  int64_t sm, sv;                          // 8-bit moments: addresses of the bf16 scales (one per 32 elements); else 0
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
template <int PDT, int MOMENT_MODE, int MASTER_MODE>
__device__ __forceinline__ bool needs_word0(bool sr) {
  return MASTER_MODE == kMaster8bit || (MASTER_MODE == kMasterNone && PDT == kBF16 && sr);
}

// The fp32 master of element i (the param itself in mode 0).
template <int PDT, int MASTER_MODE>
__device__ __forceinline__ float load_w(const AdamMeta& t, int64_t i) {
  const void* P = reinterpret_cast<const void*>(t.p);
  if constexpr (MASTER_MODE == kMasterF32) {
    return reinterpret_cast<const float*>(t.master)[i];
  } else if constexpr (MASTER_MODE == kMasterRemainder) {
    return join_master(static_cast<const uint16_t*>(P)[i], reinterpret_cast<const int16_t*>(t.master)[i]);
  } else if constexpr (MASTER_MODE == kMaster8bit) {
    return master8_decode(static_cast<const uint16_t*>(P)[i], reinterpret_cast<const int8_t*>(t.master)[i], PDT);
  } else {
    return load_as_f32(P, i, PDT);
  }
}

// Store the updated master p of element i and the param; r0 = the element's random word (when w0).
template <int PDT, int MASTER_MODE>
__device__ __forceinline__ void store_w(const AdamMeta& t, int64_t i, float p, uint32_t r0, bool w0) {
  void* P = reinterpret_cast<void*>(t.p);
  if constexpr (MASTER_MODE == kMasterF32) {
    reinterpret_cast<float*>(t.master)[i] = p;
    store_from_f32(P, i, PDT, p);
  } else if constexpr (MASTER_MODE == kMasterRemainder) {
    uint16_t hi;
    int16_t rem;
    split_master(p, hi, rem);
    static_cast<uint16_t*>(P)[i] = hi;
    reinterpret_cast<int16_t*>(t.master)[i] = rem;
  } else if constexpr (MASTER_MODE == kMaster8bit) {
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
template <int PDT, int MASTER_MODE>
constexpr int master_words() {
  return (MASTER_MODE == kMasterF32 || MASTER_MODE == kMasterRemainder || (MASTER_MODE == kMasterNone && PDT == kF32))
             ? 2
             : 1;
}

// The fp32 masters of kVE elements from their bytes: w (master_words of them) and c, the 8-bit corrections.
template <int PDT, int MASTER_MODE>
__device__ __forceinline__ void masters8_from_raw(const uint4 (&w)[2], const uint2 c, float (&p)[kVE]) {
  if constexpr (MASTER_MODE == kMasterF32 || (MASTER_MODE == kMasterNone && PDT == kF32)) {
    float a[4], b[4];
    vec_from_raw<kF32>(w[0], a);
    vec_from_raw<kF32>(w[1], b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      p[k] = a[k];
      p[k + 4] = b[k];
    }
  } else if constexpr (MASTER_MODE == kMasterRemainder) {
    uint16_t hi[kVE], lo[kVE];
    unpack16(w[0], hi);
    unpack16(w[1], lo);
#pragma unroll
    for (int k = 0; k < kVE; ++k) p[k] = join_master(hi[k], static_cast<int16_t>(lo[k]));
  } else if constexpr (MASTER_MODE == kMaster8bit && PDT == kBF16) {
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
  } else if constexpr (MASTER_MODE == kMaster8bit) {
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
template <int PDT, int MASTER_MODE>
__device__ __forceinline__ MasterSrc master_src(const AdamMeta& t, int64_t i) {
  const char* P = reinterpret_cast<const char*>(t.p);
  const char* W = reinterpret_cast<const char*>(t.master);
  if constexpr (MASTER_MODE == kMasterF32) return {{W + 4 * i, W + 4 * i + 16}, nullptr};
  if constexpr (MASTER_MODE == kMasterRemainder) return {{P + 2 * i, W + 2 * i}, nullptr};
  if constexpr (MASTER_MODE == kMaster8bit) return {{P + 2 * i, nullptr}, W + i};
  return {{P + elem_bytes<PDT>() * i, PDT == kF32 ? P + 4 * i + 16 : nullptr}, nullptr};
}

// The fp32 masters of kVE elements starting at i (every buffer aligned there).
template <int PDT, int MASTER_MODE>
__device__ __forceinline__ void load8_w(const AdamMeta& t, int64_t i, float (&p)[kVE]) {
  const MasterSrc src = master_src<PDT, MASTER_MODE>(t, i);
  uint4 w[2] = {*reinterpret_cast<const uint4*>(src.w[0]), {}};
  if constexpr (master_words<PDT, MASTER_MODE>() == 2) w[1] = *reinterpret_cast<const uint4*>(src.w[1]);
  uint2 c = {};
  if constexpr (MASTER_MODE == kMaster8bit) c = __ldcg(reinterpret_cast<const uint2*>(src.c));
  masters8_from_raw<PDT, MASTER_MODE>(w, c, p);
}

// Store the updated masters p of kVE elements starting at i and the params; rw = their random words.
// NUM: no p is NaN (the 8-bit master of bf16 params skips the NaN case).
template <int PDT, int MASTER_MODE, bool NUM = false>
__device__ __forceinline__ void store8_w(const AdamMeta& t, int64_t i, const float (&p)[kVE], const uint32_t (&rw)[kVE],
                                         bool w0) {
  void* P = reinterpret_cast<void*>(t.p);
  uint16_t hi[kVE];
  if constexpr (MASTER_MODE == kMasterF32) {
    store8<kF32>(reinterpret_cast<void*>(t.master), i, p);
    store8<PDT>(P, i, p);
  } else if constexpr (MASTER_MODE == kMasterRemainder) {
    uint16_t lo[kVE];
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      int16_t rem;
      split_master(p[k], hi[k], rem);
      lo[k] = static_cast<uint16_t>(rem);
    }
    store8_u16(P, i, hi);
    store8_u16(reinterpret_cast<void*>(t.master), i, lo);
  } else if constexpr (MASTER_MODE == kMaster8bit) {
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

}  // namespace
}  // namespace cuda
}  // namespace mpkern
