// One block per out-channel: its scale once, then its weight block.  A
// single launch, since a call of the unfrozen eval chain pays it every time
// (ATen's composite would be about eight small kernels).

#include "kernels/batch_norm/fold_into_conv.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"

namespace torchfuse::kernels::batch_norm {
namespace {

template <typename T>
__global__ void foldKernel(
    const T* __restrict__ w,
    const T* __restrict__ bias,
    const T* __restrict__ gamma,
    const T* __restrict__ beta,
    const T* __restrict__ mean,
    const T* __restrict__ var,
    T* __restrict__ w_out,
    T* __restrict__ shift_out,
    FoldArgs a) {
  const int64_t c = blockIdx.x;
  // NB: as ATen's eval BatchNorm, 1 / sqrt in float.
  const float inv = 1.0f / sqrtf(toFloat(var[c]) + a.eps);
  const float s = gamma != nullptr ? toFloat(gamma[c]) * inv : inv;
  const int64_t base = c * a.per_channel;
  for (int64_t k = threadIdx.x; k < a.per_channel; k += blockDim.x) {
    w_out[base + k] = fromFloat<T>(toFloat(w[base + k]) * s);
  }
  if (threadIdx.x == 0) {
    const float b = bias != nullptr ? toFloat(bias[c]) : 0.0f;
    const float beta_c = beta != nullptr ? toFloat(beta[c]) : 0.0f;
    shift_out[c] = fromFloat<T>((b - toFloat(mean[c])) * s + beta_c);
  }
}

} // namespace

template <typename T>
void foldIntoConv(
    const T* w,
    const T* bias,
    const T* gamma,
    const T* beta,
    const T* mean,
    const T* var,
    T* w_out,
    T* shift_out,
    FoldArgs args,
    cudaStream_t stream) {
  if (args.channels == 0) {
    return;
  }
  foldKernel<T><<<static_cast<unsigned>(args.channels), kThreads, 0, stream>>>(
      w, bias, gamma, beta, mean, var, w_out, shift_out, args);
}

#define TORCHFUSE_INSTANTIATE(T) \
  template void foldIntoConv<T>( \
      const T*, const T*, const T*, const T*, const T*, const T*, T*, T*, FoldArgs, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels::batch_norm
