#pragma once

// The per-(image, channel) mean over H x W of a dense NHWC tensor, in float32
// accumulators, each mean from a fixed order of additions (deterministic).

#include <cuda_runtime.h>

#include <cstdint>

namespace torchfuse::kernels {

struct SpatialMeanArgs {
  int64_t n, c, hw; // x is [n][hw][c] in memory; out is [n][c]
  float factor;     // what each sum is multiplied by (ATen's 1 / hw)
  int sms;          // the device's multiprocessors, to size the split
};

// Float32 elements of workspace spatialMeanNhwc needs for these extents (0
// where one pass suffices).
int64_t spatialMeanWorkspace(const SpatialMeanArgs& a);

// out[i][ch] = factor * sum over p of x[i][p][ch].  Where the images and
// channel tiles alone would leave most multiprocessors idle, the positions
// are split among blocks whose partial sums (workspace) a second launch adds
// in split order.
template <typename T>
void spatialMeanNhwc(
    const T* x,
    T* out,
    float* workspace,
    const SpatialMeanArgs& a,
    cudaStream_t stream);

} // namespace torchfuse::kernels
