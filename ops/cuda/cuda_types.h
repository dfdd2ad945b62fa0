#pragma once

// Maps ATen's scalar types to the CUDA types the kernels in kernels/ take.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace torchfuse::ops {

template <typename T>
struct CudaType {
  using type = T;
};
template <>
struct CudaType<c10::Half> {
  using type = __half;
};
template <>
struct CudaType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename T>
auto* cudaPtr(const at::Tensor& t) {
  return reinterpret_cast<typename CudaType<T>::type*>(t.data_ptr<T>());
}

} // namespace torchfuse::ops
