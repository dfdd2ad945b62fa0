#pragma once

// The storage types the kernels take (float, __half, __nv_bfloat16) and
// their conversions to and from float, in which the kernels compute.  Both
// directions round to nearest even, as ATen's casts do.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace torchfuse::kernels {

__device__ __forceinline__ float toFloat(float v) {
  return v;
}
__device__ __forceinline__ float toFloat(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float toFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ float fromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Whether results of T round away far more than float's last bits: the
// activations may then take their approximate forms (activation.cuh).
template <typename T>
constexpr bool isSixteenBit() {
  return sizeof(T) == 2;
}

} // namespace torchfuse::kernels

// Expands MACRO(T) for each storage type above: the explicit instantiations
// of a kernel file's entry points.  ops/cuda/ maps ATen's float, half and
// bfloat16 onto these types (ops/cuda/cuda_types.h).
#define TORCHFUSE_FOR_EACH_FLOAT_TYPE(MACRO) \
  MACRO(float)                               \
  MACRO(__half)                              \
  MACRO(__nv_bfloat16)
