// CPU SIMD helpers: run-time choice between an AVX2+FMA+F16C path and a portable scalar path.
//
// The AVX2 functions carry `__attribute__((target(...)))`, so the extension is compiled for the
// baseline x86-64 ISA and only those functions use AVX2; `use_avx2()` checks the running CPU
// before they are called. `MPKERN_CPU_SIMD=0` (or mpkern._C.set_cpu_simd(False)) forces the
// scalar path, which the tests use to cover both. AVX-512 functions (MPK_AVX512) are compiled the
// same way and called only when cpu_has_avx512() (the AdamW kernel; MPKERN_CPU_AVX512=0 skips them).
// The AdamW kernel's lane traits are vec_avx2.h and vec_avx512.h.
#pragma once

#include <stdint.h>

#include <vector>

#include <ATen/core/Tensor.h>

#if defined(__x86_64__) || defined(_M_X64)
#define MPK_X86 1
#include <immintrin.h>
#define MPK_AVX2 __attribute__((target("avx2,fma,f16c")))
// AVX-512 (F, BW, VL, DQ) functions: compiled per function like MPK_AVX2, called only after
// cpu_has_avx512() said yes, so the extension still loads on CPUs without AVX-512.
#define MPK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#else
#define MPK_X86 0
#endif

namespace mpkern {
namespace cpu {

// 0 = scalar, 1 = AVX2 (+FMA, F16C).
int simd_level();
struct WorkItem;
// Split every tensor of the list into kChunk-element work items (empty tensors give none).
std::vector<WorkItem> make_work(c10::ArrayRef<at::Tensor> ts, int64_t chunk);
void set_simd_enabled(bool enabled);
inline bool use_avx2() { return simd_level() >= 1; }

// Elements per (tensor, chunk) work item of the multi-tensor CPU loops. A multiple of 64 so
// vector loops only have tails at the end of a tensor.
constexpr int64_t kChunk = 1 << 15;

// One work item of a multi-tensor loop: elements [begin, end) of tensor `tensor`.
struct WorkItem {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

#if MPK_X86
// Load 8 elements of a float/half/bfloat16 buffer as 8 floats.
template <int DT>
MPK_AVX2 inline __m256 load8(const void* base, int64_t i) {
  if constexpr (DT == 0) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (DT == 1) {
      return _mm256_cvtph_ps(h);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

// 16 bfloat16 -> two vectors of 8 floats, in the lane order of _mm256_unpack{lo,hi}_epi16:
// lo = elements 0-3 and 8-11, hi = 4-7 and 12-15. bf16x16_pack below undoes exactly this order.
MPK_AVX2 inline void bf16x16_unpack(const void* src, __m256& lo, __m256& hi) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw));
}

// bf16 bits h32 (low halves of the lanes) of a rounding of x, with every NaN lane of x replaced by
// its quiet NaN of the same sign -- the NaN rule of every float -> bf16 conversion in math.h.
MPK_AVX2 inline __m256i bf16_keep_nan32(__m256i h32, __m256 x) {
  const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), _mm256_set1_epi32(0x0040));
  return _mm256_blendv_epi8(h32, qnan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
// 8 floats -> 8 bf16 bit patterns in the low halves of 32-bit lanes (round to nearest even,
// NaN kept quiet with its sign), as f32_to_bf16_rne of math.h.
MPK_AVX2 inline __m256i bf16_rne_bits32(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return bf16_keep_nan32(_mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16),
                         x);
}

MPK_AVX2 inline void bf16x16_pack(void* dst, __m256 lo, __m256 hi) {
  const __m256i packed = _mm256_packus_epi32(bf16_rne_bits32(lo), bf16_rne_bits32(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
}

// 8 floats -> 8 bfloat16 bit patterns, round to nearest even, NaN kept (quiet, same sign).
MPK_AVX2 inline __m128i f32_to_bf16x8(__m256 x) {
  const __m256i r = bf16_rne_bits32(x);
  const __m256i packed = _mm256_packus_epi32(r, r);  // [a0..a3 a0..a3 | a4..a7 a4..a7]
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// Store 8 floats into a float/half/bfloat16 buffer with round-to-nearest-even.
template <int DT>
MPK_AVX2 inline void store8(void* base, int64_t i, __m256 v) {
  if constexpr (DT == 0) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, v);
  } else if constexpr (DT == 1) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i), f32_to_bf16x8(v));
  }
}

// 8 x u32 lanes (each <= 0xffff) -> 8 x u16.
MPK_AVX2 inline __m128i pack_u16x8(__m256i r) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

// True when the CPU has AVX-512 F/BW/VL/DQ (checked once).
inline bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return has;
}

// 16 codes as bytes (nibbles in the low 4 bits) in element order -> 8 bytes of two codes each
// (math.h mom4_pack) in the low half, the same for hi16 in the high half: per 16-bit lane
// (c_even & 15) + 16 (c_odd & 15) by one unsigned x signed byte multiply-add (<= 255), packed to
// bytes with unsigned saturation (exact).
MPK_AVX2 __attribute__((always_inline)) inline __m128i pack_nibbles16x2(__m128i lo16, __m128i hi16) {
  const __m128i lo4 = _mm_set1_epi8(0x0f), w = _mm_set1_epi16(0x1001);  // bytes 1, 16
  return _mm_packus_epi16(_mm_maddubs_epi16(_mm_and_si128(lo16, lo4), w),
                          _mm_maddubs_epi16(_mm_and_si128(hi16, lo4), w));
}

// The lane operations of the vector traits (vec_avx2.h, vec_avx512.h) whose AVX2 and AVX-512
// intrinsics differ only in the width prefix PFX (_mm256 / _mm512) and the integer vector suffix
// SI (si256 / si512): one list, expanded inside each traits type (F, I, H its float, int32 and
// 16-bit vector types), every function declared ATTR.
#define MPK_VEC_WIDTH_OPS(ATTR, PFX, SI)                                                                    \
  static ATTR F setf(float x) { return PFX##_set1_ps(x); }                                                  \
  static ATTR F loadu(const float* p) { return PFX##_loadu_ps(p); }                                         \
  static ATTR F load(const float* p) { return PFX##_load_ps(p); } /* aligned */                             \
  static ATTR void storeu(float* p, F x) { PFX##_storeu_ps(p, x); }                                         \
  static ATTR void store(float* p, F x) { PFX##_store_ps(p, x); } /* aligned */                             \
  static ATTR F add(F a, F b) { return PFX##_add_ps(a, b); }                                                \
  static ATTR F sub(F a, F b) { return PFX##_sub_ps(a, b); }                                                \
  static ATTR F mul(F a, F b) { return PFX##_mul_ps(a, b); }                                                \
  static ATTR F div(F a, F b) { return PFX##_div_ps(a, b); }                                                \
  static ATTR F sqrt(F a) { return PFX##_sqrt_ps(a); }                                                      \
  static ATTR F fmadd(F a, F b, F c) { return PFX##_fmadd_ps(a, b, c); } /* a * b + c, one rounding */      \
  static ATTR F fmsub(F a, F b, F c) { return PFX##_fmsub_ps(a, b, c); } /* a * b - c, one rounding */      \
  static ATTR F min(F a, F b) { return PFX##_min_ps(a, b); }                                                \
  static ATTR F max(F a, F b) { return PFX##_max_ps(a, b); }                                                \
  static ATTR F xor_(F a, F b) { return PFX##_xor_ps(a, b); }                                               \
  static ATTR F to_f(I a) { return PFX##_cvtepi32_ps(a); }                                                  \
  static ATTR F as_f(I a) { return PFX##_cast##SI##_ps(a); }                                                \
  static ATTR F cvt_ph(H h) { return PFX##_cvtph_ps(h); } /* fp16 bits -> floats, exact */                  \
  static ATTR H cvt_ps_ph(F x) { return PFX##_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); } \
  static ATTR I seti(int32_t x) { return PFX##_set1_epi32(x); }                                             \
  static ATTR I zero() { return PFX##_setzero_##SI(); }                                                     \
  static ATTR I loadi(const uint32_t* p) { return PFX##_load_##SI(reinterpret_cast<const I*>(p)); }         \
  static ATTR void storei(uint32_t* p, I x) { PFX##_store_##SI(reinterpret_cast<I*>(p), x); }               \
  static ATTR I as_i(F a) { return PFX##_castps_##SI(a); }                                                  \
  static ATTR I add(I a, I b) { return PFX##_add_epi32(a, b); }                                             \
  static ATTR I sub(I a, I b) { return PFX##_sub_epi32(a, b); }                                             \
  static ATTR I mullo(I a, I b) { return PFX##_mullo_epi32(a, b); }                                         \
  static ATTR I and_(I a, I b) { return PFX##_and_##SI(a, b); }                                             \
  static ATTR I or_(I a, I b) { return PFX##_or_##SI(a, b); }                                               \
  static ATTR I xor_(I a, I b) { return PFX##_xor_##SI(a, b); }                                             \
  static ATTR I srli(I a, int n) { return PFX##_srli_epi32(a, n); }                                         \
  static ATTR I slli(I a, int n) { return PFX##_slli_epi32(a, n); }                                         \
  static ATTR I max(I a, I b) { return PFX##_max_epi32(a, b); } /* signed */                                \
  static ATTR I maxu(I a, I b) { return PFX##_max_epu32(a, b); }                                            \
  static ATTR I minu(I a, I b) { return PFX##_min_epu32(a, b); }                                            \
  static ATTR I widen_u16(H h) { return PFX##_cvtepu16_epi32(h); }                                          \
  static ATTR I widen_i16(H h) { return PFX##_cvtepi16_epi32(h); }

MPK_AVX2 inline double hsum_f64(__m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  double s = 0;
  for (int k = 0; k < 8; ++k) s += t[k];
  return s;
}

MPK_AVX2 inline uint32_t hmax_u32(__m256i v) {
  alignas(32) uint32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), v);
  uint32_t m = 0;
  for (int k = 0; k < 8; ++k) m = t[k] > m ? t[k] : m;
  return m;
}
#endif

}  // namespace cpu
}  // namespace mpkern
