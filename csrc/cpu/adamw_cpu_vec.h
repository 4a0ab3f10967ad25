// CPU AdamW, the vector paths written once over a lane traits type V -- Avx2 (vec_avx2.h, 8 lanes)
// or Avx512 (vec_avx512.h, 16 lanes) -- and compiled per ISA: adamw_cpu_avx2.cpp and
// adamw_cpu_avx512.cpp each define MPK_VEC as their ISA's target attribute and include this header
// once. Everything here carries MPK_VEC and has internal linkage (an anonymous namespace), so no
// function compiled for one ISA can stand in for another translation unit's.
//
// The arithmetic is the scalar path's (math.h) in the same order -- its fmas as fused multiply-adds,
// no other contraction -- so the scalar, AVX2 and AVX-512 paths are bit-identical. Two kernels:
// adamw_dense (fp32 / bf16 moments, kLanes elements a step) and adamw_compact (the grouped codes:
// 8-bit moments kMom8, 4-bit exp_avg kMom4; blocks of kLanes groups of 32).
#ifndef MPK_VEC
#error "adamw_cpu_vec.h: define MPK_VEC (the ISA's target attribute) before including it"
#endif

#include <algorithm>
#include <cstdint>

#include "adamw_cpu_impl.h"

#define MPK_VEC_INLINE MPK_VEC __attribute__((always_inline)) inline

namespace mpkern {
namespace cpu {
namespace adamw_impl {
namespace {

// A compact kernel's master mode read from Flags at run time (V::kMasterModeInstances false).
constexpr int kMasterModeAtRunTime = -1;

// body(0), ..., body(N - 1): unrolled, or kept a loop (a per-ISA choice, see the traits' kUnrollGroup).
template <bool UNROLL, int N, class Body>
MPK_VEC_INLINE void repeat(Body&& body) {
  if constexpr (UNROLL) {
#pragma GCC unroll 16
    for (int q = 0; q < N; ++q) body(q);
  } else {
#pragma GCC unroll 1
    for (int q = 0; q < N; ++q) body(q);
  }
}

// 2 u(q) with the sign of a group's 32 sign-magnitude 4-bit codes (16 bytes at p, mom4_code) as 32
// int8 in element order at dst (16-byte aligned). mom4_decode_m is u(q) * s; the kernel multiplies
// 2 u(q) by s / 2, which is exact; a negative zero nibble gives +0, whose update is the same as
// -0's. The low and high nibbles are split, interleaved back into element order and looked up with
// pshufb (it reads the low 4 bits); two 16-byte stores, which store-to-load forwarding serves to the
// update pass's loads.
MPK_VEC_INLINE void nibble_u2_32(const uint8_t* p, int8_t* dst) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo4 = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(x, lo4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), lo4);
  const __m128i u2 = _mm_setr_epi8(0, 1, 2, 4, 6, 10, 14, 22, 0, -1, -2, -4, -6, -10, -14, -22);
  _mm_store_si128(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi8(u2, _mm_unpacklo_epi8(lo, hi)));
  _mm_store_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_shuffle_epi8(u2, _mm_unpackhi_epi8(lo, hi)));
}

template <class V>
struct AdamwVec {
  using F = typename V::F;
  using I = typename V::I;
  using H = typename V::H;
  static constexpr int kLanes = V::kLanes;
  static constexpr int kPerGroup = kMom8Group / kLanes;  // vectors per group of 32
  static_assert(kMom8Group % 16 == 0 && 16 % kLanes == 0, "a group's codes are put 16 at a time");

  // ---- math.h's element functions on kLanes lanes ----------------------------------------------

  // Elements [i, i + kLanes) of a float / half / bfloat16 buffer (DT: math.h DType) as floats.
  template <int DT>
  static MPK_VEC_INLINE F load(const void* base, int64_t i) {
    if constexpr (DT == kF32) {
      return V::loadu(static_cast<const float*>(base) + i);
    } else {
      const H h = V::load_h(static_cast<const uint16_t*>(base) + i);
      if constexpr (DT == kF16) return V::cvt_ph(h);
      return V::as_f(V::slli(V::widen_u16(h), 16));
    }
  }

  // f32_to_bf16_rne: bf16 bits in the low halves of the lanes (NaN kept quiet with its sign).
  static MPK_VEC_INLINE I bf16_rne(F x) {
    const I u = V::as_i(x);
    const I lsb = V::and_(V::srli(u, 16), V::seti(1));
    return V::keep_nan(V::srli(V::add(u, V::add(lsb, V::seti(0x7fff))), 16), x);
  }

  // f32_to_bf16_sr: 16 random bits r (low halves of the lanes) added below the kept part, then
  // truncation. An inf has zero low bits, so the sum keeps it; only NaN needs its own result.
  static MPK_VEC_INLINE I bf16_sr(F x, I r) { return V::keep_nan(V::srli(V::add(V::as_i(x), r), 16), x); }

  // Store into a float / half / bfloat16 buffer, rounding to nearest even.
  template <int DT>
  static MPK_VEC_INLINE void store(void* base, int64_t i, F x) {
    if constexpr (DT == kF32) {
      V::storeu(static_cast<float*>(base) + i, x);
    } else if constexpr (DT == kF16) {
      V::store_h(static_cast<uint16_t*>(base) + i, V::cvt_ps_ph(x));
    } else {
      V::store_u16(static_cast<uint16_t*>(base) + i, bf16_rne(x));
    }
  }

  static MPK_VEC_INLINE I mix32(I x) {
    x = V::xor_(x, V::srli(x, 16));
    x = V::mullo(x, V::seti(0x7feb352d));
    x = V::xor_(x, V::srli(x, 15));
    x = V::mullo(x, V::seti(static_cast<int32_t>(0x846ca68bu)));
    return V::xor_(x, V::srli(x, 16));
  }

  // The codecs' 16-bit values of the three fields of the random words r (rand_a16 / b16 / c16).
  static MPK_VEC_INLINE I rand_a(I r) { return V::or_(V::and_(V::slli(r, 6), V::seti(0xffc0)), V::seti(0x20)); }
  static MPK_VEC_INLINE I rand_b(I r) { return V::or_(V::and_(V::srli(r, 5), V::seti(0xffe0)), V::seti(0x10)); }
  static MPK_VEC_INLINE I rand_c(I r) { return V::or_(V::and_(V::srli(r, 16), V::seti(0xffe0)), V::seti(0x10)); }

  // master8_decode of elements [i, i + kLanes): bf16 (bits(p) << 16) + 256 c; fp16 p + c * 2^(max(e, 1) - 33)
  template <int PDT>
  static MPK_VEC_INLINE F master8_decode(const TensorPtrs& t, int64_t i) {
    const H h16 = V::load_h(static_cast<const uint16_t*>(t.p) + i);
    const I c = V::load_i8(static_cast<const int8_t*>(t.master) + i);
    if constexpr (PDT == kBF16) return V::as_f(V::add(V::slli(V::widen_u16(h16), 16), V::slli(c, 8)));
    const I b = V::max(V::and_(V::srli(V::widen_u16(h16), 10), V::seti(0x1f)), V::seti(1));
    const F scale = V::as_f(V::slli(V::add(b, V::seti(94)), 23));  // 2^(b - 33)
    return V::add(V::cvt_ph(h16), V::mul(V::to_f(c), scale));
  }

  // master8_encode of the masters w of elements [i, i + kLanes), rw = their random words.
  template <int PDT>
  static MPK_VEC_INLINE void master8_encode(const TensorPtrs& t, int64_t i, F w, I rw) {
    int8_t* cdst = static_cast<int8_t*>(t.master) + i;
    uint16_t* hdst = static_cast<uint16_t*>(t.p) + i;
    if constexpr (PDT == kBF16) {
      // t = bits(w) + (word & 0xff); param = (t + 0x8000) >> 16 (a NaN: its quiet NaN); c = byte 1 of t
      const I tt = V::add(V::as_i(w), V::and_(rw, V::seti(0xff)));
      V::store_bytes(cdst, tt, 1);
      V::store_u16(hdst, V::keep_nan_rare(V::srli(V::add(tt, V::seti(0x8000)), 16), w));
    } else {
      // param = RNE(w); c = clamp(floor(x + r / 2^16)), x = (w - param) * 2^(33 - max(e, 1)); c = 0
      // where the param is not finite
      const H h16 = V::cvt_ps_ph(w);
      const F p = V::cvt_ph(h16);
      const I b = V::max(V::and_(V::srli(V::widen_u16(h16), 10), V::seti(0x1f)), V::seti(1));
      const F x = V::mul(V::sub(w, p), V::as_f(V::slli(V::sub(V::seti(160), b), 23)));
      const F u = V::mul(V::to_f(rand_a(rw)), V::setf(1.0f / 65536.0f));
      F y = V::floor(V::add(x, u));
      y = V::min(V::max(y, V::setf(-128.0f)), V::setf(127.0f));
      V::store_bytes(cdst, V::cvtt_where_finite(y, p), 0);
      V::store_h(hdst, h16);
    }
  }

  // math.h's AdamWConsts on kLanes lanes, with the grad's factor and sign flip.
  struct Consts {
    F factor, gsign, decay, omb1, b2, omb2, ss, ibc2, eps;
  };
  static MPK_VEC_INLINE Consts consts(const TensorPtrs& t, const Flags& f) {
    // g = -(grad * factor) when maximizing, as the scalar code: a sign flip after the multiply
    // (g * (-factor) differs from it in the sign of a NaN)
    return {V::setf(f.factor),      V::as_f(V::seti(f.maximize ? static_cast<int32_t>(0x80000000u) : 0)),
            V::setf(t.c.decay),     V::setf(t.c.one_m_b1),
            V::setf(t.c.beta2),     V::setf(t.c.one_m_b2),
            V::setf(t.c.step_size), V::setf(t.c.inv_bc2),
            V::setf(t.c.eps)};
  }

  template <int GDT>
  static MPK_VEC_INLINE F grad(const Consts& k, const TensorPtrs& t, int64_t i) {
    return V::xor_(V::mul(load<GDT>(t.g, i), k.factor), k.gsign);
  }

  // adamw_moments / adamw_step
  static MPK_VEC_INLINE void moments(const Consts& k, F g, F& m, F& v) {
    m = V::fmadd(k.omb1, V::sub(g, m), m);
    v = V::fmadd(V::mul(k.omb2, g), g, V::mul(v, k.b2));
  }
  static MPK_VEC_INLINE F step(const Consts& k, F p, F m, F vv) {
    const F denom = V::fmadd(V::sqrt(vv), k.ibc2, k.eps);
    // fma(p, decay, -q) with -q formed first, as the scalar fmaf gets it: a NaN q's sign flips on every path
    const F nq = V::xor_(V::div(V::mul(k.ss, m), denom), V::setf(-0.0f));
    return V::fmadd(p, k.decay, nq);
  }

  // ---- ladder codes (math.h ladder_*, mom8_*, mom4_*) -------------------------------------------

  // The dither's random part: the field (lowest bit FIELD_LO of the word: 10 for B, 21 for C) moved
  // to bits (12 - MB) .. (22 - MB). The cell-centre bit (11 - MB) below it is ladder_enc's constant.
  template <int FIELD_LO, int MB>
  static MPK_VEC_INLINE I dither(I rw) {
    constexpr int sh = FIELD_LO - (12 - MB);
    I moved;
    if constexpr (sh >= 0) {
      moved = V::srli(rw, sh);
    } else {
      moved = V::slli(rw, -sh);
    }
    return V::and_(moved, V::seti(0x7ff << (12 - MB)));
  }

  // ladder_encode: magnitude codes of ax = |x| given 1 / s, bits(z) + (field | centre) - bits(1.0)
  // as two adds (the field and the centre bit do not overlap).
  template <int MB>
  static MPK_VEC_INLINE I ladder_enc(F ax, F inv, I field) {
    const F z = V::fmadd(ax, inv, V::setf(1.0f));  // = y + 1 bit for bit (math.h)
    const I t = V::add(V::as_i(z), field);
    return V::srli(V::add(t, V::seti(static_cast<int32_t>((1u << (11 - MB)) - 0x3f800000u))), 23 - MB);
  }

  // mom8_encode_m (MB 4, sign at bit 7) / mom4_encode_m (MB 1, sign at bit 3): int32 codes.
  template <int MB>
  static MPK_VEC_INLINE I enc_m(F m, F inv, I rw) {
    constexpr int kSignAt = MB == 4 ? 7 : 3;
    const I mb = V::as_i(m);
    const I q = ladder_enc<MB>(V::as_f(V::and_(mb, V::seti(0x7fffffff))), inv, dither<10, MB>(rw));
    return V::or_and(q, V::srli(mb, 31 - kSignAt), V::seti(1 << kSignAt));
  }

  // mom8_encode_v: int32 codes, at least 1 for v > 0 (bits(v) > 0: v >= +0 here).
  static MPK_VEC_INLINE I enc_v(F v, F inv, I rw) {
    const I q = ladder_enc<4>(v, inv, dither<21, 4>(rw));
    return V::maxu(q, V::minu(V::as_i(v), V::seti(1)));
  }

  // u(q) * s of magnitude codes q: (F - 1) * s bit for bit as one fmsub (math.h, ladder_value_scaled).
  template <int MB>
  static MPK_VEC_INLINE F ladder_dec(I q, F s) {
    return V::fmsub(V::as_f(V::add(V::slli(q, 23 - MB), V::seti(0x3f800000))), s, s);
  }

  // mom8_decode_m of sign-magnitude bytes: the magnitude's value, the byte's sign (bit 31 of its sign
  // extension) OR-ed in.
  static MPK_VEC_INLINE F dec_m(const int8_t* p, F s) {
    const I b = V::load_i8(p);
    const F x = ladder_dec<4>(V::and_(b, V::seti(0x7f)), s);
    return V::as_f(V::or_and(V::as_i(x), b, V::seti(static_cast<int32_t>(0x80000000u))));
  }

  static MPK_VEC_INLINE F dec_v(const uint8_t* p, F s) { return ladder_dec<4>(V::load_u8(p), s); }

  // ladder_scale_bits and ladder_inv_scale of kLanes groups at once: x = the groups' |x| maxima as
  // bits; returns the scales' bf16 bits and 1 / s (inv, 0 for a NaN scale).
  static MPK_VEC_INLINE I scale_bits(I x, Ladder lf, F& inv) {
    I e = V::sub(V::srli(V::add(x, V::seti(static_cast<int32_t>(0x7fffffu - lf.umax_mant))), 23), V::seti(lf.umax_exp));
    e = V::max(e, V::seti(1));
    const auto nonfinite = V::gt(x, V::seti(0x7f7fffff));  // x < 2^31: a signed compare is fine
    inv = V::as_f(V::zero_if(nonfinite, V::slli(V::sub(V::seti(254), e), 23)));
    const I b = V::zero_if(V::eq(x, V::zero()), V::slli(e, 7));  // a group of zeros: scale 0
    return V::blend(nonfinite, b, V::seti(static_cast<int32_t>(kMom8NaNScale)));
  }

  // ---- the master of each master mode --------------------------------------------------------

  // The fp32 masters of elements [i, i + kLanes) (the params themselves in kMasterNone).
  template <int PDT>
  static MPK_VEC_INLINE F load_w(const TensorPtrs& t, const Flags& f, int64_t i) {
    if (f.master_mode == kMasterF32) return V::loadu(static_cast<const float*>(t.master) + i);
    if (f.master_mode == kMasterRemainder) {  // join_master: bf16 param bits << 16 + int16 remainder
      const I hi = V::widen_u16(V::load_h(static_cast<const uint16_t*>(t.p) + i));
      const I lo = V::widen_i16(V::load_h(static_cast<const int16_t*>(t.master) + i));
      return V::as_f(V::add(V::slli(hi, 16), lo));
    }
    if constexpr (PDT != kF32) {
      if (f.master_mode == kMaster8bit) return master8_decode<PDT>(t, i);
    }
    return load<PDT>(t.p, i);
  }

  // Store the updated masters p of elements [i, i + kLanes) and the params; rw = the elements'
  // random words (field A: the 8-bit master, and the param's stochastic rounding when need0).
  template <int PDT>
  static MPK_VEC_INLINE void store_w(const TensorPtrs& t, const Flags& f, int64_t i, F p, bool need0, I rw) {
    if (f.master_mode == kMasterF32) {
      V::storeu(static_cast<float*>(t.master) + i, p);
      store<PDT>(t.p, i, p);
    } else if (f.master_mode == kMasterRemainder) {  // split_master: the bf16 RNE and the low 16 bits
      const I u = V::as_i(p);
      V::store_u16(static_cast<uint16_t*>(t.p) + i, V::srli(V::add(u, V::seti(0x8000)), 16));
      V::store_lo16(static_cast<int16_t*>(t.master) + i, u);
    } else if (PDT != kF32 && f.master_mode == kMaster8bit) {
      if constexpr (PDT != kF32) master8_encode<PDT>(t, i, p, rw);
    } else if (PDT == kBF16 && need0) {
      V::store_u16(static_cast<uint16_t*>(t.p) + i, bf16_sr(p, rand_a(rw)));
    } else {
      store<PDT>(t.p, i, p);
    }
  }

  // ---- fp32 / bf16 moments ----------------------------------------------------------------------

  // kLanes elements a step, the tail by the scalar path. The random words are computed kLanes at a
  // time (one key per call: the caller splits ranges at multiples of 2^32 of the global element
  // index, so the high index half is the same in a call).
  template <int PDT, int GDT, int MOMENT_MODE>
  static MPK_VEC void adamw_dense(const TensorPtrs& t_in, int64_t begin, int64_t end, const Flags& f_in) {
    static_assert(MOMENT_MODE == kMomF32 || MOMENT_MODE == kMomBF16, "a dense moment mode");
    constexpr int kMomentDType = MOMENT_MODE;  // a dense moment mode is its moments' dtype code (math.h)
    const TensorPtrs t = t_in;  // local copies, never passed out of line (the scalar tail gets the caller's):
    const Flags f = f_in;       // the stores below cannot alias them, so nothing is reloaded in the loop
    const Consts k = consts(t, f);
    const bool need0 = needs_word0(t, f), needw = need0 || MOMENT_MODE == kMomBF16;
    const RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
    const I key = V::seti(static_cast<int32_t>(keys.key));
    const I lanes = V::lanes();
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) {
      const uint32_t elo0 = static_cast<uint32_t>(t.offset + static_cast<uint64_t>(i));  // low index half
      const I elo = V::add(V::seti(static_cast<int32_t>(elo0)), lanes);
      const I rw = needw ? mix32(V::xor_(key, elo)) : elo;  // the one random word of each element
      const F g = grad<GDT>(k, t, i);
      F p = load_w<PDT>(t, f, i);
      F m = load<kMomentDType>(t.m, i);
      F v = load<kMomentDType>(t.v, i);
      moments(k, g, m, v);
      F vv = v;
      if (t.vmax != nullptr) {  // max(vmax, v) with the scalar's tie / NaN rule: vmax > v ? vmax : v
        const F old = V::loadu(t.vmax + i);
        vv = V::blend(V::gt(old, v), v, old);
        V::storeu(t.vmax + i, vv);
      }
      p = step(k, p, m, vv);
      if constexpr (MOMENT_MODE == kMomBF16) {
        V::store_u16(static_cast<uint16_t*>(t.m) + i, bf16_sr(m, rand_b(rw)));
        V::store_u16(static_cast<uint16_t*>(t.v) + i, bf16_sr(v, rand_c(rw)));
      } else {
        V::storeu(static_cast<float*>(t.m) + i, m);
        V::storeu(static_cast<float*>(t.v) + i, v);
      }
      store_w<PDT>(t, f, i, p, need0, rw);
    }
    if (i < end) adamw_scalar(t_in, i, end, f_in);
  }

  // ---- grouped codes: 8-bit moments (kMom8), 4-bit exp_avg + 8-bit exp_avg_sq (kMom4) -----------

  // n (1..kLanes) consecutive groups of 32 from element gb (global element elo0 of the low index
  // half, all with the same high half). The update pass writes the masters and params and keeps the
  // updated moments and the random words in an L1-resident buffer, and each group's kLanes-lane |x|
  // maxima; one tree of unpacks then gives the kLanes groups' maxima, one vector pass their scales
  // and 1 / s; last the codes, group by group.
  template <int PDT, int GDT, int MOMENT_MODE>
  static MPK_VEC_INLINE void compact_block(const TensorPtrs& t, const Flags& f, const Consts& k, int64_t gb,
                                           uint32_t elo0, int n, bool need0, I key) {
    constexpr bool kNibbles = MOMENT_MODE == kMom4;  // exp_avg: two sign-magnitude 4-bit codes per byte
    constexpr int kG = kLanes;                       // groups per block: a lane each in the scale pass
    int8_t* cm = static_cast<int8_t*>(t.m);
    uint8_t* cm4 = static_cast<uint8_t*>(t.m);
    uint8_t* cv = static_cast<uint8_t*>(t.v);
    const int64_t j0 = gb / kMom8Group;
    const I abs_mask = V::seti(0x7fffffff);
    const I lanes = V::lanes();
    alignas(64) float mb[kG * kMom8Group], vb[kG * kMom8Group];
    alignas(64) uint32_t rb[kG * kMom8Group];
    I am[kG], av[kG];
    // kNibbles: the block's m codes as int8, 2 u(q) with the stored nibbles' signs (nibble_u2_32),
    // so that the update pass reads bytes as the 8-bit kind's does
    alignas(64) int8_t u2[kNibbles ? kG * kMom8Group : 1];
    if constexpr (kNibbles) {
      for (int g = 0; g < n; ++g) nibble_u2_32(cm4 + ((gb + g * kMom8Group) >> 1), u2 + g * kMom8Group);
    }
    // the random words of the kLanes elements from block offset o
    auto words = [&](int o) MPK_VEC __attribute__((always_inline)) {
      return mix32(V::xor_(key, V::add(V::seti(static_cast<int32_t>(elo0 + static_cast<uint32_t>(o))), lanes)));
    };
    for (int g = 0; g < kG; ++g) {
      if (g >= n) {
        am[g] = av[g] = V::zero();
        continue;
      }
      // kNibbles: s / 2 (the bytes hold 2 u(q)); the halving is exact (a power of two, >= 2^-127)
      const F sm = V::setf(bf16_to_f32(t.sm[j0 + g]) * (kNibbles ? 0.5f : 1.0f));
      const F sv = V::setf(bf16_to_f32(t.sv[j0 + g]));
      I gm = V::zero(), gv = V::zero();
      if constexpr (V::kWordsFirst) {
        for (int q = 0; q < kPerGroup; ++q)
          V::storei(rb + g * kMom8Group + kLanes * q, words(g * kMom8Group + kLanes * q));
      }
      repeat<V::kUnrollGroup, kPerGroup>([&](int q) MPK_VEC __attribute__((always_inline)) {
        const int o = g * kMom8Group + kLanes * q;
        const int64_t i = gb + o;
        const F gr = grad<GDT>(k, t, i);
        F p = load_w<PDT>(t, f, i);
        F mm;
        if constexpr (kNibbles) {
          mm = V::mul(V::to_f(V::load_i8(u2 + o)), sm);  // 2 u(q) times s / 2: exact
        } else {
          mm = dec_m(cm + i, sm);
        }
        F vv = dec_v(cv + i, sv);
        moments(k, gr, mm, vv);
        p = step(k, p, mm, vv);
        const I rw = V::kWordsFirst ? V::loadi(rb + o) : words(o);
        store_w<PDT>(t, f, i, p, need0, rw);
        V::store(mb + o, mm);
        V::store(vb + o, vv);
        if constexpr (!V::kWordsFirst) V::storei(rb + o, rw);
        gm = V::maxu(gm, V::and_(V::as_i(mm), abs_mask));
        gv = V::maxu(gv, V::and_(V::as_i(vv), abs_mask));
      });
      am[g] = gm;
      av[g] = gv;
    }
    F im, iv;
    const I bm = scale_bits(V::hmax_lanes(am), kNibbles ? ladder_m4() : ladder_m8(), im);
    const I bv = scale_bits(V::hmax_lanes(av), ladder_v8(), iv);
    alignas(64) float ims[kG], ivs[kG];
    alignas(64) uint32_t bms[kG], bvs[kG];
    V::store(ims, im);
    V::store(ivs, iv);
    V::storei(bms, bm);
    V::storei(bvs, bv);
    V::store_scales(t.sm + j0, bm, n);
    V::store_scales(t.sv + j0, bv, n);
    constexpr int kMB = kNibbles ? 1 : 4;  // the m ladder's mantissa bits
    for (int g = 0; g < n; ++g) {
      const F img = V::setf(ims[g]), ivg = V::setf(ivs[g]);
      // a NaN group's codes are 0
      typename V::CodeSink codes(bms[g] != kMom8NaNScale, bvs[g] != kMom8NaNScale);
      repeat<V::kUnrollGroup, kMom8Group / 16>([&](int half) MPK_VEC __attribute__((always_inline)) {
        I c[16 / kLanes], d[16 / kLanes];
        for (int j = 0; j < 16 / kLanes; ++j) {
          const int o = g * kMom8Group + 16 * half + kLanes * j;
          const I rw = V::loadi(rb + o);
          c[j] = enc_m<kMB>(V::load(mb + o), img, rw);
          d[j] = enc_v(V::load(vb + o), ivg, rw);
        }
        codes.put(half, c, d);
      });
      const int64_t i0 = gb + g * kMom8Group;
      if constexpr (kNibbles) {
        codes.template store<true>(cm4 + (i0 >> 1), cv + i0);
      } else {
        codes.template store<false>(cm + i0, cv + i0);
      }
    }
  }

  // Blocks of up to kLanes groups, each within one 2^32 range of the global element index (one
  // random key per block); a group across a multiple of 2^32, and the partial last group, by the
  // scalar path. MASTER_MODE: the master mode as a compile-time constant, or kMasterModeAtRunTime.
  template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
  static MPK_VEC void adamw_compact(const TensorPtrs& t_in, int64_t begin, int64_t end, const Flags& f_in) {
    // Local copies whose address never leaves this function (the scalar fallbacks get the caller's):
    // the code stores through char pointers cannot alias them, so the pointers stay in registers.
    const TensorPtrs t = t_in;
    Flags f = f_in;
    if constexpr (MASTER_MODE != kMasterModeAtRunTime) f.master_mode = MASTER_MODE;
    const Consts k = consts(t, f);
    const bool need0 = needs_word0(t, f);
    RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
    int64_t gb = begin;
    while (gb + kMom8Group <= end) {
      const uint64_t e0 = t.offset + static_cast<uint64_t>(gb);
      const uint32_t hi0 = static_cast<uint32_t>(e0 >> 32);
      if (static_cast<uint32_t>((e0 + kMom8Group - 1) >> 32) != hi0) {  // the group crosses 2^32: scalar
        adamw_scalar_grouped(t_in, gb, gb + kMom8Group, f_in);
        gb += kMom8Group;
        continue;
      }
      if (hi0 != keys.hi) keys = rng_keys(f.seed, t.stream, t.step, e0);
      int n = static_cast<int>(std::min<int64_t>(kLanes, (end - gb) / kMom8Group));
      while (n > 1 && static_cast<uint32_t>((e0 + static_cast<uint64_t>(kMom8Group) * n - 1) >> 32) != hi0) --n;
      compact_block<PDT, GDT, MOMENT_MODE>(t, f, k, gb, static_cast<uint32_t>(e0), n, need0,
                                           V::seti(static_cast<int32_t>(keys.key)));
      gb += static_cast<int64_t>(kMom8Group) * n;
    }
    if (gb < end) adamw_scalar_grouped(t_in, gb, end, f_in);
  }

  // The compact kernel of the master mode f.master_mode, as a compile-time constant.
  template <int PDT, int GDT, int MOMENT_MODE>
  static MPK_VEC void adamw_compact_per_mode(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
    switch (f.master_mode) {
      case kMasterF32: return adamw_compact<PDT, GDT, MOMENT_MODE, kMasterF32>(t, begin, end, f);
      case kMasterRemainder: return adamw_compact<PDT, GDT, MOMENT_MODE, kMasterRemainder>(t, begin, end, f);
      case kMaster8bit:
        if constexpr (PDT != kF32) return adamw_compact<PDT, GDT, MOMENT_MODE, kMaster8bit>(t, begin, end, f);
        [[fallthrough]];
      default: return adamw_compact<PDT, GDT, MOMENT_MODE, kMasterNone>(t, begin, end, f);
    }
  }

  // ---- the kernel of a tensor's dtypes and moment mode -------------------------------------------

  template <int PDT, int GDT, int MOMENT_MODE>
  static AvxFn pick_compact() {
    if constexpr (V::kMasterModeInstances) return &adamw_compact_per_mode<PDT, GDT, MOMENT_MODE>;
    return &adamw_compact<PDT, GDT, MOMENT_MODE, kMasterModeAtRunTime>;
  }

  template <int PDT, int GDT>
  static AvxFn pick_moments(int32_t moment_mode) {
    switch (moment_mode) {
      case kMom8: return pick_compact<PDT, GDT, kMom8>();
      case kMom4: return pick_compact<PDT, GDT, kMom4>();
      case kMomF32: return &adamw_dense<PDT, GDT, kMomF32>;
      case kMomBF16: return &adamw_dense<PDT, GDT, kMomBF16>;
      default: return nullptr;  // a mode without a vector version: the scalar path runs it
    }
  }

  template <int PDT>
  static AvxFn pick_grad(int32_t gdt, int32_t moment_mode) {
    switch (gdt) {
      case kF32: return pick_moments<PDT, kF32>(moment_mode);
      case kF16: return pick_moments<PDT, kF16>(moment_mode);
      default: return pick_moments<PDT, kBF16>(moment_mode);
    }
  }

  static AvxFn pick(int32_t pdt, int32_t gdt, int32_t moment_mode) {
    switch (pdt) {
      case kF32: return pick_grad<kF32>(gdt, moment_mode);
      case kF16: return pick_grad<kF16>(gdt, moment_mode);
      default: return pick_grad<kBF16>(gdt, moment_mode);
    }
  }
};

}  // namespace
}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
