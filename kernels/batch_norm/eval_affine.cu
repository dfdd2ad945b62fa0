// A thread per channel, one launch: the unfrozen eval chain pays it every
// call (ATen's composite would be about eight small kernels).

#include "kernels/batch_norm/eval_affine.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"

namespace torchfuse::kernels::batch_norm {
namespace {

template <typename T>
__global__ void __launch_bounds__(kThreads) evalAffineKernel(EvalAffineArgs<T> a) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.channels) {
    return;
  }
  // NB: as ATen's eval BatchNorm, 1 / sqrt in float.
  const float inv = 1.0f / sqrtf(toFloat(a.var[c]) + a.eps);
  const float s = a.gamma != nullptr ? toFloat(a.gamma[c]) * inv : inv;
  const float b = a.bias != nullptr ? toFloat(a.bias[c]) : 0.0f;
  const float beta = a.beta != nullptr ? toFloat(a.beta[c]) : 0.0f;
  a.scale[c] = s;
  a.shift[c] = (b - toFloat(a.mean[c])) * s + beta;
}

} // namespace

template <typename T>
void evalAffine(const EvalAffineArgs<T>& a, cudaStream_t stream) {
  if (a.channels == 0) {
    return;
  }
  const auto blocks = static_cast<unsigned>((a.channels + kThreads - 1) / kThreads);
  evalAffineKernel<T><<<blocks, kThreads, 0, stream>>>(a);
}

#define TORCHFUSE_INSTANTIATE(T) \
  template void evalAffine<T>(const EvalAffineArgs<T>&, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels::batch_norm
