// The gradient-norm reduction: one order of every addition, so the statistics pass (grad_stats:
// mpkern.unscale_, the clip pre-pass of FusedAdamWMP, per-tensor norms) gives the same bits on
// every backend -- CPU (scalar, AVX2; any thread count), CUDA, Triton (GPU and interpreter) and
// the pure-PyTorch reference (mpkern/reference.py, grad_stats) -- whatever the work split.
//
// Per tensor of n elements x_i, i = the element's position in memory from the tensor's own first
// element (its data_ptr(): an offset view starts at 0 like a copy of it; a sharded tensor's local
// shard starts at 0 -- shards are combined by the caller's all-reduce, not by this order):
//
//  1. Squares in fp64: q_i = (double)x_i * (double)x_i. Exact (a float's 24-bit significand squares
//     into 48 bits), so it does not matter whether a backend fuses the multiply into the add
//     (fma(x, x, s) == s + x*x when x*x is exact): no contraction or fast-math setting changes
//     a bit. inf/NaN propagate (sums of non-negative terms: no inf - inf).
//  2. Chunks of kChunk = 16384 elements (the tensor zero-padded to whole chunks; +0 adds exactly),
//     each kBlocks = 64 blocks of kRows = 16 rows of kLanes = 16 lanes:
//       element e of chunk c sits at c*kChunk + k*kBlock + r*kLanes + l.
//     a. lane sums: s[k][l] = (((q[k,0,l] + q[k,1,l]) + q[k,2,l]) + ... + q[k,15,l]), in row order;
//     b. block partial: p[k] = halves-tree over the 16 lanes of s[k][.];
//     c. chunk partial: P[c] = halves-tree over the 64 block partials p[.].
//     halves-tree of v[0..N), N a power of two: while N > 1: v[i] = v[i] + v[i + N/2] for i < N/2;
//     N /= 2 -- i.e. lanes l and l+8 first, then l and l+4, ... (the shared-memory tree of a GPU
//     block, two vertical adds of AVX2 registers, reshape(2, N/2).sum(0) in Triton/PyTorch).
//  3. Tensor: kTensorLanes = 128 lanes, lane f the row-order sum of the chunk partials P[c] with
//     c % 128 == f (0 when there is none), then the halves-tree over the 128 lanes: S.
//  4. sumsq = (float)(S * ((double)inv_scale * (double)inv_scale)) (inv^2 is exact in fp64; the
//     unscaled squares are never rounded one by one).
//  5. Over tensors (mpkern/reference.py total_sumsq, one device op sequence for every backend): the
//     per-tensor sumsq in fp64, a halves-tree over the tensors in the caller's order (zero-padded
//     to a power of two), rounded once to float32. Across ranks the all-reduce's own order rules.
//
// Why it is order-independent: every addition above has its two operands fixed by the element
// indices alone; a + b == b + a in IEEE arithmetic, so a backend may hold the lanes in any
// registers, threads or programs and split a tensor's chunks over any number of threads or
// CTAs -- chunks are the unit of work, and the chunk partials are combined once, per tensor, in
// step 3's order. The max (amax, the non-finite flag) is exact in any order.
//
// Accuracy: squares exact, at most 15 + 4 + 6 + n/2^21 + 7 fp64 additions on any path from a
// square to S: relative error < ~40 * 2^-53 plus the final rounding to float32 (0.5 ulp).
#pragma once

#include "math.h"

namespace mpkern {
namespace norm {

constexpr int kLanes = 16;
constexpr int kRows = 16;
constexpr int kBlock = kLanes * kRows;  // 256 elements
constexpr int kBlocks = 64;
constexpr int64_t kChunk = int64_t{kBlock} * kBlocks;  // 16384 elements
constexpr int kTensorLanes = 128;

MPK_HD double square(float x) {
  const double d = x;
  return d * d;
}

// Halves-tree of v[0..N) (overwrites v); N a power of two.
template <int N>
MPK_HD double tree_sum(double* v) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "tree_sum: N must be a power of two");
  for (int w = N / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) v[i] = v[i] + v[i + w];
  }
  return v[0];
}

// Step 2a-b for one block whose first `count` elements exist (the rest are zero): load(i) gives
// element i of the block as a float. The definition, element by element (scalar CPU path).
template <typename Load>
MPK_HD double block_partial(Load load, int count) {
  double s[kLanes];
  for (int l = 0; l < kLanes; ++l) s[l] = 0.0;
  for (int r = 0; r < kRows; ++r) {
    for (int l = 0; l < kLanes; ++l) {
      const int i = r * kLanes + l;
      s[l] = s[l] + (i < count ? square(load(i)) : 0.0);
    }
  }
  return tree_sum<kLanes>(s);
}

// Step 3 from the chunk partials p[0..count) of one tensor.
MPK_HD double tensor_sum(const double* p, int64_t count) {
  double lane[kTensorLanes];
  for (int f = 0; f < kTensorLanes; ++f) lane[f] = 0.0;
  for (int64_t c = 0; c < count; ++c) lane[c % kTensorLanes] = lane[c % kTensorLanes] + p[c];
  return tree_sum<kTensorLanes>(lane);
}

// Step 4.
MPK_HD float finish_sumsq(double s, float inv_scale) {
  const double inv = inv_scale;
  return static_cast<float>(s * (inv * inv));
}

// The inf-norm / non-finite part: |x| as raw bits. For IEEE floats (bits & 0x7fffffff) orders like
// |x| and puts inf above every finite value and NaN above inf, so one unsigned max gives the max
// magnitude (amax * inv_scale is the inf-norm), the non-finite flag (amax >= inf) and NaN-vs-inf.
MPK_HD uint32_t abs_bits(float x) { return f32_bits(x) & 0x7fffffffu; }

}  // namespace norm
}  // namespace mpkern
