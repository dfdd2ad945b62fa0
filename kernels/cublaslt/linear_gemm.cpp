#include "kernels/cublaslt/gemm_bias_act.h"

#include "kernels/cublaslt/cublaslt_utils.h"

namespace torchfuse::kernels {

cublasLtEpilogue_t toCublasLtEpilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::kReluBias:
      return CUBLASLT_EPILOGUE_RELU_BIAS;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown GemmEpilogue ", static_cast<int>(e));
}

namespace {

cudaDataType_t toCudaDataType(GemmDtype d) {
  switch (d) {
    case GemmDtype::kFloat32:
      return CUDA_R_32F;
    case GemmDtype::kFloat16:
      return CUDA_R_16F;
    case GemmDtype::kBFloat16:
      return CUDA_R_16BF;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown GemmDtype ", static_cast<int>(d));
}

} // namespace

bool gemmBiasAct(cublasLtHandle_t handle, const GemmBiasActArgs& a, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(a.m > 0 && a.n > 0 && a.k > 0);
  TORCH_INTERNAL_ASSERT(a.ldx >= a.k && a.ldw >= a.k && a.ldy >= a.n);
  TORCH_INTERNAL_ASSERT(a.bias != nullptr);
  using namespace cublaslt;

  const cudaDataType_t type = toCudaDataType(a.dtype);
  // kernels.md §2: TF32 only for float32 and only when the caller allows it;
  // half types accumulate in float32.
  const cublasComputeType_t compute = a.dtype == GemmDtype::kFloat32 && a.allow_tf32
      ? CUBLAS_COMPUTE_32F_FAST_TF32
      : CUBLAS_COMPUTE_32F;

  auto desc = makeMatmulDesc(compute, CUDA_R_32F);
  setAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, cublasOperation_t{CUBLAS_OP_T});
  setAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, cublasOperation_t{CUBLAS_OP_N});
  setAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, toCublasLtEpilogue(a.epilogue));
  setAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, a.bias);

  // A = W as column-major [K, N], used transposed; B = x as column-major
  // [K, M]; C = D = y as column-major [N, M] (C is not read: beta = 0).
  auto layout_a = makeMatrixLayout(type, a.k, a.n, a.ldw);
  auto layout_b = makeMatrixLayout(type, a.k, a.m, a.ldx);
  auto layout_d = makeMatrixLayout(type, a.n, a.m, a.ldy);

  auto pref = makeMatmulPreference();
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{a.workspace_size});
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, pointerAlignment(a.w));
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, pointerAlignment(a.x));
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, pointerAlignment(a.y));
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, pointerAlignment(a.y));

  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, desc.get(), layout_a.get(), layout_b.get(), layout_d.get(), layout_d.get(),
      pref.get(), 1, &heuristic, &found);
  // NOT_SUPPORTED: no heuristic for this configuration; like found == 0, the
  // caller falls back.
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    return false;
  }
  TORCHFUSE_CUBLASLT_CHECK(status);
  if (found == 0) {
    return false;
  }

  const float alpha = 1.0f;
  const float beta = 0.0f;
  TORCHFUSE_CUBLASLT_CHECK(cublasLtMatmul(
      handle, desc.get(), &alpha, a.w, layout_a.get(), a.x, layout_b.get(), &beta, a.y,
      layout_d.get(), a.y, layout_d.get(), &heuristic.algo, a.workspace, a.workspace_size,
      stream));
  return true;
}

} // namespace torchfuse::kernels
