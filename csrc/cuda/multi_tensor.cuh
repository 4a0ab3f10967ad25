// Multi-tensor apply for CUDA: one launch walks (tensor, chunk) work items of a whole tensor list.
//
// Metadata: the host describes the list as a table of fixed-size rows (addresses, sizes, chunk
// offsets). The device copy of a table is cached (csrc/cuda/table_cache.cpp), keyed by its exact
// bytes: a step over the same tensors (same storage, sizes, dtypes) finds the table built by an
// earlier step, so there is no host-to-device copy per call, and a CUDA graph can capture the
// kernels (the table a graph uses stays allocated for the life of the process). Params that move
// to new storage, a new param group or new grads give new bytes: a new table is built -- inside a
// capture (grads first allocated in the graph's pool), beside it (csrc/cuda/table_cache.cpp).
//
// Each block takes chunks in a grid-stride loop and finds its tensor by binary search over
// `chunk_begin`. All element indexing is int64, so a tensor over 2^31 elements works.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstring>
#include <vector>

#include "../common.h"

namespace mpkern {
namespace cuda {

constexpr int64_t kChunk = 1 << 16;  // elements per work item (multiple of 8: chunks keep 16 B alignment)
constexpr int kBlock = 512;

// The device copy of `bytes` on `device` (the current device), from the cache if this exact
// table was built before; one first needed during a CUDA graph capture is built beside the capture
// and kept (csrc/cuda/table_cache.cpp). Thread-safe.
const void* cached_table(c10::Device device, const void* bytes, size_t nbytes);

template <typename Row>
const Row* cached_rows(c10::Device device, const std::vector<Row>& rows) {
  return static_cast<const Row*>(cached_table(device, rows.data(), rows.size() * sizeof(Row)));
}

// One row per non-empty tensor of a grad_stats / scale_ list.
struct TensorMeta {
  int64_t ptr;          // data pointer
  int64_t numel;        // elements
  int64_t chunk_begin;  // global index of this tensor's first chunk
  int32_t dtype;        // mpkern::DType
  int32_t index;        // position in the caller's list
};
static_assert(sizeof(TensorMeta) == 32, "TensorMeta layout");

struct MetaTable {
  const TensorMeta* rows = nullptr;  // on the device
  int count = 0;
  int64_t total_chunks = 0;
};

// The (cached) table of a tensor list on `device`. Empty tensors are left out.
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
  if (tab.count > 0) tab.rows = cached_rows(device, host);
  return tab;
}

inline int grid_for(int64_t total_chunks, int blocks_per_sm = 4) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t g = std::min<int64_t>(total_chunks, static_cast<int64_t>(sms) * blocks_per_sm);
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
    if (meta[mid].chunk_begin <= c)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <int DT>
constexpr int elem_bytes() {
  return DT == kF32 ? 4 : 2;
}

// Elements per 16-byte vector.
template <int DT>
struct Vec {
  static constexpr int N = 16 / elem_bytes<DT>();
};

// Elements before the first 16-byte-aligned element of a buffer at address `p` (p is aligned to
// its element size, as every tensor's data is).
template <int DT>
__device__ __forceinline__ int64_t align_head(int64_t p) {
  return ((16 - (p & 15)) & 15) / elem_bytes<DT>();
}

__device__ __forceinline__ void unpack16(const uint4 raw, uint16_t (&h)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    h[2 * k] = static_cast<uint16_t>(w[k] & 0xffffu);
    h[2 * k + 1] = static_cast<uint16_t>(w[k] >> 16);
  }
}

__device__ __forceinline__ uint4 pack16(const uint16_t (&h)[8]) {
  return make_uint4(h[0] | (static_cast<uint32_t>(h[1]) << 16), h[2] | (static_cast<uint32_t>(h[3]) << 16),
                    h[4] | (static_cast<uint32_t>(h[5]) << 16), h[6] | (static_cast<uint32_t>(h[7]) << 16));
}

// The Vec<DT>::N floats of one 16-byte vector's bytes.
template <int DT>
__device__ __forceinline__ void vec_from_raw(const uint4 raw, float (&x)[Vec<DT>::N]) {
  if constexpr (DT == kF32) {
    x[0] = __uint_as_float(raw.x);
    x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z);
    x[3] = __uint_as_float(raw.w);
  } else {
    uint16_t h[8];
    unpack16(raw, h);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = DT == kBF16 ? bf16_to_f32(h[k]) : f16_to_f32(h[k]);
  }
}

// Load / store one 16-byte vector (element i must be 16-byte aligned) as Vec<DT>::N floats.
template <int DT>
__device__ __forceinline__ void load_vec(const void* base, int64_t i, float (&x)[Vec<DT>::N]) {
  vec_from_raw<DT>(*reinterpret_cast<const uint4*>(static_cast<const char*>(base) + i * elem_bytes<DT>()), x);
}

template <int DT>
__device__ __forceinline__ void store_vec(void* base, int64_t i, const float (&x)[Vec<DT>::N]) {
  uint4 raw;
  if constexpr (DT == kF32) {
    raw.x = __float_as_uint(x[0]);
    raw.y = __float_as_uint(x[1]);
    raw.z = __float_as_uint(x[2]);
    raw.w = __float_as_uint(x[3]);
  } else {
    uint16_t h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = DT == kBF16 ? f32_to_bf16_rne(x[k]) : f32_to_f16_rne(x[k]);
    raw = pack16(h);
  }
  *reinterpret_cast<uint4*>(static_cast<char*>(base) + i * elem_bytes<DT>()) = raw;
}

// Eight elements starting at a 16-byte-aligned element i: one 16-byte access for 16-bit
// buffers, two for fp32.
template <int DT>
__device__ __forceinline__ void load8(const void* base, int64_t i, float (&x)[8]) {
  if constexpr (DT == kF32) {
    float a[4], b[4];
    load_vec<kF32>(base, i, a);
    load_vec<kF32>(base, i + 4, b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[k] = a[k];
      x[k + 4] = b[k];
    }
  } else {
    load_vec<DT>(base, i, x);
  }
}

template <int DT>
__device__ __forceinline__ void store8(void* base, int64_t i, const float (&x)[8]) {
  if constexpr (DT == kF32) {
    const float a[4] = {x[0], x[1], x[2], x[3]}, b[4] = {x[4], x[5], x[6], x[7]};
    store_vec<kF32>(base, i, a);
    store_vec<kF32>(base, i + 4, b);
  } else {
    store_vec<DT>(base, i, x);
  }
}

// Words Q.. of w shifted right by s bits (0 or 16) across word boundaries: out[k] = bits 32(Q+k)+s.. of w.
template <int Q, int NW, int NO>
__device__ __forceinline__ void shift_words(const uint32_t (&w)[NW], uint32_t s, uint32_t (&out)[NO]) {
#pragma unroll
  for (int k = 0; k < NO; ++k) out[k] = __funnelshift_r(w[Q + k], w[Q + k + 1 < NW ? Q + k + 1 : NW - 1], s);
}

// Eight elements starting at element i of a read-only buffer that need not be 16-byte aligned there
// (a grad that is a view at an offset: DDP bucket views, flat buffers), next to buffers that are:
// the aligned 16-byte blocks holding them are loaded whole (two for 16-bit elements, three for
// fp32; each holds at least one of the eight, so nothing outside the buffer's own blocks is read)
// and the bytes shifted into place. The byte offset is the same for every element of a tensor, so
// the switch is warp-uniform; an aligned i takes load8.
template <int DT>
__device__ __forceinline__ void load8_shifted(const void* base, int64_t i, float (&x)[8]) {
  const char* a = static_cast<const char*>(base) + i * elem_bytes<DT>();
  const int o = static_cast<int>(reinterpret_cast<uintptr_t>(a) & 15);
  if (o == 0) {
    load8<DT>(base, i, x);
    return;
  }
  constexpr int NB = DT == kF32 ? 3 : 2, NW = 4 * NB, NO = DT == kF32 ? 8 : 4;
  const uint4* blk = reinterpret_cast<const uint4*>(a - o);
  uint32_t w[NW], out[NO];
#pragma unroll
  for (int b = 0; b < NB; ++b) {
    const uint4 r = blk[b];
    w[4 * b] = r.x;
    w[4 * b + 1] = r.y;
    w[4 * b + 2] = r.z;
    w[4 * b + 3] = r.w;
  }
  const uint32_t s = static_cast<uint32_t>(o & 3) * 8u;
  switch (o >> 2) {
    case 0: shift_words<0>(w, s, out); break;
    case 1: shift_words<1>(w, s, out); break;
    case 2: shift_words<2>(w, s, out); break;
    default: shift_words<3>(w, s, out); break;
  }
  if constexpr (DT == kF32) {
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = __uint_as_float(out[k]);
  } else {
    uint16_t h[8];
    unpack16(make_uint4(out[0], out[1], out[2], out[3]), h);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] = DT == kBF16 ? bf16_to_f32(h[k]) : f16_to_f32(h[k]);
  }
}

// One 16-byte store (st.global.wb, the default write-back policy): a plain uint4 assignment is lowered to
// four 4-byte stores that ptxas merges only where it proves the alignment itself (not in the compact
// kernels, with their shared-memory stage: 4 ST.E per 8 elements instead of one).
__device__ __forceinline__ void store8_u16(void* base, int64_t i, const uint16_t (&h)[8]) {
  __stwb(reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i), pack16(h));
}

}  // namespace cuda
}  // namespace mpkern
