#pragma once

// 16-byte vector access.  sm_90 has no wider vector load or store, so
// 16-byte vectors are what lets a warp's access reach copy bandwidth.

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

// The N elements at p (aligned as Vec<T, N>) in one access, as floats.
template <typename T, int N>
__device__ __forceinline__ void loadVec(const T* p, float (&v)[N]) {
  const auto vec = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int k = 0; k < N; ++k) {
    v[k] = toFloat(vec.v[k]);
  }
}

// Stores v, rounded to T, as the N elements at p in one access.
template <typename T, int N>
__device__ __forceinline__ void storeVec(T* p, const float (&v)[N]) {
  Vec<T, N> vec;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    vec.v[k] = fromFloat<T>(v[k]);
  }
  *reinterpret_cast<Vec<T, N>*>(p) = vec;
}

} // namespace torchfuse::kernels
