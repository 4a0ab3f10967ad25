// The AVX-512 F/BW/VL/DQ lane traits of the CPU vector kernels: 16 float / int32 lanes in __m512 /
// __m512i, mask registers for the selects; the interface of vec_avx2.h (see there) on 16 lanes.
// Every function carries MPK_AVX512 and is called only after cpu_has_avx512() said yes. (Zen4
// splits 512-bit operations in two: the gain is fewer instructions, not width.)
#pragma once

#include <cstdint>

#include "simd.h"

#if MPK_X86
#define MPK_AVX512_INLINE MPK_AVX512 __attribute__((always_inline)) inline

namespace mpkern {
namespace cpu {

struct Avx512 {
  using F = __m512;     // 16 floats
  using I = __m512i;    // 16 int32
  using M = __mmask16;  // a lane mask
  using H = __m256i;    // 16 16-bit values (fp16 / bf16 bits)
  static constexpr int kLanes = 16;
  // The compact kernel's per-group loops (2 vectors of a group of 32) are unrolled.
  static constexpr bool kUnrollGroup = true;
  // The random words are hashed inside the update loop and stored to the block's word buffer there.
  static constexpr bool kWordsFirst = false;
  // One compact kernel for every master mode (the mode read at run time; one instance per mode
  // measured no faster).
  static constexpr bool kMasterModeInstances = false;

  MPK_VEC_WIDTH_OPS(MPK_AVX512_INLINE, _mm512, si512)
  static MPK_AVX512_INLINE F floor(F a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static MPK_AVX512_INLINE M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static MPK_AVX512_INLINE F blend(M m, F a, F b) { return _mm512_mask_mov_ps(a, m, b); }  // m ? b : a
  static MPK_AVX512_INLINE I lanes() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static MPK_AVX512_INLINE I or_and(I a, I b, I c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }  // a | (b & c)
  static MPK_AVX512_INLINE M eq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static MPK_AVX512_INLINE M gt(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }                       // signed
  static MPK_AVX512_INLINE I blend(M m, I a, I b) { return _mm512_mask_mov_epi32(a, m, b); }              // m ? b : a
  static MPK_AVX512_INLINE I zero_if(M m, I a) { return _mm512_maskz_mov_epi32(static_cast<M>(~m), a); }  // m ? 0 : a

  // ---- narrow data: 16-bit values, bytes
  static MPK_AVX512_INLINE H load_h(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const H*>(p)); }
  static MPK_AVX512_INLINE void store_h(void* p, H x) { _mm256_storeu_si256(reinterpret_cast<H*>(p), x); }
  // 16 bytes at p, sign- / zero-extended to int32
  static MPK_AVX512_INLINE I load_i8(const int8_t* p) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static MPK_AVX512_INLINE I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // the low 16 bits of the lanes as 16 u16 at p (vpmovdw truncates: one instruction for both)
  static MPK_AVX512_INLINE void store_u16(void* p, I x) { store_h(p, _mm512_cvtepi32_epi16(x)); }
  static MPK_AVX512_INLINE void store_lo16(void* p, I x) { store_u16(p, x); }
  // byte b of each lane as 16 bytes at p
  static MPK_AVX512_INLINE void store_bytes(void* p, I x, int b) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(b == 0 ? x : _mm512_srli_epi32(x, 8 * b)));
  }

  // ---- what the kernels need of the two ISAs' own idioms (see vec_avx2.h)
  static MPK_AVX512_INLINE I keep_nan(I h, F x) {
    return _mm512_mask_or_epi32(h, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                _mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(0x0040));
  }
  static MPK_AVX512_INLINE I keep_nan_rare(I h, F x) { return keep_nan(h, x); }  // one masked OR: no test first
  static MPK_AVX512_INLINE I cvtt_where_finite(F y, F p) {
    const I expo = _mm512_set1_epi32(0x7f800000);
    return _mm512_maskz_cvttps_epi32(_mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(p), expo), expo), y);
  }

  // The unsigned maxima of the 16 lanes of each of 16 vectors x[0..15], lane g of the result = the
  // maximum of x[g]: a tree of unpacks and 128-bit shuffles (45 operations for 16 vectors where a
  // horizontal reduction each would take ~9 apiece).
  static MPK_AVX512_INLINE I hmax_lanes(const I* x) {
    I r[8], s[4];
    for (int i = 0; i < 8; ++i)  // per 128-bit block: [a0|a2, b0|b2, a1|a3, b1|b3]
      r[i] = _mm512_max_epu32(_mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]),
                              _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
    for (int i = 0; i < 4; ++i)  // per 128-bit block: the block maxima of 4 consecutive vectors, in order
      s[i] = _mm512_max_epu32(_mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]),
                              _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]));
    const I u01 = _mm512_max_epu32(_mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const I u23 = _mm512_max_epu32(_mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_max_epu32(_mm512_shuffle_i32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // The first n (1..16) lanes of b as u16 at p: one masked store.
  static MPK_AVX512_INLINE void store_scales(uint16_t* p, I b, int n) {
    _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1u), _mm512_cvtepi32_epi16(b));
  }

  // The codes of one group of 32 elements, 16 at a time (one vector of int32 codes each, put),
  // narrowed to bytes as they come (zeroed when the group's scale is NaN), written by store.
  struct CodeSink {
    M ok_m, ok_v;
    __m128i m8[2], v8[2];
    MPK_AVX512_INLINE CodeSink(bool ok_m_, bool ok_v_) : ok_m(ok_m_ ? 0xffff : 0), ok_v(ok_v_ ? 0xffff : 0) {}
    MPK_AVX512_INLINE void put(int half, const I* m, const I* v) {
      m8[half] = _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(ok_m, m[0]));
      v8[half] = _mm512_cvtepi32_epi8(_mm512_maskz_mov_epi32(ok_v, v[0]));
    }
    // NIBBLES: the m codes as 16 bytes of two nibbles each (the 4-bit exp_avg), else 32 bytes
    template <bool NIBBLES>
    MPK_AVX512_INLINE void store(void* m_dst, void* v_dst) const {
      auto* m = reinterpret_cast<__m128i*>(m_dst);
      auto* v = reinterpret_cast<__m128i*>(v_dst);
      if constexpr (NIBBLES) {
        _mm_storeu_si128(m, pack_nibbles16x2(m8[0], m8[1]));
      } else {
        _mm_storeu_si128(m, m8[0]);
        _mm_storeu_si128(m + 1, m8[1]);
      }
      _mm_storeu_si128(v, v8[0]);
      _mm_storeu_si128(v + 1, v8[1]);
    }
  };
};

}  // namespace cpu
}  // namespace mpkern
#endif  // MPK_X86
