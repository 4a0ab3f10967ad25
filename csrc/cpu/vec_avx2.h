// The AVX2 (+FMA, F16C) lane traits of the CPU vector kernels: 8 float / int32 lanes in __m256 /
// __m256i, the operations the shared kernels (adamw_cpu_vec.h) are written with -- those whose
// intrinsics differ from AVX-512's only in width from MPK_VEC_WIDTH_OPS (simd.h), the others here --
// and the few places where the AVX2 kernel is shaped differently from the AVX-512 one (the
// constants at the top, CodeSink, store_scales). Every function carries MPK_AVX2 and is inlined
// into a caller that carries it too; vec_avx512.h is the same interface on 16 lanes.
#pragma once

#include <cstdint>

#include "simd.h"

#if MPK_X86
#define MPK_AVX2_INLINE MPK_AVX2 __attribute__((always_inline)) inline

namespace mpkern {
namespace cpu {

struct Avx2 {
  using F = __m256;   // 8 floats
  using I = __m256i;  // 8 int32
  using M = __m256i;  // a lane mask: all ones or all zeros per 32-bit lane
  using H = __m128i;  // 8 16-bit values (fp16 / bf16 bits)
  static constexpr int kLanes = 8;
  // The compact kernel's per-group loops (4 vectors of a group of 32) stay loops, so that their
  // constants stay in the 16 vector registers across iterations.
  static constexpr bool kUnrollGroup = false;
  // The group's random words are hashed before its update loop, into the block's word buffer; hashed
  // inside the loop, GCC's loop distribution moved the buffer stores into a loop of their own that
  // hashed every element again.
  static constexpr bool kWordsFirst = true;
  // The compact kernel is instantiated per master mode (the mode a compile-time constant in the loop).
  static constexpr bool kMasterModeInstances = true;

  MPK_VEC_WIDTH_OPS(MPK_AVX2_INLINE, _mm256, si256)
  static MPK_AVX2_INLINE F floor(F a) { return _mm256_floor_ps(a); }
  static MPK_AVX2_INLINE M gt(F a, F b) { return _mm256_castps_si256(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  static MPK_AVX2_INLINE F blend(M m, F a, F b) { return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(m)); }  // m ? b : a
  static MPK_AVX2_INLINE I lanes() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static MPK_AVX2_INLINE I or_and(I a, I b, I c) { return _mm256_or_si256(a, _mm256_and_si256(b, c)); }  // a | (b & c)
  static MPK_AVX2_INLINE M eq(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static MPK_AVX2_INLINE M gt(I a, I b) { return _mm256_cmpgt_epi32(a, b); }             // signed
  static MPK_AVX2_INLINE I blend(M m, I a, I b) { return _mm256_blendv_epi8(a, b, m); }  // m ? b : a
  static MPK_AVX2_INLINE I zero_if(M m, I a) { return _mm256_andnot_si256(m, a); }       // m ? 0 : a

  // ---- narrow data: 16-bit values, bytes
  static MPK_AVX2_INLINE H load_h(const void* p) { return _mm_loadu_si128(reinterpret_cast<const H*>(p)); }
  static MPK_AVX2_INLINE void store_h(void* p, H x) { _mm_storeu_si128(reinterpret_cast<H*>(p), x); }
  // 8 bytes at p, sign- / zero-extended to int32
  static MPK_AVX2_INLINE I load_i8(const int8_t* p) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static MPK_AVX2_INLINE I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // the lanes (each <= 0xffff) as 8 u16 at p
  static MPK_AVX2_INLINE void store_u16(void* p, I x) { store_h(p, pack_u16x8(x)); }
  // the low 16 bits of the lanes as 8 u16 at p
  static MPK_AVX2_INLINE void store_lo16(void* p, I x) { store_u16(p, _mm256_and_si256(x, _mm256_set1_epi32(0xffff))); }
  // byte b of each lane as 8 bytes at p: one byte shuffle to the low 4 bytes of each 128-bit half,
  // then the two halves together
  static MPK_AVX2_INLINE void store_bytes(void* p, I x, int b) {
    const I bytes = _mm256_shuffle_epi8(
        x, _mm256_setr_epi8(b, b + 4, b + 8, b + 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, b, b + 4, b + 8,
                            b + 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const I packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }

  // ---- what the kernels need of the two ISAs' own idioms
  // bf16 bits h (low halves of the lanes) of a rounding of x, every NaN lane of x replaced by its
  // quiet NaN of the same sign
  static MPK_AVX2_INLINE I keep_nan(I h, F x) { return bf16_keep_nan32(h, x); }
  // the same where x is rarely NaN (the 8-bit master): one test, the blend only when a lane needs it
  static MPK_AVX2_INLINE I keep_nan_rare(I h, F x) {
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0, 0)) return keep_nan(h, x);
    return h;
  }
  // y (integral, in int32 range) as int32, 0 in the lanes where p is not finite
  static MPK_AVX2_INLINE I cvtt_where_finite(F y, F p) {
    const I expo = _mm256_set1_epi32(0x7f800000);
    return _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(p), expo), expo),
                               _mm256_cvttps_epi32(y));
  }

  // The unsigned maxima of the 8 lanes of each of 8 vectors x[0..7]: lane g of the result = the
  // maximum of x[g]; unpacks and one 128-bit permute (21 operations for 8 vectors).
  static MPK_AVX2_INLINE I hmax_lanes(const I* x) {
    I r[4], s[2];
    for (int i = 0; i < 4; ++i)  // per 128-bit half: [a0|a2, b0|b2, a1|a3, b1|b3]
      r[i] = _mm256_max_epu32(_mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]),
                              _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  // per 128-bit half: the half maxima of 4 consecutive vectors, in order
      s[i] = _mm256_max_epu32(_mm256_unpacklo_epi64(r[2 * i], r[2 * i + 1]),
                              _mm256_unpackhi_epi64(r[2 * i], r[2 * i + 1]));
    return _mm256_max_epu32(_mm256_permute2x128_si256(s[0], s[1], 0x20), _mm256_permute2x128_si256(s[0], s[1], 0x31));
  }

  // The first n (1..8) lanes of b (bf16 scale bits) as u16 at p: a whole block in one store.
  static MPK_AVX2_INLINE void store_scales(uint16_t* p, I b, int n) {
    if (n == kLanes) return store_u16(p, b);
    alignas(32) uint32_t t[kLanes];
    _mm256_store_si256(reinterpret_cast<I*>(t), b);
    for (int g = 0; g < n; ++g) p[g] = static_cast<uint16_t>(t[g]);
  }

  // The codes of one group of 32 elements, given 16 at a time as two vectors of int32 codes each
  // (put), written by store: packed to int16 as they come (exact, codes in [0, 255]) and zeroed
  // when the group's scale is NaN, then to bytes in element order.
  struct CodeSink {
    I ok_m, ok_v, m16[2], v16[2];
    MPK_AVX2_INLINE CodeSink(bool ok_m_, bool ok_v_)
        : ok_m(_mm256_set1_epi32(ok_m_ ? -1 : 0)), ok_v(_mm256_set1_epi32(ok_v_ ? -1 : 0)) {}
    MPK_AVX2_INLINE void put(int half, const I* m, const I* v) {
      m16[half] = _mm256_and_si256(_mm256_packs_epi32(m[0], m[1]), ok_m);
      v16[half] = _mm256_and_si256(_mm256_packs_epi32(v[0], v[1]), ok_v);
    }
    // NIBBLES: the m codes as 16 bytes of two nibbles each (the 4-bit exp_avg), else 32 bytes
    template <bool NIBBLES>
    MPK_AVX2_INLINE void store(void* m_dst, void* v_dst) const {
      const I order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      const I m = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(m16[0], m16[1]), order);
      if constexpr (NIBBLES) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(m_dst),
                         pack_nibbles16x2(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));
      } else {
        _mm256_storeu_si256(reinterpret_cast<I*>(m_dst), m);
      }
      _mm256_storeu_si256(reinterpret_cast<I*>(v_dst),
                          _mm256_permutevar8x32_epi32(_mm256_packus_epi16(v16[0], v16[1]), order));
    }
  };
};

}  // namespace cpu
}  // namespace mpkern
#endif  // MPK_X86
