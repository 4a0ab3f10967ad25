// CPU AdamW, the AVX-512 F/BW/VL/DQ path (16 lanes): the AVX2 path's operations in the same order,
// bit-identical to it and to the scalar path.
#include <cstdint>

#include "../kernels.h"
#include "adamw_cpu_impl.h"

#if MPK_X86
namespace mpkern {
namespace cpu {
namespace adamw_impl {

namespace {

// ---- AVX-512 path: 16 lanes, the AVX2 path's operations in the same order, with mask registers
// for the selects (Zen4 splits 512-bit ops in two: the gain is fewer instructions, not width).
MPK_AVX512 __attribute__((always_inline)) inline __m512 floor16(__m512 x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
}

// master8_decode on 16 lanes (see decode8).
template <int PDT>
MPK_AVX512 __attribute__((always_inline)) inline __m512 decode16(const TensorPtrs& t, int64_t i) {
  const __m256i h16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(t.p) + i));
  const __m128i c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(t.master) + i));
  if constexpr (PDT == kBF16) {
    const __m512i hs = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h16), 16);
    return _mm512_castsi512_ps(_mm512_add_epi32(hs, _mm512_slli_epi32(_mm512_cvtepi8_epi32(c8), 8)));
  } else {
    const __m512i h = _mm512_cvtepu16_epi32(h16);
    const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c8));
    const __m512 pv = _mm512_cvtph_ps(h16);
    const __m512i b = _mm512_max_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 10), _mm512_set1_epi32(0x1f)),
                                       _mm512_set1_epi32(1));
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(94)), 23));
    return _mm512_add_ps(pv, _mm512_mul_ps(c, scale));  // 2^(b - 33)
  }
}

// master8_encode on 16 lanes (see encode8); rw = the random words.
template <int PDT>
MPK_AVX512 __attribute__((always_inline)) inline void encode16(const TensorPtrs& t, int64_t i, __m512 w, __m512i rw) {
  int8_t* cdst = static_cast<int8_t*>(t.master) + i;
  if constexpr (PDT == kBF16) {
    // t = bits(w) + (word & 0xff); param = (t + 0x8000) >> 16 (a NaN: its quiet NaN); c = byte 1 of t
    const __m512i u = _mm512_castps_si512(w);
    const __m512i tt = _mm512_add_epi32(u, _mm512_and_si512(rw, _mm512_set1_epi32(0xff)));
    const __m512i h = bf16_keep_nan(_mm512_srli_epi32(_mm512_add_epi32(tt, _mm512_set1_epi32(0x8000)), 16), w);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(cdst), _mm512_cvtepi32_epi8(_mm512_srli_epi32(tt, 8)));
    store_u16x16(static_cast<uint16_t*>(t.p) + i, h);
    return;
  }
  const __m256i h16 = _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i h = _mm512_cvtepu16_epi32(h16);
  const __m512 p = _mm512_cvtph_ps(h16);
  const __m512i b = _mm512_max_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 10), _mm512_set1_epi32(0x1f)),
                                     _mm512_set1_epi32(1));
  const __m512 x = _mm512_mul_ps(_mm512_sub_ps(w, p),
                                 _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(160), b), 23)));
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(rand_a16x16(rw)), _mm512_set1_ps(1.0f / 65536.0f));
  __m512 y = floor16(_mm512_add_ps(x, u));
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
  const __m512i expo = _mm512_set1_epi32(0x7f800000);
  const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(p), expo), expo);
  const __m512i c = _mm512_maskz_cvttps_epi32(finite, y);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(cdst), _mm512_cvtepi32_epi8(c));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(t.p) + i), h16);
}

template <int PDT>
MPK_AVX512 __attribute__((always_inline)) inline __m512 load_w16(const TensorPtrs& t, const Flags& f, int64_t i) {
  if (f.mode == kMasterF32) return _mm512_loadu_ps(static_cast<const float*>(t.master) + i);
  if (f.mode == kMasterRemainder) {
    const auto* hp = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(t.p) + i);
    const auto* lp = reinterpret_cast<const __m256i*>(static_cast<const int16_t*>(t.master) + i);
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(hp));
    const __m512i lo = _mm512_cvtepi16_epi32(_mm256_loadu_si256(lp));
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 16), lo));
  }
  if constexpr (PDT != kF32) {
    if (f.mode == kMaster8bit) return decode16<PDT>(t, i);
  }
  return load16<PDT>(t.p, i);
}

template <int PDT>
MPK_AVX512 __attribute__((always_inline)) inline void store_w16(const TensorPtrs& t, const Flags& f, int64_t i,
                                                                __m512 p, bool need0, __m512i rw) {
  if (f.mode == kMasterF32) {
    _mm512_storeu_ps(static_cast<float*>(t.master) + i, p);
    store16<PDT>(t.p, i, p);
  } else if (f.mode == kMasterRemainder) {
    const __m512i u = _mm512_castps_si512(p);
    store_u16x16(static_cast<uint16_t*>(t.p) + i, _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)), 16));
    store_u16x16(static_cast<int16_t*>(t.master) + i, u);  // vpmovdw truncates: the low half
  } else if (PDT != kF32 && f.mode == kMaster8bit) {
    if constexpr (PDT != kF32) encode16<PDT>(t, i, p, rw);
  } else if (PDT == kBF16 && need0) {
    store_u16x16(static_cast<uint16_t*>(t.p) + i, bf16_sr_bits(p, rand_a16x16(rw)));
  } else {
    store16<PDT>(t.p, i, p);
  }
}

// The per-tensor constants of the AVX-512 loops.
struct Consts512 {
  __m512 factor, gsign, decay, omb1, b2, omb2, ss, ibc2, eps;
};

MPK_AVX512 inline Consts512 consts512(const TensorPtrs& t, const Flags& f) {
  Consts512 k;
  k.factor = _mm512_set1_ps(f.factor);  // -(g * factor) when maximizing, as in the AVX2 path
  k.gsign = _mm512_castsi512_ps(_mm512_set1_epi32(f.maximize ? static_cast<int>(0x80000000u) : 0));
  k.decay = _mm512_set1_ps(t.c.decay);
  k.omb1 = _mm512_set1_ps(t.c.one_m_b1);
  k.b2 = _mm512_set1_ps(t.c.beta2);
  k.omb2 = _mm512_set1_ps(t.c.one_m_b2);
  k.ss = _mm512_set1_ps(t.c.step_size);
  k.ibc2 = _mm512_set1_ps(t.c.inv_bc2);
  k.eps = _mm512_set1_ps(t.c.eps);
  return k;
}

// math.h's adamw_moments / adamw_step in 16 lanes.
MPK_AVX512 __attribute__((always_inline)) inline void moments16(const Consts512& k, __m512 g, __m512& m,
                                                                __m512& v) {
  m = _mm512_fmadd_ps(k.omb1, _mm512_sub_ps(g, m), m);
  v = _mm512_fmadd_ps(_mm512_mul_ps(k.omb2, g), g, _mm512_mul_ps(v, k.b2));
}

MPK_AVX512 __attribute__((always_inline)) inline __m512 step16(const Consts512& k, __m512 p, __m512 m, __m512 vv) {
  const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), k.ibc2, k.eps);
  // fma(p, decay, -q) with -q formed first, as the scalar fmaf gets it: a NaN q's sign flips on every path
  const __m512 nq = _mm512_xor_ps(_mm512_div_ps(_mm512_mul_ps(k.ss, m), denom), _mm512_set1_ps(-0.0f));
  return _mm512_fmadd_ps(p, k.decay, nq);
}

template <int PDT, int GDT, int SDT>
MPK_AVX512 void adamw_avx512(const TensorPtrs& t_in, int64_t begin, int64_t end, const Flags& f_in) {
  const TensorPtrs t = t_in;  // local copies, never passed out of line (the scalar tails get the caller's):
  // the stores below cannot alias them, so nothing is reloaded in the loops
  const Flags f = f_in;
  const Consts512 k = consts512(t, f);
  const bool need0 = needs_word0(t, f);
  const RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  const bool needw = need0 || SDT == kBF16;
  const __m512i key = _mm512_set1_epi32(static_cast<int>(keys.key));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const uint32_t elo0 = static_cast<uint32_t>(t.offset + static_cast<uint64_t>(i));
    const __m512i elo = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(elo0)), lanes);
    const __m512i rw = needw ? mix32x16(_mm512_xor_si512(key, elo)) : elo;  // the one random word
    const __m512 g = _mm512_xor_ps(_mm512_mul_ps(load16<GDT>(t.g, i), k.factor), k.gsign);
    __m512 p = load_w16<PDT>(t, f, i);
    __m512 m = load16<SDT>(t.m, i);
    __m512 v = load16<SDT>(t.v, i);
    moments16(k, g, m, v);
    __m512 vv = v;
    if (t.vmax != nullptr) {  // vmax > v ? vmax : v
      const __m512 old = _mm512_loadu_ps(t.vmax + i);
      vv = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(old, v, _CMP_GT_OQ), old);
      _mm512_storeu_ps(t.vmax + i, vv);
    }
    p = step16(k, p, m, vv);
    if constexpr (SDT == kBF16) {
      store_u16x16(static_cast<uint16_t*>(t.m) + i, bf16_sr_bits(m, rand_b16x16(rw)));
      store_u16x16(static_cast<uint16_t*>(t.v) + i, bf16_sr_bits(v, rand_c16x16(rw)));
    } else {
      _mm512_storeu_ps(static_cast<float*>(t.m) + i, m);
      _mm512_storeu_ps(static_cast<float*>(t.v) + i, v);
    }
    store_w16<PDT>(t, f, i, p, need0, rw);
  }
  if (i < end) adamw_scalar(t_in, i, end, f_in);
}

// ---- ladder codes on 16 lanes (math.h ladder_*, mom8_*, mom4_*), bit-identical to the scalar code.
// The dither of a field added below the kept mantissa bits: r16 << (7 - MB) of rand_b16 / rand_c16,
// from the random word in one shift and one ternary-logic op: the field's 11 bits moved to bits
// (12 - MB) .. (22 - MB), the cell-centre bit (11 - MB) set. FIELD_LO: the field's lowest bit in the
// word (10: B, 21: C).
template <int FIELD_LO, int MB>
MPK_AVX512 __attribute__((always_inline)) inline __m512i dither16(__m512i rw) {
  constexpr int sh = FIELD_LO - (12 - MB);
  const __m512i moved = sh >= 0 ? _mm512_srli_epi32(rw, sh) : _mm512_slli_epi32(rw, -sh);
  return _mm512_ternarylogic_epi32(moved, _mm512_set1_epi32(0x7ff << (12 - MB)), _mm512_set1_epi32(1 << (11 - MB)),
                                   0xEA);  // (a & b) | c
}

// ladder_encode: magnitude codes of ax = |x| given 1 / s and the dither.
template <int MB>
MPK_AVX512 __attribute__((always_inline)) inline __m512i ladder_enc16(__m512 ax, __m512 inv, __m512i dither) {
  const __m512 z = _mm512_fmadd_ps(ax, inv, _mm512_set1_ps(1.0f));  // = y + 1 bit for bit (math.h)
  const __m512i t = _mm512_add_epi32(_mm512_castps_si512(z), dither);
  return _mm512_srli_epi32(_mm512_sub_epi32(t, _mm512_set1_epi32(0x3f800000)), 23 - MB);
}

// mom8_encode_m (MB 4, sign at bit 7) / mom4_encode_m (MB 1, sign at bit 3): int32 codes.
template <int MB>
MPK_AVX512 __attribute__((always_inline)) inline __m512i enc_m16(__m512 m, __m512 inv, __m512i rw) {
  constexpr int kSignAt = MB == 4 ? 7 : 3;
  const __m512i q = ladder_enc16<MB>(_mm512_abs_ps(m), inv, dither16<10, MB>(rw));
  return _mm512_ternarylogic_epi32(q, _mm512_srli_epi32(_mm512_castps_si512(m), 31 - kSignAt),
                                   _mm512_set1_epi32(1 << kSignAt), 0xF8);  // q | (sign & bit)
}

// mom8_encode_v: int32 codes, at least 1 for v > 0 (bits(v) > 0: v >= +0 here).
MPK_AVX512 __attribute__((always_inline)) inline __m512i enc_v16(__m512 v, __m512 inv, __m512i rw) {
  const __m512i q = ladder_enc16<4>(v, inv, dither16<21, 4>(rw));
  return _mm512_max_epu32(q, _mm512_min_epu32(_mm512_castps_si512(v), _mm512_set1_epi32(1)));
}

// u(q) * s of 16 magnitude codes (math.h ladder_value_scaled: F - 1, then the exact multiply by the scale).
template <int MB>
MPK_AVX512 __attribute__((always_inline)) inline __m512 ladder_dec16(__m512i q, __m512 s) {
  const __m512 f = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(q, 23 - MB), _mm512_set1_epi32(0x3f800000)));
  return _mm512_fmsub_ps(f, s, s);  // = (f - 1) * s bit for bit (math.h, ladder_value_scaled)
}

// mom8_decode_m of 16 sign-magnitude bytes: the magnitude bits masked after the shift, the byte's
// sign (bit 31 of its sign extension) OR-ed in.
MPK_AVX512 __attribute__((always_inline)) inline __m512 dec_m16(const int8_t* p, __m512 s) {
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 x = ladder_dec16<4>(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), s);
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(x), b,
                                                       _mm512_set1_epi32(static_cast<int>(0x80000000u)), 0xF8));
}

MPK_AVX512 __attribute__((always_inline)) inline __m512 dec_v16(const uint8_t* p, __m512 s) {
  return ladder_dec16<4>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), s);
}

// The unsigned maxima of the 16 lanes of each of 16 vectors x[0..15], lane g of the result = the
// maximum of x[g]: a tree of unpacks and 128-bit shuffles (45 operations for 16 vectors where a
// horizontal reduction each would take ~9 apiece).
MPK_AVX512 __attribute__((always_inline)) inline __m512i hmax16x16(const __m512i* x) {
  __m512i r[8], s[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [a0|a2, b0|b2, a1|a3, b1|b3]
    r[i] = _mm512_max_epu32(_mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]),
                            _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit block: the block maxima of 4 consecutive vectors, in order
    s[i] = _mm512_max_epu32(_mm512_unpacklo_epi64(r[2 * i], r[2 * i + 1]),
                            _mm512_unpackhi_epi64(r[2 * i], r[2 * i + 1]));
  const __m512i u01 = _mm512_max_epu32(_mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i u23 = _mm512_max_epu32(_mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(s[2], s[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_max_epu32(_mm512_shuffle_i32x4(u01, u23, _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_i32x4(u01, u23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// ladder_scale_bits and ladder_inv_scale of 16 groups at once: amax = the groups' |x| maxima as bits.
MPK_AVX512 __attribute__((always_inline)) inline __m512i scale_bits16(__m512i amax, Ladder lf, __m512& inv) {
  __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(_mm512_add_epi32(amax, _mm512_set1_epi32(static_cast<int>(0x7fffffu - lf.umax_mant))), 23),
                               _mm512_set1_epi32(lf.umax_exp));
  e = _mm512_max_epi32(e, _mm512_set1_epi32(1));
  const __mmask16 nonfinite = _mm512_cmpgt_epu32_mask(amax, _mm512_set1_epi32(0x7f7fffff));
  inv = _mm512_maskz_mov_ps(static_cast<__mmask16>(~nonfinite),
                            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), e), 23)));
  const __m512i b = _mm512_maskz_slli_epi32(_mm512_test_epi32_mask(amax, amax), e, 7);  // zeros: scale 0
  return _mm512_mask_mov_epi32(b, nonfinite, _mm512_set1_epi32(static_cast<int>(kMom8NaNScale)));
}

// n (1..16) consecutive groups of 32 starting at gb (global element elo0 of the low index half, all
// with the same high half): the update pass writes the masters/params and keeps the updated
// moments and random words in an L1 buffer and each group's 16-lane |x| maxima; then the 16 groups'
// scales and 1 / s in one vector pass; then the codes.
template <int PDT, int GDT, bool M4>
MPK_AVX512 __attribute__((always_inline)) inline void mom8_block512(const TensorPtrs& t, const Flags& f,
                                                                    const Consts512& k, int64_t gb, uint32_t elo0,
                                                                    int n, bool need0, __m512i key) {
  constexpr int kG = 16;
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int8_t* cmp = static_cast<int8_t*>(t.m);
  uint8_t* cm4 = static_cast<uint8_t*>(t.m);
  uint8_t* cvp = static_cast<uint8_t*>(t.v);
  const int64_t j0 = gb >> 5;
  alignas(64) float mb[kG * kMom8Group], vb[kG * kMom8Group];
  alignas(64) uint32_t rb[kG * kMom8Group];
  __m512i am[kG], av[kG];
  // M4: the block's m codes as int8 -- 2 u(q) with the sign of the stored nibbles before the update
  // pass (nibble_u2_32), the new nibbles after the encode pass -- so that those passes read and
  // write bytes as the 8-bit kind's do, and the nibbles are unpacked and packed in short loops of
  // their own (16-byte stores and loads of the same addresses: store-to-load forwarding works; a
  // 64-byte load of four 16-byte stores measured ~6 % slower)
  alignas(64) int8_t c8[M4 ? kG * kMom8Group : 1];
  if constexpr (M4) {
    for (int g = 0; g < n; ++g) nibble_u2_32(cm4 + ((gb + g * kMom8Group) >> 1), c8 + g * kMom8Group);
  }
  for (int g = 0; g < kG; ++g) {
    if (g >= n) {
      am[g] = _mm512_setzero_si512();
      av[g] = _mm512_setzero_si512();
      continue;
    }
    // M4: s / 2 (the bytes hold 2 u(q)); the halving is exact (a power of two, >= 2^-127)
    const __m512 sm = _mm512_set1_ps(bf16_to_f32(t.sm[j0 + g]) * (M4 ? 0.5f : 1.0f));
    const __m512 sv = _mm512_set1_ps(bf16_to_f32(t.sv[j0 + g]));
    __m512i gm = _mm512_setzero_si512(), gv = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const int o = g * kMom8Group + 16 * q;
      const int64_t i = gb + o;
      const __m512i elo = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(elo0 + static_cast<uint32_t>(o))), lanes);
      const __m512 gr = _mm512_xor_ps(_mm512_mul_ps(load16<GDT>(t.g, i), k.factor), k.gsign);
      __m512 p = load_w16<PDT>(t, f, i);
      __m512 mm;
      if constexpr (M4) {  // 2 u(q) as signed bytes (nibble_u2_32), times s / 2: exact
        mm = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(c8 + o)))),
                           sm);
      } else {
        mm = dec_m16(cmp + i, sm);
      }
      __m512 vv = dec_v16(cvp + i, sv);
      moments16(k, gr, mm, vv);
      p = step16(k, p, mm, vv);
      const __m512i rw = mix32x16(_mm512_xor_si512(key, elo));  // the one random word of each element
      store_w16<PDT>(t, f, i, p, need0, rw);
      _mm512_store_ps(mb + o, mm);
      _mm512_store_ps(vb + o, vv);
      _mm512_store_si512(rb + o, rw);
      gm = _mm512_max_epu32(gm, _mm512_and_si512(_mm512_castps_si512(mm), abs_mask));
      gv = _mm512_max_epu32(gv, _mm512_and_si512(_mm512_castps_si512(vv), abs_mask));
    }
    am[g] = gm;
    av[g] = gv;
  }
  __m512 im, iv;
  const __m512i bm = scale_bits16(hmax16x16(am), M4 ? ladder_m4() : ladder_m8(), im);
  const __m512i bv = scale_bits16(hmax16x16(av), ladder_v8(), iv);
  alignas(64) float ims[kG], ivs[kG];
  alignas(64) uint32_t bms[kG], bvs[kG];
  _mm512_store_ps(ims, im);
  _mm512_store_ps(ivs, iv);
  _mm512_store_si512(bms, bm);
  _mm512_store_si512(bvs, bv);
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
  _mm256_mask_storeu_epi16(t.sm + j0, live, _mm512_cvtepi32_epi16(bm));
  _mm256_mask_storeu_epi16(t.sv + j0, live, _mm512_cvtepi32_epi16(bv));
  for (int g = 0; g < n; ++g) {
    const __m512 img = _mm512_set1_ps(ims[g]), ivg = _mm512_set1_ps(ivs[g]);
    const __mmask16 okm = bms[g] == kMom8NaNScale ? 0 : 0xffff, okv = bvs[g] == kMom8NaNScale ? 0 : 0xffff;
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const int o = g * kMom8Group + 16 * q;
      const __m512i rw = _mm512_load_si512(rb + o);
      const __m512i c = _mm512_maskz_mov_epi32(okm, enc_m16<M4 ? 1 : 4>(_mm512_load_ps(mb + o), img, rw));
      const __m512i d = _mm512_maskz_mov_epi32(okv, enc_v16(_mm512_load_ps(vb + o), ivg, rw));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(M4 ? c8 + o : cmp + gb + o), _mm512_cvtepi32_epi8(c));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cvp + gb + o), _mm512_cvtepi32_epi8(d));
    }
  }
  if constexpr (M4) {
    for (int g = 0; g < n; ++g) {
      const int8_t* c = c8 + g * kMom8Group;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(cm4 + ((gb + g * kMom8Group) >> 1)),
                       pack_nibbles16x2(_mm_load_si128(reinterpret_cast<const __m128i*>(c)),
                                        _mm_load_si128(reinterpret_cast<const __m128i*>(c + 16))));
    }
  }
}

template <int PDT, int GDT, bool M4>
MPK_AVX512 void adamw_avx512_mom8(const TensorPtrs& t_in, int64_t begin, int64_t end, const Flags& f_in) {
  const TensorPtrs t = t_in;  // local copies, never passed out of line (the scalar tails get the caller's):
  // the stores below cannot alias them, so nothing is reloaded in the loops
  const Flags f = f_in;
  const Consts512 k = consts512(t, f);
  const bool need0 = needs_word0(t, f);
  RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  int64_t gb = begin;
  while (gb + kMom8Group <= end) {
    const uint64_t e0 = t.offset + static_cast<uint64_t>(gb);
    const uint32_t hi0 = static_cast<uint32_t>(e0 >> 32);
    if (static_cast<uint32_t>((e0 + kMom8Group - 1) >> 32) != hi0) {  // the group crosses 2^32: scalar
      adamw_scalar_mom8(t_in, gb, gb + kMom8Group, f_in);
      gb += kMom8Group;
      continue;
    }
    if (hi0 != keys.hi) keys = rng_keys(f.seed, t.stream, t.step, e0);
    int n = static_cast<int>(std::min<int64_t>(16, (end - gb) / kMom8Group));
    while (n > 1 && static_cast<uint32_t>((e0 + static_cast<uint64_t>(kMom8Group) * n - 1) >> 32) != hi0) --n;
    mom8_block512<PDT, GDT, M4>(t, f, k, gb, static_cast<uint32_t>(e0), n, need0,
                            _mm512_set1_epi32(static_cast<int>(keys.key)));
    gb += static_cast<int64_t>(kMom8Group) * n;
  }
  if (gb < end) adamw_scalar_mom8(t_in, gb, end, f_in);
}

template <int PDT, int GDT>
AvxFn pick512_s(int32_t sdt) {
  if (sdt == kMom8) return &adamw_avx512_mom8<PDT, GDT, false>;
  if (sdt == kMom4) return &adamw_avx512_mom8<PDT, GDT, true>;
  if (sdt == kF32) return &adamw_avx512<PDT, GDT, kF32>;
  if (sdt == kBF16) return &adamw_avx512<PDT, GDT, kBF16>;
  return nullptr;  // a mode without a vector version: the scalar path runs it
}
template <int PDT>
AvxFn pick512_g(int32_t gdt, int32_t sdt) {
  switch (gdt) {
    case kF32: return pick512_s<PDT, kF32>(sdt);
    case kF16: return pick512_s<PDT, kF16>(sdt);
    default: return pick512_s<PDT, kBF16>(sdt);
  }
}

}  // namespace

AvxFn pick_avx512(int32_t pdt, int32_t gdt, int32_t sdt) {
  switch (pdt) {
    case kF32: return pick512_g<kF32>(gdt, sdt);
    case kF16: return pick512_g<kF16>(gdt, sdt);
    default: return pick512_g<kBF16>(gdt, sdt);
  }
}

}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
#endif  // MPK_X86
