// Torch-side helpers shared by the CPU and CUDA op implementations: dtype codes and argument
// checks. (The per-element math is in include/mpkern/math.h, which has no torch dependency.)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <vector>

#include "mpkern/math.h"

namespace mpkern {

inline int32_t dtype_code(at::ScalarType st) {
  switch (st) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: TORCH_CHECK_TYPE(false, "mpkern: expected float32, float16 or bfloat16, got ", st);
  }
  return -1;
}

// Every tensor: strided, on `device_type`, float32/float16/bfloat16, and dense without overlap
// (so it can be walked as one flat buffer; element order does not matter for these ops).
inline void check_flat_float_list(const char* op, const char* arg, at::TensorList ts, c10::DeviceType device_type) {
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK(t.layout() == at::kStrided, op, ": ", arg, "[", i, "] must be a strided (dense) tensor, got ",
                t.layout());
    TORCH_CHECK(t.device().type() == device_type, op, ": ", arg, "[", i, "] is on ", t.device(), ", expected a ",
                device_type, " tensor");
    dtype_code(t.scalar_type());
    TORCH_CHECK(t.is_non_overlapping_and_dense(), op, ": ", arg, "[", i,
                "] must be dense and non-overlapping (call .contiguous())");
  }
}

inline void check_scalar_f32(const char* op, const char* arg, const at::Tensor& s, c10::Device device) {
  TORCH_CHECK(s.numel() == 1 && s.scalar_type() == at::kFloat, op, ": ", arg,
              " must be a one-element float32 tensor, got ", s.scalar_type(), " with ", s.numel(), " elements");
  TORCH_CHECK(s.device() == device, op, ": ", arg, " is on ", s.device(), ", expected ", device);
}

}  // namespace mpkern
