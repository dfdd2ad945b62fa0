#pragma once

// The 32x32 tiles through shared memory of the staged passes
// (channels_inner.cu, transposes.cu), and their grids.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/dtype.cuh"

namespace torchfuse::kernels::conv {

// 32x32 tiles moved by 32x8 threads: each warp reads and writes 32
// consecutive elements (128 bytes in float32) on both sides of the transpose.
constexpr int kTile = 32;
constexpr int kRows = 8;
// CUDA caps gridDim.y and gridDim.z; larger extents loop.
constexpr int64_t kMaxGridYZ = 65535;

inline int64_t tiles(int64_t extent) {
  return (extent + kTile - 1) / kTile;
}

inline dim3 grid(int64_t x, int64_t y, int64_t z) {
  return dim3(
      static_cast<unsigned>(x), static_cast<unsigned>(std::min(y, kMaxGridYZ)),
      static_cast<unsigned>(std::min(z, kMaxGridYZ)));
}

// Moves a block's tile of an nchw [channels][positions] plane at
// plane + base, channels blockIdx.x * kTile on, positions s0 on, into
// tile[channel][s] (kIntoTile) or back, rounded to T (threads (lane =
// threadIdx.x, threadIdx.y); what lies outside the plane is not touched).
template <bool kIntoTile, typename T>
__device__ __forceinline__ void moveNchwTile(
    float (&tile)[kTile][kTile + 1],
    T* plane,
    int64_t base,
    int64_t channels,
    int64_t positions,
    int64_t s0,
    int lane) {
  for (int i = threadIdx.y; i < kTile; i += kRows) {
    const int64_t ch = int64_t(blockIdx.x) * kTile + i, s = s0 + lane;
    if (ch < channels && s < positions) {
      if constexpr (kIntoTile) {
        tile[i][lane] = toFloat(plane[base + ch * positions + s]);
      } else {
        plane[base + ch * positions + s] = fromFloat<T>(tile[i][lane]);
      }
    }
  }
}

} // namespace torchfuse::kernels::conv
