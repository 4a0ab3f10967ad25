// The mpkern operator library: one TORCH_LIBRARY block with every schema, and the Python module
// `mpkern._C` (build facts and the CPU SIMD switch). Device kernels register themselves in
// csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cu (CUDA) with TORCH_LIBRARY_IMPL.
#include <torch/extension.h>
#include <torch/library.h>

#include "adamw_common.h"
#include "common.h"
#include "cpu/simd.h"
#include "fastpath.h"
#include "kernels.h"

#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
namespace mpkern {
namespace cuda {
// csrc/cuda/table_cache.cpp: the cached device metadata tables; csrc/cuda/unscale_cuda.cu: whether this build has a
// kernel image (SASS or PTX) the given GPU can run.
std::tuple<int64_t, int64_t, int64_t> table_cache_stats();
void table_cache_clear();
std::string kernel_image_error(int64_t device_index);
// csrc/cuda/adamw_cuda.cu: the AdamW kernel's launch shape (block, grid blocks per SM, chunk) for a
// device and where it comes from; a shape set for every device (a sweep), and its removal.
std::tuple<int64_t, int64_t, int64_t, int64_t, std::string> adamw_config(int64_t device_index);
void set_adamw_config(int64_t block, int64_t grid_per_sm, int64_t chunk, int64_t stages);
void clear_adamw_config();
}  // namespace cuda
}  // namespace mpkern
#endif

TORCH_LIBRARY(mpkern, m) {
  // The schemas are mpkern/codecs.def's (codecs.h kOpSchemas), which Python reads too:
  // * grad_stats: read-only statistics pass of unscale_: per tensor, the sum of squares of
  //   grad * inv_scale and the max |grad| (inf/NaN propagate, so it doubles as the non-finite flag).
  // * scale_: in-place multiply of every tensor by a one-element float32 tensor on the same device.
  // * adamw_step_: fused AdamW over a tensor list (one param group on one device): updates params,
  //   moments, max_exp_avg_sqs (amsgrad; empty list otherwise), masters (as master_codec says: "fp32"
  //   float32 masters, "remainder" int16 remainders, "8bit" int8 corrections; an empty list for
  //   "none") and the per-param step counters -- or nothing when found_inf != 0. moment_codec names
  //   how the moments are kept (a row of codecs.def: "float32" / "bfloat16" tensors, "8bit" ladder
  //   codes, "4bit_m" packed 4-bit exp_avg codes + 8-bit exp_avg_sq codes, the grouped ones with one
  //   bf16 scale per group in exp_avg_scales / exp_avg_sq_scales, None otherwise). stream_ids /
  //   elem_offsets (one per tensor, or empty: index in the list, 0) name the random stream of each
  //   tensor: element i draws the bits of element elem_offsets[t] + i of stream stream_ids[t] (see
  //   math.h, rng_key). The scalars are keyword-only.
  for (const mpkern::OpSchema& s : mpkern::kOpSchemas) m.def(s.schema);
}

namespace mpkern {
namespace {
constexpr const char* kAdamwOp = "mpkern::adamw_step_";

// mpkern::adamw_step_'s arguments as the dispatcher passes them -- the schema's (mpkern/codecs.def), in its
// order: the tensor lists and tensors positional, then the keyword-only scalars and codecs -- as a parameter
// list and as the names that forward it. This file is the only place that knows the order: adamw_args and
// adamw_step_call convert between it and the named bundle AdamwArgs.
#define MPKERN_ADAMW_PARAMS                                                                                        \
  at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,                \
      at::TensorList max_exp_avg_sqs, at::TensorList masters, at::TensorList steps, const at::Tensor &grad_factor, \
      const at::Tensor &found_inf, const std::optional<at::Tensor>&lr_tensor,                                      \
      const std::optional<at::TensorList>&exp_avg_scales, const std::optional<at::TensorList>&exp_avg_sq_scales,   \
      double lr, double beta1, double beta2, double eps, double weight_decay, bool maximize,                       \
      c10::string_view master_codec, c10::string_view moment_codec, bool stochastic_rounding, int64_t seed,        \
      at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets
#define MPKERN_ADAMW_NAMES                                                                                          \
  params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, grad_factor, found_inf, lr_tensor,         \
      exp_avg_scales, exp_avg_sq_scales, lr, beta1, beta2, eps, weight_decay, maximize, master_codec, moment_codec, \
      stochastic_rounding, seed, stream_ids, elem_offsets

using AdamwStepOp = void(MPKERN_ADAMW_PARAMS);

const c10::TypedOperatorHandle<AdamwStepOp>& adamw_step_handle() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mpkern::adamw_step_", "").typed<AdamwStepOp>();
  return op;
}

// The dispatcher's flat arguments as the bundle (designated: a field out of the struct's order does not compile).
AdamwArgs adamw_args(MPKERN_ADAMW_PARAMS) {
  return AdamwArgs{.params = params,
                   .grads = grads,
                   .exp_avgs = exp_avgs,
                   .exp_avg_sqs = exp_avg_sqs,
                   .max_exp_avg_sqs = max_exp_avg_sqs,
                   .masters = masters,
                   .steps = steps,
                   .grad_factor = grad_factor,
                   .found_inf = found_inf,
                   .lr_tensor = lr_tensor,
                   .exp_avg_scales = exp_avg_scales,
                   .exp_avg_sq_scales = exp_avg_sq_scales,
                   .lr = lr,
                   .beta1 = beta1,
                   .beta2 = beta2,
                   .eps = eps,
                   .weight_decay = weight_decay,
                   .maximize = maximize,
                   .master_codec = master_codec,
                   .moment_codec = moment_codec,
                   .stochastic_rounding = stochastic_rounding,
                   .seed = seed,
                   .stream_ids = stream_ids,
                   .elem_offsets = elem_offsets};
}

// The registered kernels of mpkern::adamw_step_: the codecs parsed and every argument checked (here, in
// host-compiled code), then the device kernel with the bundle.
template <void (*Kernel)(const AdamwArgs&, int64_t, int64_t), c10::DeviceType Dev>
void adamw_step_op(MPKERN_ADAMW_PARAMS) {
  const AdamwArgs a = adamw_args(MPKERN_ADAMW_NAMES);
  const MasterCodec& master = master_codec_of(kAdamwOp, a.master_codec);
  const MomentCodec& moments = moment_codec_of(kAdamwOp, a.moment_codec);
  check_adamw_args_on(kAdamwOp, a, master, moments, Dev);
  check_adamw_scalars(kAdamwOp, a);
  Kernel(a, master.mode, moments.mode);
}
// The Autograd kernels: the ops are not differentiable (nothing to record), so they go straight to
// the device kernel. Without them the dispatcher's boxed autograd fallback would box every tensor
// list (7 lists of one entry per param) on each call -- most of a cached step's host time.
void adamw_step_autograd(c10::DispatchKeySet ks, MPKERN_ADAMW_PARAMS) {
  adamw_step_handle().redispatch(ks & c10::after_autograd_keyset, MPKERN_ADAMW_NAMES);
}

// The registered kernels of mpkern::grad_stats / mpkern::scale_: the arguments checked here, in
// host-compiled code, before the device kernel (a device kernel does not check its arguments).
template <std::tuple<at::Tensor, at::Tensor> (*Kernel)(at::TensorList, const at::Tensor&), c10::DeviceType Dev>
std::tuple<at::Tensor, at::Tensor> grad_stats_op(at::TensorList grads, const at::Tensor& inv_scale) {
  check_list_op_on("mpkern::grad_stats", "grads", grads, "inv_scale", inv_scale, Dev);
  return Kernel(grads, inv_scale);
}

template <void (*Kernel)(at::TensorList, const at::Tensor&), c10::DeviceType Dev>
void scale_op(at::TensorList tensors, const at::Tensor& scale) {
  check_list_op_on("mpkern::scale_", "tensors", tensors, "scale", scale, Dev);
  Kernel(tensors, scale);
}

std::tuple<at::Tensor, at::Tensor> grad_stats_autograd(c10::DispatchKeySet ks, at::TensorList grads,
                                                       const at::Tensor& inv_scale) {
  return grad_stats_handle().redispatch(ks & c10::after_autograd_keyset, grads, inv_scale);
}
}  // namespace

void adamw_step_call(const AdamwArgs& a) {
  adamw_step_handle().call(a.params, a.grads, a.exp_avgs, a.exp_avg_sqs, a.max_exp_avg_sqs, a.masters, a.steps,
                           a.grad_factor, a.found_inf, a.lr_tensor, a.exp_avg_scales, a.exp_avg_sq_scales, a.lr,
                           a.beta1, a.beta2, a.eps, a.weight_decay, a.maximize, a.master_codec, a.moment_codec,
                           a.stochastic_rounding, a.seed, a.stream_ids, a.elem_offsets);
}

const c10::TypedOperatorHandle<GradStatsOp>& grad_stats_handle() {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mpkern::grad_stats", "").typed<GradStatsOp>();
  return op;
}
}  // namespace mpkern

TORCH_LIBRARY_IMPL(mpkern, Autograd, m) {
  m.impl("adamw_step_", &mpkern::adamw_step_autograd);
  m.impl("grad_stats", &mpkern::grad_stats_autograd);
}

TORCH_LIBRARY_IMPL(mpkern, CPU, m) {
  m.impl("adamw_step_", static_cast<mpkern::AdamwStepOp*>(
                            &mpkern::adamw_step_op<&mpkern::cpu::adamw_step_cpu_, c10::DeviceType::CPU>));
  m.impl("grad_stats", &mpkern::grad_stats_op<&mpkern::cpu::grad_stats_cpu, c10::DeviceType::CPU>);
  m.impl("scale_", &mpkern::scale_op<&mpkern::cpu::scale_cpu_, c10::DeviceType::CPU>);
}
#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
TORCH_LIBRARY_IMPL(mpkern, CUDA, m) {
  m.impl("adamw_step_", static_cast<mpkern::AdamwStepOp*>(
                            &mpkern::adamw_step_op<&mpkern::cuda::adamw_step_cuda_, c10::DeviceType::CUDA>));
  m.impl("grad_stats", &mpkern::grad_stats_op<&mpkern::cuda::grad_stats_cuda, c10::DeviceType::CUDA>);
  m.impl("scale_", &mpkern::scale_op<&mpkern::cuda::scale_cuda_, c10::DeviceType::CUDA>);
}
#endif

#ifndef MPKERN_TORCH_VERSION
#define MPKERN_TORCH_VERSION "unknown"
#endif

#ifndef MPKERN_WITH_CUDA
#define MPKERN_WITH_CUDA 0
#endif

PYBIND11_MODULE(_C, mod) {
  mod.doc() = "mpkern native kernels (ops are under torch.ops.mpkern)";
  mod.attr("cuda_built") = static_cast<bool>(MPKERN_WITH_CUDA);
#ifdef MPKERN_CUDA_ARCHS
  mod.attr("cuda_archs") = MPKERN_CUDA_ARCHS;
#else
  mod.attr("cuda_archs") = "";
#endif
  mod.attr("torch_version") = MPKERN_TORCH_VERSION;
  mod.def("cpu_simd_level", &mpkern::cpu::simd_level, "0 = scalar, 1 = AVX2+FMA+F16C");
  mod.def("set_cpu_simd", &mpkern::cpu::set_simd_enabled, "Enable (if the CPU has it) or disable the AVX2 path");
  // The argument checks of the ops, for the backends that are not C++ (Triton, PyTorch): the
  // very functions the C++ kernels call, so every backend raises the same errors.
  mod.def(
      "check_grad_stats_args",
      [](const std::vector<at::Tensor>& grads, const at::Tensor& inv_scale) {
        mpkern::check_list_op("mpkern::grad_stats", "grads", grads, "inv_scale", inv_scale);
      },
      "Raise like mpkern::grad_stats does on bad arguments");
  mod.def(
      "check_scale_args",
      [](const std::vector<at::Tensor>& tensors, const at::Tensor& scale) {
        mpkern::check_list_op("mpkern::scale_", "tensors", tensors, "scale", scale);
      },
      "Raise like mpkern::scale_ does on bad arguments");
  // moment_codec: a row of the table by name, or (for a codec Python registered for the torch
  // backend, mpkern.codecs.register_moment_codec) the row itself: (name, exp_avg dtype, exp_avg_sq
  // dtype, group, codes per byte), the dtypes by their table names ("Char", ...)
  mod.def(
      "check_adamw_args",
      [](const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
         const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
         const std::vector<at::Tensor>& max_exp_avg_sqs, const std::vector<at::Tensor>& masters,
         const std::vector<at::Tensor>& steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
         const std::optional<at::Tensor>& lr_tensor, const std::optional<std::vector<at::Tensor>>& exp_avg_scales,
         const std::optional<std::vector<at::Tensor>>& exp_avg_sq_scales, const std::string& master_codec,
         const pybind11::object& moment_codec, const std::vector<int64_t>& stream_ids,
         const std::vector<int64_t>& elem_offsets) {
        const std::vector<at::Tensor> none;
        const char* op = "mpkern::adamw_step_";
        const mpkern::MasterCodec& master = mpkern::master_codec_of(op, master_codec);
        std::string name;
        mpkern::MomentCodec moments;
        if (pybind11::isinstance<pybind11::str>(moment_codec)) {
          name = moment_codec.cast<std::string>();
          moments = mpkern::moment_codec_of(op, name);
        } else {
          auto row = moment_codec.cast<std::tuple<std::string, std::string, std::string, int32_t, int32_t>>();
          name = std::get<0>(row);
          moments = mpkern::MomentCodec{name.c_str(),
                                        -1,
                                        mpkern::codec_dtype_of(op, std::get<1>(row)),
                                        mpkern::codec_dtype_of(op, std::get<2>(row)),
                                        std::get<3>(row),
                                        std::get<4>(row)};
        }
        mpkern::AdamwArgs a;
        a.params = params;
        a.grads = grads;
        a.exp_avgs = exp_avgs;
        a.exp_avg_sqs = exp_avg_sqs;
        a.max_exp_avg_sqs = max_exp_avg_sqs;
        a.masters = masters;
        a.steps = steps;
        a.grad_factor = grad_factor;
        a.found_inf = found_inf;
        a.lr_tensor = lr_tensor;
        // the scale lists as views of vectors that outlive the check (None: empty lists)
        const std::vector<at::Tensor>& sm = exp_avg_scales.has_value() ? *exp_avg_scales : none;
        const std::vector<at::Tensor>& sv = exp_avg_sq_scales.has_value() ? *exp_avg_sq_scales : none;
        a.exp_avg_scales = at::TensorList(sm);
        a.exp_avg_sq_scales = at::TensorList(sv);
        a.stream_ids = stream_ids;
        a.elem_offsets = elem_offsets;
        mpkern::check_adamw_args(op, a, master, moments);
      },
      pybind11::arg("params"), pybind11::arg("grads"), pybind11::arg("exp_avgs"), pybind11::arg("exp_avg_sqs"),
      pybind11::arg("max_exp_avg_sqs"), pybind11::arg("masters"), pybind11::arg("steps"), pybind11::arg("grad_factor"),
      pybind11::arg("found_inf"), pybind11::arg("lr_tensor"), pybind11::arg("exp_avg_scales") = pybind11::none(),
      pybind11::arg("exp_avg_sq_scales") = pybind11::none(), pybind11::kw_only(), pybind11::arg("master_codec"),
      pybind11::arg("moment_codec"), pybind11::arg("stream_ids") = std::vector<int64_t>{},
      pybind11::arg("elem_offsets") = std::vector<int64_t>{},
      "Raise like mpkern::adamw_step_ does on bad arguments (the tensor arguments, the codecs, the streams)");
  mod.def(
      "check_adamw_scalars",
      [](bool has_lr_tensor, double lr, double beta1, double beta2, double eps, double weight_decay) {
        mpkern::check_adamw_scalars("mpkern::adamw_step_", has_lr_tensor, lr, beta1, beta2, eps, weight_decay);
      },
      pybind11::arg("has_lr_tensor"), pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"),
      pybind11::arg("eps"), pybind11::arg("weight_decay"),
      "Raise like mpkern::adamw_step_ does on scalars outside torch.optim.AdamW's ranges");
  // The table this extension was compiled with (mpkern/codecs.def), for mpkern.codecs to compare
  // with the file it reads: {"master": [(name, mode, state dtype)], "moment": [(name, mode, exp_avg
  // dtype, exp_avg_sq dtype, group, codes per byte)], "schemas": {op: schema}}.
  mod.def(
      "codec_table",
      []() {
        pybind11::list master, moment;
        pybind11::dict schemas;
        for (const mpkern::MasterCodec& c : mpkern::kMasterCodecs)
          master.append(pybind11::make_tuple(c.name, c.mode, mpkern::codec_dtype_name(c.state)));
        for (const mpkern::MomentCodec& c : mpkern::kMomentCodecs)
          moment.append(pybind11::make_tuple(c.name, c.mode, mpkern::codec_dtype_name(c.exp_avg),
                                             mpkern::codec_dtype_name(c.exp_avg_sq), c.group, c.per_byte));
        for (const mpkern::OpSchema& s : mpkern::kOpSchemas) schemas[s.op] = s.schema;
        pybind11::dict out;
        out["master"] = master;
        out["moment"] = moment;
        out["schemas"] = schemas;
        return out;
      },
      "The codec table and op schemas this extension was compiled with (mpkern/codecs.def)");
  mpkern::register_fastpath(mod);  // FusedAdamWMP.step's cached fast path (csrc/fastpath.cpp)
#if defined(MPKERN_WITH_CUDA) && MPKERN_WITH_CUDA
  mod.def("cuda_table_cache_stats", &mpkern::cuda::table_cache_stats,
          "(tables built, lookups served from the cache, tables cached now) of the CUDA kernels");
  mod.def("cuda_table_cache_clear", &mpkern::cuda::table_cache_clear,
          "Drop the cached CUDA metadata tables that no captured CUDA graph uses");
  mod.def("cuda_kernel_image_error", &mpkern::cuda::kernel_image_error,
          "Empty if this build has a kernel image (SASS or PTX) for the GPU, else the CUDA error");
  mod.def("cuda_adamw_config", &mpkern::cuda::adamw_config, pybind11::arg("device_index"),
          "(block, grid blocks per SM, chunk, stages, source) of the AdamW kernel's launch on a device: the "
          "arch's measured row of adamw_cuda.cu's table, or the shape set_cuda_adamw_config set");
  mod.def("set_cuda_adamw_config", &mpkern::cuda::set_adamw_config, pybind11::arg("block"),
          pybind11::arg("grid_per_sm"), pybind11::arg("chunk"), pybind11::arg("stages"),
          "Launch the AdamW kernel with this shape on every device until clear_cuda_adamw_config (a sweep)");
  mod.def("clear_cuda_adamw_config", &mpkern::cuda::clear_adamw_config, "Back to each arch's shape from the table");
#endif
}
