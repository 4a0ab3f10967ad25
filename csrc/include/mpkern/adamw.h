// The AdamW update per element, fp32 with fused multiply-adds, and its CUDA fast form inside the ranges
// (part of math.h). Arithmetic and ranges: docs/design.md, "The per-element arithmetic".
#pragma once

#include "floats.h"

namespace mpkern {

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
  float decay;     // 1 - lr * weight_decay
  float one_m_b1;  // 1 - beta1
  float beta2;
  float one_m_b2;   // 1 - beta2
  float step_size;  // lr / (1 - beta1^t)
  float inv_bc2;    // 1 / sqrt(1 - beta2^t)
  float eps;
};

MPK_HD AdamWConsts adamw_consts(double lr, double beta1, double beta2, double eps, double weight_decay, double step) {
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
  const bool consts =
      (ib - 0x3f800000u <= 0x08000000u) & (eb <= 0x47800000u) & (sb < 0x7f800000u) & (f32_bits(c.beta2) < 0x3f800000u);
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

}  // namespace mpkern
