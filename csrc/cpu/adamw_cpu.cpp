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
// AVX2). The vector paths use the same operations in the same order (math.h's explicit fmas, no other
// contraction).
// The scalar path lives in adamw_cpu_scalar.cpp, the vector paths in adamw_cpu_vec.h, compiled per ISA
// by adamw_cpu_avx2.cpp and adamw_cpu_avx512.cpp (adamw_cpu_impl.h: what they share); this file is the
// op and picks the path per work item.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "../common.h"
#include "../adamw_common.h"
#include "../kernels.h"
#include "simd.h"
#include "adamw_cpu_impl.h"

namespace mpkern {
namespace cpu {

using adamw_impl::adamw_scalar;
using adamw_impl::adamw_scalar_grouped;
using adamw_impl::AvxFn;
using adamw_impl::cpu_has_moment_mode;
using adamw_impl::Flags;
using adamw_impl::TensorPtrs;
#if MPK_X86
using adamw_impl::pick_avx2;
using adamw_impl::pick_avx512;
#endif

void adamw_step_cpu_(const AdamwArgs& a, int64_t master_mode, int64_t moment_mode) {
  const at::TensorList params = a.params, grads = a.grads, steps = a.steps;
  const at::TensorList exp_avg_scales = list_or_empty(a.exp_avg_scales);
  const at::TensorList exp_avg_sq_scales = list_or_empty(a.exp_avg_sq_scales);
  // arguments checked by the registered op (csrc/ops.cpp, adamw_step_op); a moment mode of the table
  // without a CPU variant is refused before anything is written
  TORCH_CHECK_NOT_IMPLEMENTED(cpu_has_moment_mode(static_cast<int32_t>(moment_mode)),
                              "mpkern::adamw_step_: the CPU kernel has no variant for moment mode ", moment_mode);
  // CPU tensors: plain memory reads (no dispatcher round trips, no device sync)
  if (*a.found_inf.data_ptr<float>() != 0.0f) return;
  const double lr = a.lr_tensor.has_value() ? static_cast<double>(*a.lr_tensor->data_ptr<float>()) : a.lr;
  Flags f;
  f.master_mode = static_cast<int>(master_mode);
  f.maximize = a.maximize;
  f.sr = a.stochastic_rounding;
  f.seed = static_cast<uint32_t>(a.seed);
  f.factor = *a.grad_factor.data_ptr<float>();
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<TensorPtrs> tp(n);
  for (int64_t t = 0; t < n; ++t) {
    TensorPtrs& x = tp[t];
    x.p = params[t].data_ptr();
    x.g = grads[t].data_ptr();
    x.m = a.exp_avgs[t].data_ptr();
    x.v = a.exp_avg_sqs[t].data_ptr();
    x.vmax = a.max_exp_avg_sqs.empty() ? nullptr : a.max_exp_avg_sqs[t].data_ptr<float>();
    x.master = a.masters.empty() ? nullptr : a.masters[t].data_ptr();
    x.pdt = dtype_code(params[t].scalar_type());
    x.gdt = dtype_code(grads[t].scalar_type());
    x.moment_mode = static_cast<int32_t>(moment_mode);
    const bool grouped = moment_grouped(x.moment_mode);
    x.sm = grouped ? static_cast<uint16_t*>(exp_avg_scales[t].data_ptr()) : nullptr;
    x.sv = grouped ? static_cast<uint16_t*>(exp_avg_sq_scales[t].data_ptr()) : nullptr;
    const double step = static_cast<double>(*steps[t].data_ptr<float>()) + 1.0;
    x.step = static_cast<uint32_t>(step);
    x.stream = stream_of(a.stream_ids, static_cast<size_t>(t));
    x.offset = offset_of(a.elem_offsets, static_cast<size_t>(t));
    x.c = adamw_consts(lr, a.beta1, a.beta2, a.eps, a.weight_decay, step);
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
      // the vector path of the tensor's dtypes and moment mode (none: the scalar path runs it)
      const AvxFn fn = !avx     ? nullptr
                       : avx512 ? pick_avx512(x.pdt, x.gdt, x.moment_mode)
                                : pick_avx2(x.pdt, x.gdt, x.moment_mode);
      if (fn != nullptr) {
        // one random key per call: split the range where the global element index crosses a
        // multiple of 2^32 (a chunk crosses at most one)
        if (moment_grouped(x.moment_mode)) {  // group-aligned: the kernel handles a crossing of 2^32 itself
          fn(x, w.begin, w.end, f);
          continue;
        }
        const uint64_t first = x.offset + static_cast<uint64_t>(w.begin);
        const uint64_t next = (first | 0xffffffffull) + 1u;
        const int64_t split =
            next - x.offset < static_cast<uint64_t>(w.end) ? static_cast<int64_t>(next - x.offset) : w.end;
        fn(x, w.begin, split, f);
        if (split < w.end) fn(x, split, w.end, f);
        continue;
      }
#endif
      if (moment_grouped(x.moment_mode)) {
        adamw_scalar_grouped(x, w.begin, w.end, f);
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
