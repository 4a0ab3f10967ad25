// Argument checks of mpkern::adamw_step_, shared by every backend (the C++ CPU and CUDA kernels
// call it directly, the Triton and PyTorch backends through mpkern._C.check_adamw_args).
#pragma once

#include "common.h"
#include "kernels.h"

namespace mpkern {
// The random stream of tensor i: (stream id, offset of its element 0), defaults when not given.
inline uint32_t stream_of(at::IntArrayRef stream_ids, size_t i) {
  return static_cast<uint32_t>(stream_ids.empty() ? static_cast<int64_t>(i) : stream_ids[i]);
}
// An optional tensor list of the schema (Tensor[]?) as a list (None: empty).
inline at::TensorList list_or_empty(const std::optional<at::TensorList>& l) {
  return l.has_value() ? *l : at::TensorList();
}
inline uint64_t offset_of(at::IntArrayRef elem_offsets, size_t i) {
  return elem_offsets.empty() ? 0u : static_cast<uint64_t>(elem_offsets[i]);
}
}  // namespace mpkern

namespace mpkern {

// A codec row's dtype (csrc/include/mpkern/codecs.h) as the torch dtype.
inline at::ScalarType scalar_type_of(CodecDType d) {
  switch (d) {
    case CodecDType::Float: return at::kFloat;
    case CodecDType::Half: return at::kHalf;
    case CodecDType::BFloat16: return at::kBFloat16;
    case CodecDType::Char: return at::kChar;
    case CodecDType::Byte: return at::kByte;
    case CodecDType::Short: return at::kShort;
    default: return at::ScalarType::Undefined;
  }
}

// A dtype by its table name ("Float", "Char", ...; codec_dtype_name's inverse), for a codec row
// that comes from Python (a codec registered for the torch backend).
inline CodecDType codec_dtype_of(const char* op, const std::string& name) {
  for (CodecDType d : {CodecDType::Float, CodecDType::Half, CodecDType::BFloat16, CodecDType::Char, CodecDType::Byte,
                       CodecDType::Short, CodecDType::Undefined})
    if (name == codec_dtype_name(d)) return d;
  TORCH_CHECK_TYPE(false, op, ": unknown codec dtype '", name, "'");
  return CodecDType::Undefined;
}

// 'a', 'b' or 'c' -- the names of a codec table, for the error of an unknown name.
template <typename Row, size_t N>
std::string codec_names(const Row (&rows)[N]) {
  std::string out;
  for (size_t i = 0; i < N; ++i) out += (i ? (i + 1 == N ? " or '" : ", '") : "'") + std::string(rows[i].name) + "'";
  return out;
}

// The row called `name` of a codec table; ValueError naming `arg` and the table's names otherwise.
template <typename Row, size_t N>
const Row& codec_row(const char* op, const char* arg, const Row (&rows)[N], c10::string_view name) {
  for (const Row& c : rows)
    if (name == c.name) return c;
  TORCH_CHECK_VALUE(false, op, ": ", arg, " must be ", codec_names(rows), ", got '", std::string(name), "'");
  return rows[0];
}

// The op's master_codec argument as its row of the table.
inline const MasterCodec& master_codec_of(const char* op, c10::string_view codec) {
  return codec_row(op, "master_codec", kMasterCodecs, codec);
}

// The op's moment_codec argument as its row of the table. Parsed once, by the registered op
// (csrc/ops.cpp): the kernels take the mode it names instead of reading it from a dtype, so two
// formats may share a dtype; check_adamw_args checks every moment tensor against the row.
inline const MomentCodec& moment_codec_of(const char* op, c10::string_view codec) {
  return codec_row(op, "moment_codec", kMomentCodecs, codec);
}

// Every argument of one call against the codecs' rows: list lengths, the streams, each tensor's
// device, layout, size and dtype (the moments' as the moment codec's row says, with a bf16 scale per
// group when it groups; the masters' as the master codec's). The scalars: check_adamw_scalars.
inline void check_adamw_args(const char* op, const AdamwArgs& a, const MasterCodec& master,
                             const MomentCodec& moments) {
  const at::TensorList params = a.params, grads = a.grads, exp_avgs = a.exp_avgs, exp_avg_sqs = a.exp_avg_sqs;
  const at::TensorList max_exp_avg_sqs = a.max_exp_avg_sqs, masters = a.masters, steps = a.steps;
  const at::TensorList exp_avg_scales = list_or_empty(a.exp_avg_scales);
  const at::TensorList exp_avg_sq_scales = list_or_empty(a.exp_avg_sq_scales);
  const at::IntArrayRef stream_ids = a.stream_ids, elem_offsets = a.elem_offsets;
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n, op,
                    ": params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  TORCH_CHECK_VALUE(max_exp_avg_sqs.empty() || max_exp_avg_sqs.size() == n, op,
                    ": max_exp_avg_sqs must be empty or one per param");
  TORCH_CHECK_VALUE(stream_ids.empty() || stream_ids.size() == n, op,
                    ": stream_ids must be empty or one per param, got ", stream_ids.size(), " for ", n, " params");
  TORCH_CHECK_VALUE(elem_offsets.empty() || elem_offsets.size() == n, op,
                    ": elem_offsets must be empty or one per param, got ", elem_offsets.size(), " for ", n, " params");
  for (size_t i = 0; i < stream_ids.size(); ++i)
    TORCH_CHECK_VALUE(stream_ids[i] >= 0 && stream_ids[i] <= 0xffffffffLL, op, ": stream_ids[", i,
                      "] = ", stream_ids[i], " is not in [0, 2^32)");
  for (size_t i = 0; i < elem_offsets.size(); ++i)
    TORCH_CHECK_VALUE(elem_offsets[i] >= 0, op, ": elem_offsets[", i, "] = ", elem_offsets[i], " is negative");
  const at::ScalarType master_dt = scalar_type_of(master.state);
  const bool has_master = master_dt != at::ScalarType::Undefined;
  TORCH_CHECK_VALUE(has_master ? masters.size() == n : masters.empty(), op,
                    ": masters must be one per param (empty when master_codec is '", master.name, "')");
  const std::string codec = moments.name;
  const at::ScalarType m_dt = scalar_type_of(moments.exp_avg), v_dt = scalar_type_of(moments.exp_avg_sq);
  const bool grouped = moments.group > 0, packed = moments.per_byte == 2;
  if (grouped) {
    TORCH_CHECK_VALUE(max_exp_avg_sqs.empty(), op, ": amsgrad is not supported with moment_codec '", codec,
                      "' (max_exp_avg_sqs must be empty)");
    TORCH_CHECK_VALUE(exp_avg_scales.size() == n && exp_avg_sq_scales.size() == n, op, ": moment_codec '", codec,
                      "' needs exp_avg_scales and exp_avg_sq_scales, one per param; got ", exp_avg_scales.size(),
                      " and ", exp_avg_sq_scales.size(), " for ", n, " params");
  } else {
    TORCH_CHECK_VALUE(exp_avg_scales.empty() && exp_avg_sq_scales.empty(), op,
                      ": exp_avg_scales and exp_avg_sq_scales must be empty with moment_codec '", codec,
                      "' (only grouped codes have scales)");
  }
  const c10::Device dev = n ? params[0].device() : a.grad_factor.device();
  check_scalar_f32(op, "grad_factor", a.grad_factor, dev);
  check_scalar_f32(op, "found_inf", a.found_inf, dev);
  if (a.lr_tensor.has_value()) check_scalar_f32(op, "lr", *a.lr_tensor, dev);
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
    dtype_code(p.scalar_type());
    dtype_code(grads[i].scalar_type());
    TORCH_CHECK_TYPE(exp_avgs[i].scalar_type() == m_dt, op, ": moment_codec '", codec, "' needs ", m_dt,
                     " exp_avgs; exp_avgs[", i, "] is ", exp_avgs[i].scalar_type());
    TORCH_CHECK_TYPE(exp_avg_sqs[i].scalar_type() == v_dt, op, ": moment_codec '", codec, "' needs ", v_dt,
                     " exp_avg_sqs; exp_avg_sqs[", i, "] is ", exp_avg_sqs[i].scalar_type());
    same(exp_avgs[i], "exp_avgs", packed);  // packed: two codes per byte
    same(exp_avg_sqs[i], "exp_avg_sqs");
    if (grouped) {
      const int64_t groups = (numel + moments.group - 1) / moments.group;
      auto scale = [&](const at::Tensor& s, const char* what) {
        TORCH_CHECK_VALUE(s.layout() == at::kStrided, op, ": ", what, "[", i, "] must be a strided (dense) tensor");
        TORCH_CHECK_TYPE(s.scalar_type() == at::kBFloat16, op, ": ", what, "[", i, "] must be bfloat16, got ",
                         s.scalar_type());
        TORCH_CHECK_VALUE(s.device() == dev, op, ": ", what, "[", i, "] is on ", s.device(), ", expected ", dev);
        TORCH_CHECK_VALUE(s.numel() == groups, op, ": ", what, "[", i, "] has ", s.numel(),
                          " elements, expected ceil(numel / ", moments.group, ") = ", groups);
        TORCH_CHECK_VALUE(s.is_contiguous(), op, ": ", what, "[", i, "] must be contiguous");
      };
      scale(exp_avg_scales[i], "exp_avg_scales");
      scale(exp_avg_sq_scales[i], "exp_avg_sq_scales");
    }
    if (!max_exp_avg_sqs.empty()) {
      same(max_exp_avg_sqs[i], "max_exp_avg_sqs");
      TORCH_CHECK_TYPE(max_exp_avg_sqs[i].scalar_type() == at::kFloat, op, ": max_exp_avg_sqs must be float32");
    }
    if (master.mode == kMasterRemainder)
      TORCH_CHECK_TYPE(p.scalar_type() == at::kBFloat16, op, ": remainder masters need bfloat16 params");
    if (master.mode == kMaster8bit)
      TORCH_CHECK_TYPE(p.scalar_type() == at::kBFloat16 || p.scalar_type() == at::kHalf, op,
                       ": master_codec '8bit' (8-bit master corrections) needs bfloat16 or float16 params; params[", i,
                       "] is ", p.scalar_type(), ", which is its own fp32 master (use master_codec 'none')");
    if (has_master) {
      same(masters[i], "masters");
      TORCH_CHECK_TYPE(masters[i].scalar_type() == master_dt, op, ": master_codec '", master.name, "' needs ",
                       master_dt, " masters; masters[", i, "] is ", masters[i].scalar_type());
    }
    TORCH_CHECK_VALUE(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat && steps[i].device() == dev, op,
                      ": steps[", i, "] must be a one-element float32 tensor on ", dev);
  }
}

// The step's scalars, in torch.optim.AdamW's ranges: lr >= 0 (unless lr_tensor holds it), eps >= 0,
// 0 <= beta1, beta2 < 1, weight_decay >= 0 (NaN fails each). The kernels' paths (scalar, AVX2, AVX-512,
// CUDA, Triton, reference) agree bit for bit inside them only -- a negative beta2, say, makes v negative,
// whose codes each path rounds its own way -- so every backend refuses what lies outside.
inline void check_adamw_scalars(const char* op, bool has_lr_tensor, double lr, double beta1, double beta2, double eps,
                                double weight_decay) {
  TORCH_CHECK_VALUE(has_lr_tensor || lr >= 0.0, op, ": lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, op, ": beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, op, ": beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK_VALUE(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, op, ": weight_decay must be >= 0, got ", weight_decay);
}

// The bundle's scalars (lr counts only without lr_tensor).
inline void check_adamw_scalars(const char* op, const AdamwArgs& a) {
  check_adamw_scalars(op, a.lr_tensor.has_value(), a.lr, a.beta1, a.beta2, a.eps, a.weight_decay);
}

// check_adamw_args for a kernel that runs on one device type only; returns the call's device.
inline c10::Device check_adamw_args_on(const char* op, const AdamwArgs& a, const MasterCodec& master,
                                       const MomentCodec& moments, c10::DeviceType device_type) {
  check_adamw_args(op, a, master, moments);
  const c10::Device dev = a.params.empty() ? a.grad_factor.device() : a.params[0].device();
  TORCH_CHECK_VALUE(dev.type() == device_type, op, ": tensors are on ", dev, ", expected ", device_type);
  return dev;
}

}  // namespace mpkern
