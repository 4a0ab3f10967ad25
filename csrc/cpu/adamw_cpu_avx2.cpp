// CPU AdamW, the AVX2 path (8 lanes): adamw_cpu_vec.h compiled for AVX2 + FMA + F16C over the Avx2
// traits (vec_avx2.h); chosen at run time when the CPU has them (adamw_cpu.cpp).
#include "vec_avx2.h"

#if MPK_X86
#define MPK_VEC MPK_AVX2
#include "adamw_cpu_vec.h"

namespace mpkern {
namespace cpu {
namespace adamw_impl {

AvxFn pick_avx2(int32_t pdt, int32_t gdt, int32_t moment_mode) { return AdamwVec<Avx2>::pick(pdt, gdt, moment_mode); }

}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
#endif  // MPK_X86
