// The C++ entry points of the device kernels and the argument bundle of mpkern::adamw_step_, shared by
// csrc/ops.cpp (which registers the ops' kernels), the kernels and csrc/fastpath.cpp (which calls the
// registered ops): declared once, here.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <tuple>

namespace mpkern {

// One call of mpkern::adamw_step_, every argument by name: what the device kernels, the argument checks
// and the fast path take. The schema (mpkern/codecs.def) orders the arguments; only csrc/ops.cpp knows
// that order -- it builds the bundle from the dispatcher's flat arguments and calls the op with one
// (adamw_step_call). A new op argument: docs/design.md, "Adding an argument to adamw_step_".
struct AdamwArgs {
  at::TensorList params, grads, exp_avgs, exp_avg_sqs;
  at::TensorList max_exp_avg_sqs;  // amsgrad's; empty otherwise
  at::TensorList masters;          // as master_codec says; empty for "none"
  at::TensorList steps;            // one-element float32 step counters
  at::Tensor grad_factor, found_inf;
  std::optional<at::Tensor> lr_tensor;  // read on the device instead of lr when given
  // a grouped moment codec's bf16 scales, one tensor per param; nullopt (the schema's None) otherwise
  std::optional<at::TensorList> exp_avg_scales, exp_avg_sq_scales;
  double lr = 0.0, beta1 = 0.0, beta2 = 0.0, eps = 0.0, weight_decay = 0.0;
  bool maximize = false;
  c10::string_view master_codec, moment_codec;  // rows of codecs.def by name
  bool stochastic_rounding = false;
  int64_t seed = 0;
  at::IntArrayRef stream_ids, elem_offsets;  // the random stream of each tensor (empty: defaults)
};

// mpkern::adamw_step_ through the dispatcher (csrc/ops.cpp): for C++ callers (csrc/fastpath.cpp).
void adamw_step_call(const AdamwArgs& args);

// mpkern::grad_stats as the dispatcher calls it, and its typed handle (csrc/ops.cpp).
using GradStatsOp = std::tuple<at::Tensor, at::Tensor>(at::TensorList grads, const at::Tensor& inv_scale);
const c10::TypedOperatorHandle<GradStatsOp>& grad_stats_handle();

// The AdamW kernels' entry points: the bundle, and its codecs parsed by the registered op into the
// master mode and the moment mode (codecs.def) -- csrc/cpu/adamw_cpu.cpp and csrc/cuda/adamw_cuda.cu.
// grad_stats / scale_ kernels: csrc/cpu/unscale_cpu.cpp, csrc/cuda/unscale_cuda.cu. Their arguments are
// checked by the registered ops in csrc/ops.cpp before they run.
namespace cpu {
void adamw_step_cpu_(const AdamwArgs& args, int64_t master_mode, int64_t moment_mode);
std::tuple<at::Tensor, at::Tensor> grad_stats_cpu(at::TensorList grads, const at::Tensor& inv_scale);
void scale_cpu_(at::TensorList tensors, const at::Tensor& scale);
}  // namespace cpu
#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
namespace cuda {
void adamw_step_cuda_(const AdamwArgs& args, int64_t master_mode, int64_t moment_mode);
std::tuple<at::Tensor, at::Tensor> grad_stats_cuda(at::TensorList grads, const at::Tensor& inv_scale);
void scale_cuda_(at::TensorList tensors, const at::Tensor& scale);
}  // namespace cuda
#endif

}  // namespace mpkern
