// Argument checks of mpkern::adamw_step_, shared by every backend (the C++ CPU and CUDA kernels
// call it directly, the Triton and PyTorch backends through mpkern._C.check_adamw_args).
#pragma once

#include "common.h"

namespace mpkern {

enum MasterMode : int { kMasterNone = 0, kMasterF32 = 1, kMasterRemainder = 2, kMaster8bit = 3 };

// The op's master_codec argument ("none", "fp32", "remainder", "8bit") as the kernels' MasterMode.
inline int64_t master_mode_of(const char* op, c10::string_view codec) {
  if (codec == "none") return kMasterNone;
  if (codec == "fp32") return kMasterF32;
  if (codec == "remainder") return kMasterRemainder;
  if (codec == "8bit") return kMaster8bit;
  TORCH_CHECK_VALUE(false, op, ": master_codec must be 'none', 'fp32', 'remainder' or '8bit', got '",
                    std::string(codec), "'");
  return kMasterNone;
}

// The op's moment_codec argument ("float32", "bfloat16", "8bit", "4bit_m") as the kernels' moment
// code (kF32, kBF16, kMom8, kMom4), checked against the moment tensors it names (float32 / bfloat16
// exp_avgs, int8 exp_avgs, uint8 exp_avgs of packed 4-bit codes). Parsed once, by the registered op
// (csrc/ops.cpp): the kernels take the code it returns instead of reading it from a dtype, so two
// formats may one day share a dtype; the per-tensor layout checks are check_adamw_args'.
inline int64_t moment_mode_of(const char* op, c10::string_view codec, at::TensorList exp_avgs) {
  at::ScalarType want;
  int64_t mode;
  if (codec == "float32") {
    want = at::kFloat, mode = kF32;
  } else if (codec == "bfloat16") {
    want = at::kBFloat16, mode = kBF16;
  } else if (codec == "8bit") {
    want = at::kChar, mode = kMom8;
  } else if (codec == "4bit_m") {
    want = at::kByte, mode = kMom4;
  } else {
    TORCH_CHECK_VALUE(false, op, ": moment_codec must be 'float32', 'bfloat16', '8bit' or '4bit_m', got '",
                      std::string(codec), "'");
    return kF32;
  }
  for (size_t i = 0; i < exp_avgs.size(); ++i)
    TORCH_CHECK_TYPE(exp_avgs[i].scalar_type() == want, op, ": moment_codec '", std::string(codec),
                     "' needs ", want, " exp_avgs; exp_avgs[", i, "] is ", exp_avgs[i].scalar_type());
  return mode;
}

inline void check_adamw_args(const char* op, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                             at::TensorList exp_avg_sqs, at::TensorList max_exp_avg_sqs, at::TensorList masters,
                             at::TensorList steps, const at::Tensor& grad_factor, const at::Tensor& found_inf,
                             const std::optional<at::Tensor>& lr_tensor, int64_t master_mode,
                             at::IntArrayRef stream_ids = {}, at::IntArrayRef elem_offsets = {},
                             at::TensorList exp_avg_scales = {}, at::TensorList exp_avg_sq_scales = {}) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n, op,
              ": params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  TORCH_CHECK_VALUE(max_exp_avg_sqs.empty() || max_exp_avg_sqs.size() == n, op,
              ": max_exp_avg_sqs must be empty or one per param");
  TORCH_CHECK_VALUE(master_mode >= kMasterNone && master_mode <= kMaster8bit, op, ": bad master_mode ", master_mode,
                    " (0 none, 1 fp32, 2 int16 remainder, 3 int8 correction)");
  TORCH_CHECK_VALUE(stream_ids.empty() || stream_ids.size() == n, op,
                    ": stream_ids must be empty or one per param, got ", stream_ids.size(), " for ", n, " params");
  TORCH_CHECK_VALUE(elem_offsets.empty() || elem_offsets.size() == n, op,
                    ": elem_offsets must be empty or one per param, got ", elem_offsets.size(), " for ", n, " params");
  for (size_t i = 0; i < stream_ids.size(); ++i)
    TORCH_CHECK_VALUE(stream_ids[i] >= 0 && stream_ids[i] <= 0xffffffffLL, op, ": stream_ids[", i, "] = ",
                      stream_ids[i], " is not in [0, 2^32)");
  for (size_t i = 0; i < elem_offsets.size(); ++i)
    TORCH_CHECK_VALUE(elem_offsets[i] >= 0, op, ": elem_offsets[", i, "] = ", elem_offsets[i], " is negative");
  TORCH_CHECK_VALUE(master_mode == kMasterNone ? masters.empty() : masters.size() == n, op,
              ": masters must be one per param (empty when master_codec is 'none')");
  // companded moments with group scales: selected by int8 exp_avgs (8-bit) or uint8 exp_avgs (4-bit
  // exp_avg, two codes per byte), for every param of the call or none
  const at::ScalarType sdt0 = n ? exp_avgs[0].scalar_type() : at::kFloat;
  const bool mom4 = sdt0 == at::kByte;
  const bool mom8 = sdt0 == at::kChar || mom4;
  const char* kind = mom4 ? "4-bit exp_avg (uint8 exp_avgs)" : "8-bit (int8 exp_avgs)";
  if (mom8) {
    TORCH_CHECK_VALUE(max_exp_avg_sqs.empty(), op, ": amsgrad is not supported with ", kind,
                      " moments (max_exp_avg_sqs must be empty)");
    TORCH_CHECK_VALUE(exp_avg_scales.size() == n && exp_avg_sq_scales.size() == n, op, ": ", kind,
                      " moments need exp_avg_scales and exp_avg_sq_scales, one per param; got ",
                      exp_avg_scales.size(), " and ", exp_avg_sq_scales.size(), " for ", n, " params");
  } else {
    TORCH_CHECK_VALUE(exp_avg_scales.empty() && exp_avg_sq_scales.empty(), op,
                      ": exp_avg_scales and exp_avg_sq_scales must be empty unless the moments are 8-bit "
                      "(int8 exp_avgs, uint8 exp_avg_sqs)");
  }
  const c10::Device dev = n ? params[0].device() : grad_factor.device();
  check_scalar_f32(op, "grad_factor", grad_factor, dev);
  check_scalar_f32(op, "found_inf", found_inf, dev);
  if (lr_tensor.has_value()) check_scalar_f32(op, "lr", *lr_tensor, dev);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    const int64_t numel = p.numel();
    // a dense tensor on the call's device with the param's numel (or, `packed`, the 4-bit codes' bytes)
    auto same = [&](const at::Tensor& t, const char* what, bool packed = false) {
      TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": ", what, "[", i, "] must be a strided (dense) tensor");
      TORCH_CHECK_VALUE(t.device() == dev, op, ": ", what, "[", i, "] is on ", t.device(), ", expected ", dev);
      if (packed) {
        TORCH_CHECK_VALUE(t.numel() == (numel + 1) / 2, op, ": ", what, "[", i, "] has ", t.numel(),
                          " elements; 4-bit exp_avg codes of a param of ", numel,
                          " elements need ceil(numel / 2) = ", (numel + 1) / 2, " bytes");
      } else {
        TORCH_CHECK_VALUE(t.numel() == numel, op, ": ", what, "[", i, "] has ", t.numel(), " elements, param has ",
                          numel);
      }
      TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", what, "[", i, "] must be contiguous");
    };
    same(p, "params");
    same(grads[i], "grads");
    same(exp_avgs[i], "exp_avgs", mom4);  // 4-bit: two codes per byte
    same(exp_avg_sqs[i], "exp_avg_sqs");
    dtype_code(p.scalar_type());
    dtype_code(grads[i].scalar_type());
    const auto sdt = exp_avgs[i].scalar_type();
    if (mom8) {
      TORCH_CHECK_TYPE(sdt == sdt0, op, ": exp_avgs[", i, "] is ", sdt, ", but exp_avgs[0] is ", sdt0, " (", kind,
                       " moments): every param of a call has the same moment kind");
      TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == at::kByte, op, ": exp_avg_sqs[", i,
                       "] must be uint8 with ", kind, " exp_avgs, got ", exp_avg_sqs[i].scalar_type());
      const int64_t groups = (numel + kMom8Group - 1) / kMom8Group;
      auto scale = [&](const at::Tensor& s, const char* what) {
        TORCH_CHECK_VALUE(s.layout() == at::kStrided, op, ": ", what, "[", i, "] must be a strided (dense) tensor");
        TORCH_CHECK_TYPE(s.scalar_type() == at::kBFloat16, op, ": ", what, "[", i, "] must be bfloat16, got ",
                         s.scalar_type());
        TORCH_CHECK_VALUE(s.device() == dev, op, ": ", what, "[", i, "] is on ", s.device(), ", expected ", dev);
        TORCH_CHECK_VALUE(s.numel() == groups, op, ": ", what, "[", i, "] has ", s.numel(),
                          " elements, expected ceil(numel / 32) = ", groups);
        TORCH_CHECK_VALUE(s.is_contiguous(), op, ": ", what, "[", i, "] must be contiguous");
      };
      scale(exp_avg_scales[i], "exp_avg_scales");
      scale(exp_avg_sq_scales[i], "exp_avg_sq_scales");
    } else {
      TORCH_CHECK_TYPE(sdt == at::kFloat || sdt == at::kBFloat16, op, ": exp_avgs[", i,
                       "]: moments must be float32, bfloat16, 8-bit (int8 exp_avgs + uint8 exp_avg_sqs) or 4-bit "
                       "exp_avg (uint8 exp_avgs of ceil(numel / 2) bytes + uint8 exp_avg_sqs), got ", sdt);
      TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == sdt, op, ": exp_avg and exp_avg_sq dtypes differ");
    }
    if (!max_exp_avg_sqs.empty()) {
      same(max_exp_avg_sqs[i], "max_exp_avg_sqs");
      TORCH_CHECK_TYPE(max_exp_avg_sqs[i].scalar_type() == at::kFloat, op, ": max_exp_avg_sqs must be float32");
    }
    if (master_mode == kMasterF32) {
      same(masters[i], "masters");
      TORCH_CHECK_TYPE(masters[i].scalar_type() == at::kFloat, op, ": fp32 masters must be float32");
    } else if (master_mode == kMasterRemainder) {
      same(masters[i], "masters");
      TORCH_CHECK_TYPE(masters[i].scalar_type() == at::kShort, op, ": remainders must be int16");
      TORCH_CHECK_TYPE(p.scalar_type() == at::kBFloat16, op, ": remainder masters need bfloat16 params");
    } else if (master_mode == kMaster8bit) {
      TORCH_CHECK_TYPE(p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf, op,
                       ": master_codec '8bit' (8-bit master corrections) needs bfloat16 or float16 params; params[", i,
                       "] is ", p.scalar_type(), ", which is its own fp32 master (use master_codec 'none')");
      same(masters[i], "masters");
      TORCH_CHECK_TYPE(masters[i].scalar_type() == at::kChar, op, ": 8-bit master corrections must be int8, got ",
                       masters[i].scalar_type());
    }
    TORCH_CHECK_VALUE(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat && steps[i].device() == dev, op,
                ": steps[", i, "] must be a one-element float32 tensor on ", dev);
  }
}

// The same, for a kernel that runs on one device type only; returns the call's device.
inline c10::Device check_adamw_args_on(const char* op, at::TensorList params, at::TensorList grads,
                                       at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                       at::TensorList max_exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                                       const at::Tensor& grad_factor, const at::Tensor& found_inf,
                                       const std::optional<at::Tensor>& lr_tensor, int64_t master_mode,
                                       at::IntArrayRef stream_ids, at::IntArrayRef elem_offsets,
                                       at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                                       c10::DeviceType device_type) {
  check_adamw_args(op, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, steps, grad_factor, found_inf,
                   lr_tensor, master_mode, stream_ids, elem_offsets, exp_avg_scales, exp_avg_sq_scales);
  const c10::Device dev = params.empty() ? grad_factor.device() : params[0].device();
  TORCH_CHECK_VALUE(dev.type() == device_type, op, ": tensors are on ", dev, ", expected ", device_type);
  return dev;
}

}  // namespace mpkern

namespace mpkern {
// The random stream of tensor i: (stream id, offset of its element 0), defaults when not given.
inline uint32_t stream_of(at::IntArrayRef stream_ids, size_t i) {
  return static_cast<uint32_t>(stream_ids.empty() ? static_cast<int64_t>(i) : stream_ids[i]);
}
// An optional tensor list of the schema (Tensor[]?) as a list (None: empty).
inline at::TensorList list_or_empty(const std::optional<at::TensorList>& l) { return l.has_value() ? *l : at::TensorList(); }
inline uint64_t offset_of(at::IntArrayRef elem_offsets, size_t i) {
  return elem_offsets.empty() ? 0u : static_cast<uint64_t>(elem_offsets[i]);
}
}  // namespace mpkern
