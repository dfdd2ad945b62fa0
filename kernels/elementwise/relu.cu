#include "kernels/elementwise/relu.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace torchfuse::kernels {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T reluOf(T v) {
  // NB: `v <= 0 ? 0 : v`, as PyTorch's kernel: NaN compares false and stays.
  return static_cast<float>(v) <= 0.f ? T(0.f) : v;
}
__device__ __forceinline__ double reluOf(double v) {
  return v <= 0. ? 0. : v;
}

template <typename T>
__device__ __forceinline__ bool keepOf(T y) {
  return !(static_cast<float>(y) <= 0.f);
}
__device__ __forceinline__ bool keepOf(double y) {
  return !(y <= 0.);
}

// 16-byte vectors: the loads and stores that reach copy bandwidth.
template <typename T>
struct alignas(16) Vec {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

template <typename T>
__global__ void reluVecKernel(const T* __restrict__ x, T* __restrict__ y, int64_t nvec) {
  const auto* xv = reinterpret_cast<const Vec<T>*>(x);
  auto* yv = reinterpret_cast<Vec<T>*>(y);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < nvec;
       i += int64_t(gridDim.x) * blockDim.x) {
    Vec<T> a = xv[i];
#pragma unroll
    for (int k = 0; k < Vec<T>::kSize; ++k) {
      a.v[k] = reluOf(a.v[k]);
    }
    yv[i] = a;
  }
}

template <typename T>
__global__ void reluTailKernel(const T* __restrict__ x, T* __restrict__ y, int64_t begin, int64_t n) {
  const int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    y[i] = reluOf(x[i]);
  }
}

// One warp per 32-element word: the warp ballot is the mask word.
template <typename T>
__global__ void reluMaskKernel(
    const T* __restrict__ x,
    T* __restrict__ y,
    uint32_t* __restrict__ mask,
    int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t words = (n + 31) / 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t w = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32; w < words;
       w += warps) {
    const int64_t i = w * 32 + lane;
    bool keep = false;
    if (i < n) {
      const T out = reluOf(x[i]);
      y[i] = out;
      keep = keepOf(out);
    }
    const uint32_t bits = __ballot_sync(0xffffffffu, keep);
    if (lane == 0) {
      mask[w] = bits;
    }
  }
}

template <typename T>
__global__ void reluBackwardKernel(
    const T* __restrict__ dy,
    const uint32_t* __restrict__ mask,
    T* __restrict__ dx,
    int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const bool keep = (mask[i >> 5] >> (i & 31)) & 1u;
    dx[i] = keep ? dy[i] : T(0.f);
  }
}

int gridFor(int64_t work_items) {
  int device = 0;
  int sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t blocks = (work_items + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sms) * 16)));
}

} // namespace

template <typename T>
void reluForward(const T* x, T* y, uint32_t* mask, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  if (mask != nullptr) {
    reluMaskKernel<T><<<gridFor((n + 31) / 32 * 32), kThreads, 0, stream>>>(x, y, mask, n);
    return;
  }
  constexpr int kVec = Vec<T>::kSize;
  const bool aligned = (reinterpret_cast<uintptr_t>(x) % 16 == 0) &&
      (reinterpret_cast<uintptr_t>(y) % 16 == 0);
  const int64_t nvec = aligned ? n / kVec : 0;
  if (nvec > 0) {
    reluVecKernel<T><<<gridFor(nvec), kThreads, 0, stream>>>(x, y, nvec);
  }
  const int64_t begin = nvec * kVec;
  if (begin < n) {
    const int64_t rest = n - begin;
    reluTailKernel<T><<<(rest + kThreads - 1) / kThreads, kThreads, 0, stream>>>(x, y, begin, n);
  }
}

template <typename T>
void reluBackward(const T* dy, const uint32_t* mask, T* dx, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  reluBackwardKernel<T><<<gridFor(n), kThreads, 0, stream>>>(dy, mask, dx, n);
}

#define TORCHFUSE_INSTANTIATE_RELU(T)                                           \
  template void reluForward<T>(const T*, T*, uint32_t*, int64_t, cudaStream_t); \
  template void reluBackward<T>(const T*, const uint32_t*, T*, int64_t, cudaStream_t);
TORCHFUSE_INSTANTIATE_RELU(float)
TORCHFUSE_INSTANTIATE_RELU(double)
TORCHFUSE_INSTANTIATE_RELU(__half)
TORCHFUSE_INSTANTIATE_RELU(__nv_bfloat16)
#undef TORCHFUSE_INSTANTIATE_RELU

} // namespace torchfuse::kernels
