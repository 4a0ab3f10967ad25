// Internal to the CPU AdamW kernel (csrc/cpu/adamw_cpu*.cpp): what its three paths share -- the
// per-tensor pointers and step flags, which stores draw on the random word -- and the entry points
// of each path: adamw_cpu_scalar.cpp (the math.h functions element by element), the vector paths
// adamw_cpu_vec.h written once over a lane traits type and compiled per ISA by adamw_cpu_avx2.cpp
// (8 lanes) and adamw_cpu_avx512.cpp (16 lanes); adamw_cpu.cpp is the op and picks the path per call.
#pragma once

#include <cstdint>

#include "../adamw_common.h"
#include "../common.h"
#include "simd.h"

namespace mpkern {
namespace cpu {
namespace adamw_impl {

static_assert(kChunk % kMom8Group == 0, "8-bit moment groups must not straddle work items");

struct TensorPtrs {
  void* p;
  const void* g;
  void* m;
  void* v;
  float* vmax;
  void* master;  // float* (kMasterF32), int16_t* (kMasterRemainder) or int8_t* (kMaster8bit)
  uint16_t* sm;  // grouped moments (kMom8 / kMom4): bf16 scale bits, one per 32 elements
  uint16_t* sv;
  int32_t pdt, gdt;  // the param's and the grad's dtype (math.h DType)
  // kMomF32, kMomBF16 (the moments' dtype), kMom8 (int8 m + uint8 v codes) or kMom4 (packed 4-bit m)
  int32_t moment_mode;
  uint32_t step;    // after the increment
  uint32_t stream;  // random stream id
  uint64_t offset;  // global index of element 0 in its stream
  AdamWConsts c;
};

struct Flags {
  int master_mode;  // kMasterNone, kMasterF32, kMasterRemainder or kMaster8bit
  bool maximize;
  bool sr;
  uint32_t seed;
  float factor;
};

// Whether a tensor's param/master store draws on the random word (field A: param SR or the 8-bit
// master); its moments do when they are bf16 or 8-bit (fields B, C). One word per element serves all.
inline bool needs_word0(const TensorPtrs& t, const Flags& f) {
  return f.master_mode == kMaster8bit || (f.master_mode == kMasterNone && f.sr && t.pdt == kBF16);
}
inline bool needs_word(const TensorPtrs& t, const Flags& f) { return needs_word0(t, f) || t.moment_mode != kMomF32; }

using AvxFn = void (*)(const TensorPtrs&, int64_t, int64_t, const Flags&);

// the scalar path (adamw_cpu_scalar.cpp): every mode; the vector paths' tails and partial groups.
// cpu_has_moment_mode: the moment modes it implements (the CPU op refuses any other).
bool cpu_has_moment_mode(int32_t moment_mode);
void adamw_scalar(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f);
// the grouped moment modes (kMom8, kMom4), group by group
void adamw_scalar_grouped(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f);

#if MPK_X86
// the vector paths' kernel for a tensor's dtypes and moment mode (adamw_cpu_avx2.cpp,
// adamw_cpu_avx512.cpp); nullptr where the scalar path runs it
AvxFn pick_avx2(int32_t pdt, int32_t gdt, int32_t moment_mode);
AvxFn pick_avx512(int32_t pdt, int32_t gdt, int32_t moment_mode);
#endif

}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
