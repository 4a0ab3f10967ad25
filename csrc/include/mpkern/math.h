// mpkern per-element math, shared by the CPU and CUDA kernels.
//
// Header-only, no torch headers. Every function here is `MPK_HD`: __host__ __device__ inline
// under nvcc, plain inline under a host compiler, so the CPU tests exercise exactly the
// arithmetic the GPU runs. The Triton kernels in mpkern/triton_kernels mirror these formulas.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

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
// Moment "dtype" code of the 8-bit companded moments (int8 exp_avg + uint8 exp_avg_sq + bf16 scales).
constexpr int32_t kMom8 = 8;
// ... of the 4-bit exp_avg + 8-bit exp_avg_sq moments (uint8 exp_avg of two codes per byte + uint8
// exp_avg_sq + bf16 scales; mom4_* below).
constexpr int32_t kMom4 = 9;

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
// AdamW (decoupled weight decay), the update torch.optim.AdamW performs, per element, in fp32:
//   g  = grad * grad_factor            (grad_factor = inv_scale * clip_coef; negated if maximize)
//   p  = p * (1 - lr * weight_decay)
//   m  = m + (1 - beta1) * (g - m)     (lerp)
//   v  = v * beta2 + (1 - beta2) * g * g
//   vm = max(vm, v)                     (amsgrad only; the denominator then uses vm)
//   p  = p - step_size * m / (sqrt(v) * inv_bc2 + eps)
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

// One element. `vmax` may be null (no amsgrad). Returns the new parameter (fp32 master) value.
MPK_HD float adamw_update(float p, float g, float& m, float& v, float* vmax, const AdamWConsts& c) {
  p = p * c.decay;
  m = m + c.one_m_b1 * (g - m);
  v = v * c.beta2 + c.one_m_b2 * g * g;
  float vv = v;
  if (vmax != nullptr) {
    *vmax = *vmax > v ? *vmax : v;
    vv = *vmax;
  }
  const float denom = sqrtf(vv) * c.inv_bc2 + c.eps;
  return p - c.step_size * m / denom;
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
//     values (plus the fp32 rounding of r16 * w, relative 2^-24);
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
MPK_HD uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

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
MPK_HD uint32_t rand_a16(uint32_t word) { return ((word << 6) & 0xffc0u) | 0x20u; }   // param / master8
MPK_HD uint32_t rand_b16(uint32_t word) { return ((word >> 5) & 0xffe0u) | 0x10u; }   // exp_avg
MPK_HD uint32_t rand_c16(uint32_t word) { return ((word >> 16) & 0xffe0u) | 0x10u; }  // exp_avg_sq

MPK_HD uint32_t rng_key(uint32_t seed, uint32_t stream, uint32_t step, uint32_t elem_hi) {
  const uint32_t h = mix32(seed ^ mix32(stream * 0x9e3779b9u + step));
  return mix32(h ^ mix32(elem_hi * 0x85ebca6bu + 0x632be5abu));
}

MPK_HD uint32_t rng_bits(uint32_t key, uint32_t elem_lo) { return mix32(key ^ elem_lo); }

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
// 8-bit companded moments (exp_avg int8, exp_avg_sq uint8), one bf16 scale per group of 32
// consecutive elements of a tensor's buffer (group j = elements [32j, 32j + 32), from element 0).
//   exp_avg    m = sign(c) * s_m * c^2        c in [-127, 127]   (s_m * (f * |f|), f = float(c))
//   exp_avg_sq v = (s_v * c^2) * c^2          c in [0, 255]
// Decoding is exact in fp32 for m (8 + 14 significant bits), one rounding for v. After the update
// of a group, its scales are s = bf16_round_up(amax * K) with amax the largest |x| of the group
// (as raw bits: an unsigned max that puts NaN above inf above every finite value), K_M = 1/127^2,
// K_V = 1/255^4 (fp32): the group maximum maps to the top code (or one below it, from rounding
// the scale up). A non-finite moment in a group gives the scale NaN (0x7fc0) and codes 0: the
// group decodes as NaN, as fp32 AdamW would hold NaN moments.
// Encoding rounds stochastically between the neighbouring codes k and k + 1, unbiased in value:
// y = |x| / s (as |x| * (1 / s), one division per group) lies in [q(k), q(k + 1)) with
// q(k) = k^2 (m) or k^4 (v, in fp32), and the code is k + 1 with probability (y - q(k)) /
// (q(k + 1) - q(k)), decided as r16 * w < d * 2^16 with 16 random bits r16 (r16 = 0x8000: round to
// nearest value, ties down). A positive v always gets a code >= 1 (a v below one code unit is
// stored one unit up, a small upward bias that keeps m / sqrt(v) bounded). A zero scale (a group
// of zeros, or an amax so small that amax * K underflows) gives codes 0. Limitation: a scale below
// 2^-128 (amax_v < ~1.2e-29, amax_m < ~4.7e-35) has 1 / s = inf and every non-zero element of the
// group takes the top code.
// ----------------------------------------------------------------------------------------------
constexpr int kMom8Group = 32;
constexpr float kMom8KM = 0x1.040c2p-14f;   // fp32(1 / 127^2)
constexpr float kMom8KV = 0x1.040a14p-32f;  // fp32(1 / 255^4)
constexpr uint32_t kMom8NaNScale = 0x7fc0u;

// bf16 bits of x >= 0 rounded up (towards +inf) to a bf16 value.
MPK_HD uint32_t bf16_round_up_bits(float x) {
  uint32_t b = f32_bits(x);
  if (b & 0xffffu) b += 0x10000u;
  return b >> 16;
}

// The bf16 scale bits of a group from its amax bits (|x| as (bits & 0x7fffffff), maxed unsigned).
MPK_HD uint32_t mom8_scale_bits(uint32_t amax_bits, float k) {
  if (amax_bits >= 0x7f800000u) return kMom8NaNScale;
  return bf16_round_up_bits(f32_from_bits(amax_bits) * k);
}

// The per-group multiplier of the encoders: 1 / s, or 0 for a zero or NaN scale (codes 0).
MPK_HD float mom8_inv_scale(uint32_t scale_bits) {
  if (scale_bits == 0u || scale_bits == kMom8NaNScale) return 0.0f;
  return 1.0f / bf16_to_f32(static_cast<uint16_t>(scale_bits));
}

MPK_HD float mom8_decode_m(int8_t c, float s) {
  const float f = static_cast<float>(c);
  return s * (f * fabsf(f));
}

MPK_HD float mom8_decode_v(uint8_t c, float s) {
  const float f = static_cast<float>(c);
  const float f2 = f * f;
  return (s * f2) * f2;
}

// Estimates of sqrt(y) and y^(1/4) for the code searches below, which take the floor of the
// estimate and correct it by one step down and one step up against exact fp32 squares: every
// estimate within 1 of the true root gives the same code, so the device may use the hardware
// approximations (MUFU, relative error below 2^-21; y < 2^33 there, roots below 256) where the host
// uses the IEEE roots, and the codes stay bit-identical.
MPK_HD float root2_est(float y) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(y));
  return r;
#else
  return sqrtf(y);
#endif
}

MPK_HD float root4_est(float y) {
#if defined(__CUDA_ARCH__)
  float r, q;
  asm("rsqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(y));  // y^(-1/2)
  asm("rsqrt.approx.f32 %0, %1;" : "=f"(q) : "f"(r));  // y^(1/4)
  return q;
#else
  return sqrtf(sqrtf(y));
#endif
}

// exp_avg code of m given inv = the inverse scale and 16 random bits, for the square law with top
// code `top` (127: 8-bit, 7: 4-bit): the code c in [-top, top] with m = sign(c) * s * c^2.
MPK_HD int mom_encode_sq(float m, float inv, uint32_t r16, float top) {
  const float y = fabsf(m) * inv;
  if (!(y > 0.0f)) return 0;  // zero, or a zero / NaN-scale group (inv 0)
  float c;
  if (y >= top * top) {
    c = top;
  } else {
    float k = floorf(root2_est(y));
    if (k * k > y) k = k - 1.0f;
    if ((k + 1.0f) * (k + 1.0f) <= y) k = k + 1.0f;
    const float d = y - k * k;
    const float w = 2.0f * k + 1.0f;
    c = static_cast<float>(r16) * w < d * 65536.0f ? k + 1.0f : k;
  }
  return static_cast<int>(m < 0.0f ? -c : c);
}

// exp_avg code of m given inv = mom8_inv_scale(s_m) and 16 random bits.
MPK_HD int8_t mom8_encode_m(float m, float inv, uint32_t r16) {
  return static_cast<int8_t>(mom_encode_sq(m, inv, r16, 127.0f));
}

MPK_HD float mom8_q4(float k) {
  const float k2 = k * k;
  return k2 * k2;
}

// exp_avg_sq code of v >= 0 given inv = mom8_inv_scale(s_v) and 16 random bits.
MPK_HD uint8_t mom8_encode_v(float v, float inv, uint32_t r16) {
  const float y = v * inv;
  if (!(y > 0.0f)) return 0;
  float c;
  if (y >= mom8_q4(255.0f)) {
    c = 255.0f;
  } else {
    float k = floorf(root4_est(y));
    if (mom8_q4(k) > y) k = k - 1.0f;
    if (mom8_q4(k + 1.0f) <= y) k = k + 1.0f;
    const float q = mom8_q4(k);
    const float d = y - q;
    const float w = mom8_q4(k + 1.0f) - q;
    c = static_cast<float>(r16) * w < d * 65536.0f ? k + 1.0f : k;
    c = c < 1.0f ? 1.0f : c;  // y > 0: at least one code unit
  }
  return static_cast<uint8_t>(static_cast<int>(c));
}

// ----------------------------------------------------------------------------------------------
// 4-bit exp_avg (moment code kMom4, with the 8-bit exp_avg_sq above): the same square law at 4 bits,
//   m = sign(c) * s_m * c^2,  c in [-7, 7],  s_m = bf16_round_up(amax * K_M4), K_M4 = fp32(1 / 49),
// one bf16 scale per group of 32 elements (the 8-bit groups), stochastic rounding between the
// neighbouring codes from the same 11-bit field (B) of the element's random word: P(round up) is
// (y - k^2) / (2k + 1) to 2^-12 of a code step. Two codes per byte: element 2j in the low nibble of
// byte j, element 2j + 1 in the high nibble, each a 4-bit two's complement code (-8 unused); a
// tensor of n elements has ceil(n / 2) bytes and the high nibble of an odd n's last byte is 0. A
// group starts at an even element, so the two codes of a byte always belong to one group (and one
// work item: work items are whole groups).
// ----------------------------------------------------------------------------------------------
constexpr float kMom4KM = 0x1.4e5e0ap-6f;  // fp32(1 / 49)

// The signed 4-bit code of element i from its byte.
MPK_HD int mom4_code(uint8_t byte, int64_t i) {
  const int nib = (i & 1) ? (byte >> 4) : (byte & 0xf);
  return nib >= 8 ? nib - 16 : nib;
}

MPK_HD float mom4_decode_m(int c, float s) {
  const float f = static_cast<float>(c);
  return s * (f * fabsf(f));
}

// The code of m given inv = mom8_inv_scale(s_m) and 16 random bits (rand_b16).
MPK_HD int mom4_encode_m(float m, float inv, uint32_t r16) { return mom_encode_sq(m, inv, r16, 7.0f); }

// The byte of the codes of elements 2j (c0) and 2j + 1 (c1).
MPK_HD uint8_t mom4_pack(int c0, int c1) {
  return static_cast<uint8_t>((static_cast<unsigned>(c0) & 0xfu) | ((static_cast<unsigned>(c1) & 0xfu) << 4));
}

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

// bf16: the 8 random bits u8 given directly (word & 0xff; 0x80 rounds to nearest).
MPK_HD void master8_encode_bf16(float w, uint32_t u8, uint16_t& h, int8_t& c) {
  const uint32_t u = f32_bits(w);
  const uint32_t t = u + u8;
  c = static_cast<int8_t>(static_cast<uint8_t>(t >> 8));
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h = static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: quiet, same sign
    return;
  }
  h = static_cast<uint16_t>((t + 0x8000u) >> 16);
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
