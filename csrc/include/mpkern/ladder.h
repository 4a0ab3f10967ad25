// The compact codecs per element (part of math.h): the ladder codes of the 8-bit moments and the 4-bit
// exp_avg, and the 8-bit master correction. Formats: docs/storage.md, "Formats, bit by bit".
#pragma once

#include "floats.h"
#include "rng.h"

namespace mpkern {

// ---- The 8-bit moments and the 4-bit exp_avg, "ladder" codes: docs/storage.md, "Formats, bit by bit" ----
constexpr int kMom8Group = 32;
static_assert(moment_group(kMom8) == kMom8Group && moment_group(kMom4) == kMom8Group,
              "mpkern/codecs.def: the compact codecs group 32 elements per scale");
constexpr uint32_t kMom8NaNScale = 0x7fc0u;

// A ladder format: its mantissa bits, and u_max's fp32 exponent and mantissa (for the scale).
struct Ladder {
  int mbits;
  int umax_exp;        // floor(log2(u_max))
  uint32_t umax_mant;  // the 23 mantissa bits of u_max
};
// (functions, not constants: device code may call them, it may not take a host constant's address)
MPK_HD constexpr Ladder ladder_m8() { return {4, 7, 0x770000u}; }   // u_max = 247   = 1.9296875 * 2^7
MPK_HD constexpr Ladder ladder_v8() { return {4, 15, 0x77ff00u}; }  // u_max = 63487 = 1.937469482421875 * 2^15
MPK_HD constexpr Ladder ladder_m4() { return {1, 3, 0x300000u}; }   // u_max = 11    = 1.375 * 2^3

// The bf16 scale bits of a group from its amax bits (|x| bits maxed unsigned: NaN > inf > finite).
MPK_HD uint32_t ladder_scale_bits(uint32_t amax_bits, Ladder f) {
  const int e = static_cast<int>((amax_bits + (0x7fffffu - f.umax_mant)) >> 23) - f.umax_exp;  // no wrap: bits < 2^31
  const uint32_t s = static_cast<uint32_t>(e < 1 ? 1 : e) << 7;
  // a group of zeros: scale 0, codes 0 (selects, no branches: the CUDA kernels take them per lane)
  return amax_bits >= 0x7f800000u ? kMom8NaNScale : (amax_bits == 0u ? 0u : s);
}

// 1 / s of a scale (exact; 2^127 for the zero scale); 0 for the NaN scale (its codes are zeroed).
MPK_HD float ladder_inv_scale(uint32_t scale_bits) {
  if (scale_bits == kMom8NaNScale) return 0.0f;
  return f32_from_bits((254u - (scale_bits >> 7)) << 23);
}

// u(q) * s from F(q)'s bit pattern f, s a scale (a power of two >= 2^-126, 0 or NaN); fused on CUDA (and
// in the vector kernels) as F * s - s, the same bits (docs/design.md, "The per-element arithmetic").
MPK_HD float ladder_value_scaled(uint32_t f, float s) {
#if defined(__CUDA_ARCH__)
  return fmaf(f32_from_bits(f), s, -s);
#else
  return (f32_from_bits(f) - 1.0f) * s;
#endif
}

// The magnitude code of |x| (ax) given inv = ladder_inv_scale(s) and 16 random bits (fused on CUDA: same bits).
MPK_HD uint32_t ladder_encode(float ax, float inv, uint32_t r16, int mbits) {
#if defined(__CUDA_ARCH__)
  const float z = fmaf(ax, inv, 1.0f);
#else
  const float z = ax * inv + 1.0f;
#endif
  return (f32_bits(z) + (r16 << (7 - mbits)) - 0x3f800000u) >> (23 - mbits);
}

// The sign bit of x moved to bit `at` of a code.
MPK_HD uint32_t sign_at(float x, int at) { return (f32_bits(x) >> 31) << at; }

// u(q) * s of a W-bit code in the top bits of y (the bits below ignored unless CLEAN says they are 0);
// SIGNED: bit 31 the sign, OR-ed in. F is built from the code's bits in place, so a kernel holding several
// codes in a word decodes code k after one shift or byte permute (CUDA's main loop).
template <int W, int MB, bool SIGNED, bool CLEAN = false>
MPK_HD float ladder_decode_top(uint32_t y, float s) {
  constexpr uint32_t kMag = (SIGNED ? (1u << (W - 1)) - 1u : (1u << W) - 1u) << (32 - W);
  const uint32_t mag = (CLEAN && !SIGNED) ? y : (y & kMag);
  const float x = ladder_value_scaled(0x3f800000u + (mag >> (9 - W + MB)), s);  // bits(1.0) + (q << (23 - MB))
  return SIGNED ? f32_from_bits(f32_bits(x) | (y & 0x80000000u)) : x;
}

MPK_HD float mom8_decode_m(uint8_t c, float s) {
  return ladder_decode_top<8, ladder_m8().mbits, true>(static_cast<uint32_t>(c) << 24, s);
}

MPK_HD float mom8_decode_v(uint8_t c, float s) {
  return ladder_decode_top<8, ladder_v8().mbits, false, true>(static_cast<uint32_t>(c) << 24, s);
}

// exp_avg code (sign-magnitude byte) of m given inv = ladder_inv_scale(s_m) and 16 random bits.
MPK_HD uint8_t mom8_encode_m(float m, float inv, uint32_t r16) {
  return static_cast<uint8_t>(ladder_encode(fabsf(m), inv, r16, ladder_m8().mbits) | sign_at(m, 7));
}

// exp_avg_sq code of v >= 0 given inv = ladder_inv_scale(s_v) and 16 random bits: at least 1 for v > 0
// (bits(v) > 0 exactly then; a NaN v's group has its codes zeroed either way).
MPK_HD uint8_t mom8_encode_v(float v, float inv, uint32_t r16) {
  const uint32_t q = ladder_encode(v, inv, r16, ladder_v8().mbits);
#if defined(__CUDA_ARCH__)
  uint32_t pos;  // one VIMNMX (the compiler turns a plain min(bits, 1) into a compare and a select)
  asm("min.u32 %0, %1, 1;" : "=r"(pos) : "r"(f32_bits(v)));
#else
  const uint32_t pos = f32_bits(v) < 1u ? f32_bits(v) : 1u;
#endif
  return static_cast<uint8_t>(q > pos ? q : pos);
}

// ---- The 4-bit exp_avg (kMom4): sign-magnitude nibbles, two per byte: docs/storage.md, "Formats, bit by bit" ----
// The nibble of element i from its byte.
MPK_HD uint32_t mom4_code(uint8_t byte, int64_t i) { return (i & 1) ? (byte >> 4) : (byte & 0xfu); }

MPK_HD float mom4_decode_m(uint32_t nib, float s) {
  return ladder_decode_top<4, ladder_m4().mbits, true>(nib << 28, s);
}

// The nibble of m given inv = ladder_inv_scale(s_m) and 16 random bits (rand_b16).
MPK_HD uint32_t mom4_encode_m(float m, float inv, uint32_t r16) {
  return ladder_encode(fabsf(m), inv, r16, ladder_m4().mbits) | sign_at(m, 3);
}

// The byte of the nibbles of elements 2j (c0) and 2j + 1 (c1).
MPK_HD uint8_t mom4_pack(uint32_t c0, uint32_t c1) { return static_cast<uint8_t>((c0 & 0xfu) | ((c1 & 0xfu) << 4)); }

// ---- The 8-bit master correction (kMaster8bit): the 16-bit param and an int8 correction, encoded from
// field A of the element's random word: docs/storage.md, "Formats, bit by bit" ----
// 2^k as a float for k in [-126, 127] (a normal float: one shift of the exponent field).
MPK_HD float pow2n(int k) { return f32_from_bits(static_cast<uint32_t>(k + 127) << 23); }

// max(e, 1) of an fp16 param bit pattern: the binade of its ulp.
MPK_HD int f16_binade(uint16_t h) {
  const int e = (h >> 10) & 0x1f;
  return e > 1 ? e : 1;
}

MPK_HD float master8_decode(uint16_t h, int8_t c, int32_t pdt) {
  if (pdt == kBF16)
    return f32_from_bits((static_cast<uint32_t>(h) << 16) + static_cast<uint32_t>(static_cast<int32_t>(c) * 256));
  return f16_to_f32(h) + static_cast<float>(c) * pow2n(f16_binade(h) - 33);  // c * 2^(b - 33)
}

// bf16, w not NaN: the 8 random bits u8 given directly (word & 0xff; 0x80 rounds to nearest).
MPK_HD void master8_encode_bf16_num(float w, uint32_t u8, uint16_t& h, int8_t& c) {
  const uint32_t t = f32_bits(w) + u8;
  c = static_cast<int8_t>(static_cast<uint8_t>(t >> 8));
  h = static_cast<uint16_t>((t + 0x8000u) >> 16);
}

// bf16, any w (a NaN keeps its sign and is made quiet).
MPK_HD void master8_encode_bf16(float w, uint32_t u8, uint16_t& h, int8_t& c) {
  const uint32_t u = f32_bits(w);
  master8_encode_bf16_num(w, u8, h, c);
  if ((u & 0x7fffffffu) > 0x7f800000u) h = static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN: quiet, same sign
}

// fp16: r16 = 16 random bits (rand_a16; 0x8000 rounds to nearest).
MPK_HD void master8_encode_f16(float w, uint32_t r16, uint16_t& h, int8_t& c) {
  h = f32_to_f16_rne(w);
  const float p = f16_to_f32(h);
  if (nonfinite(p)) {
    c = 0;
    return;
  }
  const float x = (w - p) * pow2n(33 - f16_binade(h));  // d * 256 / ulp, exact
  float r = floorf(x + static_cast<float>(r16) * (1.0f / 65536.0f));
  r = r < -128.0f ? -128.0f : (r > 127.0f ? 127.0f : r);
  c = static_cast<int8_t>(static_cast<int>(r));
}

// The param and correction of master w from the element's random word.
MPK_HD void master8_encode(float w, int32_t pdt, uint32_t word, uint16_t& h, int8_t& c) {
  if (pdt == kBF16) {
    master8_encode_bf16(w, word & 0xffu, h, c);
  } else {
    master8_encode_f16(w, rand_a16(word), h, c);
  }
}

}  // namespace mpkern
