// CUDA kernels of the unscale_ ops (see csrc/cpu/unscale_cpu.cpp for the contract).
//   grad_stats: one multi-tensor launch writes a (sum of squares, max |x|) partial per chunk; a
//               second, tiny launch reduces each tensor's partials in a fixed order (deterministic,
//               no atomics) in fp64.
//   scale_:     one multi-tensor launch; every block returns at once when the scale is exactly 1.
// Both read 16-byte vectors: a buffer whose base address is not 16-byte aligned (a view into a
// bucket, a storage offset) gets a few scalar head elements, then the aligned vector body, then a
// scalar tail.
#include <torch/library.h>

#include <string>

#include "multi_tensor.cuh"

namespace mpkern {
namespace cuda {

namespace {

template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = threadIdx.x < nwarps ? smem[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_down_sync(0xffffffffu, v, o));
  }
  __syncthreads();
  return v;  // valid in thread 0
}

struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const { return a + b; }
};
struct MaxU32 {
  __device__ uint32_t operator()(uint32_t a, uint32_t b) const { return a > b ? a : b; }
};

// Calls f(i) for the scalar elements and fv(i) for the 16-byte vectors (Vec<DT>::N elements,
// starting at an aligned i) of elements [begin, end) of a buffer at address `ptr`, spread over
// the threads of the block.
template <int DT, typename F, typename FV>
__device__ __forceinline__ void for_chunk(int64_t ptr, int64_t begin, int64_t end, F f, FV fv) {
  constexpr int V = Vec<DT>::N;
  // first aligned element at or after `begin` (begin is a multiple of V: chunks are)
  const int64_t vb = min(end, begin + align_head<DT>(ptr));
  const int64_t nvec = (end - vb) / V;
  const int64_t ve = vb + nvec * V;
  for (int64_t i = begin + threadIdx.x; i < vb; i += blockDim.x) f(i);
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) fv(vb + v * V);
  for (int64_t i = ve + threadIdx.x; i < end; i += blockDim.x) f(i);
}

template <int DT>
__device__ void chunk_stats(const TensorMeta& m, int64_t begin, int64_t end, float inv, StatAcc& s) {
  const void* p = reinterpret_cast<const void*>(m.ptr);
  for_chunk<DT>(
      m.ptr, begin, end, [&](int64_t i) { stat_update(s, load_as_f32(p, i, DT), inv); },
      [&](int64_t i) {
        float x[Vec<DT>::N];
        load_vec<DT>(p, i, x);
#pragma unroll
        for (int k = 0; k < Vec<DT>::N; ++k) stat_update(s, x[k], inv);
      });
}

__global__ void __launch_bounds__(kBlock) stats_kernel(const TensorMeta* __restrict__ meta, int count,
                                                       int64_t total_chunks, const float* __restrict__ inv_scale,
                                                       float* __restrict__ part_sum,
                                                       uint32_t* __restrict__ part_max) {
  __shared__ int s_t;
  __shared__ float s_f[32];
  __shared__ uint32_t s_u[32];
  const float inv = *inv_scale;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) s_t = find_tensor(meta, count, c);
    __syncthreads();
    const TensorMeta m = meta[s_t];
    const int64_t begin = (c - m.chunk_begin) * kChunk;
    const int64_t end = min(m.numel, begin + kChunk);
    StatAcc s{0.f, 0u};
    switch (m.dtype) {
      case kF32: chunk_stats<kF32>(m, begin, end, inv, s); break;
      case kF16: chunk_stats<kF16>(m, begin, end, inv, s); break;
      default: chunk_stats<kBF16>(m, begin, end, inv, s); break;
    }
    const float sum = block_reduce(s.sumsq, SumOp(), s_f);
    const uint32_t mx = block_reduce(s.amax_bits, MaxU32(), s_u);
    if (threadIdx.x == 0) {
      part_sum[c] = sum;
      part_max[c] = mx;
    }
  }
}

// One block per tensor: reduce its chunk partials (fp64, fixed order) into the outputs.
__global__ void stats_finalize_kernel(const TensorMeta* __restrict__ meta, int count, int64_t total_chunks,
                                      const float* __restrict__ part_sum, const uint32_t* __restrict__ part_max,
                                      float* __restrict__ sumsq, float* __restrict__ amax) {
  __shared__ double s_d[32];
  __shared__ uint32_t s_u[32];
  const int t = blockIdx.x;
  const TensorMeta m = meta[t];
  const int64_t c0 = m.chunk_begin;
  const int64_t c1 = t + 1 < count ? meta[t + 1].chunk_begin : total_chunks;
  double acc = 0.0;
  uint32_t mx = 0u;
  for (int64_t c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
    acc += static_cast<double>(part_sum[c]);
    mx = max(mx, part_max[c]);
  }
  acc = block_reduce(acc, SumOp(), s_d);
  mx = block_reduce(mx, MaxU32(), s_u);
  if (threadIdx.x == 0) {
    sumsq[m.index] = static_cast<float>(acc);
    amax[m.index] = __uint_as_float(mx);
  }
}

template <int DT>
__device__ void chunk_scale(const TensorMeta& m, int64_t begin, int64_t end, float s) {
  void* p = reinterpret_cast<void*>(m.ptr);
  for_chunk<DT>(
      m.ptr, begin, end, [&](int64_t i) { store_from_f32(p, i, DT, load_as_f32(p, i, DT) * s); },
      [&](int64_t i) {
        float x[Vec<DT>::N];
        load_vec<DT>(p, i, x);
#pragma unroll
        for (int k = 0; k < Vec<DT>::N; ++k) x[k] *= s;
        store_vec<DT>(p, i, x);
      });
}

__global__ void __launch_bounds__(kBlock) scale_kernel(const TensorMeta* __restrict__ meta, int count,
                                                       int64_t total_chunks, const float* __restrict__ scale) {
  __shared__ int s_t;
  const float s = *scale;
  if (s == 1.0f) return;
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) s_t = find_tensor(meta, count, c);
    __syncthreads();
    const TensorMeta m = meta[s_t];
    __syncthreads();
    const int64_t begin = (c - m.chunk_begin) * kChunk;
    const int64_t end = min(m.numel, begin + kChunk);
    switch (m.dtype) {
      case kF32: chunk_scale<kF32>(m, begin, end, s); break;
      case kF16: chunk_scale<kF16>(m, begin, end, s); break;
      default: chunk_scale<kBF16>(m, begin, end, s); break;
    }
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> grad_stats_cuda(at::TensorList grads, const at::Tensor& inv_scale) {
  const c10::Device dev =
      check_list_op_on("mpkern::grad_stats", "grads", grads, "inv_scale", inv_scale, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t n = static_cast<int64_t>(grads.size());
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor sumsq = at::zeros({n}, f32);
  at::Tensor amax = at::zeros({n}, f32);
  const MetaTable tab = make_table(grads, dev);
  if (tab.count == 0) return {sumsq, amax};
  at::Tensor part_sum = at::empty({tab.total_chunks}, f32);
  at::Tensor part_max = at::empty({tab.total_chunks}, f32.dtype(at::kInt));
  auto stream = at::cuda::getCurrentCUDAStream();
  stats_kernel<<<grid_for(tab.total_chunks), kBlock, 0, stream>>>(
      tab.rows, tab.count, tab.total_chunks, inv_scale.data_ptr<float>(), part_sum.data_ptr<float>(),
      reinterpret_cast<uint32_t*>(part_max.data_ptr<int32_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  stats_finalize_kernel<<<tab.count, 256, 0, stream>>>(
      tab.rows, tab.count, tab.total_chunks, part_sum.data_ptr<float>(),
      reinterpret_cast<const uint32_t*>(part_max.data_ptr<int32_t>()), sumsq.data_ptr<float>(),
      amax.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sumsq, amax};
}

void scale_cuda_(at::TensorList tensors, const at::Tensor& scale) {
  const c10::Device dev =
      check_list_op_on("mpkern::scale_", "tensors", tensors, "scale", scale, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(dev);
  const MetaTable tab = make_table(tensors, dev);
  if (tab.count == 0) return;
  scale_kernel<<<grid_for(tab.total_chunks), kBlock, 0, at::cuda::getCurrentCUDAStream()>>>(
      tab.rows, tab.count, tab.total_chunks, scale.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the GPU can run this build's kernels: asks the driver for a kernel's attributes on
// `device_index`, which fails with "no kernel image is available" when the build has neither
// SASS for the GPU's architecture nor PTX it can compile.
std::string kernel_image_error(int64_t device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  cudaFuncAttributes attr;
  const cudaError_t err = cudaFuncGetAttributes(&attr, scale_kernel);
  if (err == cudaSuccess) return "";
  (void)cudaGetLastError();  // clear the sticky-free error so later launches are unaffected
  return cudaGetErrorString(err);
}

}  // namespace cuda
}  // namespace mpkern

TORCH_LIBRARY_IMPL(mpkern, CUDA, m) {
  m.impl("grad_stats", &mpkern::cuda::grad_stats_cuda);
  m.impl("scale_", &mpkern::cuda::scale_cuda_);
}
