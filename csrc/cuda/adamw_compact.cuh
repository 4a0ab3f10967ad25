// The grouped compact AdamW kernel (8-bit moments, 4-bit exp_avg; codecs in docs/storage.md): warp
// passes of 8 groups of 32 elements, four lanes per group, the group scales from shuffles, one or two
// load stages. Internal to csrc/cuda/adamw_cuda.cu, which includes it after adamw_lanes.cuh.
#pragma once

#include "adamw_lanes.cuh"

namespace mpkern {
namespace cuda {
namespace {

// One lane's kVE elements [i, i + kVE) of a compact-moment tensor (MOMENT_MODE kMom8, or kMom4: the 4-bit
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

template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE, bool WIDE, bool GA = false>
__device__ __forceinline__ void mom_load(const AdamMeta& t, int64_t i, int64_t end, float factor, MomLane& x) {
  constexpr bool kM4 = MOMENT_MODE == kMom4;
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
    load8_w<PDT, MASTER_MODE>(t, i, x.w);
    x.cm = kM4 ? make_uint2(__ldcg(reinterpret_cast<const unsigned int*>(CM + (i >> 1))), 0u)
               : __ldcg(reinterpret_cast<const uint2*>(CM + i));
    x.cv = __ldcg(reinterpret_cast<const uint2*>(CV + i));
  } else {
    uint32_t cm[2] = {0u, 0u}, cv[2] = {0u, 0u};
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      const bool act = i + k < end;
      x.g[k] = act ? load_as_f32(G, i + k, GDT) : 0.f;
      x.w[k] = act ? load_w<PDT, MASTER_MODE>(t, i + k) : 0.f;
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

template <int PDT, int MOMENT_MODE, int MASTER_MODE, bool WIDE>
__device__ __forceinline__ MomMid mom_moments(int64_t i, int64_t end, MomLane& x, const AdamWConsts& cs) {
  constexpr bool kM4 = MOMENT_MODE == kMom4;
  constexpr bool kNan = MASTER_MODE == kMaster8bit && PDT == kBF16;
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
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE, bool WIDE, bool FAST = false>
__device__ __forceinline__ void mom_finish(const AdamMeta& t, int64_t i, int64_t end, int lane, MomLane& x,
                                           const MomMid& y, bool sr, const ChunkKeys& keys) {
  constexpr bool kM4 = MOMENT_MODE == kMom4;
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
  const bool w0 = needs_word0<PDT, MOMENT_MODE, MASTER_MODE>(sr);
  uint8_t* __restrict__ CM = reinterpret_cast<uint8_t*>(t.m);
  uint8_t* __restrict__ CV = reinterpret_cast<uint8_t*>(t.v);
  if constexpr (WIDE) {
    store8_w<PDT, MASTER_MODE, FAST>(t, i, x.w, rw, w0);
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
      store_w<PDT, MASTER_MODE>(t, i + k, x.w[k], rw[k], w0);
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
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE, bool WIDE>
__device__ __forceinline__ void mom_update(const AdamMeta& t, int64_t i, int64_t end, int lane, MomLane& x,
                                           const AdamWConsts& cs, bool sr, const ChunkKeys& keys) {
  const MomMid y = mom_moments<PDT, MOMENT_MODE, MASTER_MODE, WIDE>(i, end, x, cs);
  mom_step<false>(x, y, cs);
  mom_finish<PDT, GDT, MOMENT_MODE, MASTER_MODE, WIDE>(t, i, end, lane, x, y, sr, keys);
}

// The whole warp passes of an aligned compact-moment tensor from wb (this warp's first pass) up to
// `end`, in a chunk whose elements all have the chunk key's high index half: wide accesses, and the
// random words from the chunk's key without a per-element check of the half. GA: the grad is 16-byte
// aligned at every pass (one access), else load8_shifted. Returns the first pass not done.
// Indices are 32-bit offsets into chunk_view's buffers.
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE, bool GA>
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
      mom_load<PDT, GDT, MOMENT_MODE, MASTER_MODE, true, GA>(t, wb + lane * kVE, end, factor, x);
      y = mom_moments<PDT, MOMENT_MODE, MASTER_MODE, true>(wb + lane * kVE, end, x, cs);
      if (__builtin_expect(!__all_sync(0xffffffffu, y.fast & off8), 0)) break;
      mom_step<true>(x, y, cs);
      mom_finish<PDT, GDT, MOMENT_MODE, MASTER_MODE, true, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
      wb += stride;
    }
    // a pass with a value outside them (a zero or tiny v, a non-finite moment, ...): the IEEE step,
    // outside the main loop
    mom_step<false>(x, y, cs);
    mom_finish<PDT, GDT, MOMENT_MODE, MASTER_MODE, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
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
template <int PDT, int MASTER_MODE>
struct MomStage {
  uint4 g[2][kAdamBlock];
  uint4 w[2][master_words<PDT, MASTER_MODE>()][kAdamBlock];
  uint2 c[2][MASTER_MODE == kMaster8bit ? kAdamBlock : 1];
  uint2 cm[2][kAdamBlock];
  uint2 cv[2][kAdamBlock];
  uint32_t sc[2][2][kAdamBlock];
};

// Lane copies of the kVE elements at i (a whole pass of an aligned tensor, its grad 16-byte aligned at i,
// its scale buffers 4-byte aligned) into stage b, as one copy group.
template <int PDT, int MOMENT_MODE, int MASTER_MODE>
__device__ __forceinline__ void mom_stage_issue(const AdamMeta& t, int64_t i, MomStage<PDT, MASTER_MODE>& st, int b,
                                                int tid) {
  cp_async<16>(&st.g[b][tid], reinterpret_cast<const char*>(t.g) + 2 * i);
  const MasterSrc src = master_src<PDT, MASTER_MODE>(t, i);
  cp_async<16>(&st.w[b][0][tid], src.w[0]);
  if constexpr (master_words<PDT, MASTER_MODE>() == 2) cp_async<16>(&st.w[b][1][tid], src.w[1]);
  if constexpr (MASTER_MODE == kMaster8bit) cp_async<8>(&st.c[b][tid], src.c);
  if constexpr (MOMENT_MODE == kMom4) {
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
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
__device__ __forceinline__ void mom_stage_read(const MomStage<PDT, MASTER_MODE>& st, int b, int tid, int64_t i,
                                               float factor, MomLane& x) {
  vec_from_raw<GDT>(st.g[b][tid], x.g);
  const uint4 w[2] = {st.w[b][0][tid], master_words<PDT, MASTER_MODE>() == 2
                                           ? st.w[b][master_words<PDT, MASTER_MODE>() - 1][tid]
                                           : uint4{}};
  masters8_from_raw<PDT, MASTER_MODE>(w, MASTER_MODE == kMaster8bit ? st.c[b][tid] : uint2{}, x.w);
  x.cm = MOMENT_MODE == kMom4 ? make_uint2(st.cm[b][tid].x, 0u) : st.cm[b][tid];
  x.cv = st.cv[b][tid];
  const uint32_t shift = static_cast<uint32_t>((static_cast<uint64_t>(i) / kMom8Group) & 1u) * 16u;
  x.sm = bf16_to_f32(static_cast<uint16_t>(st.sc[b][0][tid] >> shift));
  x.sv = bf16_to_f32(static_cast<uint16_t>(st.sc[b][1][tid] >> shift));
#pragma unroll
  for (int k = 0; k < kVE; ++k) x.g[k] *= factor;
}

// mom_wide_passes<..., GA = true> with two stages: pass wb + stride's copies are issued before pass wb is
// updated. Returns the first pass not done; no copy is in flight on return (the next chunk reuses the slots).
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
__device__ __forceinline__ uint32_t mom_wide_passes_staged(const AdamMeta& t, uint32_t wb, uint32_t end, int warps,
                                                           int lane, const AdamWConsts& cs, float factor, bool sr,
                                                           const ChunkKeys& keys) {
  extern __shared__ uint4 mom_stage_smem[];  // mom_stage_bytes(PDT, MASTER_MODE) of dynamic shared memory
  MomStage<PDT, MASTER_MODE>& st = *reinterpret_cast<MomStage<PDT, MASTER_MODE>*>(mom_stage_smem);
  const int tid = threadIdx.x;
  const uint32_t stride = static_cast<uint32_t>(warps) * kMomSpan;
  if (wb + kMomSpan <= end) mom_stage_issue<PDT, MOMENT_MODE, MASTER_MODE>(t, wb + lane * kVE, st, 0, tid);
  const bool off8 = (t.offset & (kVE - 1)) == 0;
  int b = 0;
  for (;;) {
    MomLane x;
    MomMid y;
    for (;;) {  // as in mom_wide_passes: the passes whose lanes are all fast, of a tensor with off8
      if (wb + kMomSpan > end) return wb;
      if (wb + stride + kMomSpan <= end) {
        mom_stage_issue<PDT, MOMENT_MODE, MASTER_MODE>(t, wb + stride + lane * kVE, st, b ^ 1, tid);
        cp_async_wait<1>();  // this lane's copies of pass wb have landed (the next pass's may not have)
      } else {
        cp_async_wait<0>();
      }
      mom_stage_read<PDT, GDT, MOMENT_MODE, MASTER_MODE>(st, b, tid, wb + lane * kVE, factor, x);
      y = mom_moments<PDT, MOMENT_MODE, MASTER_MODE, true>(wb + lane * kVE, end, x, cs);
      if (__builtin_expect(!__all_sync(0xffffffffu, y.fast & off8), 0)) break;
      mom_step<true>(x, y, cs);
      mom_finish<PDT, GDT, MOMENT_MODE, MASTER_MODE, true, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
      wb += stride, b ^= 1;
    }
    mom_step<false>(x, y, cs);  // the IEEE step, outside the main loop
    mom_finish<PDT, GDT, MOMENT_MODE, MASTER_MODE, true>(t, wb + lane * kVE, end, lane, x, y, sr, keys);
    wb += stride, b ^= 1;
  }
}

// t with every buffer moved to element `begin` (a multiple of kMomSpan: alignments and scale-word parities
// are kept) and its stream offset advanced to match: the wide passes then address a chunk's elements by
// 32-bit offsets (one IMAD.WIDE.U32 per address instead of a 64-bit add and its carry).
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
__device__ __forceinline__ AdamMeta chunk_view(const AdamMeta& t, int64_t begin) {
  AdamMeta c = t;
  c.p += begin * elem_bytes<PDT>();
  c.g += begin * elem_bytes<GDT>();
  c.m += MOMENT_MODE == kMom4 ? begin / 2 : begin;
  c.v += begin;
  if (MASTER_MODE != kMasterNone)
    c.master += begin * (MASTER_MODE == kMasterF32 ? 4 : MASTER_MODE == kMasterRemainder ? 2 : 1);
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
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
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
    const AdamMeta tc = chunk_view<PDT, GDT, MOMENT_MODE, MASTER_MODE>(t, begin);
    uint32_t w = static_cast<uint32_t>(wb - begin);
    const uint32_t e = static_cast<uint32_t>(end - begin);  // a chunk: at most kChunk elements
    if constexpr (GDT != kF32) {
      // two stages: the scales' 4-byte words copied whole (a scale buffer at an odd bf16 offset: one stage)
      if (aligned_grad && stages == 2 && ((t.sm | t.sv) & 3) == 0) {
        w = mom_wide_passes_staged<PDT, GDT, MOMENT_MODE, MASTER_MODE>(tc, w, e, warps, lane, cs, factor, sr, keys);
      } else if (aligned_grad) {
        w = mom_wide_passes<PDT, GDT, MOMENT_MODE, MASTER_MODE, true>(tc, w, e, warps, lane, cs, factor, sr, keys);
      } else {
        w = mom_wide_passes<PDT, GDT, MOMENT_MODE, MASTER_MODE, false>(tc, w, e, warps, lane, cs, factor, sr, keys);
      }
    } else {
      w = mom_wide_passes<PDT, GDT, MOMENT_MODE, MASTER_MODE, false>(tc, w, e, warps, lane, cs, factor, sr, keys);
    }
    wb = begin + w;
  }
  for (; wb < end; wb += warps * kMomSpan) {
    MomLane x;
    mom_load<PDT, GDT, MOMENT_MODE, MASTER_MODE, false>(t, wb + lane * kVE, end, factor, x);
    mom_update<PDT, GDT, MOMENT_MODE, MASTER_MODE, false>(t, wb + lane * kVE, end, lane, x, cs, sr, keys);
  }
}

}  // namespace
}  // namespace cuda
}  // namespace mpkern
