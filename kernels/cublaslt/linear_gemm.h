#pragma once

// y = act(x · Wᵀ + bias) for row-major x[M, K], W[N, K], y[M, N] with one
// cuBLASLt matmul and an epilogue.  Raw pointers only; the caller picks the
// handle, workspace and stream (ATen's, in ops/cuda/) and checks shapes.
//
// Mapping (kernels.md §1.3): cuBLASLt is column-major, so we compute
// D[N, M] = op_T(W)[N, K] · x[K, M], where the row-major buffers read as
// column-major W[K, N] (ld = ldw), x[K, M] (ld = ldx) and D[N, M] (ld = ldy).
// The bias has one entry per row of D, i.e. per output feature.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace torchfuse::kernels {

enum class GemmDtype { kFloat32, kFloat16, kBFloat16 };

enum class GemmEpilogue {
  kBias,      // D = x·Wᵀ + bias
  kReluBias,  // relu(x·Wᵀ + bias); NB: cuBLASLt's ReLU maps NaN to 0
};

// The cuBLASLt epilogue for `e`.
cublasLtEpilogue_t toCublasLtEpilogue(GemmEpilogue e);

struct GemmBiasActArgs {
  GemmDtype dtype;
  // float32 only: use CUBLAS_COMPUTE_32F_FAST_TF32 instead of COMPUTE_32F.
  bool allow_tf32;
  GemmEpilogue epilogue;
  int64_t m, n, k;
  const void* x;  // [M, K], row stride ldx >= K, unit column stride
  int64_t ldx;
  const void* w;  // [N, K], row stride ldw >= K, unit column stride
  int64_t ldw;
  const void* bias;  // [N], contiguous, same dtype; must not be null
  void* y;  // [M, N], row stride ldy >= N
  int64_t ldy;
  void* workspace;
  size_t workspace_size;
};

// Returns false, having launched nothing, when cuBLASLt's heuristic offers no
// algorithm for the problem; the caller must then fall back.  Throws on any
// cuBLASLt error.
bool gemmBiasAct(cublasLtHandle_t handle, const GemmBiasActArgs& args, cudaStream_t stream);

} // namespace torchfuse::kernels
