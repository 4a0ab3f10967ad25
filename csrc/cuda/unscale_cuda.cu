// CUDA kernels of the unscale_ ops (see csrc/cpu/unscale_cpu.cpp for the contract).
//   grad_stats: the reduction of include/mpkern/norm.h, bit for bit (the same bits as the CPU
//               kernel, Triton and the reference). One multi-tensor launch writes an fp64 partial
//               per norm chunk (16384 elements from the tensor's first element) and a max |x| per
//               work item; a second, tiny launch combines each tensor's chunk partials in norm.h's
//               order (128 lanes, halves-tree) and finishes sumsq -- deterministic, no atomics.
//   scale_:     one multi-tensor launch; every block returns at once when the scale is exactly 1.
// scale_ reads 16-byte vectors: a buffer whose base address is not 16-byte aligned (a view into a
// bucket, a storage offset) gets a few scalar head elements, then the aligned vector body, then a
// scalar tail. grad_stats reads 16-byte vectors when the tensor starts on 16 bytes and scalars
// otherwise (its order is anchored at the tensor's first element, not at an aligned one).
#include <torch/library.h>

#include <string>

#include "mpkern/norm.h"
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

// ---- grad_stats: norm.h's order on the GPU ------------------------------------------------------
// A work item (kChunk elements) is kItemNorm norm chunks. A thread holds L = Vec<DT>::N lanes (one
// 16-byte vector of a row) of one 256-element block: TPB threads per block row, TPC threads per
// norm chunk, CPP norm chunks per pass of the kBlock threads.
constexpr int kItemNorm = static_cast<int>(kChunk / norm::kChunk);
static_assert(kChunk % norm::kChunk == 0, "a CUDA work item must be whole norm chunks");

template <int DT>
struct NormTile {
  static constexpr int L = Vec<DT>::N;             // lanes per thread: 4 (fp32), 8 (16-bit)
  static constexpr int TPB = norm::kLanes / L;     // threads per block row
  static constexpr int TPC = norm::kBlocks * TPB;  // threads per norm chunk
  static constexpr int CPP = kBlock / TPC;         // norm chunks per pass
  static_assert(kBlock % TPC == 0 && kItemNorm % CPP == 0 && CPP <= kBlock / 32, "norm tile shape");
};

// The norm chunk at element e0 of tensor m (elements past its end are +0): the calling thread's
// share of the lane sums (row order, norm.h 2a) and the halves-tree over the 16 lanes (2b); the
// block partial p[k] is left in part[k] by the block's first thread. amax updated with |x| bits.
template <int DT>
__device__ __forceinline__ void norm_block(const TensorMeta& m, int64_t e0, int k, int g, bool aligned, double* part,
                                           uint32_t& mx) {
  using T = NormTile<DT>;
  const void* p = reinterpret_cast<const void*>(m.ptr);
  double s[T::L];
#pragma unroll
  for (int j = 0; j < T::L; ++j) s[j] = 0.0;
  const int64_t b = e0 + int64_t{k} * norm::kBlock + g * T::L;
#pragma unroll 4
  for (int r = 0; r < norm::kRows; ++r) {
    const int64_t i = b + r * norm::kLanes;
    float x[T::L];
    if (aligned && i + T::L <= m.numel) {
      load_vec<DT>(p, i, x);
    } else {
#pragma unroll
      for (int j = 0; j < T::L; ++j) x[j] = i + j < m.numel ? load_as_f32(p, i + j, DT) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < T::L; ++j) {
      const uint32_t a = norm::abs_bits(x[j]);
      mx = a > mx ? a : mx;
      s[j] = s[j] + norm::square(x[j]);
    }
  }
  // halves-tree over lanes g*L + j: distances >= L are across the TPB threads of the row
  // (adjacent lanes of one warp), the rest inside the thread
#pragma unroll
  for (int w = norm::kLanes / 2; w >= T::L; w /= 2) {
#pragma unroll
    for (int j = 0; j < T::L; ++j) s[j] = s[j] + __shfl_down_sync(0xffffffffu, s[j], w / T::L);
  }
  const double v = norm::tree_sum<T::L>(s);
  if (g == 0) part[k] = v;
}

// The kItemNorm norm chunks of work item c of tensor m: partial P of norm chunk nc (within the
// tensor) to part_sum[slot0 + nc]; returns this thread's max |x| bits.
template <int DT>
__device__ uint32_t item_stats(const TensorMeta& m, int64_t c, double* __restrict__ part_sum,
                               double (*s_part)[norm::kBlocks]) {
  using T = NormTile<DT>;
  const int q = threadIdx.x / T::TPC, u = threadIdx.x % T::TPC;
  const int k = u / T::TPB, g = u % T::TPB;
  const bool aligned = (m.ptr & 15) == 0;
  const int64_t slot0 = m.chunk_begin * kItemNorm;
  uint32_t mx = 0u;
  for (int pass = 0; pass < kItemNorm / T::CPP; ++pass) {
    const int64_t nc = (c - m.chunk_begin) * kItemNorm + pass * T::CPP + q;  // uniform per norm chunk
    const int64_t e0 = nc * norm::kChunk;
    if (e0 < m.numel) norm_block<DT>(m, e0, k, g, aligned, s_part[q], mx);  // whole warps take one side
    __syncthreads();
    // 2c: halves-tree over the 64 block partials, one warp per norm chunk
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (warp < T::CPP) {
      const int64_t wc = (c - m.chunk_begin) * kItemNorm + pass * T::CPP + warp;
      if (wc * norm::kChunk < m.numel) {
        double v = s_part[warp][lane] + s_part[warp][lane + 32];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v = v + __shfl_down_sync(0xffffffffu, v, o);
        if (lane == 0) part_sum[slot0 + wc] = v;
      }
    }
    __syncthreads();
  }
  return mx;
}

__global__ void __launch_bounds__(kBlock)
    stats_kernel(const TensorMeta* __restrict__ meta, int count, int64_t total_chunks, double* __restrict__ part_sum,
                 uint32_t* __restrict__ part_max) {
  __shared__ int s_t;
  __shared__ uint32_t s_u[32];
  // block partials of the norm chunks of a pass (the 16-bit types have the most per pass)
  __shared__ double s_part[NormTile<kF16>::CPP][norm::kBlocks];
  for (int64_t c = blockIdx.x; c < total_chunks; c += gridDim.x) {
    if (threadIdx.x == 0) s_t = find_tensor(meta, count, c);
    __syncthreads();
    const TensorMeta m = meta[s_t];
    uint32_t mx;
    switch (m.dtype) {
      case kF32: mx = item_stats<kF32>(m, c, part_sum, s_part); break;
      case kF16: mx = item_stats<kF16>(m, c, part_sum, s_part); break;
      default: mx = item_stats<kBF16>(m, c, part_sum, s_part); break;
    }
    mx = block_reduce(mx, MaxU32(), s_u);  // its __syncthreads also guard s_t
    if (threadIdx.x == 0) part_max[c] = mx;
  }
}

// One block of kTensorLanes threads per tensor (norm.h steps 3-4): thread f sums the chunk
// partials c = f, f + 128, ... in order, then the halves-tree over the 128 lanes; the max of the
// work items' maxima.
__global__ void __launch_bounds__(norm::kTensorLanes)
    stats_finalize_kernel(const TensorMeta* __restrict__ meta, int count, int64_t total_chunks,
                          const double* __restrict__ part_sum, const uint32_t* __restrict__ part_max,
                          const float* __restrict__ inv_scale, float* __restrict__ sumsq, float* __restrict__ amax) {
  __shared__ double s_d[norm::kTensorLanes];
  __shared__ uint32_t s_u[32];
  const int t = blockIdx.x, f = threadIdx.x;
  const TensorMeta m = meta[t];
  const int64_t c0 = m.chunk_begin;
  const int64_t c1 = t + 1 < count ? meta[t + 1].chunk_begin : total_chunks;
  const int64_t nchunks = (m.numel + norm::kChunk - 1) / norm::kChunk;
  const double* p = part_sum + c0 * kItemNorm;
  double lane = 0.0;
  for (int64_t c = f; c < nchunks; c += norm::kTensorLanes) lane = lane + p[c];
  s_d[f] = lane;
  uint32_t mx = 0u;
  for (int64_t c = c0 + f; c < c1; c += norm::kTensorLanes) mx = max(mx, part_max[c]);
  __syncthreads();
#pragma unroll
  for (int w = norm::kTensorLanes / 2; w >= 1; w /= 2) {
    if (f < w) s_d[f] = s_d[f] + s_d[f + w];
    __syncthreads();
  }
  mx = block_reduce(mx, MaxU32(), s_u);
  if (f == 0) {
    sumsq[m.index] = norm::finish_sumsq(s_d[0], *inv_scale);  // a listed tensor is non-empty
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

// Arguments checked by the registered op (csrc/ops.cpp): nothing here throws on bad input.
std::tuple<at::Tensor, at::Tensor> grad_stats_cuda(at::TensorList grads, const at::Tensor& inv_scale) {
  const c10::Device dev = call_device(grads, inv_scale);
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t n = static_cast<int64_t>(grads.size());
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(dev);
  at::Tensor sumsq = at::zeros({n}, f32);
  at::Tensor amax = at::zeros({n}, f32);
  const MetaTable tab = make_table(grads, dev);
  if (tab.count == 0) return {sumsq, amax};
  // chunk partials: tensor t's norm chunk nc at slot chunk_begin * kItemNorm + nc (slots past a
  // tensor's last norm chunk stay unused)
  at::Tensor part_sum = at::empty({tab.total_chunks * kItemNorm}, f32.dtype(at::kDouble));
  at::Tensor part_max = at::empty({tab.total_chunks}, f32.dtype(at::kInt));
  auto stream = at::cuda::getCurrentCUDAStream();
  stats_kernel<<<grid_for(tab.total_chunks), kBlock, 0, stream>>>(
      tab.rows, tab.count, tab.total_chunks, part_sum.data_ptr<double>(),
      reinterpret_cast<uint32_t*>(part_max.data_ptr<int32_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  stats_finalize_kernel<<<tab.count, norm::kTensorLanes, 0, stream>>>(
      tab.rows, tab.count, tab.total_chunks, part_sum.data_ptr<double>(),
      reinterpret_cast<const uint32_t*>(part_max.data_ptr<int32_t>()), inv_scale.data_ptr<float>(),
      sumsq.data_ptr<float>(), amax.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sumsq, amax};
}

void scale_cuda_(at::TensorList tensors, const at::Tensor& scale) {
  const c10::Device dev = call_device(tensors, scale);
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
