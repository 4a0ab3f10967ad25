// mpkern::mm_f32_ (CPU): out (fp32) = a @ b, or out += a @ b, for 16-bit a and b -- the GEMM with an
// fp32 C that mpkern.matmul's CPU "aten" route needs for fp32 outputs, a bias in another dtype, and
// the weight-gradient accumulation into an fp32 main_grad (beta = 1 in the GEMM, no temporary).
//
// ATen computes this in its bf16 x bf16 -> fp32 (and fp16 x fp16 -> fp32) GEMM: oneDNN's matmul
// (AMX / AVX512-BF16 where the CPU has them) when it takes the problem, else ATen's generic kernel,
// both accumulating in fp32. Its only exported entry point is cpublas::brgemm with is_vnni = false,
// which runs that GEMM on row-major operands (unit stride along K for a, along N for b) and a
// row-major C: the Python caller hands it such views, copying an operand only when it is not one.
//
// The op's schema is defined here (TORCH_LIBRARY_FRAGMENT), beside csrc/ops.cpp's.
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

namespace mpkern {
namespace cpu {
namespace {

bool row_major(const at::Tensor& t) {
  return t.dim() == 2 && (t.stride(1) == 1 || t.size(1) <= 1) && (t.stride(0) >= t.size(1) || t.size(0) <= 1);
}

void mm_f32_cpu_(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out, bool accumulate) {
  TORCH_CHECK_VALUE(a.dim() == 2 && b.dim() == 2 && out.dim() == 2, "mm_f32_: a, b and out must be 2-D, got ",
                    a.sizes(), ", ", b.sizes(), ", ", out.sizes());
  TORCH_CHECK_TYPE(
      (a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf) && b.scalar_type() == a.scalar_type(),
      "mm_f32_: a and b must both be bfloat16 or both float16, got ", a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK_TYPE(out.scalar_type() == at::kFloat, "mm_f32_: out must be float32, got ", out.scalar_type());
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  TORCH_CHECK_VALUE(b.size(0) == K && out.size(0) == M && out.size(1) == N, "mm_f32_: shapes a ", a.sizes(), " @ b ",
                    b.sizes(), " -> out ", out.sizes(), " do not fit");
  TORCH_CHECK_VALUE(a.device().is_cpu() && b.device().is_cpu() && out.device().is_cpu(),
                    "mm_f32_: a CPU kernel, got tensors on ", a.device(), ", ", b.device(), ", ", out.device());
  TORCH_CHECK_VALUE(row_major(a) && row_major(b) && row_major(out),
                    "mm_f32_: a, b and out must be row-major (stride 1 along the last dim), got strides ", a.strides(),
                    ", ", b.strides(), ", ", out.strides());
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) out.zero_();
    return;
  }
  // brgemm's leading dimensions must be >= the row length even for one-row / one-column views
  const int64_t lda = std::max(a.stride(0), K), ldb = std::max(b.stride(0), N), ldc = std::max(out.stride(0), N);
  float* c = out.mutable_data_ptr<float>();
  if (a.scalar_type() == at::kBFloat16) {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, a.const_data_ptr<at::BFloat16>(),
                                b.const_data_ptr<at::BFloat16>(), c, /*is_vnni=*/false);
  } else {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, a.const_data_ptr<at::Half>(),
                                b.const_data_ptr<at::Half>(), c, /*is_vnni=*/false);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace mpkern

TORCH_LIBRARY_FRAGMENT(mpkern, m) {
  // out (float32, row-major) = a @ b, or += with accumulate; a, b: row-major, both bf16 or both fp16.
  // fp32 accumulation (ATen's 16-bit -> fp32 GEMM). CPU only.
  m.def("mm_f32_(Tensor a, Tensor b, Tensor(a!) out, bool accumulate) -> ()");
}

TORCH_LIBRARY_IMPL(mpkern, CPU, m) { m.impl("mm_f32_", &mpkern::cpu::mm_f32_cpu_); }
