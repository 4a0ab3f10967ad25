// mpkern per-element math, shared by the CPU and CUDA kernels.
//
// Header-only, no torch headers. Every function here is `MPK_HD`: __host__ __device__ inline
// under nvcc, plain inline under a host compiler, so the CPU tests exercise exactly the
// arithmetic the GPU runs. The Triton kernels in mpkern/triton_kernels mirror these formulas.
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

// ----------------------------------------------------------------------------------------------
// Bit casts.
// ----------------------------------------------------------------------------------------------
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

// ----------------------------------------------------------------------------------------------
// bfloat16 <-> float. bf16 is the high half of an fp32 bit pattern.
// ----------------------------------------------------------------------------------------------
MPK_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even (what `tensor.to(torch.bfloat16)` does). NaN stays NaN (quiet),
// keeping its sign; overflow rounds to inf.
MPK_HD uint16_t f32_to_bf16_rne(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Stochastic rounding: add 16 random bits below the kept part, then truncate. Unbiased:
// E[bf16_to_f32(result)] == f for finite f (P(round up) = dropped bits / 2^16).
// inf/NaN are passed through (NaN quieted).
MPK_HD uint16_t f32_to_bf16_sr(float f, uint32_t rand16) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    if (u & 0x007fffffu) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    return static_cast<uint16_t>(u >> 16);
  }
  u += (rand16 & 0xffffu);
  return static_cast<uint16_t>(u >> 16);
}

// ----------------------------------------------------------------------------------------------
// IEEE half <-> float. Software versions for the host; the device uses the hardware conversion
// (round to nearest even in both, so the results are bit-identical).
// ----------------------------------------------------------------------------------------------
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

// ----------------------------------------------------------------------------------------------
// Element codes used in the multi-tensor tables (same numbering in Python).
// ----------------------------------------------------------------------------------------------
enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
// The moment modes (codecs.h, from mpkern/codecs.def): a dense codec's mode is its moments' dtype code
// (the kernels load and store them by it); kMom8 the 8-bit ladder codes (int8 exp_avg + uint8
// exp_avg_sq + bf16 scales), kMom4 the 4-bit exp_avg + 8-bit exp_avg_sq (mom4_* below).
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

// (The gradient statistics -- sum of squares, max |x| -- are in norm.h: one reduction order on
// every backend.)

// ----------------------------------------------------------------------------------------------
// bf16 master remainder ("remainder" master weights). The fp32 master m is stored as a bf16
// high half h and a signed 16-bit remainder r with bits(m) == (h << 16) + r. h is m rounded to
// nearest with ties away from zero (a remainder of +0x8000 does not fit in int16), which equals
// round-to-nearest-even except on exact ties.
// ----------------------------------------------------------------------------------------------
MPK_HD void split_master(float m, uint16_t& hi, int16_t& rem) {
  const uint32_t u = f32_bits(m);
  hi = static_cast<uint16_t>((u + 0x8000u) >> 16);  // round half away from zero (in magnitude)
  rem = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));  // low half, read as signed
}

MPK_HD float join_master(uint16_t hi, int16_t rem) {
  return f32_from_bits((static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(rem)));
}

// ----------------------------------------------------------------------------------------------
// AdamW (decoupled weight decay), the update torch.optim.AdamW performs, per element, in fp32, with
// fused multiply-adds (fma: one rounding) where torch rounds twice:
//   g  = grad * grad_factor                  (grad_factor = inv_scale * clip_coef; negated if maximize)
//   m  = fma(1 - beta1, g - m, m)            (lerp)
//   v  = fma((1 - beta2) * g, g, beta2 * v)
//   vm = max(vm, v)                           (amsgrad only; the denominator then uses vm)
//   q  = step_size * m / fma(sqrt(v), inv_bc2, eps)
//   p  = fma(p, 1 - lr * weight_decay, -q)   (the decay and the step in one rounding)
// Four roundings per element fewer than torch's sequence (each result within an ulp of it), the same
// on every backend: fmaf in C++ / CUDA, the FMA intrinsics in the vector kernels, tl.fma in Triton
// (emulated exactly under its interpreter) and reference_codecs.fma32 in the torch reference.
// with step_size = lr / (1 - beta1^t) and inv_bc2 = 1 / sqrt(1 - beta2^t) computed in fp64 per
// tensor from its step count t (after the increment). beta^t is pow_int's, not the libm pow (whose
// last bit differs between glibc, CUDA's and others): every backend does the same fp64 multiplies.
// ----------------------------------------------------------------------------------------------
// b^n by binary exponentiation in fp64, in one fixed order: for each bit of n from the lowest, the
// running power b^(2^k) multiplies the result when the bit is set, then is squared (IEEE
// multiplies only, so the C++ host and device code, Triton and the torch reference agree bit for bit).
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
  float inv_bc2;     // 1 / sqrt(1 - beta2^t): one division per element fewer than torch's
                     // sqrt(v) / bc2_sqrt, within 1 ulp of it
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

// ----------------------------------------------------------------------------------------------
// adamw_step without the IEEE square root's and division's rare cases (CUDA; the same bits).
// nvcc's IEEE sqrtf and division are a fast path -- MUFU.RSQ / MUFU.RCP and a few FMAs -- behind a
// range check (an integer compare / FCHK), plus the branch and call of a slow path for zeros,
// subnormals, huge or non-finite values: ~27 instructions per element in the compact kernels' loop, ~9
// of them the slow paths' scaffolding. A compact kernel checks once per lane and pass that every value
// of its 8 elements lies inside the ranges below, then runs the fast paths alone (adamw_step_in_range);
// else adamw_step. The fast paths are nvcc's own instruction sequences, MUFU included, so inside nvcc's
// range checks they give what its IEEE operations give there -- the IEEE result. (Their correctness rests
// on MUFU's exact outputs, not only on an error bound: with the estimate one ulp off, the square root
// misrounds 3 of the 2^24 values of [1, 4) and the division hard cases like 2^k / (2 - 2^-23) -- hence
// exact copies, not variants.) The ranges:
// * sqrt_in_range(v), v in [2^-101, 2^54): inside nvcc's check, bits(v) - 0x0d000000 <= 0x727fffff
//   (every positive normal v >= 2^-101; the SASS of any sqrtf shows it).
// * div_in_range(a, b), a in {+0} u [2^-70, 2^40), b in [2^-51, 2^44): the quotient in (2^-114, 2^91),
//   the reciprocal in (2^-44, 2^51], the remainder 0 or at least 2^-117 (exact) -- every value at
//   least 9 binades from both ends of the normal range, well inside what FCHK (undocumented: it screens
//   the operands' exponents) passes to the fast path; a +0 numerator gives +0 through the sequence's own
//   arithmetic (tests/test_math.py emulates the sequence over these ranges).
// * the denominator fma(sqrt(v), inv_bc2, eps) is in [2^-51, 2^44) when v is in [2^-101, 2^54), inv_bc2
//   in [1, 2^16] (it is 1 / sqrt(1 - beta2^t) >= 1) and eps in [0, 2^16];
// * the numerator: step_size * m is divided as step_size * |m| (|a| rounds as a does) with m's sign
//   put back, so a -0 numerator gives -0 as the IEEE division does, and the range of step_size * |m|
//   follows from the lane's least nonzero and largest |m| (rounding is monotonic).
// ----------------------------------------------------------------------------------------------
// Whether adamw_step_in_range may stand for adamw_step on a lane's elements, from the bit patterns of
// their |m| and v: m_lo = min(bits(|m|) - 1) (unsigned: a zero m counts as 0xffffffff, no bound), m_hi =
// max(bits(|m|)), v_lo = min(bits(v)), v_hi = max(bits(v)) -- v >= 0 where beta2 is in [0, 1), which the
// check asks (the op itself takes any beta2, and a negative v would pass the bit-pattern bounds).
// Bitwise ands: no branches.
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

// sqrtf(v) for v in [2^-101, 2^54) (above).
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

// a / b for a in {+0} u [2^-70, 2^40), b in [2^-51, 2^44) (above).
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

// ----------------------------------------------------------------------------------------------
// Counter-based random bits: ONE 32-bit word per element per step, a pure function of
// (seed, stream, element, step), so a run is reproducible and resumable and every backend draws
// the same bits.
//   stream  : the caller's stream id of the tensor (default: its index in the list);
//   element : elem_offset + i, 64-bit (a shard passes its global flat offset, so it draws the bits
//             the unsharded tensor would);
//   step    : the tensor's step count after the increment.
// The word is
//   key  = mix32(mix32(seed ^ mix32(stream * 0x9e3779b9 + step))
//                ^ mix32(element_hi * 0x85ebca6b + 0x632be5ab))
//   word = mix32(key ^ element_lo)
// key depends only on (seed, stream, step, element >> 32): kernels compute it once per chunk, so
// an element costs one mix32 (two 32-bit multiplies) for all its stochastic roundings.
//
// The word is split into three disjoint fields, one per rounding an element can need in a step
// (bit 0 = least significant):
//   A  bits  0..9  (10 bits): kRandParam (bf16 param SR, no master) or kRandMaster8 (the 8-bit
//                              master correction) -- never both in one mode;
//   B  bits 10..20 (11 bits): kRandExpAvg   (bf16 exp_avg SR, or the 8-bit exp_avg code);
//   C  bits 21..31 (11 bits): kRandExpAvgSq (bf16 exp_avg_sq SR, or the 8-bit exp_avg_sq code).
// The bits of a mix32 output are (to the hash's quality) independent, so the three roundings of
// an element are independent. A w-bit field f is handed to the codecs as a 16-bit value
//   r16 = (f << (16 - w)) | (1 << (15 - w))      (rand16 below)
// i.e. the centre of the f-th of 2^w equal cells of [0, 2^16): every codec keeps its 16-bit
// interface, and the rounding is decided by comparing a probability p against (f + 1/2) / 2^w.
// Bias bound of each use, in units of the format's step (the distance between the two values
// the rounding chooses between): P(round up) = round(p * 2^w) / 2^w, so |bias| <= 2^-(w+1) step,
// and it averages to zero over the fractions p a value passes through:
//   * bf16 SR (param, 10 bits): |bias| <= 2^-11 bf16 ulp; (exp_avg / exp_avg_sq, 11 bits): 2^-12 ulp
//     (an fp32 value has 16 bits below the bf16 ulp; fractions finer than the field are rounded to
//     the nearest cell centre instead of truncated, so the bound is symmetric);
//   * 8-bit moment codes (11 bits): |bias| <= 2^-12 of the gap between the two neighbouring code
//     values (plus the fp32 rounding of y + 1 in the ladder encoder, relative 2^-24);
//   * 8-bit master correction: exact, no bias. bf16 params use bits 0..7 of the field: the master's
//     fp32 bit pattern is rounded to a multiple of 256, an integer with 8 bits below the code
//     unit, so adding 8 random bits and truncating goes up with probability exactly
//     (bits mod 256) / 256. fp16 params use all 10 bits: the error x has at most 9 bits below 1
//     (master8_* below), so floor(x + u) with u = r16 / 2^16 (11 significant bits below 1) goes
//     up with probability exactly frac(x); below fp16's smallest normal (a param under 6.1e-5)
//     |bias| <= 2^-11 code unit = 2^-43 absolute.
// The widths: the bias of a w-bit field is at most 2^-(w+1) of a step while the rounding's own
// noise is up to step / 2 per element and step; over the 1 / (1 - beta2) ~ 1000 steps an EMA
// remembers, a systematic 2^-12 step stays below a quarter step, and it is not systematic:
// the fraction p of a moment moves every step.
// ----------------------------------------------------------------------------------------------
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

// The codecs' 16-bit value of a purpose's field of random word `word` (cell centre, see above).
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

// rng_bits(key, lo + k) for k in [0, 8) and lo a multiple of 8, in two parts: lo + k = lo ^ k, and k does
// not reach bit 16, so mix32's first step is (key ^ lo) ^ ((key ^ lo) >> 16) ^ k -- taken once for the
// eight (rng_bits8_base), then one xor each (rng_bits8_at). The same bits, two operations fewer each.
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

// ----------------------------------------------------------------------------------------------
// 8-bit moments (exp_avg int8, exp_avg_sq uint8) and the 4-bit exp_avg: "ladder" codes, one bf16
// scale per group of 32 consecutive elements of a tensor's buffer (group j = elements [32j, 32j + 32),
// from element 0). Codec 2 (issue 43): built to cost a few integer operations per element.
//
// A ladder with b mantissa bits maps an unsigned code q to the value
//   u(q) = F(q) - 1,   F(q) = the fp32 number with bit pattern bits(1.0) + (q << (23 - b)),
// i.e. F runs through the fp32 numbers >= 1 that have b mantissa bits: u is 0, 2^-b, 2 * 2^-b, ...
// with a step of 2^-b below 1, then doubling every 2^b codes (a float with b mantissa bits whose
// "subnormals" are the first binade, shifted so that code 0 is 0). An element is stored as
// x = u(q) * s, with s the group's scale, a power of two:
//   exp_avg    (8-bit): b = 4, q in [0, 127] (u <= 247), sign-magnitude int8: bit 7 = the sign;
//   exp_avg_sq (8-bit): b = 4, q in [0, 255] (u <= 63487), unsigned;
//   exp_avg    (4-bit): b = 1, q in [0, 7]   (u in {0, 1/2, 1, 2, 3, 5, 7, 11}), sign-magnitude
//                       nibble: bit 3 = the sign; two per byte (below).
// Relative precision 2^-b .. 2^-(b+1) of a step over 2^7 (exp_avg) and 2^15 (exp_avg_sq) below the
// group maximum (the exp_avg_sq range is the square of the exp_avg one, as v ~ g^2, m ~ g), then a
// linear tail of steps 2^-b s down to 0.
// * Scale: the smallest power of two s = 2^e with amax / s <= u_max (the group's maximum |x| fits
//   the top code), e >= -126 (s and 1 / s normal); from amax's bits with integer operations only:
//   biased e = ((bits(amax) + 0x7fffff - mant(u_max)) >> 23) - exp(u_max) (the carry is 1 exactly
//   when amax's mantissa exceeds u_max's), at least 1. Stored as bf16 (a power of two is exact). A
//   group of zeros has the scale 0 (its 1 / s is 2^127: every code 0).
//   A non-finite moment in a group gives the scale NaN (0x7fc0) and every code of the group 0
//   (the kernels zero the group's codes): the group decodes as NaN, as fp32 AdamW would hold NaN.
// * Encode x (finite, |x| <= amax): y = |x| * (1 / s) is exact (a power of two; a y below 2^-126
//   may flush, it does not matter: y + 1 rounds to 1 either way); z = y + 1 (one fp32 rounding,
//   to nearest even, relative 2^-24); then stochastic rounding of z to b mantissa bits by adding
//   the dither below the kept bits and truncating (as bf16 SR does):
//     q = ((bits(z) + (r16 << (7 - b))) - bits(1.0)) >> (23 - b)
//   with r16 the 16 random bits of the codecs (rand_b16 / rand_c16: an 11-bit field at the cell
//   centre, 0x8000 = round to nearest, ties up). Unbiased in value: inside a binade of z the codes'
//   values are evenly spaced and bits(z) is a linear function of z, so q goes up with probability
//   (the dropped bits) / 2^(23-b) -- to 2^-12 of a step, the field's resolution (math of rand_field16
//   above) -- and a binade's top is the next binade's first code. z <= u_max + 1 = F(q_max) exactly
//   (fp32-representable), whose dropped bits are 0: no code past q_max, no clamp.
//   exp_avg_sq: a positive v gets at least code 1 (keeps m / sqrt(v) bounded; a small upward bias
//   below one linear step).
// * Decode: u(q) from the bit pattern (an integer add, one exact fp32 subtract), times s (exact), the
//   sign bit of the code OR-ed in. A NaN scale gives NaN.
// Per element: encode 5-7 integer / fp32 operations, decode 4-5, no division, root or conversion.
// ----------------------------------------------------------------------------------------------
constexpr int kMom8Group = 32;
static_assert(moment_group(kMom8) == kMom8Group && moment_group(kMom4) == kMom8Group,
              "mpkern/codecs.def: the compact codecs group 32 elements per scale");
constexpr uint32_t kMom8NaNScale = 0x7fc0u;

// A ladder format: its mantissa bits, and u_max's fp32 exponent and mantissa (for the scale; the top
// code needs no field: no encoding goes past it).
struct Ladder {
  int mbits;
  int umax_exp;        // floor(log2(u_max))
  uint32_t umax_mant;  // the 23 mantissa bits of u_max
};
// (functions, not constants: device code may call them, it may not take a host constant's address)
MPK_HD constexpr Ladder ladder_m8() { return {4, 7, 0x770000u}; }  // u_max = 247   = 1.9296875 * 2^7
MPK_HD constexpr Ladder ladder_v8() { return {4, 15, 0x77ff00u}; }  // u_max = 63487 = 1.937469482421875 * 2^15
MPK_HD constexpr Ladder ladder_m4() { return {1, 3, 0x300000u}; }  // u_max = 11    = 1.375 * 2^3

// The bf16 scale bits of a group from its amax bits (|x| as (bits & 0x7fffffff), maxed unsigned:
// NaN above inf above every finite value).
MPK_HD uint32_t ladder_scale_bits(uint32_t amax_bits, Ladder f) {
  const int e = static_cast<int>((amax_bits + (0x7fffffu - f.umax_mant)) >> 23) - f.umax_exp;  // no wrap: bits < 2^31
  const uint32_t s = static_cast<uint32_t>(e < 1 ? 1 : e) << 7;
  // a group of zeros: scale 0, codes 0 (selects, no branches: the CUDA kernels take them per lane)
  return amax_bits >= 0x7f800000u ? kMom8NaNScale : (amax_bits == 0u ? 0u : s);
}

// 1 / s of a scale (exact: a power of two; 2^127 for the zero scale); 0 for the NaN scale (whose
// group's codes are zeroed).
MPK_HD float ladder_inv_scale(uint32_t scale_bits) {
  if (scale_bits == kMom8NaNScale) return 0.0f;
  return f32_from_bits((254u - (scale_bits >> 7)) << 23);
}

// u(q) * s from F(q)'s bit pattern f, s a scale (a power of two >= 2^-126, 0 or NaN). CUDA (and the
// AVX2 / AVX-512 kernels, with their FMA intrinsics) computes it as F * s - s in one rounding: F - 1 is
// exact (F in [1, 2^9), 4 mantissa bits) and so is (F - 1) * s (a multiple of 2^-130, below 2^137: a normal or subnormal
// float, or past the range either way), so the fused form rounds the same exact value -- the same
// bits (0 * s - 0 = +0; a NaN s gives NaN), one operation fewer. (F * s - s in two roundings could
// overflow where (F - 1) * s does not: the unfused form stays.)
MPK_HD float ladder_value_scaled(uint32_t f, float s) {
#if defined(__CUDA_ARCH__)
  return fmaf(f32_from_bits(f), s, -s);
#else
  return (f32_from_bits(f) - 1.0f) * s;
#endif
}

// The magnitude code of |x| (ax) given inv = ladder_inv_scale(s) and 16 random bits. z = ax * inv + 1
// in one rounding (CUDA, the AVX2 / AVX-512 kernels) or two is the same: ax * inv is exact (inv a
// power of two) unless it falls below 2^-126, and then z rounds to 1 either way.
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

// The value of a W-bit code held in the top bits of y (bits 31 - W + 1 .. 31; the bits below are ignored
// unless CLEAN says they are 0): u(q) * s with, SIGNED, bit 31 the sign (OR-ed in: a -0 code decodes as
// -0). u(q)'s F from the code's bits in place -- the magnitude masked and shifted to F's mantissa field,
// one add of bits(1.0) -- so a kernel holding four or eight codes in a word decodes code k after one
// shift (or byte permute) of the word: CUDA's main loop.
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

// exp_avg_sq code of v >= 0 given inv = ladder_inv_scale(s_v) and 16 random bits: at least 1 for v > 0,
// as max(q, min(bits(v), 1)) -- v >= +0, so bits(v) > 0 exactly when v > 0 (a NaN v: its group's codes
// are zeroed either way).
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

// ----------------------------------------------------------------------------------------------
// 4-bit exp_avg (moment code kMom4, with the 8-bit exp_avg_sq above): the b = 1 ladder, a sign-
// magnitude nibble per element, one bf16 scale per group of 32 elements (the 8-bit groups), rounded
// stochastically from the same 11-bit field (B) of the element's random word. Two codes per byte:
// element 2j in the low nibble of byte j, element 2j + 1 in the high nibble; a tensor of n elements
// has ceil(n / 2) bytes and the high nibble of an odd n's last byte is 0. A group starts at an even
// element, so the two codes of a byte always belong to one group (and one work item: work items
// are whole groups).
// ----------------------------------------------------------------------------------------------
// The nibble (sign-magnitude code) of element i from its byte.
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

// ----------------------------------------------------------------------------------------------
// 8-bit master correction (master_mode 3, bf16/fp16 params): the 16-bit param p and an int8
// correction c. The encoder takes the element's random word (field A, rand_* above).
//
// bf16 params -- in the bit domain. The master is the fp32 bit pattern M rounded stochastically
// to a multiple of 2^8 (sign, exponent and 15 mantissa bits kept):
//   t = bits(w) + (word & 0xff),   M = t & ~0xff           (floor((bits + u8) / 256) * 256)
// stored as its high half rounded to nearest (ties away from zero) -- the param -- and the signed
// byte of bits 8..15, so that
//   h = (t + 0x8000) >> 16,   c = (int8)(t >> 8),   bits(master) = (h << 16) + 256 * c.
// (If byte 1 of M is >= 0x80, h carries one up and c = byte - 256: the sum is M either way.)
// Every multiple of 256 is representable, so no clamp. Unbiased exactly: bits(w) mod 256 is an
// integer, so t crosses the next multiple of 256 with probability exactly (bits mod 256) / 256,
// and fp32 bit patterns are evenly spaced in value inside a binade, while a power of two is a
// multiple of 256 (so the two candidates never straddle a change of spacing). The resolution is
// 256 fp32 ulps of the master's binade = 1/256 of the bf16 ulp. The param is the bf16 nearest to
// the stored master (a tie goes away from zero), so it can differ from RNE(w) by one ulp when w
// is within 1/256 ulp of a midpoint. Three integer operations per element, no float rounding.
// A NaN master keeps its NaN param (quiet, same sign, like f32_to_bf16_rne) and c = (int8)(t >> 8);
// an inf master has c = 0; a finite master beyond bf16's range keeps its finite value with an inf
// param (what .to(torch.bfloat16) gives).
//
// fp16 params -- in value: master = p + c * ulp(p) / 256 with ulp(p) = 2^(max(e,1)-15-10), e the
// biased exponent field, p = RNE(w); decoding is exact in fp32 (11 + 8 significant bits); the
// remaining error x = (w - p) * 256 / ulp(p) (exact: a difference of neighbours, a power-of-two
// scaling; |x| <= 128) is rounded stochastically, c = floor(x + u), u = rand_a16(word) / 2^16 --
// exact and unbiased for a normal param because x has at most 9 bits below 1 (below fp16's
// smallest normal the sum x + u may round, a < 2^-16 effect), except where it is clamped to
// [-128, 127]: x in (127, 128] (w within 1/256 ulp below a midpoint that rounded down) can round
// to 128 and is stored as 127 (a bias below 1/256 ulp in that sliver). A non-finite param gets c = 0.
// ----------------------------------------------------------------------------------------------
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
