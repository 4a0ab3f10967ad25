// Counter-based random bits: one 32-bit word per element per step (part of math.h). Format and bias
// bounds: docs/storage.md, "Randomness".
#pragma once

#include "floats.h"

namespace mpkern {

// ---- Random bits: ONE 32-bit word per element per step, a pure function of (seed, stream, element, step),
// split into the fields A, B and C. Format and bias bounds: docs/storage.md, "Randomness". ----
// mix32 after its first step (x ^= x >> 16).
MPK_HD uint32_t mix32_rest(uint32_t x) {
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

MPK_HD uint32_t mix32(uint32_t x) { return mix32_rest(x ^ (x >> 16)); }

enum RandPurpose : int { kRandParam = 0, kRandExpAvg = 1, kRandExpAvgSq = 2, kRandMaster8 = 3 };

// Field of a purpose: its lowest bit in the word and its width.
MPK_HD int rand_shift(int purpose) { return purpose == kRandExpAvg ? 10 : (purpose == kRandExpAvgSq ? 21 : 0); }
MPK_HD int rand_width(int purpose) { return (purpose == kRandExpAvg || purpose == kRandExpAvgSq) ? 11 : 10; }

// The codecs' 16-bit value of a purpose's field of random word `word` (the centre of its cell).
MPK_HD uint32_t rand_field16(uint32_t word, int purpose) {
  const int w = rand_width(purpose);
  return (((word >> rand_shift(purpose)) & ((1u << w) - 1u)) << (16 - w)) | (1u << (15 - w));
}
// The same per field with constant shifts (what the vector paths compute):
MPK_HD uint32_t rand_a16(uint32_t word) { return ((word << 6) & 0xffc0u) + 0x20u; }   // param / master8
MPK_HD uint32_t rand_b16(uint32_t word) { return ((word >> 5) & 0xffe0u) + 0x10u; }   // exp_avg
MPK_HD uint32_t rand_c16(uint32_t word) { return ((word >> 16) & 0xffe0u) + 0x10u; }  // exp_avg_sq

MPK_HD uint32_t rng_key(uint32_t seed, uint32_t stream, uint32_t step, uint32_t elem_hi) {
  const uint32_t h = mix32(seed ^ mix32(stream * 0x9e3779b9u + step));
  return mix32(h ^ mix32(elem_hi * 0x85ebca6bu + 0x632be5abu));
}

MPK_HD uint32_t rng_bits(uint32_t key, uint32_t elem_lo) { return mix32(key ^ elem_lo); }

// rng_bits(key, lo + k) for k in [0, 8), lo a multiple of 8: lo + k = lo ^ k and k does not reach bit 16,
// so mix32's first step is taken once for the eight (rng_bits8_base), then one xor each. The same bits.
MPK_HD uint32_t rng_bits8_base(uint32_t key, uint32_t lo) { return (key ^ lo) ^ ((key ^ lo) >> 16); }
MPK_HD uint32_t rng_bits8_at(uint32_t base, uint32_t k) { return mix32_rest(base ^ k); }

// The key of one tensor at one step, for the elements whose high index half is `hi`; other
// elements (a chunk that crosses a multiple of 2^32) get their key computed on the fly.
struct RngKeys {
  uint32_t seed, stream, step, hi;
  uint32_t key;
};

MPK_HD RngKeys rng_keys(uint32_t seed, uint32_t stream, uint32_t step, uint64_t elem) {
  RngKeys k;
  k.seed = seed;
  k.stream = stream;
  k.step = step;
  k.hi = static_cast<uint32_t>(elem >> 32);
  k.key = rng_key(seed, stream, step, k.hi);
  return k;
}

// The random word of global element `elem`.
MPK_HD uint32_t rng_word(const RngKeys& k, uint64_t elem) {
  const uint32_t hi = static_cast<uint32_t>(elem >> 32);
  const uint32_t key = hi == k.hi ? k.key : rng_key(k.seed, k.stream, k.step, hi);
  return rng_bits(key, static_cast<uint32_t>(elem));
}

// The codecs' 16-bit value of `purpose` for global element `elem`.
MPK_HD uint32_t rand16(const RngKeys& k, int purpose, uint64_t elem) {
  return rand_field16(rng_word(k, elem), purpose);
}

// The same without precomputed keys (reference formula).
MPK_HD uint32_t rand16(uint32_t seed, uint32_t stream, uint64_t elem, uint32_t step, int purpose) {
  const uint32_t key = rng_key(seed, stream, step, static_cast<uint32_t>(elem >> 32));
  return rand_field16(rng_bits(key, static_cast<uint32_t>(elem)), purpose);
}

}  // namespace mpkern
