/* Reciprocal throughput of the vector instructions the CPU AdamW kernels are built from, in core
 * cycles per instruction, on the machine it runs on (not a test; evidence for the "what bounds the
 * compact step" figures in RESULTS.md where the VM has no PMU for perf stat).
 *
 *   gcc -O2 -mavx2 -mfma -mavx512f -mavx512dq -mavx512vl benchmarks/op_throughput.c -o /tmp/op_tp && /tmp/op_tp
 *
 * The clock is measured first (a chain of dependent integer adds retires one per cycle); each op is
 * then timed on 8 independent dependency chains (enough to hide the latencies of everything here
 * but the divider, whose unit is the limit anyway). A zmm op on a CPU that splits 512-bit work in
 * two 256-bit halves (AMD Zen 4) shows about twice the ymm figure. Needs AVX-512 F/DQ/VL.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double ghz(void) {
  uint64_t x = 1;
  const long n = 500000000L;
  const double t = now();
  for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(x));
  return 4.0 * n / (now() - t) / 1e9;
}

#define N 50000000L
#define BENCH(name, T, init, op)                                                                         \
  {                                                                                                    \
    T a0 = init(1.0f), a1 = init(1.1f), a2 = init(1.2f), a3 = init(1.3f), a4 = init(1.4f), a5 = init(1.5f), \
      a6 = init(1.6f), a7 = init(1.7f);                                                                \
    const double t0 = now();                                                                           \
    for (long i = 0; i < N; i++) {                                                                     \
      a0 = op(a0); a1 = op(a1); a2 = op(a2); a3 = op(a3); a4 = op(a4); a5 = op(a5); a6 = op(a6); a7 = op(a7); \
    }                                                                                                  \
    const double s = now() - t0;                                                                       \
    __asm__ volatile("" ::"x"(a0), "x"(a1), "x"(a2), "x"(a3), "x"(a4), "x"(a5), "x"(a6), "x"(a7));     \
    printf("%-22s %5.2f cycles\n", name, s * f * 1e9 / (8.0 * N));                                    \
  }

#define S16(x) _mm512_set1_ps(x)
#define S8(x) _mm256_set1_ps(x)
#define I16(x) _mm512_set1_epi32((int)((x) * 10))
#define I8(x) _mm256_set1_epi32((int)((x) * 10))
static inline __m512 sqrt16(__m512 x) { return _mm512_sqrt_ps(x); }
static inline __m256 sqrt8(__m256 x) { return _mm256_sqrt_ps(x); }
static inline __m512 div16(__m512 x) { return _mm512_div_ps(_mm512_set1_ps(1.0001f), x); }
static inline __m256 div8(__m256 x) { return _mm256_div_ps(_mm256_set1_ps(1.0001f), x); }
static inline __m512 mul16(__m512 x) { return _mm512_mul_ps(x, _mm512_set1_ps(1.0001f)); }
static inline __m256 mul8(__m256 x) { return _mm256_mul_ps(x, _mm256_set1_ps(1.0001f)); }
static inline __m256 add8(__m256 x) { return _mm256_add_ps(x, _mm256_set1_ps(2.0f)); }
static inline __m256 min8(__m256 x) { return _mm256_min_ps(x, _mm256_set1_ps(2.0f)); }
static inline __m512i mullo16(__m512i x) { return _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d)); }
static inline __m256i mullo8(__m256i x) { return _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d)); }
static inline __m512 rsqrt16(__m512 x) { return _mm512_rsqrt14_ps(x); }
static inline __m256 rsqrt8(__m256 x) { return _mm256_rsqrt_ps(x); }
static inline __m256 floor8(__m256 x) { return _mm256_floor_ps(x); }
static inline __m512 floor16(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
static inline __m256 cvt8(__m256 x) { return _mm256_cvtepi32_ps(_mm256_castps_si256(x)); }
static inline __m256 cmpand8(__m256 x) { return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(2.0f), _CMP_LT_OQ), x); }

int main(void) {
  const double f = ghz();
  printf("core clock %.2f GHz; reciprocal throughput per instruction:\n", f);
  BENCH("vsqrtps zmm", __m512, S16, sqrt16)
  BENCH("vsqrtps ymm", __m256, S8, sqrt8)
  BENCH("vdivps zmm", __m512, S16, div16)
  BENCH("vdivps ymm", __m256, S8, div8)
  BENCH("vmulps zmm", __m512, S16, mul16)
  BENCH("vmulps ymm", __m256, S8, mul8)
  BENCH("vaddps ymm", __m256, S8, add8)
  BENCH("vminps ymm", __m256, S8, min8)
  BENCH("vpmulld zmm", __m512i, I16, mullo16)
  BENCH("vpmulld ymm", __m256i, I8, mullo8)
  BENCH("vrsqrt14ps zmm", __m512, S16, rsqrt16)
  BENCH("vrsqrtps ymm", __m256, S8, rsqrt8)
  BENCH("vrndscaleps zmm", __m512, S16, floor16)
  BENCH("vroundps ymm", __m256, S8, floor8)
  BENCH("vcvtdq2ps ymm", __m256, S8, cvt8)
  BENCH("vcmpps+vandps ymm (2)", __m256, S8, cmpand8)
  return 0;
}
