// mpkern per-element math, shared by the CPU and CUDA kernels: header-only, no torch headers. Every
// function is `MPK_HD` (__host__ __device__ inline under nvcc, plain inline elsewhere), so the CPU tests
// run exactly the arithmetic the GPU runs; mpkern.triton_kernels and mpkern/reference_codecs.py mirror it.
// Formats: docs/storage.md, "Formats, bit by bit". Arithmetic: docs/design.md, "The per-element arithmetic".
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "codecs.h"

#if defined(__CUDACC__)
#define MPK_HD __host__ __device__ __forceinline__
#else
#define MPK_HD inline
#endif

namespace mpkern {

MPK_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MPK_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// True for +-inf and NaN: exponent bits all ones.
MPK_HD bool nonfinite(float x) { return (f32_bits(x) & 0x7f800000u) == 0x7f800000u; }

// ---- bf16 / fp16 <-> fp32; the rounding rules: docs/storage.md, "Formats, bit by bit" ----
MPK_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even (as tensor.to(torch.bfloat16)); NaN stays NaN (quiet, sign kept).
MPK_HD uint16_t f32_to_bf16_rne(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Stochastic rounding: add 16 random bits below the kept half, truncate (unbiased for finite f); inf/NaN
// pass through (NaN quieted).
MPK_HD uint16_t f32_to_bf16_sr(float f, uint32_t rand16) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    if (u & 0x007fffffu) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    return static_cast<uint16_t>(u >> 16);
  }
  u += (rand16 & 0xffffu);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float: software on the host, the hardware conversion on the device (nearest even: same bits).
MPK_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {
    // subnormal half: value = man * 2^-24; normalise.
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | (man << 13);
  }
  return f32_from_bits(bits);
#endif
}

MPK_HD uint16_t f32_to_f16_rne(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {
    // normal half range: drop 13 mantissa bits with round-to-nearest-even.
    uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15 (in the shifted frame)
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 itself is a tie -> 0)
  // subnormal half: value / 2^-24 rounded to nearest even integer.
  const uint32_t exp = a >> 23;  // 102..112
  const uint32_t man = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24
  uint32_t q = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
#endif
}

// Element codes used in the multi-tensor tables (same numbering in Python).
enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
static_assert(kMomF32 == kF32 && kMomBF16 == kBF16, "mpkern/codecs.def: a dense moment mode is its dtype code");

// Load one element of a 16/32-bit float buffer as float.
MPK_HD float load_as_f32(const void* base, int64_t i, int32_t dt) {
  if (dt == kF32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dt == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// Store a float into a 16/32-bit float buffer, rounding to nearest even.
MPK_HD void store_from_f32(void* base, int64_t i, int32_t dt, float v) {
  if (dt == kF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = dt == kBF16 ? f32_to_bf16_rne(v) : f32_to_f16_rne(v);
  }
}

// ---- The "remainder" master: docs/storage.md, "Formats, bit by bit" ----
// bits(m) == (hi << 16) + rem, hi rounded to nearest with ties away from zero.
MPK_HD void split_master(float m, uint16_t& hi, int16_t& rem) {
  const uint32_t u = f32_bits(m);
  hi = static_cast<uint16_t>((u + 0x8000u) >> 16);  // round half away from zero (in magnitude)
  rem = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));  // low half, read as signed
}

MPK_HD float join_master(uint16_t hi, int16_t rem) {
  return f32_from_bits((static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(rem)));
}

// ---- AdamW per element, fp32 with fused multiply-adds: docs/design.md, "The per-element arithmetic" ----
// b^n in fp64 by binary exponentiation in one fixed order (IEEE multiplies only: the same bits everywhere).
MPK_HD double pow_int(double b, uint32_t n) {
  double r = 1.0;
  for (double x = b; n != 0u; n >>= 1) {
    if (n & 1u) r = r * x;
    x = x * x;
  }
  return r;
}

struct AdamWConsts {
  float decay;       // 1 - lr * weight_decay
  float one_m_b1;    // 1 - beta1
  float beta2;
  float one_m_b2;    // 1 - beta2
  float step_size;   // lr / (1 - beta1^t)
  float inv_bc2;     // 1 / sqrt(1 - beta2^t)
  float eps;
};

MPK_HD AdamWConsts adamw_consts(double lr, double beta1, double beta2, double eps, double weight_decay,
                                double step) {
  AdamWConsts c;
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.one_m_b1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_m_b2 = static_cast<float>(1.0 - beta2);
  const uint32_t t = static_cast<uint32_t>(step);  // an integer count (float32 counters: <= 2^24)
  c.step_size = static_cast<float>(lr / (1.0 - pow_int(beta1, t)));
  c.inv_bc2 = static_cast<float>(1.0 / sqrt(1.0 - pow_int(beta2, t)));
  c.eps = static_cast<float>(eps);
  return c;
}

// adamw_update's first half: the new moments.
MPK_HD void adamw_moments(float g, float& m, float& v, const AdamWConsts& c) {
  m = fmaf(c.one_m_b1, g - m, m);
  v = fmaf(c.one_m_b2 * g, g, v * c.beta2);
}

// adamw_update's second half: the decay and step of p from the new m and vv (v, or vmax under amsgrad).
MPK_HD float adamw_step(float p, float m, float vv, const AdamWConsts& c) {
  const float denom = fmaf(sqrtf(vv), c.inv_bc2, c.eps);
  return fmaf(p, c.decay, -(c.step_size * m / denom));
}

// One element. `vmax` may be null (no amsgrad). Returns the new parameter (fp32 master) value.
MPK_HD float adamw_update(float p, float g, float& m, float& v, float* vmax, const AdamWConsts& c) {
  adamw_moments(g, m, v, c);
  float vv = v;
  if (vmax != nullptr) {
    *vmax = *vmax > v ? *vmax : v;
    vv = *vmax;
  }
  return adamw_step(p, m, vv, c);
}

// ---- adamw_step without sqrt's and division's rare-case paths (CUDA; the same bits inside the ranges) ----
// The ranges and why: docs/design.md, "The per-element arithmetic".
// Whether adamw_step_in_range may stand for adamw_step on a lane's elements: m_lo = min(bits(|m|) - 1) (a
// zero m counts as 0xffffffff, no bound), m_hi = max(bits(|m|)), v_lo = min(bits(v)), v_hi = max(bits(v)).
MPK_HD bool adamw_step_in_range_ok(uint32_t m_lo, uint32_t m_hi, uint32_t v_lo, uint32_t v_hi, const AdamWConsts& c) {
  // inv_bc2 in [1, 2^16], eps in [+0, 2^16], step_size +0..finite, beta2 in [+0, 1)
  const uint32_t ib = f32_bits(c.inv_bc2), eb = f32_bits(c.eps), sb = f32_bits(c.step_size);
  const bool consts = (ib - 0x3f800000u <= 0x08000000u) & (eb <= 0x47800000u) & (sb < 0x7f800000u) &
                      (f32_bits(c.beta2) < 0x3f800000u);
  const bool vs = (v_lo >= 0x0d000000u) & (v_hi < 0x5a800000u);  // [2^-101, 2^54)
  const uint32_t a_lo = f32_bits(c.step_size * f32_from_bits(m_lo + 1u));
  const uint32_t a_hi = f32_bits(c.step_size * f32_from_bits(m_hi));
  // every m +-0, or step_size * |m| in [2^-70, 2^40)
  const bool ms = (m_lo == 0xffffffffu) | ((a_lo >= 0x1c800000u) & (a_hi < 0x53800000u));
  return consts & vs & ms;
}

// sqrtf(v) for v in [2^-101, 2^54).
MPK_HD float sqrt_in_range(float v) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(v));  // MUFU.RSQ
  const float s = __fmul_rn(v, y), h = __fmul_rn(y, 0.5f);
  return __fmaf_rn(__fmaf_rn(-s, s, v), h, s);
#else
  return sqrtf(v);
#endif
}

// a / b for a in {+0} u [2^-70, 2^40), b in [2^-51, 2^44).
MPK_HD float div_in_range(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));  // MUFU.RCP
  r = __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r);
  const float q = __fmul_rn(a, r);
  return __fmaf_rn(r, __fmaf_rn(-b, q, a), q);
#else
  return a / b;
#endif
}

// adamw_step(p, m, vv, c) where adamw_step_in_range_ok holds for m and vv.
MPK_HD float adamw_step_in_range(float p, float m, float vv, const AdamWConsts& c) {
  const float denom = fmaf(sqrt_in_range(vv), c.inv_bc2, c.eps);
  const float q = div_in_range(c.step_size * fabsf(m), denom);
  return fmaf(p, c.decay, -f32_from_bits(f32_bits(q) | (f32_bits(m) & 0x80000000u)));
}

// ---- Random bits: ONE 32-bit word per element per step, a pure function of (seed, stream, element, step),
// split into the fields A, B and C. Format and bias bounds: docs/storage.md, "Randomness". ----
// mix32 after its first step (x ^= x >> 16).
MPK_HD uint32_t mix32_rest(uint32_t x) {
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

MPK_HD uint32_t mix32(uint32_t x) { return mix32_rest(x ^ (x >> 16)); }

enum RandPurpose : int { kRandParam = 0, kRandExpAvg = 1, kRandExpAvgSq = 2, kRandMaster8 = 3 };

// Field of a purpose: its lowest bit in the word and its width.
MPK_HD int rand_shift(int purpose) {
  return purpose == kRandExpAvg ? 10 : (purpose == kRandExpAvgSq ? 21 : 0);
}
MPK_HD int rand_width(int purpose) { return (purpose == kRandExpAvg || purpose == kRandExpAvgSq) ? 11 : 10; }

// The codecs' 16-bit value of a purpose's field of random word `word` (the centre of its cell).
MPK_HD uint32_t rand_field16(uint32_t word, int purpose) {
  const int w = rand_width(purpose);
  return (((word >> rand_shift(purpose)) & ((1u << w) - 1u)) << (16 - w)) | (1u << (15 - w));
}
// The same per field with constant shifts (what the vector paths compute):
MPK_HD uint32_t rand_a16(uint32_t word) { return ((word << 6) & 0xffc0u) + 0x20u; }   // param / master8
MPK_HD uint32_t rand_b16(uint32_t word) { return ((word >> 5) & 0xffe0u) + 0x10u; }   // exp_avg
MPK_HD uint32_t rand_c16(uint32_t word) { return ((word >> 16) & 0xffe0u) + 0x10u; }  // exp_avg_sq

MPK_HD uint32_t rng_key(uint32_t seed, uint32_t stream, uint32_t step, uint32_t elem_hi) {
  const uint32_t h = mix32(seed ^ mix32(stream * 0x9e3779b9u + step));
  return mix32(h ^ mix32(elem_hi * 0x85ebca6bu + 0x632be5abu));
}

MPK_HD uint32_t rng_bits(uint32_t key, uint32_t elem_lo) { return mix32(key ^ elem_lo); }

// rng_bits(key, lo + k) for k in [0, 8), lo a multiple of 8: lo + k = lo ^ k and k does not reach bit 16,
// so mix32's first step is taken once for the eight (rng_bits8_base), then one xor each. The same bits.
MPK_HD uint32_t rng_bits8_base(uint32_t key, uint32_t lo) { return (key ^ lo) ^ ((key ^ lo) >> 16); }
MPK_HD uint32_t rng_bits8_at(uint32_t base, uint32_t k) { return mix32_rest(base ^ k); }

// The key of one tensor at one step, for the elements whose high index half is `hi`; other
// elements (a chunk that crosses a multiple of 2^32) get their key computed on the fly.
struct RngKeys {
  uint32_t seed, stream, step, hi;
  uint32_t key;
};

MPK_HD RngKeys rng_keys(uint32_t seed, uint32_t stream, uint32_t step, uint64_t elem) {
  RngKeys k;
  k.seed = seed;
  k.stream = stream;
  k.step = step;
  k.hi = static_cast<uint32_t>(elem >> 32);
  k.key = rng_key(seed, stream, step, k.hi);
  return k;
}

// The random word of global element `elem`.
MPK_HD uint32_t rng_word(const RngKeys& k, uint64_t elem) {
  const uint32_t hi = static_cast<uint32_t>(elem >> 32);
  const uint32_t key = hi == k.hi ? k.key : rng_key(k.seed, k.stream, k.step, hi);
  return rng_bits(key, static_cast<uint32_t>(elem));
}

// The codecs' 16-bit value of `purpose` for global element `elem`.
MPK_HD uint32_t rand16(const RngKeys& k, int purpose, uint64_t elem) {
  return rand_field16(rng_word(k, elem), purpose);
}

// The same without precomputed keys (reference formula).
MPK_HD uint32_t rand16(uint32_t seed, uint32_t stream, uint64_t elem, uint32_t step, int purpose) {
  const uint32_t key = rng_key(seed, stream, step, static_cast<uint32_t>(elem >> 32));
  return rand_field16(rng_bits(key, static_cast<uint32_t>(elem)), purpose);
}

// ---- The 8-bit moments and the 4-bit exp_avg, "ladder" codes: docs/storage.md, "Formats, bit by bit" ----
constexpr int kMom8Group = 32;
static_assert(moment_group(kMom8) == kMom8Group && moment_group(kMom4) == kMom8Group,
              "mpkern/codecs.def: the compact codecs group 32 elements per scale");
constexpr uint32_t kMom8NaNScale = 0x7fc0u;

// A ladder format: its mantissa bits, and u_max's fp32 exponent and mantissa (for the scale).
struct Ladder {
  int mbits;
  int umax_exp;        // floor(log2(u_max))
  uint32_t umax_mant;  // the 23 mantissa bits of u_max
};
// (functions, not constants: device code may call them, it may not take a host constant's address)
MPK_HD constexpr Ladder ladder_m8() { return {4, 7, 0x770000u}; }  // u_max = 247   = 1.9296875 * 2^7
MPK_HD constexpr Ladder ladder_v8() { return {4, 15, 0x77ff00u}; }  // u_max = 63487 = 1.937469482421875 * 2^15
MPK_HD constexpr Ladder ladder_m4() { return {1, 3, 0x300000u}; }  // u_max = 11    = 1.375 * 2^3

// The bf16 scale bits of a group from its amax bits (|x| bits maxed unsigned: NaN > inf > finite).
MPK_HD uint32_t ladder_scale_bits(uint32_t amax_bits, Ladder f) {
  const int e = static_cast<int>((amax_bits + (0x7fffffu - f.umax_mant)) >> 23) - f.umax_exp;  // no wrap: bits < 2^31
  const uint32_t s = static_cast<uint32_t>(e < 1 ? 1 : e) << 7;
  // a group of zeros: scale 0, codes 0 (selects, no branches: the CUDA kernels take them per lane)
  return amax_bits >= 0x7f800000u ? kMom8NaNScale : (amax_bits == 0u ? 0u : s);
}

// 1 / s of a scale (exact; 2^127 for the zero scale); 0 for the NaN scale (its codes are zeroed).
MPK_HD float ladder_inv_scale(uint32_t scale_bits) {
  if (scale_bits == kMom8NaNScale) return 0.0f;
  return f32_from_bits((254u - (scale_bits >> 7)) << 23);
}

// u(q) * s from F(q)'s bit pattern f, s a scale (a power of two >= 2^-126, 0 or NaN); fused on CUDA (and
// in the vector kernels) as F * s - s, the same bits (docs/design.md, "The per-element arithmetic").
MPK_HD float ladder_value_scaled(uint32_t f, float s) {
#if defined(__CUDA_ARCH__)
  return fmaf(f32_from_bits(f), s, -s);
#else
  return (f32_from_bits(f) - 1.0f) * s;
#endif
}

// The magnitude code of |x| (ax) given inv = ladder_inv_scale(s) and 16 random bits (fused on CUDA: same bits).
MPK_HD uint32_t ladder_encode(float ax, float inv, uint32_t r16, int mbits) {
#if defined(__CUDA_ARCH__)
  const float z = fmaf(ax, inv, 1.0f);
#else
  const float z = ax * inv + 1.0f;
#endif
  return (f32_bits(z) + (r16 << (7 - mbits)) - 0x3f800000u) >> (23 - mbits);
}

// The sign bit of x moved to bit `at` of a code.
MPK_HD uint32_t sign_at(float x, int at) { return (f32_bits(x) >> 31) << at; }

// u(q) * s of a W-bit code in the top bits of y (the bits below ignored unless CLEAN says they are 0);
// SIGNED: bit 31 the sign, OR-ed in. F is built from the code's bits in place, so a kernel holding several
// codes in a word decodes code k after one shift or byte permute (CUDA's main loop).
template <int W, int MB, bool SIGNED, bool CLEAN = false>
MPK_HD float ladder_decode_top(uint32_t y, float s) {
  constexpr uint32_t kMag = (SIGNED ? (1u << (W - 1)) - 1u : (1u << W) - 1u) << (32 - W);
  const uint32_t mag = (CLEAN && !SIGNED) ? y : (y & kMag);
  const float x = ladder_value_scaled(0x3f800000u + (mag >> (9 - W + MB)), s);  // bits(1.0) + (q << (23 - MB))
  return SIGNED ? f32_from_bits(f32_bits(x) | (y & 0x80000000u)) : x;
}

MPK_HD float mom8_decode_m(uint8_t c, float s) {
  return ladder_decode_top<8, ladder_m8().mbits, true>(static_cast<uint32_t>(c) << 24, s);
}

MPK_HD float mom8_decode_v(uint8_t c, float s) {
  return ladder_decode_top<8, ladder_v8().mbits, false, true>(static_cast<uint32_t>(c) << 24, s);
}

// exp_avg code (sign-magnitude byte) of m given inv = ladder_inv_scale(s_m) and 16 random bits.
MPK_HD uint8_t mom8_encode_m(float m, float inv, uint32_t r16) {
  return static_cast<uint8_t>(ladder_encode(fabsf(m), inv, r16, ladder_m8().mbits) | sign_at(m, 7));
}

// exp_avg_sq code of v >= 0 given inv = ladder_inv_scale(s_v) and 16 random bits: at least 1 for v > 0
// (bits(v) > 0 exactly then; a NaN v's group has its codes zeroed either way).
MPK_HD uint8_t mom8_encode_v(float v, float inv, uint32_t r16) {
  const uint32_t q = ladder_encode(v, inv, r16, ladder_v8().mbits);
#if defined(__CUDA_ARCH__)
  uint32_t pos;  // one VIMNMX (the compiler turns a plain min(bits, 1) into a compare and a select)
  asm("min.u32 %0, %1, 1;" : "=r"(pos) : "r"(f32_bits(v)));
#else
  const uint32_t pos = f32_bits(v) < 1u ? f32_bits(v) : 1u;
#endif
  return static_cast<uint8_t>(q > pos ? q : pos);
}

// ---- The 4-bit exp_avg (kMom4): sign-magnitude nibbles, two per byte: docs/storage.md, "Formats, bit by bit" ----
// The nibble of element i from its byte.
MPK_HD uint32_t mom4_code(uint8_t byte, int64_t i) { return (i & 1) ? (byte >> 4) : (byte & 0xfu); }

MPK_HD float mom4_decode_m(uint32_t nib, float s) {
  return ladder_decode_top<4, ladder_m4().mbits, true>(nib << 28, s);
}

// The nibble of m given inv = ladder_inv_scale(s_m) and 16 random bits (rand_b16).
MPK_HD uint32_t mom4_encode_m(float m, float inv, uint32_t r16) {
  return ladder_encode(fabsf(m), inv, r16, ladder_m4().mbits) | sign_at(m, 3);
}

// The byte of the nibbles of elements 2j (c0) and 2j + 1 (c1).
MPK_HD uint8_t mom4_pack(uint32_t c0, uint32_t c1) { return static_cast<uint8_t>((c0 & 0xfu) | ((c1 & 0xfu) << 4)); }

// ---- The 8-bit master correction (kMaster8bit): the 16-bit param and an int8 correction, encoded from
// field A of the element's random word: docs/storage.md, "Formats, bit by bit" ----
// 2^k as a float for k in [-126, 127] (a normal float: one shift of the exponent field).
MPK_HD float pow2n(int k) { return f32_from_bits(static_cast<uint32_t>(k + 127) << 23); }

// max(e, 1) of an fp16 param bit pattern: the binade of its ulp.
MPK_HD int f16_binade(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  return e > 1 ? e : 1;
}

MPK_HD float master8_decode(uint16_t h, int8_t c, int32_t pdt) {
  if (pdt == kBF16)
    return f32_from_bits((static_cast<uint32_t>(h) << 16) + static_cast<uint32_t>(static_cast<int32_t>(c) * 256));
  return f16_to_f32(h) + static_cast<float>(c) * pow2n(f16_binade(h) - 33);  // c * 2^(b - 33)
}

// bf16, w not NaN: the 8 random bits u8 given directly (word & 0xff; 0x80 rounds to nearest).
MPK_HD void master8_encode_bf16_num(float w, uint32_t u8, uint16_t& h, int8_t& c) {
  const uint32_t t = f32_bits(w) + u8;
  c = static_cast<int8_t>(static_cast<uint8_t>(t >> 8));
  h = static_cast<uint16_t>((t + 0x8000u) >> 16);
}

// bf16, any w (a NaN keeps its sign and is made quiet).
MPK_HD void master8_encode_bf16(float w, uint32_t u8, uint16_t& h, int8_t& c) {
  const uint32_t u = f32_bits(w);
  master8_encode_bf16_num(w, u8, h, c);
  if ((u & 0x7fffffffu) > 0x7f800000u) h = static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: quiet, same sign
}

// fp16: r16 = 16 random bits (rand_a16; 0x8000 rounds to nearest).
MPK_HD void master8_encode_f16(float w, uint32_t r16, uint16_t& h, int8_t& c) {
  h = f32_to_f16_rne(w);
  const float p = f16_to_f32(h);
  if (nonfinite(p)) {
    c = 0;
    return;
  }
  const float x = (w - p) * pow2n(33 - f16_binade(h));  // d * 256 / ulp, exact
  float r = floorf(x + static_cast<float>(r16) * (1.0f / 65536.0f));
  r = r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r);
  c = static_cast<int8_t>(static_cast<int>(r));
}

// The param and correction of master w from the element's random word.
MPK_HD void master8_encode(float w, int32_t pdt, uint32_t word, uint16_t& h, int8_t& c) {
  if (pdt == kBF16) {
    master8_encode_bf16(w, word & 0xffu, h, c);
  } else {
    master8_encode_f16(w, rand_a16(word), h, c);
  }
}

}  // namespace mpkern
