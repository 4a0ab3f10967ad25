// Multi-tensor apply for CUDA: one launch walks (tensor, chunk) work items of a whole tensor list.
//
// The host packs one TensorMeta per non-empty tensor into a pinned buffer and copies it to the
// device asynchronously (one small H2D copy per call, no sync). Each block takes chunks in a
// grid-stride loop and finds its tensor by binary search over `chunk_begin`. All element
// indexing is int64, so a tensor over 2^31 elements works.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <vector>

#include "../common.h"

namespace mpkern {
namespace cuda {

struct TensorMeta {
  int64_t ptr;          // data pointer
  int64_t numel;        // elements
  int64_t chunk_begin;  // global index of this tensor's first chunk
  int32_t dtype;        // mpkern::DType
  int32_t index;        // position in the caller's list
};
static_assert(sizeof(TensorMeta) == 32, "TensorMeta layout");

constexpr int64_t kChunk = 1 << 16;  // elements per work item (multiple of 8: chunks stay 16B-aligned)
constexpr int kBlock = 512;

struct MetaTable {
  at::Tensor device;  // uint8 [count * sizeof(TensorMeta)] on the GPU
  int count = 0;
  int64_t total_chunks = 0;
  const TensorMeta* ptr() const { return reinterpret_cast<const TensorMeta*>(device.data_ptr()); }
};

// Pack the table of a tensor list onto `device`. Empty tensors are left out.
inline MetaTable make_table(at::TensorList ts, c10::Device device) {
  std::vector<TensorMeta> host;
  host.reserve(ts.size());
  int64_t chunks = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const int64_t n = ts[i].numel();
    if (n == 0) continue;
    host.push_back({reinterpret_cast<int64_t>(ts[i].data_ptr()), n, chunks, dtype_code(ts[i].scalar_type()),
                    static_cast<int32_t>(i)});
    chunks += (n + kChunk - 1) / kChunk;
  }
  MetaTable tab;
  tab.count = static_cast<int>(host.size());
  tab.total_chunks = chunks;
  if (tab.count == 0) return tab;
  const int64_t bytes = static_cast<int64_t>(host.size() * sizeof(TensorMeta));
  at::Tensor pinned = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(pinned.data_ptr(), host.data(), bytes);
  tab.device = pinned.to(device, /*non_blocking=*/true);
  return tab;
}

inline int grid_for(int64_t total_chunks) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t g = std::min<int64_t>(total_chunks, static_cast<int64_t>(sms) * 4);
  return static_cast<int>(std::max<int64_t>(g, 1));
}

// Index of the tensor that owns global chunk `c`: the last entry with chunk_begin <= c (empty
// tensors share chunk_begin with the next entry and are never chosen). Any table whose rows
// have a `chunk_begin` field works.
template <typename Meta>
__device__ __forceinline__ int find_tensor(const Meta* meta, int count, int64_t c) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (meta[mid].chunk_begin <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Elements per 16-byte vector.
template <int DT>
struct Vec {
  static constexpr int N = DT == kF32 ? 4 : 8;
};

// Load / store a 16-byte vector as N floats.
template <int DT>
__device__ __forceinline__ void load_vec(const void* base, int64_t i, float (&x)[Vec<DT>::N]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const char*>(base) + i * (DT == kF32 ? 4 : 2));
  if constexpr (DT == kF32) {
    x[0] = __uint_as_float(raw.x); x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z); x[3] = __uint_as_float(raw.w);
  } else {
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint16_t lo = static_cast<uint16_t>(w[k] & 0xffffu), hi = static_cast<uint16_t>(w[k] >> 16);
      x[2 * k] = DT == kBF16 ? bf16_to_f32(lo) : f16_to_f32(lo);
      x[2 * k + 1] = DT == kBF16 ? bf16_to_f32(hi) : f16_to_f32(hi);
    }
  }
}

template <int DT>
__device__ __forceinline__ void store_vec(void* base, int64_t i, const float (&x)[Vec<DT>::N]) {
  uint4 raw;
  if constexpr (DT == kF32) {
    raw.x = __float_as_uint(x[0]); raw.y = __float_as_uint(x[1]);
    raw.z = __float_as_uint(x[2]); raw.w = __float_as_uint(x[3]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t lo = DT == kBF16 ? f32_to_bf16_rne(x[2 * k]) : f32_to_f16_rne(x[2 * k]);
      const uint32_t hi = DT == kBF16 ? f32_to_bf16_rne(x[2 * k + 1]) : f32_to_f16_rne(x[2 * k + 1]);
      w[k] = lo | (hi << 16);
    }
    raw = make_uint4(w[0], w[1], w[2], w[3]);
  }
  *reinterpret_cast<uint4*>(static_cast<char*>(base) + i * (DT == kF32 ? 4 : 2)) = raw;
}

__device__ __forceinline__ bool aligned16(int64_t p) { return (p & 15) == 0; }

}  // namespace cuda
}  // namespace mpkern
