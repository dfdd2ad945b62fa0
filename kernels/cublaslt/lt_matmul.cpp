#include "kernels/cublaslt/lt_matmul.h"

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/common/fastest.h"
#include "kernels/common/problem_cache.h"
#include "kernels/cublaslt/cublaslt_utils.h"

namespace torchfuse::kernels {
namespace {

using namespace cublaslt;

// Up to this many heuristic candidates are timed on a key's first use
// (kernels/common/fastest.h).
constexpr int kMaxCandidates = 8;
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

cublasLtEpilogue_t toCublasLtEpilogue(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::kDefault:
      return CUBLASLT_EPILOGUE_DEFAULT;
    case LtEpilogue::kBias:
      return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::kBGradB:
      return CUBLASLT_EPILOGUE_BGRADB;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown LtEpilogue ", static_cast<int>(e));
}

using PlanKey = std::array<int64_t, 22>;

PlanKey makeKey(const LtMatmulArgs& a, int device) {
  const bool has_bias = a.epilogue != LtEpilogue::kDefault;
  return {
      device,
      static_cast<int64_t>(a.dtype),
      a.dtype == GemmDtype::kFloat32 && a.allow_tf32,
      a.trans_a,
      a.trans_b,
      a.m,
      a.n,
      a.k,
      a.lda,
      a.ldb,
      a.c != nullptr ? a.ldc : -1,
      a.ldd,
      static_cast<int64_t>(a.epilogue),
      has_bias && a.bias_fp32,
      pointerAlignment(a.a),
      pointerAlignment(a.b),
      a.c != nullptr ? pointerAlignment(a.c) : 0,
      pointerAlignment(a.d),
      has_bias ? pointerAlignment(a.bias) : 0,
      static_cast<int64_t>(a.workspace_size),
      a.autotune,
      static_cast<int64_t>(a.reduction_schemes)};
}

// Everything cuBLASLt needs for one key.  The descriptor's bias pointer is
// the only per-call attribute, so `mutex` is held from setting it to the
// end of the (asynchronous) launch.
struct Plan {
  std::mutex mutex;
  bool ready = false;
  bool found = false;
  MatmulDesc desc;
  MatrixLayout a, b, c, d;
  cublasLtMatmulAlgo_t algo{};
};

cublasStatus_t launch(
    cublasLtHandle_t handle, const Plan& plan, const cublasLtMatmulAlgo_t& algo,
    const LtMatmulArgs& a, cudaStream_t stream) {
  return cublasLtMatmul(
      handle, plan.desc.get(), &a.alpha, a.a, plan.a.get(), a.b, plan.b.get(), &a.beta,
      a.c != nullptr ? a.c : a.d, plan.c.get(), a.d, plan.d.get(), &algo, a.workspace,
      a.workspace_size, stream);
}

// The fastest of `results` on the call's buffers (kernels/common/fastest.h);
// a candidate cuBLASLt refuses at launch time is skipped, not fatal.
int fastest(
    cublasLtHandle_t handle, const Plan& plan,
    const cublasLtMatmulHeuristicResult_t* results, int count, const LtMatmulArgs& a,
    cudaStream_t stream) {
  const int best = fastestCandidate(
      count,
      [&](int i) {
        return launch(handle, plan, results[i].algo, a, stream) == CUBLAS_STATUS_SUCCESS;
      },
      stream);
  return best < 0 ? 0 : best;
}

// Builds the descriptors and picks the algorithm; plan.mutex is held.
void build(Plan& plan, cublasLtHandle_t handle, const LtMatmulArgs& a, cudaStream_t stream) {
  const cudaDataType_t type = toCudaDataType(a.dtype);
  // As ATen's cuBLASLt path: TF32 only for float32 and only where the caller allows
  // it; 16-bit types accumulate in float32.
  const cublasComputeType_t compute = a.dtype == GemmDtype::kFloat32 && a.allow_tf32
      ? CUBLAS_COMPUTE_32F_FAST_TF32
      : CUBLAS_COMPUTE_32F;
  plan.desc = makeMatmulDesc(compute, CUDA_R_32F);
  setAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA,
               cublasOperation_t{a.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N});
  setAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB,
               cublasOperation_t{a.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N});
  setAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, toCublasLtEpilogue(a.epilogue));
  if (a.epilogue != LtEpilogue::kDefault) {
    setAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                 static_cast<int32_t>(a.bias_fp32 ? CUDA_R_32F : type));
    // The heuristic reads the pointer's alignment (part of the key).
    setAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, a.bias);
  }
  plan.a = a.trans_a ? makeMatrixLayout(type, a.k, a.m, a.lda)
                     : makeMatrixLayout(type, a.m, a.k, a.lda);
  plan.b = a.trans_b ? makeMatrixLayout(type, a.n, a.k, a.ldb)
                     : makeMatrixLayout(type, a.k, a.n, a.ldb);
  plan.c = makeMatrixLayout(type, a.m, a.n, a.c != nullptr ? a.ldc : a.ldd);
  plan.d = makeMatrixLayout(type, a.m, a.n, a.ldd);

  auto pref = makeMatmulPreference();
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{a.workspace_size});
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, pointerAlignment(a.a));
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, pointerAlignment(a.b));
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
               pointerAlignment(a.c != nullptr ? a.c : a.d));
  setAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, pointerAlignment(a.d));
  setAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, a.reduction_schemes);

  // NB: no timing while capturing a CUDA graph: event synchronization is
  // illegal there, and the timed launches would be captured too.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const int wanted = a.autotune && capture == cudaStreamCaptureStatusNone ? kMaxCandidates : 1;

  std::array<cublasLtMatmulHeuristicResult_t, kMaxCandidates> results{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan.desc.get(), plan.a.get(), plan.b.get(), plan.c.get(), plan.d.get(),
      pref.get(), wanted, results.data(), &found);
  // NOT_SUPPORTED: no heuristic for this configuration; INVALID_VALUE: a
  // configuration this cuBLASLt rejects (seen for float16 with odd leading
  // dimensions and a float32 bias).  Like found == 0, the caller falls back.
  if (status != CUBLAS_STATUS_NOT_SUPPORTED && status != CUBLAS_STATUS_INVALID_VALUE) {
    TORCHFUSE_CUBLASLT_CHECK(status);
  }
  const int usable = status == CUBLAS_STATUS_SUCCESS
      ? static_cast<int>(std::stable_partition(
                             results.begin(), results.begin() + found,
                             [](const auto& r) { return r.state == CUBLAS_STATUS_SUCCESS; }) -
                         results.begin())
      : 0;
  plan.found = usable > 0;
  if (plan.found) {
    const int best = usable > 1 ? fastest(handle, plan, results.data(), usable, a, stream) : 0;
    plan.algo = results[best].algo;
  }
  plan.ready = true;
}

} // namespace

bool ltMatmul(cublasLtHandle_t handle, const LtMatmulArgs& a, cudaStream_t stream) {
  TORCH_INTERNAL_ASSERT(a.m > 0 && a.n > 0 && a.k > 0);
  TORCH_INTERNAL_ASSERT(a.lda >= (a.trans_a ? a.k : a.m));
  TORCH_INTERNAL_ASSERT(a.ldb >= (a.trans_b ? a.n : a.k));
  TORCH_INTERNAL_ASSERT(a.ldd >= a.m && (a.c == nullptr || a.ldc >= a.m));
  TORCH_INTERNAL_ASSERT((a.epilogue == LtEpilogue::kDefault) == (a.bias == nullptr));
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto plan = problemEntry<PlanKey, Plan>(makeKey(a, device));
  std::lock_guard<std::mutex> lock(plan->mutex);
  if (!plan->ready) {
    build(*plan, handle, a, stream);
  }
  if (!plan->found) {
    return false;
  }
  if (a.epilogue != LtEpilogue::kDefault) {
    setAttribute(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, a.bias);
  }
  TORCHFUSE_CUBLASLT_CHECK(launch(handle, *plan, plan->algo, a, stream));
  return true;
}

} // namespace torchfuse::kernels
