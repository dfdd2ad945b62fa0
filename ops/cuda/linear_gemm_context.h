#pragma once

// What the CUDA kernels of the linear ops (custom_linear_add_relu,
// custom_linear_act) need from ATen to run kernels/cublaslt/linear_gemm.h:
// the dtype mapping, torch's precision flags, the handle, workspace and
// stream, and the row stride of a tensor read as a matrix.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "kernels/cublaslt/linear_gemm.h"

namespace torchfuse::ops {

// float32, float16 and bfloat16; nullopt for any other dtype.
std::optional<kernels::GemmDtype> gemmDtype(at::ScalarType s);

// kernels.md §2: the same choice as ATen's cuBLAS(Lt) paths: TF32 only where
// torch's float32 matmul precision allows it and no NoTF32Guard is active.
bool allowTf32Matmul();

// ATen's handle, stream and workspace; TF32 as allowTf32Matmul; the split-K
// reduction schemes ATen allows for float16/bfloat16 under torch's
// reduced-precision reduction flags (allow_fp16_reduced_precision_reduction,
// allow_bf16_reduced_precision_reduction), as its cuBLASLt path sets them.
kernels::LinearGemmContext gemmContext(kernels::GemmDtype dtype);

// Whether ATen would accumulate this dtype's matmuls in float16
// (torch.backends.cuda.matmul.allow_fp16_accumulation): our GEMMs always
// accumulate in float32, so such a call runs ATen's own.
bool atenAccumulatesInHalf(kernels::GemmDtype dtype);

// The row stride of t read, without a copy, as the row-major matrix
// [numel / size(-1), size(-1)] with unit column stride; nullopt if it cannot
// be.  NB: strides of size-1 dims are arbitrary, so they are skipped.
std::optional<int64_t> rowStride(const at::Tensor& t);

} // namespace torchfuse::ops
