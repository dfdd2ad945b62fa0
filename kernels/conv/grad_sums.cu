// convGradSumsTotal: a block per 32 channels and sum, its warps striding
// over the rows (each warp reads 32 consecutive doubles of a row), then a
// fixed-order tree over the warps in shared memory.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/conv/grad_sums.cuh"

namespace torchfuse::kernels {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) gradSumsTotalKernel(
    const double* __restrict__ rows_a,
    const double* __restrict__ rows_b,
    int64_t parts,
    int64_t channels,
    T* __restrict__ out_a,
    T* __restrict__ out_b) {
  const double* rows = blockIdx.y == 0 ? rows_a : rows_b;
  T* out = blockIdx.y == 0 ? out_a : out_b;
  if (rows == nullptr) {
    return;
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t c = int64_t(blockIdx.x) * 32 + lane;
  double sum = 0.0;
  if (c < channels) {
    for (int64_t r = warp; r < parts; r += kWarps) {
      sum += rows[r * channels + c];
    }
  }
  __shared__ double partial[kWarps][32];
  partial[warp][lane] = sum;
  __syncthreads();
  for (int half = kWarps / 2; half > 0; half /= 2) {
    if (warp < half) {
      partial[warp][lane] += partial[warp + half][lane];
    }
    __syncthreads();
  }
  if (warp == 0 && c < channels) {
    // NB: through float, as ATen's double-to-half and -bfloat16 casts go.
    out[c] = fromFloat<T>(static_cast<float>(partial[0][lane]));
  }
}

} // namespace

template <typename T>
void convGradSumsTotal(
    const double* rows_a,
    const double* rows_b,
    int64_t parts,
    int64_t channels,
    T* out_a,
    T* out_b,
    cudaStream_t stream) {
  if (channels == 0 || (rows_a == nullptr && rows_b == nullptr)) {
    return;
  }
  const dim3 blocks(static_cast<unsigned>((channels + 31) / 32), 2);
  gradSumsTotalKernel<T>
      <<<blocks, kThreads, 0, stream>>>(rows_a, rows_b, parts, channels, out_a, out_b);
}

#define TORCHFUSE_INSTANTIATE(T)      \
  template void convGradSumsTotal<T>( \
      const double*, const double*, int64_t, int64_t, T*, T*, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
