// CPU kernel of mpkern::adamw_step_: the fused master-weight AdamW update over a tensor list.
//
// Per element it reads the grad (any float dtype), the master value (fp32 master, bf16 param +
// int16 remainder, 16-bit param + int8 correction, or the param itself), both moments (fp32 or
// bf16; bf16 ones are stored with stochastic rounding), applies
// grad * grad_factor (inv_scale * clip_coef) in registers, and writes master, moments and the
// rounded param. 8-bit moments (int8 exp_avg / uint8 exp_avg_sq codes with a bf16 scale per 32
// elements, math.h mom8_*) are processed in groups (the vector paths: blocks of 8 / 16 groups whose
// scales are computed together): decode, update, new scales from each group's amax,
// stochastically rounded codes. Nothing else is read or written; the grad is never written. When
// found_inf is non-zero nothing at all is written (step counters included).
// Three paths, bit-identical: scalar (the math.h functions; MPKERN_CPU_SIMD=0), AVX2 (8 lanes) and
// AVX-512 F/BW/VL/DQ (16 lanes; chosen at run time when the CPU has it, MPKERN_CPU_AVX512=0 forces
// AVX2). The vector paths use the same operations in the same order (no fma contraction).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "../common.h"
#include "../adamw_common.h"
#include "../kernels.h"
#include "simd.h"

namespace mpkern {
namespace cpu {


namespace {

static_assert(kChunk % kMom8Group == 0, "8-bit moment groups must not straddle work items");

struct TensorPtrs {
  void* p;
  const void* g;
  void* m;
  void* v;
  float* vmax;
  void* master;  // float* (mode 1), int16_t* (mode 2) or int8_t* (mode 3)
  uint16_t* sm;  // 8-bit / 4-bit moments (sdt kMom8 / kMom4): bf16 scale bits, one per 32 elements
  uint16_t* sv;
  int32_t pdt, gdt, sdt;  // sdt: kF32, kBF16, kMom8 (int8 m + uint8 v codes) or kMom4 (packed 4-bit m)
  uint32_t step;    // after the increment
  uint32_t stream;  // random stream id
  uint64_t offset;  // global index of element 0 in its stream
  AdamWConsts c;
};

struct Flags {
  int mode;
  bool maximize;
  bool sr;
  uint32_t seed;
  float factor;
};

// Whether a tensor's param/master store draws on the random word (field A: param SR or the 8-bit
// master); its moments do when they are bf16 or 8-bit (fields B, C). One word per element serves all.
inline bool needs_word0(const TensorPtrs& t, const Flags& f) {
  return f.mode == kMaster8bit || (f.mode == kMasterNone && f.sr && t.pdt == kBF16);
}
inline bool needs_word(const TensorPtrs& t, const Flags& f) { return needs_word0(t, f) || t.sdt != kF32; }

// ---- scalar path: the shared math, element by element --------------------------------------------
// The fp32 master value of element i (the param itself in mode 0).
inline float load_w(const TensorPtrs& t, const Flags& f, int64_t i) {
  if (f.mode == kMasterF32) return static_cast<const float*>(t.master)[i];
  if (f.mode == kMasterRemainder)
    return join_master(static_cast<const uint16_t*>(t.p)[i], static_cast<const int16_t*>(t.master)[i]);
  if (f.mode == kMaster8bit)
    return master8_decode(static_cast<const uint16_t*>(t.p)[i], static_cast<const int8_t*>(t.master)[i], t.pdt);
  return load_as_f32(t.p, i, t.pdt);
}

// Store the updated master p of element i (and the param); r0 = the element's random word when needed.
inline void store_w(const TensorPtrs& t, const Flags& f, int64_t i, float p, uint32_t r0, bool w0) {
  if (f.mode == kMasterF32) {
    static_cast<float*>(t.master)[i] = p;
    store_from_f32(t.p, i, t.pdt, p);
  } else if (f.mode == kMasterRemainder) {
    uint16_t hi;
    int16_t rem;
    split_master(p, hi, rem);
    static_cast<uint16_t*>(t.p)[i] = hi;
    static_cast<int16_t*>(t.master)[i] = rem;
  } else if (f.mode == kMaster8bit) {
    uint16_t h;
    int8_t c;
    master8_encode(p, t.pdt, r0, h, c);
    static_cast<uint16_t*>(t.p)[i] = h;
    static_cast<int8_t*>(t.master)[i] = c;
  } else if (w0) {
    static_cast<uint16_t*>(t.p)[i] = f32_to_bf16_sr(p, rand_a16(r0));
  } else {
    store_from_f32(t.p, i, t.pdt, p);
  }
}

void adamw_scalar(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
  const bool w0 = needs_word0(t, f), w1 = t.sdt == kBF16, w = needs_word(t, f);
  const RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t e = t.offset + static_cast<uint64_t>(i);
    const uint32_t r = w ? rng_word(keys, e) : 0u;
    float g = load_as_f32(t.g, i, t.gdt) * f.factor;
    if (f.maximize) g = -g;
    float p = load_w(t, f, i);
    float m = load_as_f32(t.m, i, t.sdt);
    float v = load_as_f32(t.v, i, t.sdt);
    p = adamw_update(p, g, m, v, t.vmax ? t.vmax + i : nullptr, t.c);
    if (w1) {
      static_cast<uint16_t*>(t.m)[i] = f32_to_bf16_sr(m, rand_b16(r));
      static_cast<uint16_t*>(t.v)[i] = f32_to_bf16_sr(v, rand_c16(r));
    } else {
      static_cast<float*>(t.m)[i] = m;
      static_cast<float*>(t.v)[i] = v;
    }
    store_w(t, f, i, p, r, w0);
  }
}

// 8-bit moments (and the 4-bit exp_avg of kMom4), group by group (begin a multiple of 32; the last
// group may be partial): decode, update and store master/param per element, then the group's scales
// and the codes (math.h mom8_*, mom4_*).
void adamw_scalar_mom8(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
  const bool w0 = needs_word0(t, f);
  const bool m4 = t.sdt == kMom4;
  const RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  int8_t* cm = static_cast<int8_t*>(t.m);
  uint8_t* cm4 = static_cast<uint8_t*>(t.m);
  uint8_t* cv = static_cast<uint8_t*>(t.v);
  for (int64_t gb = begin; gb < end; gb += kMom8Group) {
    const int cnt = static_cast<int>(end - gb < kMom8Group ? end - gb : kMom8Group);
    const int64_t j = gb / kMom8Group;
    const float sm = bf16_to_f32(t.sm[j]), sv = bf16_to_f32(t.sv[j]);
    float m[kMom8Group], v[kMom8Group];
    uint32_t r[kMom8Group];
    uint32_t am = 0u, av = 0u;
    for (int k = 0; k < cnt; ++k) {
      const int64_t i = gb + k;
      const uint64_t e = t.offset + static_cast<uint64_t>(i);
      r[k] = rng_word(keys, e);
      float g = load_as_f32(t.g, i, t.gdt) * f.factor;
      if (f.maximize) g = -g;
      float p = load_w(t, f, i);
      float mm = m4 ? mom4_decode_m(mom4_code(cm4[i >> 1], i), sm) : mom8_decode_m(cm[i], sm);
      float vv = mom8_decode_v(cv[i], sv);
      p = adamw_update(p, g, mm, vv, nullptr, t.c);
      store_w(t, f, i, p, r[k], w0);
      m[k] = mm;
      v[k] = vv;
      const uint32_t a = f32_bits(mm) & 0x7fffffffu, b = f32_bits(vv) & 0x7fffffffu;
      am = a > am ? a : am;
      av = b > av ? b : av;
    }
    const uint32_t bm = mom8_scale_bits(am, m4 ? kMom4KM : kMom8KM), bv = mom8_scale_bits(av, kMom8KV);
    const float im = mom8_inv_scale(bm), iv = mom8_inv_scale(bv);
    for (int k = 0; k < cnt; ++k) cv[gb + k] = mom8_encode_v(v[k], iv, rand_c16(r[k]));
    if (m4) {
      for (int k = 0; k < cnt; k += 2) {  // gb is even: a byte's two codes are k, k + 1 of this group
        const int c0 = mom4_encode_m(m[k], im, rand_b16(r[k]));
        const int c1 = k + 1 < cnt ? mom4_encode_m(m[k + 1], im, rand_b16(r[k + 1])) : 0;
        cm4[(gb + k) >> 1] = mom4_pack(c0, c1);
      }
    } else {
      for (int k = 0; k < cnt; ++k) cm[gb + k] = mom8_encode_m(m[k], im, rand_b16(r[k]));
    }
    t.sm[j] = static_cast<uint16_t>(bm);
    t.sv[j] = static_cast<uint16_t>(bv);
  }
}

#if MPK_X86
// ---- AVX2 path: same arithmetic, same order of operations (no fma contraction) ------------------
// The random words are computed 8 lanes at a time (one key per call: the caller splits ranges at
// multiples of 2^32 of the global element index, so the high index half is the same in a call).
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
    const __m256i h = bf16_keep_nan32(_mm256_srli_epi32(_mm256_add_epi32(tt, _mm256_set1_epi32(0x8000)), 16), w);
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
MPK_AVX2 void adamw_avx2(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
  // g = -(grad * factor) when maximizing, as the scalar code: a sign flip after the multiply
  // (g * (-factor) differs from it in the sign of a NaN)
  const __m256 factor = _mm256_set1_ps(f.factor);
  const __m256 gsign = _mm256_castsi256_ps(_mm256_set1_epi32(f.maximize ? static_cast<int>(0x80000000u) : 0));
  const __m256 decay = _mm256_set1_ps(t.c.decay), omb1 = _mm256_set1_ps(t.c.one_m_b1);
  const __m256 b2 = _mm256_set1_ps(t.c.beta2), omb2 = _mm256_set1_ps(t.c.one_m_b2);
  const __m256 ss = _mm256_set1_ps(t.c.step_size), ibc2 = _mm256_set1_ps(t.c.inv_bc2);
  const __m256 eps = _mm256_set1_ps(t.c.eps);
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
    p = _mm256_mul_ps(p, decay);
    m = _mm256_add_ps(m, _mm256_mul_ps(omb1, _mm256_sub_ps(g, m)));
    v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    __m256 vv = v;
    if (t.vmax != nullptr) {
      // max(vmax, v) with the scalar's tie/NaN rule: vmax > v ? vmax : v
      const __m256 old = _mm256_loadu_ps(t.vmax + i);
      vv = _mm256_blendv_ps(v, old, _mm256_cmp_ps(old, v, _CMP_GT_OQ));
      _mm256_storeu_ps(t.vmax + i, vv);
    }
    const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vv), ibc2), eps);
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(ss, m), denom));
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
  if (i < end) adamw_scalar(t, i, end, f);
}

// ---- 8-bit moments, AVX2: one group of 32 = 4 x 8 lanes in registers -----------------------------

// The codecs' random value r16 / 2^16 of a field as a float (see rand_unit16 in the AVX-512 part):
// the 11 field bits at mantissa bits 12..22, 1.0's exponent and the cell-centre bit 11 set, minus 1.
MPK_AVX2 __attribute__((always_inline)) inline __m256 rand_unit8(__m256i field_at12) {
  const __m256i bits = _mm256_or_si256(_mm256_and_si256(field_at12, _mm256_set1_epi32(0x7ff000)),
                                       _mm256_set1_epi32(0x3f800800));
  return _mm256_sub_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(1.0f));
}


// An estimate e of a root lowered by 2^-10 .. 2^-9 of itself with an integer op instead of a
// multiply (2^14 subtracted from its bit pattern; see lower16).
MPK_AVX2 __attribute__((always_inline)) inline __m256 lower8(__m256 e) {
  return _mm256_castsi256_ps(_mm256_sub_epi32(_mm256_castps_si256(e), _mm256_set1_epi32(0x4000)));
}

// mom8_encode_m on 8 lanes; returns int32 codes, bit-identical to the scalar code (the operations
// of enc_m16, with blends for the masks):
// * y = min(|m| * inv, 127^2) (min keeps a NaN y: inv 0 with a NaN m): a y >= 127^2 then gives
//   k = 127, d = 0, so the code 127 of the scalar's y >= 16129 branch without a select;
// * k, the integer with k^2 <= y < (k + 1)^2, from the estimate y * rsqrt(y) (rsqrt's relative
//   error is below 1.5 * 2^-12) lowered by >= 2^-10 (lower8): never above sqrt(y), at most 0.3
//   below it (sqrt(y) <= 127), so floor(estimate) is k or k - 1 and ONE fix-up (k + 1 when
//   (k + 1)^2 = k^2 + 2k + 1 <= y, exact integers) gives k; y < 1 (and a NaN, zero or subnormal
//   y, where rsqrt is inf) gives k = 0;
// * the scalar's r16 * w < d * 2^16 decision as rf * w < d (rand_unit8), added as an integer (the
//   compare mask is -1);
// * the sign of m with vpsignd (a negative m negates the code; a code 0 stays 0).
// (TOP = 7: the 4-bit exp_avg of mom4_encode_m, y clamped to 49 the same way.)
template <int TOP = 127>
MPK_AVX2 __attribute__((always_inline)) inline __m256i enc_m8(__m256 m, __m256 inv, __m256 rf) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 absm = _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(0x7fffffff)));
  const __m256 y = _mm256_min_ps(_mm256_set1_ps(static_cast<float>(TOP * TOP)), _mm256_mul_ps(absm, inv));
  const __m256 est = lower8(_mm256_mul_ps(y, _mm256_rsqrt_ps(y)));
  const __m256 k0 = _mm256_and_ps(_mm256_floor_ps(est), _mm256_cmp_ps(y, one, _CMP_GE_OQ));
  const __m256 s0 = _mm256_mul_ps(k0, k0);
  const __m256 w0 = _mm256_add_ps(_mm256_add_ps(k0, k0), one);  // 2k + 1 (k + k == 2 * k exactly)
  const __m256 s1 = _mm256_add_ps(s0, w0);                       // (k + 1)^2
  const __m256 fix = _mm256_cmp_ps(s1, y, _CMP_LE_OQ);
  const __m256 k = _mm256_add_ps(k0, _mm256_and_ps(fix, one));
  const __m256 d = _mm256_sub_ps(y, _mm256_blendv_ps(s0, s1, fix));
  const __m256 w = _mm256_add_ps(w0, _mm256_and_ps(fix, _mm256_set1_ps(2.0f)));
  const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(rf, w), d, _CMP_LT_OQ);
  const __m256i c = _mm256_sub_epi32(_mm256_cvttps_epi32(k), _mm256_castps_si256(up));
  return _mm256_sign_epi32(c, _mm256_castps_si256(m));
}

// mom8_encode_v on 8 lanes; returns int32 codes, bit-identical to the scalar code:
// * y = min(v * inv, q4(255)) (a NaN y stays NaN): y >= q4(255) gives k = 255, d = 0, code 255;
// * k from the estimate rsqrt(rsqrt(y)) of y^(1/4) (relative error below 2.25 * 2^-12) lowered by
//   >= 2^-10 (lower8): never above y^(1/4), at most 0.64 below it (y^(1/4) <= 255), so one fix-up
//   (k + 1 when q4(k + 1) <= y) gives the scalar k;
// * q4 of k0, k0 + 1, k0 + 2 from one multiply k0 * k0, adds and three squares (see enc_v16);
// * codes >= 1 for y > 0, 0 for y == 0 or NaN (the scalar's early return).
MPK_AVX2 __attribute__((always_inline)) inline __m256i enc_v8(__m256 v, __m256 inv, __m256 rf) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 y = _mm256_min_ps(_mm256_set1_ps(mom8_q4(255.0f)), _mm256_mul_ps(v, inv));
  const __m256 est = lower8(_mm256_rsqrt_ps(_mm256_rsqrt_ps(y)));
  const __m256 k0 = _mm256_and_ps(_mm256_floor_ps(est), _mm256_cmp_ps(y, one, _CMP_GE_OQ));
  const __m256 s0 = _mm256_mul_ps(k0, k0);
  const __m256 a = _mm256_add_ps(_mm256_add_ps(k0, k0), one);  // 2k0 + 1
  const __m256 s1 = _mm256_add_ps(s0, a);
  const __m256 s2 = _mm256_add_ps(_mm256_add_ps(s1, a), _mm256_set1_ps(2.0f));
  const __m256 q0 = _mm256_mul_ps(s0, s0), q1 = _mm256_mul_ps(s1, s1), q2 = _mm256_mul_ps(s2, s2);
  const __m256 fix = _mm256_cmp_ps(q1, y, _CMP_LE_OQ);
  const __m256 k = _mm256_add_ps(k0, _mm256_and_ps(fix, one));
  const __m256 q = _mm256_blendv_ps(q0, q1, fix);
  const __m256 d = _mm256_sub_ps(y, q);
  const __m256 w = _mm256_sub_ps(_mm256_blendv_ps(q1, q2, fix), q);
  const __m256 up = _mm256_cmp_ps(_mm256_mul_ps(rf, w), d, _CMP_LT_OQ);
  const __m256i c = _mm256_max_epi32(_mm256_sub_epi32(_mm256_cvttps_epi32(k), _mm256_castps_si256(up)),
                                     _mm256_set1_epi32(1));
  return _mm256_and_si256(c, _mm256_castps_si256(_mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GT_OQ)));
}

// c |c| of a group's 32 signed 4-bit codes (16 bytes at p, mom4_code; c |c| is mom4_decode_m's
// f |f|, exact, in [-64, 49]) as 32 int8 in element order at dst (16-byte aligned): the low and high
// nibbles split, interleaved back into element order and looked up with pshufb (it reads the low 4
// bits). Two 16-byte stores, read back by 16-byte (AVX-512) or contained 8-byte (AVX2) loads, which
// store-to-load forwarding serves.
MPK_AVX2 __attribute__((always_inline)) inline void nibble_sq32(const uint8_t* p, int8_t* dst) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo4 = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(x, lo4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), lo4);
  const __m128i sq = _mm_setr_epi8(0, 1, 4, 9, 16, 25, 36, 49, -64, -49, -36, -25, -16, -9, -4, -1);
  _mm_store_si128(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi8(sq, _mm_unpacklo_epi8(lo, hi)));
  _mm_store_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_shuffle_epi8(sq, _mm_unpackhi_epi8(lo, hi)));
}

// 16 codes as signed bytes in element order -> 8 bytes of two codes each (mom4_pack) in the low
// half, the same for hi16 in the high half: per 16-bit lane (c_even & 15) + 16 (c_odd & 15) by one
// unsigned x signed byte multiply-add (<= 255), packed to bytes with unsigned saturation (exact).
MPK_AVX2 __attribute__((always_inline)) inline __m128i pack_nibbles16x2(__m128i lo16, __m128i hi16) {
  const __m128i lo4 = _mm_set1_epi8(0x0f), w = _mm_set1_epi16(0x1001);  // bytes 1, 16
  return _mm_packus_epi16(_mm_maddubs_epi16(_mm_and_si128(lo16, lo4), w),
                          _mm_maddubs_epi16(_mm_and_si128(hi16, lo4), w));
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

// mom8_scale_bits and mom8_inv_scale of 8 groups at once: x = the groups' |x| maxima as bits;
// returns the scales' bf16 bits and 1 / s (inv, 0 for a zero or NaN scale).
MPK_AVX2 __attribute__((always_inline)) inline __m256i scale_bits8(__m256i x, __m256 k, __m256& inv) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i b = _mm256_castps_si256(_mm256_mul_ps(_mm256_castsi256_ps(x), k));
  const __m256i low_zero = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0xffff)), zero);
  b = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_andnot_si256(low_zero, _mm256_set1_epi32(0x10000))), 16);
  const __m256i nonfinite = _mm256_cmpgt_epi32(x, _mm256_set1_epi32(0x7f7fffff));  // x < 2^31: signed is fine
  b = _mm256_blendv_epi8(b, _mm256_set1_epi32(static_cast<int>(kMom8NaNScale)), nonfinite);
  const __m256i none = _mm256_or_si256(nonfinite, _mm256_cmpeq_epi32(b, zero));  // codes 0
  const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
  inv = _mm256_andnot_ps(_mm256_castsi256_ps(none), _mm256_div_ps(_mm256_set1_ps(1.0f), s));
  return b;
}

// One master mode's loop, blocks of up to 8 groups of 32. AVX2 has 16 vector registers: the
// updated moments and random words go through an L1-resident buffer between the update pass and
// the encode pass (keeping a group's in registers made the compiler spill and rebuild constants:
// ~1050 instructions per group, measured with callgrind), and the update pass is a loop of 8 lanes,
// so its constants stay in registers across iterations. Each group's 8-lane |x| maxima are kept,
// one unpack tree gives the 8 group maxima and one vector pass the 8 scales and 1 / s.
// M4: the 4-bit exp_avg (kMom4: two codes per byte, top code 7, scale amax / 49).
template <int PDT, int GDT, int MODE, bool M4>
MPK_AVX2 void adamw_avx2_mom8_mode(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f_in) {
  Flags f = f_in;
  f.mode = MODE;  // a compile-time constant in load_w8 / store_w8
  // g = -(grad * factor) when maximizing, as the scalar code: a sign flip after the multiply
  // (g * (-factor) differs from it in the sign of a NaN)
  const __m256 factor = _mm256_set1_ps(f.factor);
  const __m256 gsign = _mm256_castsi256_ps(_mm256_set1_epi32(f.maximize ? static_cast<int>(0x80000000u) : 0));
  const __m256 decay = _mm256_set1_ps(t.c.decay), omb1 = _mm256_set1_ps(t.c.one_m_b1);
  const __m256 b2 = _mm256_set1_ps(t.c.beta2), omb2 = _mm256_set1_ps(t.c.one_m_b2);
  const __m256 ss = _mm256_set1_ps(t.c.step_size), ibc2 = _mm256_set1_ps(t.c.inv_bc2);
  const __m256 eps = _mm256_set1_ps(t.c.eps);
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
  RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  int64_t gb = begin;
  while (gb + kMom8Group <= end) {
    const uint64_t e0 = t.offset + static_cast<uint64_t>(gb);
    const uint32_t hi0 = static_cast<uint32_t>(e0 >> 32);
    if (static_cast<uint32_t>((e0 + kMom8Group - 1) >> 32) != hi0) {  // the group crosses 2^32: scalar
      adamw_scalar_mom8(t, gb, gb + kMom8Group, f);
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
      const __m256 sm = _mm256_set1_ps(bf16_to_f32(t.sm[j0 + g])), sv = _mm256_set1_ps(bf16_to_f32(t.sv[j0 + g]));
      __m256i gm = _mm256_setzero_si256(), gv = _mm256_setzero_si256();
      alignas(16) int8_t sq4[kMom8Group];  // M4: c |c| of the group's m codes
      if constexpr (M4) nibble_sq32(cm4 + ((gb + g * kMom8Group) >> 1), sq4);
#pragma GCC unroll 1
      for (int q = 0; q < 4; ++q) {
        const int o = g * kMom8Group + 8 * q;
        const int64_t i = gb + o;
        const __m256i elo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(e0) +
                                                                                static_cast<uint32_t>(o))),
                                             lanes);
        const __m256 gr = _mm256_xor_ps(_mm256_mul_ps(load8<GDT>(t.g, i), factor), gsign);
        __m256 p = load_w8<PDT>(t, f, i);
        __m256 fm2;  // c |c| of the m codes
        if constexpr (M4) {
          fm2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sq4 + 8 * q))));
        } else {
          const __m256 fm = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cmp + i))));
          fm2 = _mm256_mul_ps(fm, _mm256_castsi256_ps(_mm256_and_si256(_mm256_castps_si256(fm), abs_mask)));
        }
        const __m256 fv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cvp + i))));
        __m256 mm = _mm256_mul_ps(sm, fm2);
        const __m256 f2 = _mm256_mul_ps(fv, fv);
        __m256 vv = _mm256_mul_ps(_mm256_mul_ps(sv, f2), f2);
        p = _mm256_mul_ps(p, decay);
        mm = _mm256_add_ps(mm, _mm256_mul_ps(omb1, _mm256_sub_ps(gr, mm)));
        vv = _mm256_add_ps(_mm256_mul_ps(vv, b2), _mm256_mul_ps(_mm256_mul_ps(omb2, gr), gr));
        const __m256 denom = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(vv), ibc2), eps);
        p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(ss, mm), denom));
        const __m256i rw = mix32x8(_mm256_xor_si256(key, elo));  // the one random word of each element
        store_w8<PDT>(t, f, i, p, need0, rw);
        _mm256_store_ps(mb + o, mm);
        _mm256_store_ps(vb + o, vv);
        _mm256_store_si256(reinterpret_cast<__m256i*>(rb + o), rw);
        gm = _mm256_max_epu32(gm, _mm256_and_si256(_mm256_castps_si256(mm), abs_mask));
        gv = _mm256_max_epu32(gv, _mm256_and_si256(_mm256_castps_si256(vv), abs_mask));
      }
      am[g] = gm;
      av[g] = gv;
    }
    __m256 im, iv;
    _mm256_store_si256(reinterpret_cast<__m256i*>(bms), scale_bits8(hmax8x8(am), _mm256_set1_ps(M4 ? kMom4KM : kMom8KM), im));
    _mm256_store_si256(reinterpret_cast<__m256i*>(bvs), scale_bits8(hmax8x8(av), _mm256_set1_ps(kMom8KV), iv));
    _mm256_store_ps(ims, im);
    _mm256_store_ps(ivs, iv);
    for (int g = 0; g < n; ++g) {
      t.sm[j0 + g] = static_cast<uint16_t>(bms[g]);
      t.sv[j0 + g] = static_cast<uint16_t>(bvs[g]);
      const __m256 img = _mm256_set1_ps(ims[g]), ivg = _mm256_set1_ps(ivs[g]);
      const float* mg = mb + g * kMom8Group;
      const float* vg = vb + g * kMom8Group;
      const uint32_t* rg = rb + g * kMom8Group;
      // codes, two vectors of 8 at a time packed to int16 (packs: exact, |codes| <= 255)
      __m256i pm[2], pv[2];
#pragma GCC unroll 1
      for (int h = 0; h < 2; ++h) {
        const __m256i r0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(rg + 16 * h));
        const __m256i r1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(rg + 16 * h + 8));
        // fields B (bits 10..20) and C (bits 21..31) moved to mantissa bits 12..22
        constexpr int kTop = M4 ? 7 : 127;
        const __m256i c0 = enc_m8<kTop>(_mm256_load_ps(mg + 16 * h), img, rand_unit8(_mm256_slli_epi32(r0, 2)));
        const __m256i c1 = enc_m8<kTop>(_mm256_load_ps(mg + 16 * h + 8), img, rand_unit8(_mm256_slli_epi32(r1, 2)));
        pm[h] = _mm256_packs_epi32(c0, c1);
        const __m256i d0 = enc_v8(_mm256_load_ps(vg + 16 * h), ivg, rand_unit8(_mm256_srli_epi32(r0, 9)));
        const __m256i d1 = enc_v8(_mm256_load_ps(vg + 16 * h + 8), ivg, rand_unit8(_mm256_srli_epi32(r1, 9)));
        pv[h] = _mm256_packs_epi32(d0, d1);
      }
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      const int64_t i0 = gb + g * kMom8Group;
      const __m256i mcodes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(pm[0], pm[1]), order);
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
  if (gb < end) adamw_scalar_mom8(t, gb, end, f);
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

using AvxFn = void (*)(const TensorPtrs&, int64_t, int64_t, const Flags&);

template <int PDT, int GDT>
AvxFn pick_s(int32_t sdt) {
  if (sdt == kMom8) return &adamw_avx2_mom8<PDT, GDT, false>;
  if (sdt == kMom4) return &adamw_avx2_mom8<PDT, GDT, true>;
  return sdt == kF32 ? &adamw_avx2<PDT, GDT, kF32> : &adamw_avx2<PDT, GDT, kBF16>;
}
template <int PDT>
AvxFn pick_g(int32_t gdt, int32_t sdt) {
  switch (gdt) {
    case kF32: return pick_s<PDT, kF32>(sdt);
    case kF16: return pick_s<PDT, kF16>(sdt);
    default: return pick_s<PDT, kBF16>(sdt);
  }
}
AvxFn pick_avx2(int32_t pdt, int32_t gdt, int32_t sdt) {
  switch (pdt) {
    case kF32: return pick_g<kF32>(gdt, sdt);
    case kF16: return pick_g<kF16>(gdt, sdt);
    default: return pick_g<kBF16>(gdt, sdt);
  }
}

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

template <int PDT, int GDT, int SDT>
MPK_AVX512 void adamw_avx512(const TensorPtrs& t_in, int64_t begin, int64_t end, const Flags& f_in) {
  const TensorPtrs t = t_in;  // local copies: the stores below cannot alias them, no reloads
  const Flags f = f_in;
  const __m512 factor = _mm512_set1_ps(f.factor);  // -(g * factor) when maximizing, as in the AVX2 path
  const __m512 gsign = _mm512_castsi512_ps(_mm512_set1_epi32(f.maximize ? static_cast<int>(0x80000000u) : 0));
  const __m512 decay = _mm512_set1_ps(t.c.decay), omb1 = _mm512_set1_ps(t.c.one_m_b1);
  const __m512 b2 = _mm512_set1_ps(t.c.beta2), omb2 = _mm512_set1_ps(t.c.one_m_b2);
  const __m512 ss = _mm512_set1_ps(t.c.step_size), ibc2 = _mm512_set1_ps(t.c.inv_bc2);
  const __m512 eps = _mm512_set1_ps(t.c.eps);
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
    const __m512 g = _mm512_xor_ps(_mm512_mul_ps(load16<GDT>(t.g, i), factor), gsign);
    __m512 p = load_w16<PDT>(t, f, i);
    __m512 m = load16<SDT>(t.m, i);
    __m512 v = load16<SDT>(t.v, i);
    p = _mm512_mul_ps(p, decay);
    m = _mm512_add_ps(m, _mm512_mul_ps(omb1, _mm512_sub_ps(g, m)));
    v = _mm512_add_ps(_mm512_mul_ps(v, b2), _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    __m512 vv = v;
    if (t.vmax != nullptr) {  // vmax > v ? vmax : v
      const __m512 old = _mm512_loadu_ps(t.vmax + i);
      vv = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(old, v, _CMP_GT_OQ), old);
      _mm512_storeu_ps(t.vmax + i, vv);
    }
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vv), ibc2), eps);
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(ss, m), denom));
    if constexpr (SDT == kBF16) {
      store_u16x16(static_cast<uint16_t*>(t.m) + i, bf16_sr_bits(m, rand_b16x16(rw)));
      store_u16x16(static_cast<uint16_t*>(t.v) + i, bf16_sr_bits(v, rand_c16x16(rw)));
    } else {
      _mm512_storeu_ps(static_cast<float*>(t.m) + i, m);
      _mm512_storeu_ps(static_cast<float*>(t.v) + i, v);
    }
    store_w16<PDT>(t, f, i, p, need0, rw);
  }
  if (i < end) adamw_scalar(t, i, end, f);
}

// The codecs' random value r16 / 2^16 of a field as a float, without a conversion: the field's 11
// bits f are moved to mantissa bits 12..22 (`field_at12`), one ternary-logic op keeps them and sets
// 1.0's exponent and the cell-centre bit 11 (1 + (f + 1/2) / 2^11), and 1.0 is subtracted (exact).
// The encoders compare rf * w < d, which is the scalar code's r16 * w < d * 2^16 scaled by 2^-16
// on both sides: fl(rf * w) = fl(r16 * w) * 2^-16 exactly (no underflow: w >= 1, rf >= 2^-12).
MPK_AVX512 __attribute__((always_inline)) inline __m512 rand_unit16(__m512i field_at12) {
  const __m512i bits = _mm512_ternarylogic_epi32(field_at12, _mm512_set1_epi32(0x7ff000),
                                                 _mm512_set1_epi32(0x3f800800), 0xEA);  // (a & b) | c
  return _mm512_sub_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(1.0f));
}

// An estimate e of a root lowered by 2^-10 .. 2^-9 of itself with an integer op instead of a
// multiply (the multiply ports bind these loops): 2^14 subtracted from its bit pattern is
// 2^-9 / mantissa relative. A NaN or inf e stays NaN (the callers mask y < 1 out).
MPK_AVX512 __attribute__((always_inline)) inline __m512 lower16(__m512 e) {
  return _mm512_castsi512_ps(_mm512_sub_epi32(_mm512_castps_si512(e), _mm512_set1_epi32(0x4000)));
}

// mom8_encode_m on 16 lanes, bit-identical to the scalar code; returns int32 codes:
// * y = min(|m| * inv, 127^2) (min keeps a NaN y): a y >= 127^2 then gives k = 127, d = 0, so the
//   code 127 of the scalar's y >= 16129 branch without a select;
// * k, the integer with k^2 <= y < (k + 1)^2, from an estimate never above sqrt(y) and less than 1
//   below it: y * rsqrt14(y) (relative error < 2^-14) lowered by >= 2^-10 (lower16), at most
//   0.27 below sqrt(y) <= 127; so floor(estimate) is k or k - 1 and one fix-up (k + 1 when
//   (k + 1)^2 <= y, with (k + 1)^2 = k^2 + 2k + 1 from adds: exact integers) is exact; y < 1 (and
//   a NaN, zero or subnormal y) gives k = 0;
// * the rounding decision rf * w < d (see rand_unit16); a zero or NaN y gives d = 0 or NaN: no
//   round-up, code 0, as the scalar's early return;
// * the sign of m copied onto the float code before the conversion (-c; a code 0 gives 0).
// (TOP = 7: the 4-bit exp_avg of mom4_encode_m, y clamped to 49 the same way.)
template <int TOP = 127>
MPK_AVX512 __attribute__((always_inline)) inline __m512i enc_m16(__m512 m, __m512 inv, __m512 rf) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 y = _mm512_min_ps(_mm512_set1_ps(static_cast<float>(TOP * TOP)), _mm512_mul_ps(_mm512_abs_ps(m), inv));
  const __m512 est = lower16(_mm512_mul_ps(y, _mm512_rsqrt14_ps(y)));
  const __m512 k0 = _mm512_maskz_roundscale_ps(_mm512_cmp_ps_mask(y, one, _CMP_GE_OQ), est,
                                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 s0 = _mm512_mul_ps(k0, k0);
  const __m512 w0 = _mm512_add_ps(_mm512_add_ps(k0, k0), one);  // 2k + 1 (k + k == 2 * k exactly)
  const __m512 s1 = _mm512_add_ps(s0, w0);                       // (k + 1)^2
  const __mmask16 fix = _mm512_cmp_ps_mask(s1, y, _CMP_LE_OQ);
  const __m512 k = _mm512_mask_add_ps(k0, fix, k0, one);
  const __m512 d = _mm512_sub_ps(y, _mm512_mask_mov_ps(s0, fix, s1));
  const __m512 w = _mm512_mask_add_ps(w0, fix, w0, _mm512_set1_ps(2.0f));
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(rf, w), d, _CMP_LT_OQ);
  const __m512i c = _mm512_castps_si512(_mm512_mask_add_ps(k, up, k, one));
  const __m512i sc = _mm512_ternarylogic_epi32(c, _mm512_castps_si512(m), _mm512_set1_epi32(static_cast<int>(0x80000000u)),
                                               0xF8);  // c | (m & sign)
  return _mm512_cvttps_epi32(_mm512_castsi512_ps(sc));
}

// mom8_encode_v on 16 lanes; returns int32 codes, bit-identical to the scalar code:
// * y = min(v * inv, q4(255)) (a NaN y stays NaN): y >= q4(255) gives k = 255, d = 0, code 255;
// * k from the estimate rsqrt14(rsqrt14(y)) of y^(1/4) (relative error < 1.5 * 2^-14) lowered by
//   >= 2^-10 (lower16): never above y^(1/4), at most 0.55 below it (y^(1/4) <= 255), so one fix-up
//   (k + 1 when q4(k + 1) <= y) gives the scalar k;
// * q4(j) = fl(S * S) with S = j^2 -- the scalar's (j * j) * (j * j) -- for j = k0, k0 + 1, k0 + 2
//   from ONE multiply k0 * k0 and adds (S1 = S0 + 2k0 + 1, S2 = S1 + 2k0 + 3: exact integers below
//   2^24), so q4(k) and q4(k + 1) after the fix-up are selects, not more multiplies;
// * the rounding decision rf * w < d (see rand_unit16);
// * codes >= 1 for y > 0, 0 for y == 0 or NaN (the scalar's early return).
MPK_AVX512 __attribute__((always_inline)) inline __m512i enc_v16(__m512 v, __m512 inv, __m512 rf) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 y = _mm512_min_ps(_mm512_set1_ps(mom8_q4(255.0f)), _mm512_mul_ps(v, inv));
  const __m512 est = lower16(_mm512_rsqrt14_ps(_mm512_rsqrt14_ps(y)));
  const __m512 k0 = _mm512_maskz_roundscale_ps(_mm512_cmp_ps_mask(y, one, _CMP_GE_OQ), est,
                                               _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 s0 = _mm512_mul_ps(k0, k0);
  const __m512 a = _mm512_add_ps(_mm512_add_ps(k0, k0), one);  // 2k0 + 1
  const __m512 s1 = _mm512_add_ps(s0, a);
  const __m512 s2 = _mm512_add_ps(_mm512_add_ps(s1, a), _mm512_set1_ps(2.0f));
  const __m512 q0 = _mm512_mul_ps(s0, s0), q1 = _mm512_mul_ps(s1, s1), q2 = _mm512_mul_ps(s2, s2);
  const __mmask16 fix = _mm512_cmp_ps_mask(q1, y, _CMP_LE_OQ);
  const __m512 k = _mm512_mask_add_ps(k0, fix, k0, one);
  const __m512 q = _mm512_mask_mov_ps(q0, fix, q1);
  const __m512 d = _mm512_sub_ps(y, q);
  const __m512 w = _mm512_sub_ps(_mm512_mask_mov_ps(q1, fix, q2), q);
  const __mmask16 up = _mm512_cmp_ps_mask(_mm512_mul_ps(rf, w), d, _CMP_LT_OQ);
  const __m512 c = _mm512_maskz_max_ps(_mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_GT_OQ),
                                       _mm512_mask_add_ps(k, up, k, one), one);
  return _mm512_cvttps_epi32(c);
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

// mom8_scale_bits and mom8_inv_scale of 16 groups at once: amax = the groups' |x| maxima as bits.
MPK_AVX512 __attribute__((always_inline)) inline __m512i scale_bits16(__m512i amax, float k, __m512& inv) {
  __m512i b = _mm512_castps_si512(_mm512_mul_ps(_mm512_castsi512_ps(amax), _mm512_set1_ps(k)));
  b = _mm512_mask_add_epi32(b, _mm512_test_epi32_mask(b, _mm512_set1_epi32(0xffff)), b, _mm512_set1_epi32(0x10000));
  b = _mm512_srli_epi32(b, 16);  // rounded up to bf16
  const __mmask16 nonfinite = _mm512_cmpgt_epu32_mask(amax, _mm512_set1_epi32(0x7f7fffff));
  b = _mm512_mask_mov_epi32(b, nonfinite, _mm512_set1_epi32(static_cast<int>(kMom8NaNScale)));
  const __mmask16 some = _mm512_kandn(nonfinite, _mm512_test_epi32_mask(b, b));  // codes 0 otherwise
  inv = _mm512_maskz_div_ps(some, _mm512_set1_ps(1.0f), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
  return b;
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
  // M4: the block's m codes as int8 -- c |c| of the stored ones before the update pass, the new
  // codes after the encode pass -- so that those passes read and write bytes as the 8-bit kind's
  // do, and the nibbles are unpacked and packed in short loops of their own (16-byte stores and
  // loads of the same addresses: store-to-load forwarding works; a 64-byte load of four 16-byte
  // stores measured ~6 % slower)
  alignas(64) int8_t c8[M4 ? kG * kMom8Group : 1];
  if constexpr (M4) {
    for (int g = 0; g < n; ++g) nibble_sq32(cm4 + ((gb + g * kMom8Group) >> 1), c8 + g * kMom8Group);
  }
  for (int g = 0; g < kG; ++g) {
    if (g >= n) {
      am[g] = _mm512_setzero_si512();
      av[g] = _mm512_setzero_si512();
      continue;
    }
    const __m512 sm = _mm512_set1_ps(bf16_to_f32(t.sm[j0 + g])), sv = _mm512_set1_ps(bf16_to_f32(t.sv[j0 + g]));
    __m512i gm = _mm512_setzero_si512(), gv = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const int o = g * kMom8Group + 16 * q;
      const int64_t i = gb + o;
      const __m512i elo = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(elo0 + static_cast<uint32_t>(o))), lanes);
      const __m512 gr = _mm512_xor_ps(_mm512_mul_ps(load16<GDT>(t.g, i), k.factor), k.gsign);
      __m512 p = load_w16<PDT>(t, f, i);
      __m512 fm2;  // c |c| of the m codes
      if constexpr (M4) {
        fm2 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(c8 + o))));
      } else {
        const __m512 fm = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cmp + i))));
        fm2 = _mm512_mul_ps(fm, _mm512_abs_ps(fm));
      }
      const __m512 fv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cvp + i))));
      __m512 mm = _mm512_mul_ps(sm, fm2);
      const __m512 f2 = _mm512_mul_ps(fv, fv);
      __m512 vv = _mm512_mul_ps(_mm512_mul_ps(sv, f2), f2);
      p = _mm512_mul_ps(p, k.decay);
      mm = _mm512_add_ps(mm, _mm512_mul_ps(k.omb1, _mm512_sub_ps(gr, mm)));
      vv = _mm512_add_ps(_mm512_mul_ps(vv, k.b2), _mm512_mul_ps(_mm512_mul_ps(k.omb2, gr), gr));
      const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vv), k.ibc2), k.eps);
      p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(k.ss, mm), denom));
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
  const __m512i bm = scale_bits16(hmax16x16(am), M4 ? kMom4KM : kMom8KM, im);
  const __m512i bv = scale_bits16(hmax16x16(av), kMom8KV, iv);
  alignas(64) float ims[kG], ivs[kG];
  _mm512_store_ps(ims, im);
  _mm512_store_ps(ivs, iv);
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1u);
  _mm256_mask_storeu_epi16(t.sm + j0, live, _mm512_cvtepi32_epi16(bm));
  _mm256_mask_storeu_epi16(t.sv + j0, live, _mm512_cvtepi32_epi16(bv));
  for (int g = 0; g < n; ++g) {
    const __m512 img = _mm512_set1_ps(ims[g]), ivg = _mm512_set1_ps(ivs[g]);
#pragma GCC unroll 2
    for (int q = 0; q < 2; ++q) {
      const int o = g * kMom8Group + 16 * q;
      const __m512i rw = _mm512_load_si512(rb + o);
      // fields B (bits 10..20) and C (bits 21..31) moved to mantissa bits 12..22
      const __m512i c = enc_m16<M4 ? 7 : 127>(_mm512_load_ps(mb + o), img, rand_unit16(_mm512_slli_epi32(rw, 2)));
      const __m512i d = enc_v16(_mm512_load_ps(vb + o), ivg, rand_unit16(_mm512_srli_epi32(rw, 9)));
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
  const TensorPtrs t = t_in;  // local copies: the stores below cannot alias them, no reloads
  const Flags f = f_in;
  const Consts512 k = consts512(t, f);
  const bool need0 = needs_word0(t, f);
  RngKeys keys = rng_keys(f.seed, t.stream, t.step, t.offset + static_cast<uint64_t>(begin));
  int64_t gb = begin;
  while (gb + kMom8Group <= end) {
    const uint64_t e0 = t.offset + static_cast<uint64_t>(gb);
    const uint32_t hi0 = static_cast<uint32_t>(e0 >> 32);
    if (static_cast<uint32_t>((e0 + kMom8Group - 1) >> 32) != hi0) {  // the group crosses 2^32: scalar
      adamw_scalar_mom8(t, gb, gb + kMom8Group, f);
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
  if (gb < end) adamw_scalar_mom8(t, gb, end, f);
}

template <int PDT, int GDT>
AvxFn pick512_s(int32_t sdt) {
  if (sdt == kMom8) return &adamw_avx512_mom8<PDT, GDT, false>;
  if (sdt == kMom4) return &adamw_avx512_mom8<PDT, GDT, true>;
  return sdt == kF32 ? &adamw_avx512<PDT, GDT, kF32> : &adamw_avx512<PDT, GDT, kBF16>;
}
template <int PDT>
AvxFn pick512_g(int32_t gdt, int32_t sdt) {
  switch (gdt) {
    case kF32: return pick512_s<PDT, kF32>(sdt);
    case kF16: return pick512_s<PDT, kF16>(sdt);
    default: return pick512_s<PDT, kBF16>(sdt);
  }
}
AvxFn pick_avx512(int32_t pdt, int32_t gdt, int32_t sdt) {
  switch (pdt) {
    case kF32: return pick512_g<kF32>(gdt, sdt);
    case kF16: return pick512_g<kF16>(gdt, sdt);
    default: return pick512_g<kBF16>(gdt, sdt);
  }
}
#endif

}  // namespace

void adamw_step_cpu_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                     at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                     const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool maximize, int64_t master_mode, bool stochastic_rounding,
                     int64_t seed, at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets,
                     const std::optional<at::TensorList>& exp_avg_scales_opt,
                     const std::optional<at::TensorList>& exp_avg_sq_scales_opt) {
  const at::TensorList exp_avg_scales = list_or_empty(exp_avg_scales_opt);
  const at::TensorList exp_avg_sq_scales = list_or_empty(exp_avg_sq_scales_opt);
  // arguments checked by the registered op (csrc/ops.cpp, adamw_step_op)
  // CPU tensors: plain memory reads (no dispatcher round trips, no device sync)
  if (*found_inf.data_ptr<float>() != 0.0f) return;
  if (lr_tensor.has_value()) lr = *lr_tensor->data_ptr<float>();
  Flags f;
  f.mode = static_cast<int>(master_mode);
  f.maximize = maximize;
  f.sr = stochastic_rounding;
  f.seed = static_cast<uint32_t>(seed);
  f.factor = *grad_factor.data_ptr<float>();
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<TensorPtrs> tp(n);
  for (int64_t t = 0; t < n; ++t) {
    TensorPtrs& x = tp[t];
    x.p = params[t].data_ptr();
    x.g = grads[t].data_ptr();
    x.m = exp_avgs[t].data_ptr();
    x.v = exp_avg_sqs[t].data_ptr();
    x.vmax = max_exp_avg_sqs.empty() ? nullptr : max_exp_avg_sqs[t].data_ptr<float>();
    x.master = masters.empty() ? nullptr : masters[t].data_ptr();
    x.pdt = dtype_code(params[t].scalar_type());
    x.gdt = dtype_code(grads[t].scalar_type());
    x.sdt = moment_code(exp_avgs[t]);
    const bool grouped = x.sdt == kMom8 || x.sdt == kMom4;
    x.sm = grouped ? static_cast<uint16_t*>(exp_avg_scales[t].data_ptr()) : nullptr;
    x.sv = grouped ? static_cast<uint16_t*>(exp_avg_sq_scales[t].data_ptr()) : nullptr;
    const double step = static_cast<double>(*steps[t].data_ptr<float>()) + 1.0;
    x.step = static_cast<uint32_t>(step);
    x.stream = stream_of(stream_ids, static_cast<size_t>(t));
    x.offset = offset_of(elem_offsets, static_cast<size_t>(t));
    x.c = adamw_consts(lr, beta1, beta2, eps, weight_decay, step);
  }
  const auto items = make_work(params, kChunk);
#if MPK_X86
  const bool avx = use_avx2();
  // AVX-512 when the CPU has it, unless MPKERN_CPU_AVX512=0 (read per call, so tests can compare
  // the AVX-512, AVX2 and scalar paths in one process); all three are bit-identical
  const char* env512 = std::getenv("MPKERN_CPU_AVX512");
  const bool avx512 = avx && cpu_has_avx512() && !(env512 != nullptr && env512[0] == '0');
#endif
  // grain from element counts: about kSerialElems elements per task at least, so a small step
  // (many tiny tensors) runs on the calling thread instead of paying thread wake-ups
  constexpr int64_t kSerialElems = 1 << 18;
  int64_t total = 0;
  for (const WorkItem& w : items) total += w.end - w.begin;
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t grain = total > 0 ? std::max<int64_t>(1, (n_items * kSerialElems + total - 1) / total) : 1;
  at::parallel_for(0, n_items, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const WorkItem& w = items[k];
      const TensorPtrs& x = tp[w.tensor];
#if MPK_X86
      if (avx) {
        // one random key per call: split the range where the global element index crosses a
        // multiple of 2^32 (a chunk crosses at most one)
        const AvxFn fn = avx512 ? pick_avx512(x.pdt, x.gdt, x.sdt) : pick_avx2(x.pdt, x.gdt, x.sdt);
        if (x.sdt == kMom8 || x.sdt == kMom4) {  // group-aligned: the kernel handles a crossing of 2^32 itself
          fn(x, w.begin, w.end, f);
          continue;
        }
        const uint64_t first = x.offset + static_cast<uint64_t>(w.begin);
        const uint64_t next = (first | 0xffffffffull) + 1u;
        const int64_t split = next - x.offset < static_cast<uint64_t>(w.end) ? static_cast<int64_t>(next - x.offset)
                                                                              : w.end;
        fn(x, w.begin, split, f);
        if (split < w.end) fn(x, split, w.end, f);
        continue;
      }
#endif
      if (x.sdt == kMom8 || x.sdt == kMom4) {
        adamw_scalar_mom8(x, w.begin, w.end, f);
      } else {
        adamw_scalar(x, w.begin, w.end, f);
      }
    }
  });
  for (int64_t t = 0; t < n; ++t) *steps[t].data_ptr<float>() += 1.0f;
}

}  // namespace cpu
}  // namespace mpkern

// registered by csrc/ops.cpp (the schema's codecs parsed there; see csrc/kernels.h)
