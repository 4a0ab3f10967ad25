// CPU kernel of mpkern::adamw_step_: the fused master-weight AdamW update over a tensor list.
//
// Per element it reads the grad (any float dtype), the master value (fp32 master, bf16 param +
// int16 remainder, or the param itself), both moments (fp32 or bf16), applies
// grad * grad_factor (inv_scale * clip_coef) in registers, and writes master, moments and the
// rounded param. Nothing else is read or written; the grad is never written. When found_inf is
// non-zero nothing at all is written (step counters included).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../common.h"
#include "../adamw_common.h"
#include "simd.h"

namespace mpkern {
namespace cpu {


namespace {

struct TensorPtrs {
  void* p;
  const void* g;
  void* m;
  void* v;
  float* vmax;
  void* master;  // float* (mode 1) or int16_t* (mode 2)
  int32_t pdt, gdt, sdt;
  uint32_t step;  // after the increment
  AdamWConsts c;
};

struct Flags {
  int mode;
  bool maximize;
  bool sr;
  uint32_t seed;
  float factor;
};

// ---- scalar path: the shared math, element by element --------------------------------------------
void adamw_scalar(const TensorPtrs& t, int64_t tid, int64_t begin, int64_t end, const Flags& f) {
  for (int64_t i = begin; i < end; ++i) {
    float g = load_as_f32(t.g, i, t.gdt) * f.factor;
    if (f.maximize) g = -g;
    float p;
    if (f.mode == kMasterF32) {
      p = static_cast<const float*>(t.master)[i];
    } else if (f.mode == kMasterRemainder) {
      p = join_master(static_cast<const uint16_t*>(t.p)[i], static_cast<const int16_t*>(t.master)[i]);
    } else {
      p = load_as_f32(t.p, i, t.pdt);
    }
    float m = load_as_f32(t.m, i, t.sdt);
    float v = load_as_f32(t.v, i, t.sdt);
    p = adamw_update(p, g, m, v, t.vmax ? t.vmax + i : nullptr, t.c);
    store_from_f32(t.m, i, t.sdt, m);
    store_from_f32(t.v, i, t.sdt, v);
    if (f.mode == kMasterF32) {
      static_cast<float*>(t.master)[i] = p;
      store_from_f32(t.p, i, t.pdt, p);
    } else if (f.mode == kMasterRemainder) {
      uint16_t hi;
      int16_t rem;
      split_master(p, hi, rem);
      static_cast<uint16_t*>(t.p)[i] = hi;
      static_cast<int16_t*>(t.master)[i] = rem;
    } else if (f.sr && t.pdt == kBF16) {
      static_cast<uint16_t*>(t.p)[i] = f32_to_bf16_sr(p, sr_bits(f.seed, static_cast<uint32_t>(tid), i, t.step));
    } else {
      store_from_f32(t.p, i, t.pdt, p);
    }
  }
}

#if MPK_X86
// ---- AVX2 path: same arithmetic, same order of operations (no fma contraction) ------------------
template <int PDT, int GDT, int SDT>
MPK_AVX2 void adamw_avx2(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f) {
  const __m256 factor = _mm256_set1_ps(f.maximize ? -f.factor : f.factor);
  const __m256 decay = _mm256_set1_ps(t.c.decay), omb1 = _mm256_set1_ps(t.c.one_m_b1);
  const __m256 b2 = _mm256_set1_ps(t.c.beta2), omb2 = _mm256_set1_ps(t.c.one_m_b2);
  const __m256 ss = _mm256_set1_ps(t.c.step_size), ibc2 = _mm256_set1_ps(t.c.inv_bc2);
  const __m256 eps = _mm256_set1_ps(t.c.eps);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    // maximize: -(g * factor) == g * (-factor) exactly (sign flips commute with rounding)
    const __m256 g = _mm256_mul_ps(load8<GDT>(t.g, i), factor);
    __m256 p;
    if (f.mode == kMasterF32) {
      p = _mm256_loadu_ps(static_cast<const float*>(t.master) + i);
    } else if (f.mode == kMasterRemainder) {
      const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(t.p) + i)));
      const __m256i lo = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int16_t*>(t.master) + i)));
      p = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(hi, 16), lo));
    } else {
      p = load8<PDT>(t.p, i);
    }
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
    store8<SDT>(t.m, i, m);
    store8<SDT>(t.v, i, v);
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
    } else {
      store8<PDT>(t.p, i, p);
    }
  }
  if (i < end) adamw_scalar(t, 0, i, end, f);
}

using AvxFn = void (*)(const TensorPtrs&, int64_t, int64_t, const Flags&);

template <int PDT, int GDT>
AvxFn pick_s(int32_t sdt) {
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
#endif

}  // namespace

void adamw_step_cpu_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                     at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                     const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool maximize, int64_t master_mode, bool stochastic_rounding,
                     int64_t seed) {
  check_adamw_args_on("mpkern::adamw_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps,
                   grad_factor, found_inf, lr_tensor, master_mode, c10::DeviceType::CPU);
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
    x.sdt = dtype_code(exp_avgs[t].scalar_type());
    const double step = static_cast<double>(*steps[t].data_ptr<float>()) + 1.0;
    x.step = static_cast<uint32_t>(step);
    x.c = adamw_consts(lr, beta1, beta2, eps, weight_decay, step);
  }
  const auto items = make_work(params, kChunk);
#if MPK_X86
  const bool avx = use_avx2() && !stochastic_rounding;
#endif
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const WorkItem& w = items[k];
      const TensorPtrs& x = tp[w.tensor];
#if MPK_X86
      if (avx) {
        pick_avx2(x.pdt, x.gdt, x.sdt)(x, w.begin, w.end, f);
        continue;
      }
#endif
      adamw_scalar(x, w.tensor, w.begin, w.end, f);
    }
  });
  for (int64_t t = 0; t < n; ++t) *steps[t].data_ptr<float>() += 1.0f;
}

}  // namespace cpu
}  // namespace mpkern

TORCH_LIBRARY_IMPL(mpkern, CPU, m) { m.impl("adamw_step_", &mpkern::cpu::adamw_step_cpu_); }
