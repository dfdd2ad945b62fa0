#pragma once

// Small cuBLASLt helpers: one checking macro, RAII descriptors and a typed
// setAttribute.  No dispatcher headers (the rule of kernels/, README.md);
// errors throw c10::Error through TORCH_CHECK.  CUDA-version guards belong
// here only.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernels/common/problem_cache.h"

#if !defined(CUBLAS_VERSION) || CUBLAS_VERSION < 11000
#error "torchfuse's cuBLASLt kernels need cuBLAS 11 or newer"
#endif

// Checks a cublasStatus_t and reports cuBLASLt's name and description of it.
#define TORCHFUSE_CUBLASLT_CHECK(EXPR)                                        \
  do {                                                                        \
    const cublasStatus_t _tf_status = (EXPR);                                 \
    TORCH_CHECK(                                                              \
        _tf_status == CUBLAS_STATUS_SUCCESS, "cuBLASLt error ",               \
        ::cublasLtGetStatusName(_tf_status), " (",                            \
        ::cublasLtGetStatusString(_tf_status), ") from " #EXPR);              \
  } while (0)

namespace torchfuse::kernels::cublaslt {

namespace detail {

// Deleters run in destructors, possibly during unwinding: they must not
// throw, so a failed destroy is reported (debug builds) rather than raised.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct Deleter {
  void operator()(T desc) const noexcept {
    if (desc != nullptr) {
      [[maybe_unused]] const cublasStatus_t status = Destroy(desc);
      TORCH_INTERNAL_ASSERT_DEBUG_ONLY(status == CUBLAS_STATUS_SUCCESS);
    }
  }
};

} // namespace detail

// The cuBLASLt descriptor handles are pointers to opaque structs.
using MatmulDesc = std::unique_ptr<
    std::remove_pointer_t<cublasLtMatmulDesc_t>,
    detail::Deleter<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>>;
using MatrixLayout = std::unique_ptr<
    std::remove_pointer_t<cublasLtMatrixLayout_t>,
    detail::Deleter<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>>;
using MatmulPreference = std::unique_ptr<
    std::remove_pointer_t<cublasLtMatmulPreference_t>,
    detail::Deleter<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>>;

inline MatmulDesc makeMatmulDesc(cublasComputeType_t compute, cudaDataType_t scale) {
  cublasLtMatmulDesc_t desc = nullptr;
  TORCHFUSE_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc, compute, scale));
  return MatmulDesc(desc);
}

// A column-major rows x cols matrix with leading dimension ld.
inline MatrixLayout makeMatrixLayout(
    cudaDataType_t type, uint64_t rows, uint64_t cols, int64_t ld) {
  cublasLtMatrixLayout_t layout = nullptr;
  TORCHFUSE_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&layout, type, rows, cols, ld));
  return MatrixLayout(layout);
}

inline MatmulPreference makeMatmulPreference() {
  cublasLtMatmulPreference_t pref = nullptr;
  TORCHFUSE_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  return MatmulPreference(pref);
}

template <typename T>
void setAttribute(const MatmulDesc& desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  TORCHFUSE_CUBLASLT_CHECK(
      cublasLtMatmulDescSetAttribute(desc.get(), attr, &value, sizeof(T)));
}

template <typename T>
void setAttribute(
    const MatmulPreference& pref, cublasLtMatmulPreferenceAttributes_t attr, const T& value) {
  TORCHFUSE_CUBLASLT_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &value, sizeof(T)));
}

using kernels::pointerAlignment;

} // namespace torchfuse::kernels::cublaslt
