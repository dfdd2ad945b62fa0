#pragma once

// The GEMMs of custom_linear_add_relu for row-major matrices, on the cached
// cuBLASLt matmul of lt_matmul.h.  Raw pointers only; the caller picks the
// handle, workspace and stream (ATen's, in ops/cuda/) and checks shapes.
//
// cuBLASLt is column-major: a row-major [R, C] matrix with row stride ld
// reads as a column-major [C, R] one with the same ld.
//
//   forward      y[M, N] = x[M, K] · W[N, K]ᵀ (+ bias[N]) (+ beta · c[M, N])
//                  as D[N, M] = op_T(W)[N, K] · x[K, M] (+ beta · C[N, M]);
//                  the bias has one entry per row of D, i.e. per feature.
//   grad input   dx[M, K] = g[M, N] · W[N, K]
//                  as D[K, M] = W[K, N] · g[N, M].
//   grad weight  dW[N, K] = gᵀ · x and, with the BGRADB epilogue in the same
//                GEMM, db[N] = Σ_rows g
//                  as D[K, N] = x[K, M] · op_T(g)[M, N]; or, from transposed
//                  copies xt[K, M] and gt[N, M], as D[K, N] = op_T(xt) · gt,
//                  where both operands are K-major (TF32 on Hopper is slow
//                  otherwise: wgmma has no transposed TF32 operands).
//
// Each returns false, having launched nothing, when cuBLASLt offers no
// algorithm; the caller then falls back.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cublaslt/lt_matmul.h"

namespace torchfuse::kernels {

struct LinearGemmContext {
  cublasLtHandle_t handle;
  cudaStream_t stream;
  GemmDtype dtype;
  bool allow_tf32;  // float32 only
  void* workspace;
  size_t workspace_size;
  bool autotune; // LtMatmulArgs::autotune
  uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_MASK; // LtMatmulArgs::reduction_schemes
};

struct LinearForwardArgs {
  int64_t m, n, k;
  const void* x;  // [M, K], row stride ldx >= K
  int64_t ldx;
  const void* w;  // [N, K], row stride ldw >= K
  int64_t ldw;
  const void* bias = nullptr;  // [N] or null; float32 when bias_fp32
  bool bias_fp32 = false;
  const void* c = nullptr;  // [M, N], row stride ldc >= N, or null
  int64_t ldc = 0;
  float beta = 0.0f;
  void* y;  // [M, N], row stride ldy >= N
  int64_t ldy;
};

bool linearForward(const LinearGemmContext& ctx, const LinearForwardArgs& args);

// dx[M, K] (row stride lddx) = g[M, N] (ldg) · W[N, K] (ldw).
bool linearGradInput(
    const LinearGemmContext& ctx, int64_t m, int64_t n, int64_t k, const void* g,
    int64_t ldg, const void* w, int64_t ldw, void* dx, int64_t lddx);

struct LinearGradWeightArgs {
  int64_t m, n, k;
  // transposed: x is xt[K, M] and g is gt[N, M] (row strides >= M);
  // otherwise x[M, K] and g[M, N].
  bool transposed = false;
  const void* x;
  int64_t ldx;
  const void* g;
  int64_t ldg;
  void* dw;  // [N, K], row stride lddw >= K
  int64_t lddw;
  void* db = nullptr;  // [N], dtype, or null: not computed
};

bool linearGradWeight(const LinearGemmContext& ctx, const LinearGradWeightArgs& args);

} // namespace torchfuse::kernels
