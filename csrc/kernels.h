// The C++ entry points of the device kernels and the C++ signature of the registered ops, shared by
// csrc/ops.cpp (which registers the adamw_step_ schema's kernels) and csrc/fastpath.cpp (which calls
// the registered ops through typed dispatcher handles): declared once, here.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace mpkern {

// mpkern::adamw_step_ as the dispatcher calls it (the schema in csrc/ops.cpp): the tensor lists and
// tensors positionally, then the keyword-only scalars and codecs.
using AdamwStepOp = void(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                         at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                         at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                         const std::optional<at::Tensor>& lr_tensor,
                         const std::optional<at::TensorList>& exp_avg_scales,
                         const std::optional<at::TensorList>& exp_avg_sq_scales, double lr, double beta1,
                         double beta2, double eps, double weight_decay, bool maximize,
                         c10::string_view master_codec, c10::string_view moment_codec, bool stochastic_rounding,
                         int64_t seed, at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets);

// mpkern::grad_stats as the dispatcher calls it.
using GradStatsOp = std::tuple<at::Tensor, at::Tensor>(at::TensorList grads, const at::Tensor& inv_scale);

// Typed dispatcher handles of the registered ops (csrc/ops.cpp), for C++ callers (csrc/fastpath.cpp).
const c10::TypedOperatorHandle<AdamwStepOp>& adamw_step_handle();
const c10::TypedOperatorHandle<GradStatsOp>& grad_stats_handle();

// The kernels' own entry points (the codecs already parsed: the master's into a MasterMode, the
// moments' into a moment code, see adamw_common.h); csrc/cpu/adamw_cpu.cpp and csrc/cuda/adamw_cuda.cu define them.
#define MPKERN_ADAMW_KERNEL_ARGS                                                                                   \
  at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,               \
      at::TensorList max_exp_avg_sqs, at::TensorList masters, at::TensorList steps, const at::Tensor &grad_factor, \
      const at::Tensor &found_inf, const std::optional<at::Tensor> &lr_tensor, double lr, double beta1,            \
      double beta2, double eps, double weight_decay, bool maximize, int64_t master_mode, int64_t moment_mode,      \
      bool stochastic_rounding,                                                                                    \
      int64_t seed, at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets,                                      \
      const std::optional<at::TensorList> &exp_avg_scales_opt, const std::optional<at::TensorList> &exp_avg_sq_scales_opt

// grad_stats / scale_ kernels (csrc/cpu/unscale_cpu.cpp, csrc/cuda/unscale_cuda.cu); their arguments
// are checked by the registered op in csrc/ops.cpp before they run.
namespace cpu {
void adamw_step_cpu_(MPKERN_ADAMW_KERNEL_ARGS);
std::tuple<at::Tensor, at::Tensor> grad_stats_cpu(at::TensorList grads, const at::Tensor& inv_scale);
void scale_cpu_(at::TensorList tensors, const at::Tensor& scale);
}  // namespace cpu
#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
namespace cuda {
void adamw_step_cuda_(MPKERN_ADAMW_KERNEL_ARGS);
std::tuple<at::Tensor, at::Tensor> grad_stats_cuda(at::TensorList grads, const at::Tensor& inv_scale);
void scale_cuda_(at::TensorList tensors, const at::Tensor& scale);
}  // namespace cuda
#endif

}  // namespace mpkern
