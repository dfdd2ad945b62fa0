#include "ops/cuda/linear_gemm_context.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>

#include "torchfuse/backends.h"

namespace torchfuse::ops {

std::optional<kernels::GemmDtype> gemmDtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat:
      return kernels::GemmDtype::kFloat32;
    case at::kHalf:
      return kernels::GemmDtype::kFloat16;
    case at::kBFloat16:
      return kernels::GemmDtype::kBFloat16;
    default:
      return std::nullopt;
  }
}

bool allowTf32Matmul() {
  return at::globalContext().float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL) ==
      at::Float32Precision::TF32 &&
      !at::NoTF32Guard::should_disable_tf32();
}

namespace {

// As aten/src/ATen/cuda/CUDABlas.cpp's cuBLASLt path.
uint32_t reductionSchemes(kernels::GemmDtype dtype) {
  if (dtype == kernels::GemmDtype::kFloat32) {
    return CUBLASLT_REDUCTION_SCHEME_MASK;
  }
  const auto option = dtype == kernels::GemmDtype::kFloat16
      ? at::globalContext().allowFP16ReductionCuBLAS()
      : at::globalContext().allowBF16ReductionCuBLAS();
  switch (option) {
    case at::CuBLASReductionOption::AllowReducedPrecisionWithSplitK:
      return CUBLASLT_REDUCTION_SCHEME_MASK;
    case at::CuBLASReductionOption::DisallowReducedPrecisionAllowSplitK:
      return CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE | CUBLASLT_REDUCTION_SCHEME_NONE;
    case at::CuBLASReductionOption::DisallowReducedPrecisionDisallowSplitK:
      return CUBLASLT_REDUCTION_SCHEME_NONE;
  }
  return CUBLASLT_REDUCTION_SCHEME_NONE;
}

} // namespace

kernels::LinearGemmContext gemmContext(kernels::GemmDtype dtype) {
  return {
      at::cuda::getCurrentCUDABlasLtHandle(),
      at::cuda::getCurrentCUDAStream(),
      dtype,
      dtype == kernels::GemmDtype::kFloat32 && allowTf32Matmul(),
      at::cuda::getCUDABlasLtWorkspace(),
      at::cuda::getCUDABlasLtWorkspaceSize(),
      backends::matmul().autotune(),
      reductionSchemes(dtype)};
}

bool atenAccumulatesInHalf(kernels::GemmDtype dtype) {
  return dtype == kernels::GemmDtype::kFloat16 && at::globalContext().allowFP16AccumulationCuBLAS();
}

std::optional<int64_t> rowStride(const at::Tensor& t) {
  const int64_t cols = t.size(-1);
  if (cols != 1 && t.stride(-1) != 1) {
    return std::nullopt;
  }
  int64_t ld = -1;
  int64_t next = 0; // the stride the next outer non-trivial dim must have
  for (int64_t d = t.dim() - 2; d >= 0; --d) {
    if (t.size(d) == 1) {
      continue;
    }
    if (ld < 0) {
      ld = t.stride(d);
    } else if (t.stride(d) != next) {
      return std::nullopt;
    }
    next = t.stride(d) * t.size(d);
  }
  if (ld < 0) {
    ld = cols; // a single row
  }
  return ld >= cols ? std::optional<int64_t>(ld) : std::nullopt;
}

} // namespace torchfuse::ops
