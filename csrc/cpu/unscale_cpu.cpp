// CPU kernels of the unscale_ ops: mpkern::grad_stats (read-only statistics pass) and
// mpkern::scale_ (in-place multiply). One parallel loop over (tensor, chunk) work items covers
// every tensor of the list, whatever the mix of dtypes.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "../common.h"
#include "mpkern/norm.h"
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

// ---- statistics: the norm reduction of include/mpkern/norm.h ----------------------------------
// Work items are whole norm chunks (kChunk is a multiple of norm::kChunk), each chunk partial goes
// to its own slot, and each tensor's partials are combined once, in norm.h's order, after the
// parallel loop: the same bits for any thread count, on the scalar and the AVX2 path alike.
static_assert(kChunk % norm::kChunk == 0, "CPU work items must be whole norm chunks");
// Software prefetch distance (elements) of the AVX2 loops: a few KB ahead of the loads.
constexpr int64_t kPrefetch = 2048;

// One chunk's partial, element by element (the definition, norm::block_partial); amax updated.
double chunk_scalar(const void* p, int32_t dt, int64_t begin, int64_t end, uint32_t* amax) {
  double part[norm::kBlocks];
  uint32_t mx = *amax;
  for (int k = 0; k < norm::kBlocks; ++k) {
    const int64_t b = begin + int64_t{k} * norm::kBlock;
    const int count = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(norm::kBlock, end - b)));
    part[k] = norm::block_partial(
        [&](int i) {
          const float x = load_as_f32(p, b + i, dt);
          const uint32_t a = norm::abs_bits(x);
          mx = a > mx ? a : mx;
          return x;
        },
        count);
  }
  *amax = mx;
  return norm::tree_sum<norm::kBlocks>(part);
}

#if MPK_X86
// One row (16 elements from i) as four fp64 vectors, lanes 0-3, 4-7, 8-11, 12-15; the max of the
// |x| bits goes to mx (u32 lanes for fp32, u16 lanes of the raw bits for the 16-bit types: the
// order of |x| is the same, and the conversion to fp32 keeps it).
template <int DT>
MPK_AVX2 inline void row_f64(const void* p, int64_t i, __m256d& a0, __m256d& a1, __m256d& a2, __m256d& a3,
                             __m256i& mx) {
  __m256 lo, hi;
  if constexpr (DT == kF32) {
    const float* f = static_cast<const float*>(p) + i;
    lo = _mm256_loadu_ps(f);
    hi = _mm256_loadu_ps(f + 8);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(lo), absmask));
    mx = _mm256_max_epu32(mx, _mm256_and_si256(_mm256_castps_si256(hi), absmask));
  } else {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    mx = _mm256_max_epu16(mx, _mm256_and_si256(raw, _mm256_set1_epi16(0x7fff)));
    const __m128i r0 = _mm256_castsi256_si128(raw), r1 = _mm256_extracti128_si256(raw, 1);
    if constexpr (DT == kF16) {
      lo = _mm256_cvtph_ps(r0);
      hi = _mm256_cvtph_ps(r1);
    } else {
      lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r0), 16));
      hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(r1), 16));
    }
  }
  a0 = _mm256_cvtps_pd(_mm256_castps256_ps128(lo));
  a1 = _mm256_cvtps_pd(_mm256_extractf128_ps(lo, 1));
  a2 = _mm256_cvtps_pd(_mm256_castps256_ps128(hi));
  a3 = _mm256_cvtps_pd(_mm256_extractf128_ps(hi, 1));
}

// One full block (256 elements from b): lane sums in row order in four fp64 registers (one lane
// per element of a register; fma(x, x, s) == s + x*x exactly, the square being exact), then the
// halves-tree: lanes l + l+8 (s0+s2, s1+s3), l + l+4, then l + l+2 and l + l+1 inside a register.
template <int DT>
MPK_AVX2 inline double block_avx2(const void* p, int64_t b, __m256i& mx) {
  __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
  for (int r = 0; r < norm::kRows; ++r) {
    const int64_t i = b + int64_t{r} * norm::kLanes;
    _mm_prefetch(static_cast<const char*>(p) + (i + kPrefetch) * (DT == kF32 ? 4 : 2), _MM_HINT_T0);
    __m256d a0, a1, a2, a3;
    row_f64<DT>(p, i, a0, a1, a2, a3, mx);
    s0 = _mm256_fmadd_pd(a0, a0, s0);
    s1 = _mm256_fmadd_pd(a1, a1, s1);
    s2 = _mm256_fmadd_pd(a2, a2, s2);
    s3 = _mm256_fmadd_pd(a3, a3, s3);
  }
  const __m256d t = _mm256_add_pd(_mm256_add_pd(s0, s2), _mm256_add_pd(s1, s3));
  const __m128d u = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
  return _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
}

template <int DT>
MPK_AVX2 uint32_t hmax_abs_bits(__m256i mx) {
  if constexpr (DT == kF32) {
    return hmax_u32(mx);
  } else {
    alignas(32) uint16_t h[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(h), mx);
    uint16_t m = 0;
    for (int k = 0; k < 16; ++k) m = h[k] > m ? h[k] : m;
    return norm::abs_bits(DT == kBF16 ? bf16_to_f32(m) : f16_to_f32(m));
  }
}

// One chunk's partial (elements [begin, end), end - begin <= norm::kChunk); amax updated. A block
// cut by the end of the tensor is copied into a zeroed buffer (+0: adds nothing) and summed by
// the same code.
template <int DT>
MPK_AVX2 double chunk_avx2(const void* p, int64_t begin, int64_t end, uint32_t* amax) {
  constexpr int kEs = DT == kF32 ? 4 : 2;
  double part[norm::kBlocks];
  __m256i mx = _mm256_setzero_si256();
  for (int k = 0; k < norm::kBlocks; ++k) {
    const int64_t b = begin + int64_t{k} * norm::kBlock;
    if (b + norm::kBlock <= end) {
      part[k] = block_avx2<DT>(p, b, mx);
    } else if (b < end) {
      alignas(32) unsigned char buf[norm::kBlock * kEs] = {};
      std::memcpy(buf, static_cast<const char*>(p) + b * kEs, static_cast<size_t>(end - b) * kEs);
      part[k] = block_avx2<DT>(buf, 0, mx);
    } else {
      part[k] = 0.0;
    }
  }
  const uint32_t m = hmax_abs_bits<DT>(mx);
  *amax = std::max(*amax, m);
  return norm::tree_sum<norm::kBlocks>(part);
}
#endif

double chunk_stats(const void* p, int32_t dt, int64_t begin, int64_t end, uint32_t* amax) {
#if MPK_X86
  if (use_avx2()) {
    switch (dt) {
      case kF32: return chunk_avx2<kF32>(p, begin, end, amax);
      case kF16: return chunk_avx2<kF16>(p, begin, end, amax);
      default: return chunk_avx2<kBF16>(p, begin, end, amax);
    }
  }
#endif
  return chunk_scalar(p, dt, begin, end, amax);
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
//   sumsq[t] = sum_i (grads[t][i] * inv_scale)^2   (fp64, in the order of include/mpkern/norm.h)
//   amax[t]  = max_i |grads[t][i]|                   (NaN if any NaN, else inf if any inf)
// Arguments checked by the registered op (csrc/ops.cpp, check_list_op_on).
std::tuple<at::Tensor, at::Tensor> grad_stats_cpu(at::TensorList grads, const at::Tensor& inv_scale) {
  const int64_t n = static_cast<int64_t>(grads.size());
  const float inv = inv_scale.data_ptr<float>()[0];
  const auto items = make_work(grads, kChunk);
  std::vector<const void*> ptrs(n);
  std::vector<int32_t> dts(n);
  std::vector<int64_t> slot0(n + 1, 0);  // tensor t's chunk partials: slots [slot0[t], slot0[t + 1])
  for (int64_t t = 0; t < n; ++t) {
    ptrs[t] = grads[t].data_ptr();
    dts[t] = dtype_code(grads[t].scalar_type());
    slot0[t + 1] = slot0[t] + (grads[t].numel() + norm::kChunk - 1) / norm::kChunk;
  }
  std::vector<double> part_sum(slot0[n]);
  std::vector<uint32_t> part_max(slot0[n]);
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain_of(items), [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const WorkItem& w = items[k];
      for (int64_t b = w.begin; b < w.end; b += norm::kChunk) {
        const int64_t slot = slot0[w.tensor] + b / norm::kChunk;
        uint32_t mx = 0u;
        part_sum[slot] = chunk_stats(ptrs[w.tensor], dts[w.tensor], b, std::min(w.end, b + norm::kChunk), &mx);
        part_max[slot] = mx;
      }
    }
  });
  at::Tensor sumsq = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor amax = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  float* ps = sumsq.data_ptr<float>();
  float* pm = amax.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t count = slot0[t + 1] - slot0[t];
    uint32_t mx = 0u;
    for (int64_t s = slot0[t]; s < slot0[t + 1]; ++s) mx = std::max(mx, part_max[s]);
    // an empty tensor: 0 (not 0 * inv^2, NaN for an infinite inv_scale)
    ps[t] = count ? norm::finish_sumsq(norm::tensor_sum(part_sum.data() + slot0[t], count), inv) : 0.0f;
    pm[t] = f32_from_bits(mx);
  }
  return {sumsq, amax};
}

// scale_(tensors, scale): tensors[t] *= scale, in place, rounded to each tensor's dtype.
void scale_cpu_(at::TensorList tensors, const at::Tensor& scale) {
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
