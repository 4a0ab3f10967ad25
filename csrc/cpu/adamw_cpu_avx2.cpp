// CPU AdamW, the AVX2 path (8 lanes): the scalar path's arithmetic in the same order (its fmas as
// FMA intrinsics, no other contraction), bit-identical to it.
#include <cstdint>

#include "../kernels.h"
#include "adamw_cpu_impl.h"

#if MPK_X86
namespace mpkern {
namespace cpu {
namespace adamw_impl {

namespace {

// ---- AVX2 path: same arithmetic, same order of operations (math.h's fmas, no other contraction) -----
// The random words are computed 8 lanes at a time (one key per call: the caller splits ranges at
// multiples of 2^32 of the global element index, so the high index half is the same in a call).

// math.h's AdamWConsts in 8 lanes, and its adamw_moments / adamw_step on them.
struct Consts8 {
  __m256 decay, omb1, b2, omb2, ss, ibc2, eps;
};

MPK_AVX2 inline Consts8 consts8(const AdamWConsts& c) {
  return {_mm256_set1_ps(c.decay), _mm256_set1_ps(c.one_m_b1), _mm256_set1_ps(c.beta2), _mm256_set1_ps(c.one_m_b2),
          _mm256_set1_ps(c.step_size), _mm256_set1_ps(c.inv_bc2), _mm256_set1_ps(c.eps)};
}

MPK_AVX2 __attribute__((always_inline)) inline void moments8(const Consts8& k, __m256 g, __m256& m, __m256& v) {
  m = _mm256_fmadd_ps(k.omb1, _mm256_sub_ps(g, m), m);
  v = _mm256_fmadd_ps(_mm256_mul_ps(k.omb2, g), g, _mm256_mul_ps(v, k.b2));
}

MPK_AVX2 __attribute__((always_inline)) inline __m256 step8(const Consts8& k, __m256 p, __m256 m, __m256 vv) {
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vv), k.ibc2, k.eps);
  // fma(p, decay, -q) with -q formed first, as the scalar fmaf gets it: a NaN q's sign flips on every path
  const __m256 nq = _mm256_xor_ps(_mm256_div_ps(_mm256_mul_ps(k.ss, m), denom), _mm256_set1_ps(-0.0f));
  return _mm256_fmadd_ps(p, k.decay, nq);
}
template <int PDT>
MPK_AVX2 __attribute__((always_inline)) inline void decode8(const TensorPtrs& t, int64_t i, __m256& p) {
  // master8_decode: bf16 (bits(p) << 16) + 256 c; fp16 p + c * 2^(max(e, 1) - 33)
  const __m128i h16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(t.p) + i));
  const __m128i c8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(t.master) + i));
  if constexpr (PDT == kBF16) {
    const __m256i hs = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h16), 16);
    p = _mm256_castsi256_ps(_mm256_add_epi32(hs, _mm256_slli_epi32(_mm256_cvtepi8_epi32(c8), 8)));
  } else {
    const __m256i h = _mm256_cvtepu16_epi32(h16);
    const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8));
    const __m256 pv = _mm256_cvtph_ps(h16);
    __m256i b = _mm256_max_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 10), _mm256_set1_epi32(0x1f)),
                                 _mm256_set1_epi32(1));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(94)), 23));
    p = _mm256_add_ps(pv, _mm256_mul_ps(c, scale));  // 2^(b - 33)
  }
}

// Byte B of each of 8 int32 lanes -> 8 bytes at dst: one byte shuffle to the low 4 bytes of each
// 128-bit half, then the two halves together.
template <int B>
MPK_AVX2 __attribute__((always_inline)) inline void store_byte8(void* dst, __m256i v) {
  const __m256i bytes = _mm256_shuffle_epi8(v, _mm256_setr_epi8(B, B + 4, B + 8, B + 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                -1, -1, -1, -1, B, B + 4, B + 8, B + 12, -1, -1, -1, -1,
                                                                -1, -1, -1, -1, -1, -1, -1, -1));
  const __m256i packed = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(packed));
}

template <int PDT>
MPK_AVX2 __attribute__((always_inline)) inline void encode8(const TensorPtrs& t, int64_t i, __m256 w, __m256i rw) {
  int8_t* cdst = static_cast<int8_t*>(t.master) + i;
  uint16_t* hdst = static_cast<uint16_t*>(t.p) + i;
  if constexpr (PDT == kBF16) {
    // master8_encode, bf16: t = bits(w) + (word & 0xff); param = (t + 0x8000) >> 16 (a NaN: its
    // quiet NaN); c = byte 1 of t
    const __m256i u = _mm256_castps_si256(w);
    const __m256i tt = _mm256_add_epi32(u, _mm256_and_si256(rw, _mm256_set1_epi32(0xff)));
    __m256i h = _mm256_srli_epi32(_mm256_add_epi32(tt, _mm256_set1_epi32(0x8000)), 16);
    // a NaN master (rare: the step's found_inf skips a non-finite grad) keeps its quiet NaN; the
    // test is one movemask, the blend only when a lane needs it
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps(w, w, _CMP_UNORD_Q)) != 0, 0)) h = bf16_keep_nan32(h, w);
    store_byte8<1>(cdst, tt);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hdst), pack_u16x8(h));
    return;
  }
  // fp16: param = RNE(w); c = clamp(floor(x + r / 2^16)), x = (w - param) * 2^(33 - max(e, 1))
  const __m128i h16 = _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i h = _mm256_cvtepu16_epi32(h16);
  const __m256 p = _mm256_cvtph_ps(h16);
  const __m256i b = _mm256_max_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 10), _mm256_set1_epi32(0x1f)),
                                     _mm256_set1_epi32(1));
  const __m256 x = _mm256_mul_ps(_mm256_sub_ps(w, p),
                                 _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(160), b), 23)));
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(rand_a16x8(rw)), _mm256_set1_ps(1.0f / 65536.0f));
  __m256 y = _mm256_floor_ps(_mm256_add_ps(x, u));
  y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
  const __m256i pu = _mm256_castps_si256(p);
  const __m256i expo = _mm256_set1_epi32(0x7f800000);
  const __m256i nonfinite = _mm256_cmpeq_epi32(_mm256_and_si256(pu, expo), expo);
  store_byte8<0>(cdst, _mm256_andnot_si256(nonfinite, _mm256_cvttps_epi32(y)));  // in [-128, 127]
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hdst), h16);
}

// The fp32 master of elements [i, i + 8) (the param itself in mode 0).
template <int PDT>
MPK_AVX2 __attribute__((always_inline)) inline __m256 load_w8(const TensorPtrs& t, const Flags& f, int64_t i) {
  __m256 p;
  if (f.mode == kMasterF32) {
    p = _mm256_loadu_ps(static_cast<const float*>(t.master) + i);
  } else if (f.mode == kMasterRemainder) {
    const auto* hp = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(t.p) + i);
    const auto* lp = reinterpret_cast<const __m128i*>(static_cast<const int16_t*>(t.master) + i);
    const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(hp));
    const __m256i lo = _mm256_cvtepi16_epi32(_mm_loadu_si128(lp));
    p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 16), lo));
  } else if (PDT != kF32 && f.mode == kMaster8bit) {
    if constexpr (PDT != kF32) decode8<PDT>(t, i, p);
  } else {
    p = load8<PDT>(t.p, i);
  }
  return p;
}

// Store the updated masters p of elements [i, i + 8) and the params; rw = the elements' random
// words (field A used in mode 3 and for param SR).
template <int PDT>
MPK_AVX2 __attribute__((always_inline)) inline void store_w8(const TensorPtrs& t, const Flags& f, int64_t i, __m256 p,
                                                             bool need0, __m256i rw) {
  if (f.mode == kMasterF32) {
    _mm256_storeu_ps(static_cast<float*>(t.master) + i, p);
    store8<PDT>(t.p, i, p);
  } else if (f.mode == kMasterRemainder) {
    const __m256i u = _mm256_castps_si256(p);
    const __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), 16);
    const __m256i lo = _mm256_and_si256(u, _mm256_set1_epi32(0xffff));
    const __m256i hp = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08);
    const __m256i lp = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, lo), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.p) + i), _mm256_castsi256_si128(hp));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<int16_t*>(t.master) + i), _mm256_castsi256_si128(lp));
  } else if (PDT != kF32 && f.mode == kMaster8bit) {
    if constexpr (PDT != kF32) encode8<PDT>(t, i, p, rw);
  } else if (PDT == kBF16 && need0) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.p) + i),
                     pack_u16x8(bf16_sr_bits32(p, rand_a16x8(rw))));
  } else {
    store8<PDT>(t.p, i, p);
  }
}

template <int PDT, int GDT, int SDT>
MPK_AVX2 void adamw_avx2(const TensorPtrs& t_in, int64_t begin, int64_t end, const Flags& f_in) {
  const TensorPtrs t = t_in;  // local copies, never passed out of line (the scalar tail gets the caller's):
  const Flags f = f_in;       // the stores below cannot alias them, so nothing is reloaded in the loop
  // g = -(grad * factor) when maximizing, as the scalar code: a sign flip after the multiply
  // (g * (-factor) differs from it in the sign of a NaN)
  const __m256 factor = _mm256_set1_ps(f.factor);
  const __m256 gsign = _mm256_castsi256_ps(_mm256_set1_epi32(f.maximize ? static_cast<int>(0x80000000u) : 0));
  const Consts8 k = consts8(t.c);
  const bool need0 = needs_word0(t, f), needw = need0 || SDT == kBF16;
  const RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  const __m256i key = _mm256_set1_epi32(static_cast<int>(keys.key));
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const uint32_t elo0 = static_cast<uint32_t>(t.offset + static_cast<uint64_t>(i));  // low index half
    const __m256i elo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(elo0)), lanes);
    const __m256i rw = needw ? mix32x8(_mm256_xor_si256(key, elo)) : elo;  // the one random word
    const __m256 g = _mm256_xor_ps(_mm256_mul_ps(load8<GDT>(t.g, i), factor), gsign);
    __m256 p = load_w8<PDT>(t, f, i);
    __m256 m = load8<SDT>(t.m, i);
    __m256 v = load8<SDT>(t.v, i);
    moments8(k, g, m, v);
    __m256 vv = v;
    if (t.vmax != nullptr) {
      // max(vmax, v) with the scalar's tie/NaN rule: vmax > v ? vmax : v
      const __m256 old = _mm256_loadu_ps(t.vmax + i);
      vv = _mm256_blendv_ps(v, old, _mm256_cmp_ps(old, v, _CMP_GT_OQ));
      _mm256_storeu_ps(t.vmax + i, vv);
    }
    p = step8(k, p, m, vv);
    if constexpr (SDT == kBF16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.m) + i),
                       pack_u16x8(bf16_sr_bits32(m, rand_b16x8(rw))));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(t.v) + i),
                       pack_u16x8(bf16_sr_bits32(v, rand_c16x8(rw))));
    } else {
      _mm256_storeu_ps(static_cast<float*>(t.m) + i, m);
      _mm256_storeu_ps(static_cast<float*>(t.v) + i, v);
    }
    store_w8<PDT>(t, f, i, p, need0, rw);
  }
  if (i < end) adamw_scalar(t_in, i, end, f_in);
}

// ---- 8-bit moments, AVX2: one group of 32 = 4 x 8 lanes in registers -----------------------------

// ---- ladder codes on 8 lanes (math.h ladder_*, mom8_*, mom4_*; the AVX-512 part's dither16 .. dec_v16),
// bit-identical to the scalar code.

// The dither's random part: the field (lowest bit FIELD_LO of the word) moved to bits (12 - MB) ..
// (22 - MB). The cell-centre bit (11 - MB) below it is ladder_enc8's constant.
template <int FIELD_LO, int MB>
MPK_AVX2 __attribute__((always_inline)) inline __m256i dither8(__m256i rw) {
  constexpr int sh = FIELD_LO - (12 - MB);
  const __m256i moved = sh >= 0 ? _mm256_srli_epi32(rw, sh) : _mm256_slli_epi32(rw, -sh);
  return _mm256_and_si256(moved, _mm256_set1_epi32(0x7ff << (12 - MB)));
}

// ladder_encode with the dither's field from dither8: bits(z) + (field | centre) - bits(1.0) as two
// adds, the centre bit and -bits(1.0) one constant (the field and the centre bit do not overlap).
template <int MB>
MPK_AVX2 __attribute__((always_inline)) inline __m256i ladder_enc8(__m256 ax, __m256 inv, __m256i field) {
  const __m256 z = _mm256_fmadd_ps(ax, inv, _mm256_set1_ps(1.0f));  // = y + 1 bit for bit (math.h)
  const __m256i t = _mm256_add_epi32(_mm256_castps_si256(z), field);
  return _mm256_srli_epi32(_mm256_add_epi32(t, _mm256_set1_epi32(static_cast<int>((1u << (11 - MB)) - 0x3f800000u))),
                           23 - MB);
}

// mom8_encode_m (MB 4, sign at bit 7) / mom4_encode_m (MB 1, sign at bit 3): int32 codes.
template <int MB>
MPK_AVX2 __attribute__((always_inline)) inline __m256i enc_m8(__m256 m, __m256 inv, __m256i rw) {
  constexpr int kSignAt = MB == 4 ? 7 : 3;
  const __m256i mb = _mm256_castps_si256(m);
  const __m256 am = _mm256_castsi256_ps(_mm256_and_si256(mb, _mm256_set1_epi32(0x7fffffff)));
  const __m256i q = ladder_enc8<MB>(am, inv, dither8<10, MB>(rw));
  return _mm256_or_si256(q, _mm256_and_si256(_mm256_srli_epi32(mb, 31 - kSignAt), _mm256_set1_epi32(1 << kSignAt)));
}

// mom8_encode_v: int32 codes, at least 1 for v > 0 (bits(v) > 0: v >= +0 here).
MPK_AVX2 __attribute__((always_inline)) inline __m256i enc_v8(__m256 v, __m256 inv, __m256i rw) {
  const __m256i q = ladder_enc8<4>(v, inv, dither8<21, 4>(rw));
  return _mm256_max_epu32(q, _mm256_min_epu32(_mm256_castps_si256(v), _mm256_set1_epi32(1)));
}

template <int MB>
MPK_AVX2 __attribute__((always_inline)) inline __m256 ladder_dec8(__m256i q, __m256 s) {
  const __m256 f = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(q, 23 - MB), _mm256_set1_epi32(0x3f800000)));
  return _mm256_fmsub_ps(f, s, s);  // = (f - 1) * s bit for bit (math.h, ladder_value_scaled)
}

// mom8_decode_m of 8 sign-magnitude bytes.
MPK_AVX2 __attribute__((always_inline)) inline __m256 dec_m8(const int8_t* p, __m256 s) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 x = ladder_dec8<4>(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), s);
  return _mm256_or_ps(x, _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0x80000000u)))));
}

MPK_AVX2 __attribute__((always_inline)) inline __m256 dec_v8(const uint8_t* p, __m256 s) {
  return ladder_dec8<4>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), s);
}

// The unsigned maxima of the 8 lanes of each of 8 vectors x[0..7], lane g of the result = the
// maximum of x[g]: unpacks and one 128-bit permute (21 operations for 8 vectors).
MPK_AVX2 __attribute__((always_inline)) inline __m256i hmax8x8(const __m256i* x) {
  __m256i r[4], s[2];
  for (int i = 0; i < 4; ++i)  // per 128-bit half: [a0|a2, b0|b2, a1|a3, b1|b3]
    r[i] = _mm256_max_epu32(_mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]),
                            _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 2; ++i)  // per 128-bit half: the half maxima of 4 consecutive vectors, in order
    s[i] = _mm256_max_epu32(_mm256_unpacklo_epi64(r[2 * i], r[2 * i + 1]),
                            _mm256_unpackhi_epi64(r[2 * i], r[2 * i + 1]));
  return _mm256_max_epu32(_mm256_permute2x128_si256(s[0], s[1], 0x20), _mm256_permute2x128_si256(s[0], s[1], 0x31));
}

// ladder_scale_bits and ladder_inv_scale of 8 groups at once: x = the groups' |x| maxima as bits;
// returns the scales' bf16 bits and 1 / s (inv, 0 for a NaN scale).
MPK_AVX2 __attribute__((always_inline)) inline __m256i scale_bits8(__m256i x, Ladder lf, __m256& inv) {
  __m256i e = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(static_cast<int>(0x7fffffu - lf.umax_mant))), 23),
                               _mm256_set1_epi32(lf.umax_exp));
  e = _mm256_max_epi32(e, _mm256_set1_epi32(1));
  const __m256i nonfinite = _mm256_cmpgt_epi32(x, _mm256_set1_epi32(0x7f7fffff));  // x < 2^31: signed is fine
  inv = _mm256_andnot_ps(_mm256_castsi256_ps(nonfinite),
                         _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(254), e), 23)));
  const __m256i zero = _mm256_cmpeq_epi32(x, _mm256_setzero_si256());  // a group of zeros: scale 0
  const __m256i b = _mm256_andnot_si256(zero, _mm256_slli_epi32(e, 7));
  return _mm256_blendv_epi8(b, _mm256_set1_epi32(static_cast<int>(kMom8NaNScale)), nonfinite);
}

// One master mode's loop, blocks of up to 8 groups of 32. AVX2 has 16 vector registers: the
// updated moments and random words go through an L1-resident buffer between the update pass and
// the encode pass (keeping a group's in registers made the compiler spill and rebuild constants:
// ~1050 instructions per group, measured with callgrind), and the update pass is a loop of 8 lanes,
// so its constants stay in registers across iterations. Each group's 8-lane |x| maxima are kept,
// one unpack tree gives the 8 group maxima and one vector pass the 8 scales and 1 / s.
// M4: the 4-bit exp_avg (kMom4: two sign-magnitude nibbles per byte, the 1-mantissa-bit ladder).
template <int PDT, int GDT, int MODE, bool M4>
MPK_AVX2 void adamw_avx2_mom8_mode(const TensorPtrs& t_in, int64_t begin, int64_t end, const Flags& f_in) {
  // Local copies whose address never leaves this function (the scalar fallbacks get the caller's):
  // the code stores through char pointers below cannot alias them, so the pointers stay in registers
  // and the mode is a compile-time constant in load_w8 / store_w8 (a copy passed to an out-of-line
  // call is reloaded, and its mode compared, on every iteration).
  const TensorPtrs t = t_in;
  Flags f = f_in;
  f.mode = MODE;
  // g = -(grad * factor) when maximizing, as the scalar code: a sign flip after the multiply
  // (g * (-factor) differs from it in the sign of a NaN)
  const __m256 factor = _mm256_set1_ps(f.factor);
  const __m256 gsign = _mm256_castsi256_ps(_mm256_set1_epi32(f.maximize ? static_cast<int>(0x80000000u) : 0));
  const Consts8 k = consts8(t.c);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const bool need0 = needs_word0(t, f);
  int8_t* cmp = static_cast<int8_t*>(t.m);
  uint8_t* cm4 = static_cast<uint8_t*>(t.m);
  uint8_t* cvp = static_cast<uint8_t*>(t.v);
  constexpr int kG = 8;  // groups per block
  alignas(32) float mb[kG * kMom8Group], vb[kG * kMom8Group];
  alignas(32) uint32_t rb[kG * kMom8Group];
  alignas(32) __m256i am[kG], av[kG];
  alignas(32) float ims[kG], ivs[kG];
  alignas(32) uint32_t bms[kG], bvs[kG];
  alignas(32) int32_t okms[kG], okvs[kG];  // -1: the group's scale is a number, 0: NaN (codes zeroed)
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
    int n = static_cast<int>(std::min<int64_t>(kG, (end - gb) / kMom8Group));
    while (n > 1 && static_cast<uint32_t>((e0 + static_cast<uint64_t>(kMom8Group) * n - 1) >> 32) != hi0) --n;
    const __m256i key = _mm256_set1_epi32(static_cast<int>(keys.key));
    const int64_t j0 = gb / kMom8Group;
    for (int g = 0; g < kG; ++g) {
      if (g >= n) {
        am[g] = av[g] = _mm256_setzero_si256();
        continue;
      }
      // M4: s / 2 (the bytes hold 2 u(q)); the halving is exact (a power of two, >= 2^-127)
      const __m256 sm = _mm256_set1_ps(bf16_to_f32(t.sm[j0 + g]) * (M4 ? 0.5f : 1.0f));
      const __m256 sv = _mm256_set1_ps(bf16_to_f32(t.sv[j0 + g]));
      __m256i gm = _mm256_setzero_si256(), gv = _mm256_setzero_si256();
      alignas(16) int8_t sq4[kMom8Group];  // M4: 2 u(q) with the sign of the group's m codes
      if constexpr (M4) nibble_u2_32(cm4 + ((gb + g * kMom8Group) >> 1), sq4);
      // the group's random words first, one each, into rb: the update pass reads them (the master
      // encoder) and so does the encode pass (computed inside the update loop, GCC's loop
      // distribution moved the rb stores into a loop of their own that hashed every element again)
      __m256i elo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(e0) +
                                                                         static_cast<uint32_t>(g * kMom8Group))),
                                     lanes);
      for (int q = 0; q < 4; ++q, elo = _mm256_add_epi32(elo, _mm256_set1_epi32(8)))
        _mm256_store_si256(reinterpret_cast<__m256i*>(rb + g * kMom8Group + 8 * q), mix32x8(_mm256_xor_si256(key, elo)));
#pragma GCC unroll 1
      for (int q = 0; q < 4; ++q) {
        const int o = g * kMom8Group + 8 * q;
        const int64_t i = gb + o;
        const __m256 gr = _mm256_xor_ps(_mm256_mul_ps(load8<GDT>(t.g, i), factor), gsign);
        __m256 p = load_w8<PDT>(t, f, i);
        __m256 mm;
        if constexpr (M4) {  // 2 u(q) as signed bytes (nibble_u2_32), times s / 2: exact
          mm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sq4 + 8 * q)))),
                             sm);
        } else {
          mm = dec_m8(cmp + i, sm);
        }
        __m256 vv = dec_v8(cvp + i, sv);
        moments8(k, gr, mm, vv);
        p = step8(k, p, mm, vv);
        store_w8<PDT>(t, f, i, p, need0, _mm256_load_si256(reinterpret_cast<const __m256i*>(rb + o)));
        _mm256_store_ps(mb + o, mm);
        _mm256_store_ps(vb + o, vv);
        gm = _mm256_max_epu32(gm, _mm256_and_si256(_mm256_castps_si256(mm), abs_mask));
        gv = _mm256_max_epu32(gv, _mm256_and_si256(_mm256_castps_si256(vv), abs_mask));
      }
      am[g] = gm;
      av[g] = gv;
    }
    __m256 im, iv;
    // the 8 groups' scales, 1 / s, and the masks that zero a NaN group's codes, each as one vector
    const __m256i nan_scale = _mm256_set1_epi32(static_cast<int>(kMom8NaNScale));
    const __m256i bmv = scale_bits8(hmax8x8(am), M4 ? ladder_m4() : ladder_m8(), im);
    const __m256i bvv = scale_bits8(hmax8x8(av), ladder_v8(), iv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bms), bmv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(bvs), bvv);
    _mm256_store_si256(reinterpret_cast<__m256i*>(okms), _mm256_xor_si256(_mm256_cmpeq_epi32(bmv, nan_scale), _mm256_set1_epi32(-1)));
    _mm256_store_si256(reinterpret_cast<__m256i*>(okvs), _mm256_xor_si256(_mm256_cmpeq_epi32(bvv, nan_scale), _mm256_set1_epi32(-1)));
    _mm256_store_ps(ims, im);
    _mm256_store_ps(ivs, iv);
    if (n == kG) {  // a whole block: the 8 scales of each moment in one store
      _mm_storeu_si128(reinterpret_cast<__m128i*>(t.sm + j0), pack_u16x8(bmv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(t.sv + j0), pack_u16x8(bvv));
    } else {
      for (int g = 0; g < n; ++g) {
        t.sm[j0 + g] = static_cast<uint16_t>(bms[g]);
        t.sv[j0 + g] = static_cast<uint16_t>(bvs[g]);
      }
    }
    for (int g = 0; g < n; ++g) {
      const __m256 img = _mm256_set1_ps(ims[g]), ivg = _mm256_set1_ps(ivs[g]);
      const float* mg = mb + g * kMom8Group;
      const float* vg = vb + g * kMom8Group;
      const uint32_t* rg = rb + g * kMom8Group;
      // codes, two vectors of 8 at a time packed to int16 (packs: exact, codes in [0, 255]); a NaN
      // group's codes 0
      const __m256i okm = _mm256_set1_epi32(okms[g]), okv = _mm256_set1_epi32(okvs[g]);
      __m256i pm[2], pv[2];
#pragma GCC unroll 1
      for (int h = 0; h < 2; ++h) {
        const __m256i r0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(rg + 16 * h));
        const __m256i r1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(rg + 16 * h + 8));
        constexpr int kMB = M4 ? 1 : 4;
        const __m256i c0 = enc_m8<kMB>(_mm256_load_ps(mg + 16 * h), img, r0);
        const __m256i c1 = enc_m8<kMB>(_mm256_load_ps(mg + 16 * h + 8), img, r1);
        pm[h] = _mm256_and_si256(_mm256_packs_epi32(c0, c1), okm);
        const __m256i d0 = enc_v8(_mm256_load_ps(vg + 16 * h), ivg, r0);
        const __m256i d1 = enc_v8(_mm256_load_ps(vg + 16 * h + 8), ivg, r1);
        pv[h] = _mm256_and_si256(_mm256_packs_epi32(d0, d1), okv);
      }
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      const int64_t i0 = gb + g * kMom8Group;
      const __m256i mcodes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(pm[0], pm[1]), order);
      if constexpr (M4) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(cm4 + (i0 >> 1)),
                         pack_nibbles16x2(_mm256_castsi256_si128(mcodes), _mm256_extracti128_si256(mcodes, 1)));
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(cmp + i0), mcodes);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(cvp + i0),
                          _mm256_permutevar8x32_epi32(_mm256_packus_epi16(pv[0], pv[1]), order));
    }
    gb += static_cast<int64_t>(kMom8Group) * n;
  }
  if (gb < end) adamw_scalar_mom8(t_in, gb, end, f_in);
}

template <int PDT, int GDT, bool M4>
MPK_AVX2 void adamw_avx2_mom8(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
  switch (f.mode) {
    case kMasterF32: return adamw_avx2_mom8_mode<PDT, GDT, kMasterF32, M4>(t, begin, end, f);
    case kMasterRemainder: return adamw_avx2_mom8_mode<PDT, GDT, kMasterRemainder, M4>(t, begin, end, f);
    case kMaster8bit:
      if constexpr (PDT != kF32) return adamw_avx2_mom8_mode<PDT, GDT, kMaster8bit, M4>(t, begin, end, f);
      [[fallthrough]];
    default: return adamw_avx2_mom8_mode<PDT, GDT, kMasterNone, M4>(t, begin, end, f);
  }
}



template <int PDT, int GDT>
AvxFn pick_s(int32_t sdt) {
  if (sdt == kMom8) return &adamw_avx2_mom8<PDT, GDT, false>;
  if (sdt == kMom4) return &adamw_avx2_mom8<PDT, GDT, true>;
  if (sdt == kF32) return &adamw_avx2<PDT, GDT, kF32>;
  if (sdt == kBF16) return &adamw_avx2<PDT, GDT, kBF16>;
  return nullptr;  // a mode without a vector version: the scalar path runs it
}
template <int PDT>
AvxFn pick_g(int32_t gdt, int32_t sdt) {
  switch (gdt) {
    case kF32: return pick_s<PDT, kF32>(sdt);
    case kF16: return pick_s<PDT, kF16>(sdt);
    default: return pick_s<PDT, kBF16>(sdt);
  }
}

}  // namespace

AvxFn pick_avx2(int32_t pdt, int32_t gdt, int32_t sdt) {
  switch (pdt) {
    case kF32: return pick_g<kF32>(gdt, sdt);
    case kF16: return pick_g<kF16>(gdt, sdt);
    default: return pick_g<kBF16>(gdt, sdt);
  }
}

}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
#endif  // MPK_X86
