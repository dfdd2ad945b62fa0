#pragma once

// 16-byte vector access.  sm_90 has no wider vector load or store, so
// 16-byte vectors are what lets a warp's access reach copy bandwidth.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"

namespace torchfuse::kernels {

// N consecutive elements, aligned to their size up to 16 bytes: a vector of
// 8 floats is two 16-byte accesses.
template <typename T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Vec {
  static constexpr int kSize = N;
  T v[N];
};

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int maxVec() {
  return 16 / static_cast<int>(sizeof(T));
}

template <typename T>
using Vec16 = Vec<T, maxVec<T>()>;

// Whether p allows 16-byte vector access.  Null (an absent operand) does.
inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// The 16-bit types' pairs, converted two at a time: one conversion
// instruction per pair instead of one per element (on an H200 the float16
// conv epilogue ran 1.25x as long as the bfloat16 one, which differs in its
// conversions only).  Both round to nearest even, as fromFloat.
template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 toFloat2(type p) {
    return __half22float2(p);
  }
  static __device__ __forceinline__ type fromFloat2(float a, float b) {
    return __floats2half2_rn(a, b);
  }
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 toFloat2(type p) {
    return __bfloat1622float2(p);
  }
  static __device__ __forceinline__ type fromFloat2(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
};

template <typename T, int N>
constexpr bool kPaired = sizeof(T) == 2 && N % 2 == 0;

// The N elements at p (aligned as Vec<T, N>) in one access, as floats.
template <typename T, int N>
__device__ __forceinline__ void loadVec(const T* p, float (&v)[N]) {
  const auto vec = *reinterpret_cast<const Vec<T, N>*>(p);
  if constexpr (kPaired<T, N>) {
    const auto* pairs = reinterpret_cast<const typename Pair<T>::type*>(vec.v);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      const float2 f = Pair<T>::toFloat2(pairs[k]);
      v[2 * k] = f.x;
      v[2 * k + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      v[k] = toFloat(vec.v[k]);
    }
  }
}

// Stores v, rounded to T, as the N elements at p in one access.
template <typename T, int N>
__device__ __forceinline__ void storeVec(T* p, const float (&v)[N]) {
  Vec<T, N> vec;
  if constexpr (kPaired<T, N>) {
    auto* pairs = reinterpret_cast<typename Pair<T>::type*>(vec.v);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
      pairs[k] = Pair<T>::fromFloat2(v[2 * k], v[2 * k + 1]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      vec.v[k] = fromFloat<T>(v[k]);
    }
  }
  *reinterpret_cast<Vec<T, N>*>(p) = vec;
}

} // namespace torchfuse::kernels
