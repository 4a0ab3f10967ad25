// The dense AdamW kernel's element updates (fp32 or bf16 moments): one element with scalar accesses
// (a tensor's unaligned head and tail), kVE elements with 16-byte accesses (the body). Internal to
// csrc/cuda/adamw_cuda.cu, which includes it after adamw_lanes.cuh.
#pragma once

#include "adamw_lanes.cuh"

namespace mpkern {
namespace cuda {
namespace {

// One element, scalar loads and stores.
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
__device__ __forceinline__ void adam_scalar(const AdamMeta& t, int64_t i, const AdamWConsts& cs, float factor, bool sr,
                                            const RngKeys& keys) {
  void *M = reinterpret_cast<void*>(t.m), *V = reinterpret_cast<void*>(t.v);
  float* VMAX = reinterpret_cast<float*>(t.vmax);
  const uint64_t e = static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(i);
  const bool w0 = needs_word0<PDT, MOMENT_MODE, MASTER_MODE>(sr);
  const uint32_t r0 = (w0 || MOMENT_MODE == kBF16) ? rng_word(keys, e) : 0u;
  const float g = load_as_f32(reinterpret_cast<const void*>(t.g), i, GDT) * factor;
  float p = load_w<PDT, MASTER_MODE>(t, i);
  float m = load_as_f32(M, i, MOMENT_MODE);
  float v = load_as_f32(V, i, MOMENT_MODE);
  p = adamw_update(p, g, m, v, VMAX ? VMAX + i : nullptr, cs);
  if constexpr (MOMENT_MODE == kBF16) {
    static_cast<uint16_t*>(M)[i] = f32_to_bf16_sr(m, rand_b16(r0));
    static_cast<uint16_t*>(V)[i] = f32_to_bf16_sr(v, rand_c16(r0));
  } else {
    static_cast<float*>(M)[i] = m;
    static_cast<float*>(V)[i] = v;
  }
  store_w<PDT, MASTER_MODE>(t, i, p, r0, w0);
}

// kVE elements starting at i, where every buffer is 16-byte aligned (an int8 buffer: 8-byte accesses).
template <int PDT, int GDT, int MOMENT_MODE, int MASTER_MODE>
__device__ __forceinline__ void adam_vec(const AdamMeta& t, int64_t i, const AdamWConsts& cs, float factor, bool sr,
                                         const RngKeys& keys) {
  void* M = reinterpret_cast<void*>(t.m);
  void* V = reinterpret_cast<void*>(t.v);
  float g[kVE], p[kVE], m[kVE], v[kVE];
  load8_shifted<GDT>(reinterpret_cast<const void*>(t.g), i, g);  // the grad may be at any offset
  load8_w<PDT, MASTER_MODE>(t, i, p);
  load8<MOMENT_MODE>(M, i, m);
  load8<MOMENT_MODE>(V, i, v);
  if (t.vmax != 0) {
    float vm[kVE];
    load8<kF32>(reinterpret_cast<const void*>(t.vmax), i, vm);
#pragma unroll
    for (int k = 0; k < kVE; ++k) p[k] = adamw_update(p[k], g[k] * factor, m[k], v[k], &vm[k], cs);
    store8<kF32>(reinterpret_cast<void*>(t.vmax), i, vm);
  } else {
#pragma unroll
    for (int k = 0; k < kVE; ++k) p[k] = adamw_update(p[k], g[k] * factor, m[k], v[k], nullptr, cs);
  }
  // the elements' random words, one each, for every rounding below
  const bool w0 = needs_word0<PDT, MOMENT_MODE, MASTER_MODE>(sr);
  uint32_t rw[kVE] = {};
  if (MOMENT_MODE == kBF16 || w0) {
    const uint64_t e = static_cast<uint64_t>(t.offset) + static_cast<uint64_t>(i);
#pragma unroll
    for (int k = 0; k < kVE; ++k) rw[k] = rng_word(keys, e + k);
  }
  if constexpr (MOMENT_MODE == kBF16) {
    uint16_t hm[kVE], hv[kVE];
#pragma unroll
    for (int k = 0; k < kVE; ++k) {
      hm[k] = f32_to_bf16_sr(m[k], rand_b16(rw[k]));
      hv[k] = f32_to_bf16_sr(v[k], rand_c16(rw[k]));
    }
    store8_u16(M, i, hm);
    store8_u16(V, i, hv);
  } else {
    store8<MOMENT_MODE>(M, i, m);
    store8<MOMENT_MODE>(V, i, v);
  }
  store8_w<PDT, MASTER_MODE>(t, i, p, rw, w0);
}

}  // namespace
}  // namespace cuda
}  // namespace mpkern
