// Bit casts, bf16 / fp16 <-> fp32 with their rounding rules, the element dtype codes, the remainder
// master (part of math.h: the per-element math shared by the CPU and CUDA kernels; MPK_HD defined here).
// Formats: docs/storage.md, "Formats, bit by bit".
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "codecs.h"

#if defined(__CUDACC__)
#define MPK_HD __host__ __device__ __forceinline__
#else
#define MPK_HD inline
#endif

namespace mpkern {

MPK_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MPK_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// True for +-inf and NaN: exponent bits all ones.
MPK_HD bool nonfinite(float x) { return (f32_bits(x) & 0x7f800000u) == 0x7f800000u; }

// ---- bf16 / fp16 <-> fp32; the rounding rules: docs/storage.md, "Formats, bit by bit" ----
MPK_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even (as tensor.to(torch.bfloat16)); NaN stays NaN (quiet, sign kept).
MPK_HD uint16_t f32_to_bf16_rne(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Stochastic rounding: add 16 random bits below the kept half, truncate (unbiased for finite f); inf/NaN
// pass through (NaN quieted).
MPK_HD uint16_t f32_to_bf16_sr(float f, uint32_t rand16) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) {
    if (u & 0x007fffffu) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    return static_cast<uint16_t>(u >> 16);
  }
  u += (rand16 & 0xffffu);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float: software on the host, the hardware conversion on the device (nearest even: same bits).
MPK_HD float f16_to_f32(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {
    // subnormal half: value = man * 2^-24; normalise.
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    man &= 0x3ffu;
    bits = sign | (static_cast<uint32_t>(112 - e) << 23) | (man << 13);
  }
  return f32_from_bits(bits);
#endif
}

MPK_HD uint16_t f32_to_f16_rne(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);                        // rounds to >= 65520: inf
  if (a >= 0x38800000u) {
    // normal half range: drop 13 mantissa bits with round-to-nearest-even.
    uint32_t r = a - 0x38000000u;  // rebias exponent 127 -> 15 (in the shifted frame)
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a < 0x33000000u) return sign;  // < 2^-25: rounds to zero (2^-25 itself is a tie -> 0)
  // subnormal half: value / 2^-24 rounded to nearest even integer.
  const uint32_t exp = a >> 23;  // 102..112
  const uint32_t man = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24
  uint32_t q = man >> shift;
  const uint32_t rem = man & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
#endif
}

// Element codes used in the multi-tensor tables (same numbering in Python).
enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };
static_assert(kMomF32 == kF32 && kMomBF16 == kBF16, "mpkern/codecs.def: a dense moment mode is its dtype code");

// Load one element of a 16/32-bit float buffer as float.
MPK_HD float load_as_f32(const void* base, int64_t i, int32_t dt) {
  if (dt == kF32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dt == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// Store a float into a 16/32-bit float buffer, rounding to nearest even.
MPK_HD void store_from_f32(void* base, int64_t i, int32_t dt, float v) {
  if (dt == kF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = dt == kBF16 ? f32_to_bf16_rne(v) : f32_to_f16_rne(v);
  }
}

// ---- The "remainder" master: docs/storage.md, "Formats, bit by bit" ----
// bits(m) == (hi << 16) + rem, hi rounded to nearest with ties away from zero.
MPK_HD void split_master(float m, uint16_t& hi, int16_t& rem) {
  const uint32_t u = f32_bits(m);
  hi = static_cast<uint16_t>((u + 0x8000u) >> 16);                 // round half away from zero (in magnitude)
  rem = static_cast<int16_t>(static_cast<uint16_t>(u & 0xffffu));  // low half, read as signed
}

MPK_HD float join_master(uint16_t hi, int16_t rem) {
  return f32_from_bits((static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(rem)));
}

}  // namespace mpkern
