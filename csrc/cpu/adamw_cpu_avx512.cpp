// CPU AdamW, the AVX-512 F/BW/VL/DQ path (16 lanes): adamw_cpu_vec.h compiled for AVX-512 over the
// Avx512 traits (vec_avx512.h); chosen at run time when the CPU has them (adamw_cpu.cpp).
#include "vec_avx512.h"

#if MPK_X86
#define MPK_VEC MPK_AVX512
#include "adamw_cpu_vec.h"

namespace mpkern {
namespace cpu {
namespace adamw_impl {

AvxFn pick_avx512(int32_t pdt, int32_t gdt, int32_t moment_mode) {
  return AdamwVec<Avx512>::pick(pdt, gdt, moment_mode);
}

}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
#endif  // MPK_X86
