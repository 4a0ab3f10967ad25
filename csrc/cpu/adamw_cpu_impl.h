// Internal to the CPU AdamW kernel (csrc/cpu/adamw_cpu*.cpp): what its three paths share -- the
// per-tensor pointers and step flags, which stores draw on the random word, the nibble helpers the
// AVX2 and AVX-512 4-bit paths both use -- and the entry points of each path. One file per path:
// adamw_cpu_scalar.cpp (the math.h functions element by element), adamw_cpu_avx2.cpp (8 lanes),
// adamw_cpu_avx512.cpp (16 lanes); adamw_cpu.cpp is the op and picks the path per call.
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
  void* master;  // float* (mode 1), int16_t* (mode 2) or int8_t* (mode 3)
  uint16_t* sm;  // 8-bit / 4-bit moments (sdt kMom8 / kMom4): bf16 scale bits, one per 32 elements
  uint16_t* sv;
  int32_t pdt, gdt, sdt;  // sdt: kF32, kBF16, kMom8 (int8 m + uint8 v codes) or kMom4 (packed 4-bit m)
  uint32_t step;    // after the increment
  uint32_t stream;  // random stream id
  uint64_t offset;  // global index of element 0 in its stream
  AdamWConsts c;
};

struct Flags {
  int mode;
  bool maximize;
  bool sr;
  uint32_t seed;
  float factor;
};

// Whether a tensor's param/master store draws on the random word (field A: param SR or the 8-bit
// master); its moments do when they are bf16 or 8-bit (fields B, C). One word per element serves all.
inline bool needs_word0(const TensorPtrs& t, const Flags& f) {
  return f.mode == kMaster8bit || (f.mode == kMasterNone && f.sr && t.pdt == kBF16);
}
inline bool needs_word(const TensorPtrs& t, const Flags& f) { return needs_word0(t, f) || t.sdt != kF32; }

using AvxFn = void (*)(const TensorPtrs&, int64_t, int64_t, const Flags&);

// the scalar path (adamw_cpu_scalar.cpp): every mode; the vector paths' tails and partial groups.
// cpu_has_moment_mode: the moment modes it implements (the CPU op refuses any other).
bool cpu_has_moment_mode(int32_t sdt);
void adamw_scalar(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f);
void adamw_scalar_mom8(const TensorPtrs& t, int64_t begin, int64_t end, const Flags& f);

#if MPK_X86
// the vector paths' kernel for a tensor's dtypes (adamw_cpu_avx2.cpp, adamw_cpu_avx512.cpp)
AvxFn pick_avx2(int32_t pdt, int32_t gdt, int32_t sdt);
AvxFn pick_avx512(int32_t pdt, int32_t gdt, int32_t sdt);

// 2 u(q) with the sign of a group's 32 sign-magnitude 4-bit codes (16 bytes at p, mom4_code;
// mom4_decode_m is u(q) * s, the vector paths multiply 2 u(q) by s / 2: exact; a negative zero
// nibble gives +0, whose update is the same as -0's) as 32 int8 in element order at dst (16-byte
// aligned): the low and high nibbles split, interleaved back into element order and looked up with
// pshufb (it reads the low 4 bits). Two 16-byte stores, read back by 16-byte (AVX-512) or contained
// 8-byte (AVX2) loads, which store-to-load forwarding serves.
MPK_AVX2 __attribute__((always_inline)) inline void nibble_u2_32(const uint8_t* p, int8_t* dst) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo4 = _mm_set1_epi8(0x0f);
  const __m128i lo = _mm_and_si128(x, lo4), hi = _mm_and_si128(_mm_srli_epi16(x, 4), lo4);
  const __m128i u2 = _mm_setr_epi8(0, 1, 2, 4, 6, 10, 14, 22, 0, -1, -2, -4, -6, -10, -14, -22);
  _mm_store_si128(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi8(u2, _mm_unpacklo_epi8(lo, hi)));
  _mm_store_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_shuffle_epi8(u2, _mm_unpackhi_epi8(lo, hi)));
}

// 16 codes as bytes (nibbles in the low 4 bits) in element order -> 8 bytes of two codes each (mom4_pack) in the low
// half, the same for hi16 in the high half: per 16-bit lane (c_even & 15) + 16 (c_odd & 15) by one
// unsigned x signed byte multiply-add (<= 255), packed to bytes with unsigned saturation (exact).
MPK_AVX2 __attribute__((always_inline)) inline __m128i pack_nibbles16x2(__m128i lo16, __m128i hi16) {
  const __m128i lo4 = _mm_set1_epi8(0x0f), w = _mm_set1_epi16(0x1001);  // bytes 1, 16
  return _mm_packus_epi16(_mm_maddubs_epi16(_mm_and_si128(lo16, lo4), w),
                          _mm_maddubs_epi16(_mm_and_si128(hi16, lo4), w));
}
#endif

}  // namespace adamw_impl
}  // namespace cpu
}  // namespace mpkern
