// CPU SIMD helpers: run-time choice between an AVX2+FMA+F16C path and a portable scalar path.
//
// The AVX2 functions carry `__attribute__((target(...)))`, so the extension is compiled for the
// baseline x86-64 ISA and only those functions use AVX2; `use_avx2()` checks the running CPU
// before they are called. `MPKERN_CPU_SIMD=0` (or mpkern._C.set_cpu_simd(False)) forces the
// scalar path, which the tests use to cover both. AVX-512 functions (MPK_AVX512) are compiled the
// same way and called only when cpu_has_avx512() (the AdamW kernel; MPKERN_CPU_AVX512=0 skips them).
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
  return bf16_keep_nan32(_mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16), x);
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

// Stochastic rounding to bf16 (f32_to_bf16_sr of math.h): 16 random bits r (low halves of the
// lanes) added below the kept part, then truncation. An inf has zero low bits, so the sum keeps
// it; only NaN needs its own result (quiet, same sign).
MPK_AVX2 inline __m256i bf16_sr_bits32(__m256 x, __m256i r) {
  return bf16_keep_nan32(_mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16), x);
}

// mix32 of math.h on 8 lanes.
MPK_AVX2 inline __m256i mix32x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  return x;
}

// The codecs' 16-bit values of the three fields of the random words r (math.h rand_a16 / b16 / c16).
MPK_AVX2 inline __m256i rand_a16x8(__m256i r) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi32(r, 6), _mm256_set1_epi32(0xffc0)), _mm256_set1_epi32(0x20));
}
MPK_AVX2 inline __m256i rand_b16x8(__m256i r) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(r, 5), _mm256_set1_epi32(0xffe0)), _mm256_set1_epi32(0x10));
}
MPK_AVX2 inline __m256i rand_c16x8(__m256i r) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0xffe0)), _mm256_set1_epi32(0x10));
}

// ---- AVX-512: 16 lanes, same arithmetic as the AVX2 helpers above ----------------------------
// True when the CPU has AVX-512 F/BW/VL/DQ (checked once).
inline bool cpu_has_avx512() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }();
  return has;
}

// Load 16 elements of a float/half/bfloat16 buffer as 16 floats.
template <int DT>
MPK_AVX512 inline __m512 load16(const void* base, int64_t i) {
  if constexpr (DT == 0) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if constexpr (DT == 1) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// 16 x u32 lanes (each <= 0xffff) -> 16 x u16 at dst.
MPK_AVX512 inline void store_u16x16(void* dst, __m512i r) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}

// f32_to_bf16_rne on 16 lanes (bf16 bits in the low halves of 32-bit lanes).
// bf16_keep_nan32 on 16 lanes.
MPK_AVX512 inline __m512i bf16_keep_nan(__m512i h32, __m512 x) {
  return _mm512_mask_or_epi32(h32, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_srli_epi32(_mm512_castps_si512(x), 16),
                              _mm512_set1_epi32(0x0040));
}
MPK_AVX512 inline __m512i bf16_rne_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return bf16_keep_nan(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16), x);
}

// f32_to_bf16_sr on 16 lanes, r = 16 random bits per lane.
MPK_AVX512 inline __m512i bf16_sr_bits(__m512 x, __m512i r) {
  return bf16_keep_nan(_mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16), x);
}

// Store 16 floats into a float/half/bfloat16 buffer with round-to-nearest-even.
template <int DT>
MPK_AVX512 inline void store16(void* base, int64_t i, __m512 v) {
  if constexpr (DT == 0) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, v);
  } else if constexpr (DT == 1) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    store_u16x16(static_cast<uint16_t*>(base) + i, bf16_rne_bits(v));
  }
}

// mix32 of math.h on 16 lanes.
MPK_AVX512 inline __m512i mix32x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  return x;
}

// The three fields on 16 lanes.
MPK_AVX512 inline __m512i rand_a16x16(__m512i r) {
  return _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi32(r, 6), _mm512_set1_epi32(0xffc0)), _mm512_set1_epi32(0x20));
}
MPK_AVX512 inline __m512i rand_b16x16(__m512i r) {
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(r, 5), _mm512_set1_epi32(0xffe0)), _mm512_set1_epi32(0x10));
}
MPK_AVX512 inline __m512i rand_c16x16(__m512i r) {
  return _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(r, 16), _mm512_set1_epi32(0xffe0)), _mm512_set1_epi32(0x10));
}

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
