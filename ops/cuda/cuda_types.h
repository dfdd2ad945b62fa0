#pragma once

// Maps ATen's scalar types to the CUDA types the kernels in kernels/ take.

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// AT_DISPATCH over the dtypes the kernels are instantiated for
// (TORCHFUSE_FOR_EACH_FLOAT_TYPE in kernels/common/dtype.cuh): float, half
// and bfloat16; scalar_t is ATen's type, cudaPtr<scalar_t> the kernels'.
#define TORCHFUSE_DISPATCH_KERNEL_TYPES(TYPE, NAME, ...)                                 \
  AT_DISPATCH_SWITCH(                                                                    \
      TYPE, NAME,                                                                        \
      AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
          AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

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
