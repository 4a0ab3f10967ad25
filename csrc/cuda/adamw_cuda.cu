// CUDA kernel of mpkern::adamw_step_ (contract in csrc/cpu/adamw_cpu.cpp). One multi-tensor
// launch updates every tensor of the list; a second one-thread-per-tensor launch bumps the step
// counters. Both read found_inf on the device and do nothing when it is set: no host sync.
#include <torch/library.h>

#include "../adamw_common.h"
#include "multi_tensor.cuh"

namespace mpkern {
namespace cuda {

namespace {

struct AdamMeta {
  int64_t p, g, m, v, vmax, master, step;  // addresses (vmax / master may be 0)
  int64_t numel;
  int64_t chunk_begin;
  int32_t pdt, gdt, sdt, index;
};

struct AdamScalars {
  float lr;  // used when lr_ptr is null
  const float* lr_ptr;
  const float* factor;
  const float* found_inf;
  double beta1, beta2, eps, weight_decay;
  int mode;
  bool maximize, sr;
  uint32_t seed;
};

__global__ void __launch_bounds__(kBlock) adamw_kernel(const AdamMeta* __restrict__ meta, int count,
                                                       int64_t total_chunks, AdamScalars s) {
  if (*s.found_inf != 0.f) return;
  __shared__ int s_t;
  __shared__ AdamWConsts s_c;
  __shared__ uint32_t s_step;
  const float factor = s.maximize ? -*s.factor : *s.factor;
  const double lr = s.lr_ptr ? static_cast<double>(*s.lr_ptr) : static_cast<double>(s.lr);
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) {
      s_t = find_tensor(meta, count, c);
      const double step = static_cast<double>(*reinterpret_cast<const float*>(meta[s_t].step)) + 1.0;
      s_step = static_cast<uint32_t>(step);
      s_c = adamw_consts(lr, s.beta1, s.beta2, s.eps, s.weight_decay, step);
    }
    __syncthreads();
    const AdamMeta t = meta[s_t];
    const AdamWConsts cs = s_c;
    const uint32_t step = s_step;
    __syncthreads();
    const int64_t begin = (c - t.chunk_begin) * kChunk;
    const int64_t end = min(t.numel, begin + kChunk);
    void* P = reinterpret_cast<void*>(t.p);
    const void* G = reinterpret_cast<const void*>(t.g);
    void* M = reinterpret_cast<void*>(t.m);
    void* V = reinterpret_cast<void*>(t.v);
    float* VMAX = reinterpret_cast<float*>(t.vmax);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const float g = load_as_f32(G, i, t.gdt) * factor;
      float p;
      if (s.mode == kMasterF32) {
        p = reinterpret_cast<const float*>(t.master)[i];
      } else if (s.mode == kMasterRemainder) {
        p = join_master(static_cast<const uint16_t*>(P)[i], reinterpret_cast<const int16_t*>(t.master)[i]);
      } else {
        p = load_as_f32(P, i, t.pdt);
      }
      float m = load_as_f32(M, i, t.sdt);
      float v = load_as_f32(V, i, t.sdt);
      p = adamw_update(p, g, m, v, VMAX ? VMAX + i : nullptr, cs);
      store_from_f32(M, i, t.sdt, m);
      store_from_f32(V, i, t.sdt, v);
      if (s.mode == kMasterF32) {
        reinterpret_cast<float*>(t.master)[i] = p;
        store_from_f32(P, i, t.pdt, p);
      } else if (s.mode == kMasterRemainder) {
        uint16_t hi;
        int16_t rem;
        split_master(p, hi, rem);
        static_cast<uint16_t*>(P)[i] = hi;
        reinterpret_cast<int16_t*>(t.master)[i] = rem;
      } else if (s.sr && t.pdt == kBF16) {
        static_cast<uint16_t*>(P)[i] = f32_to_bf16_sr(p, sr_bits(s.seed, static_cast<uint32_t>(t.index), i, step));
      } else {
        store_from_f32(P, i, t.pdt, p);
      }
    }
  }
}

__global__ void bump_steps_kernel(const AdamMeta* __restrict__ meta, int count, const float* __restrict__ found_inf) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < count && *found_inf == 0.f) *reinterpret_cast<float*>(meta[t].step) += 1.f;
}

int64_t addr(const at::Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr()); }

}  // namespace

void adamw_step_cuda_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                      at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                      const std::optional<at::Tensor>& lr_tensor, double lr, double beta1, double beta2, double eps,
                      double weight_decay, bool maximize, int64_t master_mode, bool stochastic_rounding,
                      int64_t seed) {
  check_adamw_args("mpkern::adamw_step_", params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps,
                   grad_factor, found_inf, lr_tensor, master_mode, c10::DeviceType::CUDA);
  if (params.empty()) return;
  const c10::Device dev = params[0].device();
  const c10::cuda::CUDAGuard guard(dev);
  // All tensors (empty ones too: their step counters still advance) go into the table; only
  // non-empty ones own chunks.
  std::vector<AdamMeta> host(params.size());
  int64_t chunks = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    AdamMeta& a = host[i];
    a.p = addr(params[i]);
    a.g = addr(grads[i]);
    a.m = addr(exp_avgs[i]);
    a.v = addr(exp_avg_sqs[i]);
    a.vmax = max_exp_avg_sqs.empty() ? 0 : addr(max_exp_avg_sqs[i]);
    a.master = masters.empty() ? 0 : addr(masters[i]);
    a.step = addr(steps[i]);
    a.numel = params[i].numel();
    a.chunk_begin = chunks;
    a.pdt = dtype_code(params[i].scalar_type());
    a.gdt = dtype_code(grads[i].scalar_type());
    a.sdt = dtype_code(exp_avgs[i].scalar_type());
    a.index = static_cast<int32_t>(i);
    chunks += (a.numel + kChunk - 1) / kChunk;
  }
  const int64_t bytes = static_cast<int64_t>(host.size() * sizeof(AdamMeta));
  at::Tensor pinned = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(pinned.data_ptr(), host.data(), bytes);
  at::Tensor table = pinned.to(dev, /*non_blocking=*/true);
  const AdamMeta* meta = reinterpret_cast<const AdamMeta*>(table.data_ptr());
  AdamScalars s;
  s.lr = static_cast<float>(lr);
  s.lr_ptr = lr_tensor.has_value() ? lr_tensor->data_ptr<float>() : nullptr;
  s.factor = grad_factor.data_ptr<float>();
  s.found_inf = found_inf.data_ptr<float>();
  s.beta1 = beta1;
  s.beta2 = beta2;
  s.eps = eps;
  s.weight_decay = weight_decay;
  s.mode = static_cast<int>(master_mode);
  s.maximize = maximize;
  s.sr = stochastic_rounding;
  s.seed = static_cast<uint32_t>(seed);
  auto stream = at::cuda::getCurrentCUDAStream();
  const int count = static_cast<int>(host.size());
  if (chunks > 0) {
    adamw_kernel<<<grid_for(chunks), kBlock, 0, stream>>>(meta, count, chunks, s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  bump_steps_kernel<<<(count + 255) / 256, 256, 0, stream>>>(meta, count, s.found_inf);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace mpkern

TORCH_LIBRARY_IMPL(mpkern, CUDA, m) { m.impl("adamw_step_", &mpkern::cuda::adamw_step_cuda_); }
