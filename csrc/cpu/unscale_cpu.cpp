// CPU kernels of the unscale_ ops: mpkern::grad_stats (read-only statistics pass) and
// mpkern::scale_ (in-place multiply). One parallel loop over (tensor, chunk) work items covers
// every tensor of the list, whatever the mix of dtypes.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <vector>

#include "../common.h"
#include "simd.h"

namespace mpkern {
namespace cpu {

namespace {
int detect_simd() {
#if MPK_X86
  const char* env = std::getenv("MPKERN_CPU_SIMD");
  if (env != nullptr && env[0] == '0') return 0;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return 1;
#endif
  return 0;
}
int g_simd = detect_simd();
}  // namespace

int simd_level() { return g_simd; }
void set_simd_enabled(bool enabled) { g_simd = enabled ? detect_simd() : 0; }

std::vector<WorkItem> make_work(c10::ArrayRef<at::Tensor> ts, int64_t chunk) {
  std::vector<WorkItem> items;
  for (size_t t = 0; t < ts.size(); ++t) {
    const int64_t n = ts[t].numel();
    for (int64_t b = 0; b < n; b += chunk) items.push_back({static_cast<int64_t>(t), b, std::min(n, b + chunk)});
  }
  return items;
}

namespace {

// Grain (in work items) of the parallel loops: at least kMinPerThread elements per thread, so a
// small call (many tiny tensors) runs on fewer threads, or on the calling thread alone, instead of
// paying a thread fan-out that costs more than the work.
constexpr int64_t kMinPerThread = int64_t{1} << 16;
int64_t grain_of(const std::vector<WorkItem>& items) {
  int64_t total = 0;
  for (const WorkItem& w : items) total += w.end - w.begin;
  if (total <= 0) return 1;
  const int64_t n = static_cast<int64_t>(items.size());
  return std::max<int64_t>(1, std::min<int64_t>(n, (kMinPerThread * n + total - 1) / total));
}

// ---- statistics: scalar path (the shared math, element by element) ---------------------------
// Sums of squares are accumulated in fp32 over short blocks (kSub elements, like one GPU thread's
// share of a chunk) and the blocks are added in fp64, keeping the rounding error near PyTorch's.
constexpr int64_t kSub = 256;
// Software prefetch distance (elements) of the AVX2 loops: a few KB ahead of the loads.
constexpr int64_t kPrefetch = 2048;

void stats_scalar(const void* p, int32_t dt, int64_t begin, int64_t end, float inv, double* sum, uint32_t* amax) {
  double total = 0.0;
  uint32_t mx = 0u;
  for (int64_t b = begin; b < end; b += kSub) {
    StatAcc s{0.f, mx};
    const int64_t e = std::min(end, b + kSub);
    for (int64_t i = b; i < e; ++i) stat_update(s, load_as_f32(p, i, dt), inv);
    total += s.sumsq;
    mx = s.amax_bits;
  }
  *sum = total;
  *amax = mx;
}

#if MPK_X86
// ---- statistics: AVX2 path. Same quantities as stat_update, 32 elements per iteration with
// four independent sum-of-squares accumulators; the tail goes through stat_update.
template <int DT>
MPK_AVX2 StatAcc stats_avx2(const void* p, int64_t begin, int64_t end, float inv, double* sum_out) {
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  double total = 0.0;
  int64_t i = begin;
  // blocks of 8 * kSub elements (64 per lane) in fp32, blocks added in fp64
  for (; i + 32 <= end;) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const int64_t block_end = std::min(end, i + 8 * kSub);
  for (; i + 32 <= block_end; i += 32) {
    _mm_prefetch(static_cast<const char*>(p) + (i + kPrefetch) * (DT == 0 ? 4 : 2), _MM_HINT_T0);
    __m256 x0, x1, x2, x3;
    if constexpr (DT == kBF16) {  // element order is irrelevant to the statistics
      bf16x16_unpack(static_cast<const uint16_t*>(p) + i, x0, x1);
      bf16x16_unpack(static_cast<const uint16_t*>(p) + i + 16, x2, x3);
    } else {
      x0 = load8<DT>(p, i), x1 = load8<DT>(p, i + 8), x2 = load8<DT>(p, i + 16), x3 = load8<DT>(p, i + 24);
    }
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_castps_si256(x0), absmask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_castps_si256(x1), absmask));
    m0 = _mm256_max_epu32(m0, _mm256_and_si256(_mm256_castps_si256(x2), absmask));
    m1 = _mm256_max_epu32(m1, _mm256_and_si256(_mm256_castps_si256(x3), absmask));
    const __m256 y0 = _mm256_mul_ps(x0, vinv), y1 = _mm256_mul_ps(x1, vinv);
    const __m256 y2 = _mm256_mul_ps(x2, vinv), y3 = _mm256_mul_ps(x3, vinv);
    a0 = _mm256_fmadd_ps(y0, y0, a0);
    a1 = _mm256_fmadd_ps(y1, y1, a1);
    a2 = _mm256_fmadd_ps(y2, y2, a2);
    a3 = _mm256_fmadd_ps(y3, y3, a3);
  }
  total += hsum_f64(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  }
  StatAcc s{0.f, hmax_u32(_mm256_max_epu32(m0, m1))};
  for (; i < end; ++i) stat_update(s, load_as_f32(p, i, DT), inv);
  *sum_out = total + static_cast<double>(s.sumsq);
  return s;
}
#endif

void stats_item(const void* p, int32_t dt, int64_t begin, int64_t end, float inv, double* sum, uint32_t* amax) {
#if MPK_X86
  if (use_avx2()) {
    StatAcc s;
    switch (dt) {
      case kF32: s = stats_avx2<0>(p, begin, end, inv, sum); break;
      case kF16: s = stats_avx2<1>(p, begin, end, inv, sum); break;
      default: s = stats_avx2<2>(p, begin, end, inv, sum); break;
    }
    *amax = s.amax_bits;
    return;
  }
#endif
  stats_scalar(p, dt, begin, end, inv, sum, amax);
}

// ---- in-place scale ---------------------------------------------------------------------------
void scale_scalar(void* p, int32_t dt, int64_t begin, int64_t end, float s) {
  for (int64_t i = begin; i < end; ++i) store_from_f32(p, i, dt, load_as_f32(p, i, dt) * s);
}

#if MPK_X86
template <int DT>
MPK_AVX2 void scale_avx2(void* p, int64_t begin, int64_t end, float s) {
  const __m256 vs = _mm256_set1_ps(s);
  int64_t i = begin;
  if constexpr (DT == kBF16) {  // one 32-byte load and store per 16 elements, no lane permutes
    uint16_t* q = static_cast<uint16_t*>(p);
    for (; i + 16 <= end; i += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(q + i + kPrefetch), _MM_HINT_T0);
      __m256 lo, hi;
      bf16x16_unpack(q + i, lo, hi);
      bf16x16_pack(q + i, _mm256_mul_ps(lo, vs), _mm256_mul_ps(hi, vs));
    }
  }
  for (; i + 16 <= end; i += 16) {
    _mm_prefetch(static_cast<const char*>(p) + (i + kPrefetch) * (DT == 0 ? 4 : 2), _MM_HINT_T0);
    const __m256 x0 = load8<DT>(p, i), x1 = load8<DT>(p, i + 8);
    store8<DT>(p, i, _mm256_mul_ps(x0, vs));
    store8<DT>(p, i + 8, _mm256_mul_ps(x1, vs));
  }
  for (; i < end; ++i) store_from_f32(p, i, DT, load_as_f32(p, i, DT) * s);
}
#endif

void scale_item(void* p, int32_t dt, int64_t begin, int64_t end, float s) {
#if MPK_X86
  if (use_avx2()) {
    switch (dt) {
      case kF32: scale_avx2<0>(p, begin, end, s); return;
      case kF16: scale_avx2<1>(p, begin, end, s); return;
      default: scale_avx2<2>(p, begin, end, s); return;
    }
  }
#endif
  scale_scalar(p, dt, begin, end, s);
}

}  // namespace

// grad_stats(grads, inv_scale) -> (sumsq[n], amax[n]), float32 on the CPU.
//   sumsq[t] = sum_i (grads[t][i] * inv_scale)^2   (accumulated per chunk in fp32, chunks in fp64)
//   amax[t]  = max_i |grads[t][i]|                   (NaN if any NaN, else inf if any inf)
std::tuple<at::Tensor, at::Tensor> grad_stats_cpu(at::TensorList grads, const at::Tensor& inv_scale) {
  check_list_op_on("mpkern::grad_stats", "grads", grads, "inv_scale", inv_scale, c10::DeviceType::CPU);
  const int64_t n = static_cast<int64_t>(grads.size());
  const float inv = inv_scale.data_ptr<float>()[0];
  const auto items = make_work(grads, kChunk);
  std::vector<double> part_sum(items.size());
  std::vector<uint32_t> part_max(items.size());
  std::vector<const void*> ptrs(n);
  std::vector<int32_t> dts(n);
  for (int64_t t = 0; t < n; ++t) {
    ptrs[t] = grads[t].data_ptr();
    dts[t] = dtype_code(grads[t].scalar_type());
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain_of(items), [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const WorkItem& w = items[k];
      stats_item(ptrs[w.tensor], dts[w.tensor], w.begin, w.end, inv, &part_sum[k], &part_max[k]);
    }
  });
  std::vector<double> tsum(n, 0.0);
  std::vector<uint32_t> tmax(n, 0u);
  for (size_t k = 0; k < items.size(); ++k) {  // fixed order: deterministic for any thread count
    tsum[items[k].tensor] += part_sum[k];
    tmax[items[k].tensor] = std::max(tmax[items[k].tensor], part_max[k]);
  }
  at::Tensor sumsq = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor amax = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  float* ps = sumsq.data_ptr<float>();
  float* pm = amax.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    // A NaN sum means "a NaN was seen"; keep the inf/NaN the per-element math produced.
    ps[t] = static_cast<float>(tsum[t]);
    pm[t] = f32_from_bits(tmax[t]);
  }
  return {sumsq, amax};
}

// scale_(tensors, scale): tensors[t] *= scale, in place, rounded to each tensor's dtype.
void scale_cpu_(at::TensorList tensors, const at::Tensor& scale) {
  check_list_op_on("mpkern::scale_", "tensors", tensors, "scale", scale, c10::DeviceType::CPU);
  const float s = scale.data_ptr<float>()[0];
  if (s == 1.0f) return;  // x * 1 == x bit for bit (NaN payloads aside): skip the pass
  const auto items = make_work(tensors, kChunk);
  std::vector<void*> ptrs(tensors.size());
  std::vector<int32_t> dts(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    ptrs[t] = tensors[t].data_ptr();
    dts[t] = dtype_code(tensors[t].scalar_type());
  }
  // Walk each thread's share of the work items backwards: the statistics pass that ran just
  // before walked them forwards with the same static split, so the data it touched last is
  // still in the last-level cache when this pass starts.
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain_of(items), [&](int64_t lo, int64_t hi) {
    for (int64_t k = hi - 1; k >= lo; --k) {
      const WorkItem& w = items[k];
      scale_item(ptrs[w.tensor], dts[w.tensor], w.begin, w.end, s);
    }
  });
}

}  // namespace cpu
}  // namespace mpkern

TORCH_LIBRARY_IMPL(mpkern, CPU, m) {
  m.impl("grad_stats", &mpkern::cpu::grad_stats_cpu);
  m.impl("scale_", &mpkern::cpu::scale_cpu_);
}
