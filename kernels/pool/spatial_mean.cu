// spatialMeanNhwc: a block per (32 channels, image, split); its 32 lanes
// read 32 consecutive channels of a position (whole 32-byte sectors), its 16
// rows stride over the split's positions, kUnroll positions a step, then a
// fixed-order tree adds the rows in shared memory.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/common/dtype.cuh"
#include "kernels/pool/spatial_mean.cuh"

namespace torchfuse::kernels {
namespace {

constexpr int kLanes = 32;
constexpr int kRows = 16;
constexpr int kUnroll = 8;
// Positions a split takes at least: below this the second launch costs
// more than the parallelism gains.
constexpr int64_t kMinSplitPositions = 256;

int64_t splitsFor(const SpatialMeanArgs& a) {
  const int64_t blocks = a.n * ((a.c + kLanes - 1) / kLanes);
  // NB: about four blocks of kLanes * kRows threads fill a multiprocessor.
  const int64_t wanted = (4 * int64_t(a.sms) + blocks - 1) / blocks;
  return std::max<int64_t>(1, std::min<int64_t>({wanted, a.hw / kMinSplitPositions, 65535}));
}

// One block's sum of x[image][p][ch] for p in [p0, p1), in row 0 of
// `rows` after the tree; returns it for threadIdx.y == 0.
template <typename T>
__device__ float blockSum(
    const T* __restrict__ x,
    int64_t image,
    int64_t ch,
    int64_t p0,
    int64_t p1,
    const SpatialMeanArgs& a) {
  __shared__ float rows[kRows][kLanes];
  float sum = 0.0f;
  if (ch < a.c) {
    const T* base = x + image * a.hw * a.c + ch;
    int64_t p = p0 + threadIdx.y;
    // NB: kUnroll independent loads in flight per thread: one warp's load is
    // only 32 channels (64 bytes in 16-bit types), too little to cover the
    // memory latency on its own.
    for (; p + (kUnroll - 1) * kRows < p1; p += kUnroll * kRows) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        v[u] = toFloat(base[(p + u * kRows) * a.c]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        sum += v[u];
      }
    }
    for (; p < p1; p += kRows) {
      sum += toFloat(base[p * a.c]);
    }
  }
  rows[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  for (int half = kRows / 2; half > 0; half /= 2) {
    if (threadIdx.y < half) {
      rows[threadIdx.y][threadIdx.x] += rows[threadIdx.y + half][threadIdx.x];
    }
    __syncthreads();
  }
  return rows[0][threadIdx.x];
}

template <typename T>
__global__ void __launch_bounds__(kLanes * kRows) spatialMeanKernel(
    const T* __restrict__ x,
    T* __restrict__ out,
    float* __restrict__ partial,
    SpatialMeanArgs a,
    int64_t splits) {
  const int64_t ch = int64_t(blockIdx.x) * kLanes + threadIdx.x;
  const int64_t image = blockIdx.y;
  const int64_t split = blockIdx.z;
  const int64_t per = (a.hw + splits - 1) / splits;
  const int64_t p0 = split * per, p1 = std::min(a.hw, p0 + per);
  const float sum = blockSum(x, image, ch, p0, p1, a);
  if (threadIdx.y != 0 || ch >= a.c) {
    return;
  }
  if (splits == 1) {
    out[image * a.c + ch] = fromFloat<T>(sum * a.factor);
  } else {
    partial[(split * a.n + image) * a.c + ch] = sum;
  }
}

template <typename T>
__global__ void spatialMeanSplitsKernel(
    const float* __restrict__ partial,
    T* __restrict__ out,
    SpatialMeanArgs a,
    int64_t splits) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.n * a.c) {
    return;
  }
  float sum = 0.0f;
  for (int64_t s = 0; s < splits; ++s) {
    sum += partial[s * a.n * a.c + i];
  }
  out[i] = fromFloat<T>(sum * a.factor);
}

} // namespace

int64_t spatialMeanWorkspace(const SpatialMeanArgs& a) {
  const int64_t splits = splitsFor(a);
  return splits == 1 ? 0 : splits * a.n * a.c;
}

template <typename T>
void spatialMeanNhwc(
    const T* x,
    T* out,
    float* workspace,
    const SpatialMeanArgs& a,
    cudaStream_t stream) {
  const int64_t splits = splitsFor(a);
  const dim3 blocks(
      static_cast<unsigned>((a.c + kLanes - 1) / kLanes), static_cast<unsigned>(a.n),
      static_cast<unsigned>(splits));
  spatialMeanKernel<T><<<blocks, dim3(kLanes, kRows), 0, stream>>>(x, out, workspace, a, splits);
  if (splits > 1) {
    const int64_t outputs = a.n * a.c;
    spatialMeanSplitsKernel<T><<<static_cast<unsigned>((outputs + 255) / 256), 256, 0, stream>>>(
        workspace, out, a, splits);
  }
}

#define TORCHFUSE_INSTANTIATE(T) \
  template void spatialMeanNhwc<T>(const T*, T*, float*, const SpatialMeanArgs&, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
