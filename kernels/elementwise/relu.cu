#include "kernels/elementwise/relu.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"

namespace torchfuse::kernels {
namespace {

// Vectors each thread keeps in flight: enough outstanding bytes to reach copy
// bandwidth on HBM3/HBM3e without a grid-stride loop.
constexpr int kUnroll = 4;

template <typename T>
__device__ __forceinline__ bool clamps(T v) {
  // NB: `v <= 0`, as PyTorch's kernel: NaN compares false, so relu(NaN) is
  // NaN and its gradient passes.
  return static_cast<float>(v) <= 0.f;
}
__device__ __forceinline__ bool clamps(double v) {
  return v <= 0.;
}

// Elements covered by one warp-wide vector access.
template <typename T>
constexpr int64_t warpChunk() {
  return 32 * Vec16<T>::kSize;
}

// Forward on whole warp chunks.  Each lane holds kSize consecutive elements,
// so the kSize-bit groups of 32 / kSize neighbouring lanes form one 32-bit
// mask word; an OR across those lanes assembles it.
template <typename T, bool kMask>
__global__ void __launch_bounds__(kThreads) reluChunkKernel(
    const T* __restrict__ x,
    T* __restrict__ y,
    uint32_t* __restrict__ mask,
    int64_t chunks) {
  constexpr int kSize = Vec16<T>::kSize;
  constexpr int kLanesPerWord = 32 / kSize;
  const int lane = threadIdx.x & 31;
  const int64_t first =
      (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * kUnroll;
  const auto* xv = reinterpret_cast<const Vec16<T>*>(x);
  auto* yv = reinterpret_cast<Vec16<T>*>(y);
  Vec16<T> a[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (first + u < chunks) {
      a[u] = xv[(first + u) * 32 + lane];
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (first + u >= chunks) {
      break;  // warp-uniform
    }
    uint32_t bits = 0;
#pragma unroll
    for (int k = 0; k < kSize; ++k) {
      const bool clamp = clamps(a[u].v[k]);
      a[u].v[k] = clamp ? T(0.f) : a[u].v[k];
      bits |= uint32_t(!clamp) << k;
    }
    yv[(first + u) * 32 + lane] = a[u];
    if constexpr (kMask) {
      uint32_t word = bits << (kSize * (lane % kLanesPerWord));
#pragma unroll
      for (int offset = 1; offset < kLanesPerWord; offset <<= 1) {
        word |= __shfl_xor_sync(0xffffffffu, word, offset);
      }
      if (lane % kLanesPerWord == 0) {
        mask[(first + u) * kSize + lane / kLanesPerWord] = word;
      }
    }
  }
}

// Elements [begin, n), begin a multiple of 32: one warp per mask word.
template <typename T>
__global__ void reluTailKernel(
    const T* __restrict__ x,
    T* __restrict__ y,
    uint32_t* __restrict__ mask,
    int64_t begin,
    int64_t n) {
  const int lane = threadIdx.x & 31;
  const int64_t w = begin / 32 + (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int64_t i = w * 32 + lane;
  bool keep = false;
  if (i < n) {
    const T v = x[i];
    keep = !clamps(v);
    y[i] = keep ? v : T(0.f);
  }
  const uint32_t bits = __ballot_sync(0xffffffffu, keep);
  if (mask != nullptr && lane == 0 && w * 32 < n) {
    mask[w] = bits;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) reluBackwardChunkKernel(
    const T* __restrict__ dy,
    const uint32_t* __restrict__ mask,
    T* __restrict__ dx,
    int64_t chunks) {
  constexpr int kSize = Vec16<T>::kSize;
  constexpr uint32_t kBits = (1u << kSize) - 1u;
  const int lane = threadIdx.x & 31;
  const int64_t first =
      (int64_t(blockIdx.x) * kWarps + threadIdx.x / 32) * kUnroll;
  const auto* dyv = reinterpret_cast<const Vec16<T>*>(dy);
  auto* dxv = reinterpret_cast<Vec16<T>*>(dx);
  Vec16<T> g[kUnroll];
  uint32_t bits[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (first + u < chunks) {
      const int64_t v = (first + u) * 32 + lane;  // vector index
      g[u] = dyv[v];
      const int64_t e = v * kSize;                // first element
      bits[u] = (mask[e / 32] >> (e % 32)) & kBits;
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (first + u < chunks) {
#pragma unroll
      for (int k = 0; k < kSize; ++k) {
        g[u].v[k] = ((bits[u] >> k) & 1u) ? g[u].v[k] : T(0.f);
      }
      dxv[(first + u) * 32 + lane] = g[u];
    }
  }
}

template <typename T>
__global__ void reluBackwardTailKernel(
    const T* __restrict__ dy,
    const uint32_t* __restrict__ mask,
    T* __restrict__ dx,
    int64_t begin,
    int64_t n) {
  const int64_t i = begin + blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    dx[i] = ((mask[i >> 5] >> (i & 31)) & 1u) ? dy[i] : T(0.f);
  }
}

// The offset, under `strides`, of logical index i.
__device__ __forceinline__ int64_t stridedOffset(
    int64_t i, const ReluStrides& s, const int64_t* strides) {
  int64_t offset = 0;
  for (int d = s.ndim - 1; d >= 0; --d) {
    const int64_t size = s.sizes[d];
    offset += (i % size) * strides[d];
    i /= size;
  }
  return offset;
}

// One thread per logical index; a warp covers one mask word (kThreads is a
// multiple of 32, and every thread of the warp takes part in the ballot).
template <typename T>
__global__ void __launch_bounds__(kThreads) reluMaskStridedKernel(
    const T* __restrict__ y, ReluStrides s, uint32_t* __restrict__ mask, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const bool keep = i < n && !clamps(y[stridedOffset(i, s, s.a)]);
  const uint32_t bits = __ballot_sync(0xffffffffu, keep);
  if ((threadIdx.x & 31) == 0 && i < n) {
    mask[i / 32] = bits;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) reluBackwardStridedKernel(
    const T* __restrict__ dy,
    const uint32_t* __restrict__ mask,
    T* __restrict__ dx,
    ReluStrides s,
    int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) {
    const bool keep = (mask[i >> 5] >> (i & 31)) & 1u;
    dx[stridedOffset(i, s, s.b)] = keep ? dy[stridedOffset(i, s, s.a)] : T(0.f);
  }
}

int64_t chunkBlocks(int64_t chunks) {
  return (chunks + kWarps * kUnroll - 1) / (kWarps * kUnroll);
}

} // namespace

template <typename T>
void reluForward(const T* x, T* y, uint32_t* mask, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  const int64_t chunks = aligned16(x) && aligned16(y) ? n / warpChunk<T>() : 0;
  if (chunks > 0) {
    if (mask != nullptr) {
      reluChunkKernel<T, true>
          <<<chunkBlocks(chunks), kThreads, 0, stream>>>(x, y, mask, chunks);
    } else {
      reluChunkKernel<T, false>
          <<<chunkBlocks(chunks), kThreads, 0, stream>>>(x, y, nullptr, chunks);
    }
  }
  const int64_t begin = chunks * warpChunk<T>();
  if (begin < n) {
    const int64_t words = (n - begin + 31) / 32;
    const int64_t blocks = (words * 32 + kThreads - 1) / kThreads;
    reluTailKernel<T><<<blocks, kThreads, 0, stream>>>(x, y, mask, begin, n);
  }
}

template <typename T>
void reluBackward(const ReluGradArgs<T>& a, cudaStream_t stream) {
  const auto [dy, mask, dx, n] = a;
  if (n == 0) {
    return;
  }
  const int64_t chunks = aligned16(dy) && aligned16(dx) ? n / warpChunk<T>() : 0;
  if (chunks > 0) {
    reluBackwardChunkKernel<T>
        <<<chunkBlocks(chunks), kThreads, 0, stream>>>(dy, mask, dx, chunks);
  }
  const int64_t begin = chunks * warpChunk<T>();
  if (begin < n) {
    const int64_t blocks = (n - begin + kThreads - 1) / kThreads;
    reluBackwardTailKernel<T><<<blocks, kThreads, 0, stream>>>(dy, mask, dx, begin, n);
  }
}

template <typename T>
void reluMaskStrided(
    const T* y, const ReluStrides& s, uint32_t* mask, int64_t n, cudaStream_t stream) {
  if (n == 0) {
    return;
  }
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  reluMaskStridedKernel<T><<<blocks, kThreads, 0, stream>>>(y, s, mask, n);
}

template <typename T>
void reluBackwardStrided(const ReluGradArgs<T>& a, const ReluStrides& s, cudaStream_t stream) {
  if (a.n == 0) {
    return;
  }
  const int64_t blocks = (a.n + kThreads - 1) / kThreads;
  reluBackwardStridedKernel<T><<<blocks, kThreads, 0, stream>>>(a.dy, a.mask, a.dx, s, a.n);
}

#define TORCHFUSE_INSTANTIATE_RELU(T)                                           \
  template void reluForward<T>(const T*, T*, uint32_t*, int64_t, cudaStream_t); \
  template void reluBackward<T>(const ReluGradArgs<T>&, cudaStream_t);          \
  template void reluMaskStrided<T>(                                             \
      const T*, const ReluStrides&, uint32_t*, int64_t, cudaStream_t);          \
  template void reluBackwardStrided<T>(const ReluGradArgs<T>&, const ReluStrides&, cudaStream_t);
TORCHFUSE_INSTANTIATE_RELU(float)
TORCHFUSE_INSTANTIATE_RELU(double)
TORCHFUSE_INSTANTIATE_RELU(__half)
TORCHFUSE_INSTANTIATE_RELU(__nv_bfloat16)
#undef TORCHFUSE_INSTANTIATE_RELU

} // namespace torchfuse::kernels
