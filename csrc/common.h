// Torch-side helpers shared by every backend of the mpkern ops: dtype codes and the argument
// checks. The registered ops call these before the C++ CPU and CUDA kernels run (csrc/ops.cpp);
// the Triton ops and the pure-PyTorch backend call the same functions through `mpkern._C`, so
// every backend rejects the same inputs with the same message. (The per-element math is in
// include/mpkern/math.h, which has no torch dependency.)
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <optional>
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

inline void check_scalar_f32(const char* op, const char* arg, const at::Tensor& s, c10::Device device) {
  TORCH_CHECK_VALUE(s.numel() == 1 && s.scalar_type() == at::kFloat, op, ": ", arg,
                    " must be a one-element float32 tensor, got ", s.scalar_type(), " with ", s.numel(), " elements");
  TORCH_CHECK_VALUE(s.device() == device, op, ": ", arg, " is on ", s.device(), ", expected ", device);
}

// The device one call of an op runs on: that of the first tensor of the list, or of the scalar
// argument when the list is empty.
inline c10::Device call_device(at::TensorList ts, const at::Tensor& scalar) {
  return ts.empty() ? scalar.device() : ts[0].device();
}

// Arguments of grad_stats / scale_: every tensor strided, float32/float16/bfloat16, dense without
// overlap (walked as one flat buffer from data_ptr(), storage offset included; element order does
// not matter for these ops), all on one device; `scalar` a one-element float32 tensor there.
// Returns that device.
inline c10::Device check_list_op(const char* op, const char* arg, at::TensorList ts, const char* scalar_arg,
                                 const at::Tensor& scalar) {
  const c10::Device dev = call_device(ts, scalar);
  for (size_t i = 0; i < ts.size(); ++i) {
    const at::Tensor& t = ts[i];
    TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", arg, "[", i, "] must be a strided (dense) tensor, got ",
                      t.layout());
    TORCH_CHECK_VALUE(t.device() == dev, op, ": ", arg, "[", i, "] is on ", t.device(), ", expected ", dev,
                      " (one call per device)");
    dtype_code(t.scalar_type());
    TORCH_CHECK_VALUE(t.is_non_overlapping_and_dense(), op, ": ", arg, "[", i,
                      "] must be dense and non-overlapping (call .contiguous())");
  }
  check_scalar_f32(op, scalar_arg, scalar, dev);
  return dev;
}

// The same, for a kernel that runs on one device type only (the C++ CPU and CUDA kernels).
inline c10::Device check_list_op_on(const char* op, const char* arg, at::TensorList ts, const char* scalar_arg,
                                    const at::Tensor& scalar, c10::DeviceType device_type) {
  const c10::Device dev = check_list_op(op, arg, ts, scalar_arg, scalar);
  TORCH_CHECK_VALUE(dev.type() == device_type, op, ": tensors are on ", dev, ", expected ", device_type);
  return dev;
}

}  // namespace mpkern
