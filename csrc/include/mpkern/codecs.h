// The codecs of mpkern::adamw_step_ and the op schemas, from the one table mpkern/codecs.def (which
// Python reads too): the master modes (MasterMode kMasterNone ...), the moment modes (kMomF32,
// kMomBF16, kMom8, kMom4 ...), each moment mode's layout (moment_group, moment_codes_per_byte), and
// the rows by name (kMasterCodecs, kMomentCodecs, kOpSchemas) that csrc/ops.cpp parses the op's
// arguments with. No torch dependency: math.h and the CUDA device code include it.
#pragma once

#include <stdint.h>

// the table, relative to this header: one file for C++ and Python, in the Python package
#define MPKERN_CODECS_DEF "../../../mpkern/codecs.def"

namespace mpkern {

// The storage dtypes a row names (c10::ScalarType's names; csrc/adamw_common.h maps them to it).
enum class CodecDType : int32_t { Undefined, Float, Half, BFloat16, Char, Byte, Short };

struct MasterCodec {
  const char* name;  // the op's master_codec
  int32_t mode;      // MasterMode
  CodecDType state;  // dtype of the per-param master tensor (Undefined: none)
};
struct MomentCodec {
  const char* name;       // the op's moment_codec
  int32_t mode;           // the kernels' moment mode
  CodecDType exp_avg;     // dtype of the exp_avgs
  CodecDType exp_avg_sq;  // dtype of the exp_avg_sqs
  int32_t group;          // elements per bf16 scale (0: no exp_avg_scales / exp_avg_sq_scales)
  int32_t per_byte;       // exp_avg codes per byte (2: packed nibbles, ceil(numel / 2) bytes)
};
struct OpSchema {
  const char* op;
  const char* schema;
};

// master_codec -> the kernels' master mode
#define MPKERN_MASTER_CODEC(ident, name, mode, dtype) ident = mode,
#define MPKERN_MOMENT_CODEC(ident, name, mode, exp_avg, exp_avg_sq, group, per_byte)
#define MPKERN_OP_SCHEMA(op, schema)
enum MasterMode : int {
#include MPKERN_CODECS_DEF
};
#undef MPKERN_MASTER_CODEC
#undef MPKERN_MOMENT_CODEC

// moment_codec -> the kernels' moment mode (a dense codec's is the dtype code of its moments)
#define MPKERN_MASTER_CODEC(ident, name, mode, dtype)
#define MPKERN_MOMENT_CODEC(ident, name, mode, exp_avg, exp_avg_sq, group, per_byte) constexpr int32_t ident = mode;
#include MPKERN_CODECS_DEF
#undef MPKERN_MOMENT_CODEC

// Elements per bf16 scale of a moment mode's grouped codes (0: no scales; -1: no such mode).
#define MPKERN_MOMENT_CODEC(ident, name, mode_, exp_avg, exp_avg_sq, group, per_byte) mode == mode_ ? group:
constexpr int32_t moment_group(int32_t mode) {
  return
#include MPKERN_CODECS_DEF
      -1;
}
#undef MPKERN_MOMENT_CODEC

// exp_avg codes per byte of a moment mode (2: packed nibbles; -1: no such mode).
#define MPKERN_MOMENT_CODEC(ident, name, mode_, exp_avg, exp_avg_sq, group, per_byte) mode == mode_ ? per_byte:
constexpr int32_t moment_codes_per_byte(int32_t mode) {
  return
#include MPKERN_CODECS_DEF
      -1;
}
#undef MPKERN_MOMENT_CODEC

// Whether a moment mode's moments are grouped codes with scales (the compact kernels' path).
constexpr bool moment_grouped(int32_t mode) { return moment_group(mode) > 0; }

// The rows by name.
#undef MPKERN_MASTER_CODEC
#define MPKERN_MASTER_CODEC(ident, name, mode, dtype) MasterCodec{name, mode, CodecDType::dtype},
#define MPKERN_MOMENT_CODEC(ident, name, mode, exp_avg, exp_avg_sq, group, per_byte)
inline constexpr MasterCodec kMasterCodecs[] = {
#include MPKERN_CODECS_DEF
};
#undef MPKERN_MASTER_CODEC
#undef MPKERN_MOMENT_CODEC
#define MPKERN_MASTER_CODEC(ident, name, mode, dtype)
#define MPKERN_MOMENT_CODEC(ident, name, mode, exp_avg, exp_avg_sq, group, per_byte) \
  MomentCodec{name, mode, CodecDType::exp_avg, CodecDType::exp_avg_sq, group, per_byte},
inline constexpr MomentCodec kMomentCodecs[] = {
#include MPKERN_CODECS_DEF
};
#undef MPKERN_MOMENT_CODEC
#undef MPKERN_OP_SCHEMA
#define MPKERN_MOMENT_CODEC(ident, name, mode, exp_avg, exp_avg_sq, group, per_byte)
#define MPKERN_OP_SCHEMA(op, schema) OpSchema{#op, schema},
inline constexpr OpSchema kOpSchemas[] = {
#include MPKERN_CODECS_DEF
};
#undef MPKERN_MASTER_CODEC
#undef MPKERN_MOMENT_CODEC
#undef MPKERN_OP_SCHEMA

// A row's dtype by its table name ("Float", ...), for mpkern._C.codec_table().
constexpr const char* codec_dtype_name(CodecDType d) {
  switch (d) {
    case CodecDType::Float: return "Float";
    case CodecDType::Half: return "Half";
    case CodecDType::BFloat16: return "BFloat16";
    case CodecDType::Char: return "Char";
    case CodecDType::Byte: return "Byte";
    case CodecDType::Short: return "Short";
    default: return "Undefined";
  }
}

}  // namespace mpkern
