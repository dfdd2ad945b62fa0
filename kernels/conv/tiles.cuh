#pragma once

// The 32x32 tiles through shared memory of the staged passes
// (channels_inner.cu, transposes.cu), and their grids.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

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

} // namespace torchfuse::kernels::conv
