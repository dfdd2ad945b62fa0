// custom_add_layer_norm's kernel (the contract is in add_layer_norm.cuh).
//
// Each row is read once: the threads of its warp (rows of up to 1024
// elements) or block hold it in registers as VPT 16-byte vectors each, add
// `other`, round the sum to T (eager's add result), optionally store it,
// reduce the mean, then the squared deviations from it (two passes over the
// registers: no cancellation, unlike E[x²] - E[x]²), and write the
// normalized row.  NaN and Inf reach the statistics and so the whole row, as
// in eager.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/norm/add_layer_norm.cuh"

namespace torchfuse::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kMaxElementsPerThread = 32;
// Rows per block of the warp-per-row kernel.
constexpr int kWarpRowsPerBlock = 4;

__device__ __forceinline__ float warpSum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// The sum over the block, returned to every thread.  `shared` holds one
// float per warp; reusable after the call (it ends with a barrier).
__device__ __forceinline__ float blockSum(float v, float* shared) {
  const int lane = threadIdx.x % kWarp;
  const int warp = threadIdx.x / kWarp;
  const int warps = (blockDim.x + kWarp - 1) / kWarp;
  v = warpSum(v);
  if (lane == 0) {
    shared[warp] = v;
  }
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < warps; ++w) {
    total += shared[w];
  }
  __syncthreads();
  return total;
}

// One row, by `threads` threads (thread `t` of them); `reduce` sums a float
// over those threads.
template <typename T, int N, int VPT, typename Reduce>
__device__ __forceinline__ void normalizeRow(
    const AddLayerNormRows<T>& a,
    int64_t row,
    int t,
    int threads,
    Reduce reduce) {
  const int64_t vectors = a.cols / N;
  const int64_t base = row * a.cols;
  float x[VPT][N];
  float local = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t v = t + int64_t(i) * threads;
    if (v < vectors) {
      float o[N];
      loadVec<T, N>(a.input + base + v * N, x[i]);
      loadVec<T, N>(a.other + base + v * N, o);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        // NB: rounded to T as eager's add result is, before the statistics.
        x[i][k] = toFloat(fromFloat<T>(x[i][k] + a.alpha * o[k]));
        local += x[i][k];
      }
      if (a.sum != nullptr) {
        storeVec<T, N>(a.sum + base + v * N, x[i]);
      }
    }
  }
  const float inv_cols = 1.0f / static_cast<float>(a.cols);
  const float mean = reduce(local) * inv_cols;
  local = 0.0f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t v = t + int64_t(i) * threads;
    if (v < vectors) {
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const float d = x[i][k] - mean;
        local += d * d;
      }
    }
  }
  const float var = reduce(local) * inv_cols;
  const float rstd = rsqrtf(var + a.eps);
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t v = t + int64_t(i) * threads;
    if (v < vectors) {
      float w[N], b[N];
      if (a.weight != nullptr) {
        loadVec<T, N>(a.weight + v * N, w);
      }
      if (a.bias != nullptr) {
        loadVec<T, N>(a.bias + v * N, b);
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        float y = (x[i][k] - mean) * rstd;
        if (a.weight != nullptr) {
          y *= w[k];
        }
        if (a.bias != nullptr) {
          y += b[k];
        }
        x[i][k] = y;
      }
      storeVec<T, N>(a.out + base + v * N, x[i]);
    }
  }
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(kWarp * kWarpRowsPerBlock)
    warpRowKernel(const AddLayerNormRows<T> a) {
  const int64_t row = int64_t(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / kWarp;
  if (row >= a.rows) {
    return; // NB: whole warps leave together: the shuffles stay full-mask
  }
  normalizeRow<T, N, VPT>(a, row, threadIdx.x % kWarp, kWarp, [](float v) { return warpSum(v); });
}

template <typename T, int N, int VPT>
__global__ void __launch_bounds__(1024) blockRowKernel(const AddLayerNormRows<T> a) {
  __shared__ float shared[1024 / kWarp];
  normalizeRow<T, N, VPT>(a, blockIdx.x, threadIdx.x, blockDim.x, [&](float v) {
    return blockSum(v, shared);
  });
}

// The smallest VPT in {1, 2, 4, 8, ...} with threads * VPT >= vectors.
int vectorsPerThread(int64_t vectors, int64_t threads) {
  int vpt = 1;
  while (threads * vpt < vectors) {
    vpt *= 2;
  }
  return vpt;
}

template <typename T, int VPT>
void launchRows(const AddLayerNormRows<T>& a, bool warp_rows, int threads, cudaStream_t stream) {
  constexpr int N = maxVec<T>();
  if constexpr (VPT * N <= kMaxElementsPerThread) {
    if (warp_rows) {
      const int64_t blocks = (a.rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock;
      warpRowKernel<T, N, VPT>
          <<<unsigned(blocks), kWarp * kWarpRowsPerBlock, 0, stream>>>(a);
    } else {
      blockRowKernel<T, N, VPT><<<unsigned(a.rows), threads, 0, stream>>>(a);
    }
  }
}

} // namespace

template <typename T>
bool addLayerNormRowsSupported(const AddLayerNormRows<T>& a) {
  constexpr int N = maxVec<T>();
  return a.rows > 0 && a.cols > 0 && a.cols % N == 0 && a.cols <= kAddLayerNormMaxCols &&
      a.rows <= int64_t(0x7fffffff) && aligned16(a.input) && aligned16(a.other) &&
      aligned16(a.weight) && aligned16(a.bias) && aligned16(a.out) && aligned16(a.sum);
}

template <typename T>
void addLayerNormRows(const AddLayerNormRows<T>& a, cudaStream_t stream) {
  constexpr int N = maxVec<T>();
  const int64_t vectors = a.cols / N;
  const bool warp_rows = a.cols <= int64_t(kWarp) * kMaxElementsPerThread;
  // NB: block rows: the fewest threads (a multiple of 32, from 128 on) that
  // hold the row at most 32 elements each.
  int threads = kWarp;
  if (!warp_rows) {
    threads = 128;
    while (int64_t(threads) * (kMaxElementsPerThread / N) < vectors) {
      threads *= 2;
    }
  }
  switch (vectorsPerThread(vectors, threads)) {
    case 1:
      launchRows<T, 1>(a, warp_rows, threads, stream);
      break;
    case 2:
      launchRows<T, 2>(a, warp_rows, threads, stream);
      break;
    case 4:
      launchRows<T, 4>(a, warp_rows, threads, stream);
      break;
    default:
      launchRows<T, 8>(a, warp_rows, threads, stream);
      break;
  }
}

#define TORCHFUSE_INSTANTIATE(T)                                                   \
  template bool addLayerNormRowsSupported<T>(const AddLayerNormRows<T>&);          \
  template void addLayerNormRows<T>(const AddLayerNormRows<T>&, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
