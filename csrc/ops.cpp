// The mpkern operator library: one TORCH_LIBRARY block with every schema, and the Python module
// `mpkern._C` (build facts and the CPU SIMD switch). Device kernels register themselves in
// csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cu (CUDA) with TORCH_LIBRARY_IMPL.
#include <torch/extension.h>
#include <torch/library.h>

#include "cpu/simd.h"

TORCH_LIBRARY(mpkern, m) {
  // Read-only statistics pass of unscale_: per tensor, the sum of squares of grad * inv_scale and
  // the max |grad| (inf/NaN propagate, so it doubles as the non-finite flag).
  m.def("grad_stats(Tensor[] grads, Tensor inv_scale) -> (Tensor sumsq, Tensor amax)");
  // In-place multiply of every tensor by a one-element float32 tensor on the same device.
  m.def("scale_(Tensor(a!)[] tensors, Tensor scale) -> ()");
  // Fused AdamW over a tensor list (one param group on one device): updates params, moments,
  // max_exp_avg_sqs (amsgrad; empty list otherwise), masters (fp32 or int16 remainders; empty
  // list for master_mode 0) and the per-param step counters -- or nothing when found_inf != 0.
  m.def(
      "adamw_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] masters, Tensor(f!)[] steps, Tensor grad_factor, "
      "Tensor found_inf, Tensor? lr_tensor, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool maximize, int master_mode, bool stochastic_rounding, int seed) -> ()");
}

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
}
