// custom_conv_act_max_pool on CUDA: eager's own convolution without its bias
// (as custom_conv_add_act's CUDA kernel runs it), then one pass that reads
// each window of the conv output, adds the bias and applies the activation
// per element in float, and writes only the pooled maximum, rounded once.
// Eager reads and writes the full conv output once more for the bias (cuDNN)
// and for the activation before the pool reads it.  Conv outputs in neither
// nchw nor channels-last layout, or with a size-1 dimension (whose strides
// each op of the chain picks), take the chain's own ops on the convolution
// already computed.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/conv/act_max_pool.cuh"
#include "ops/common/conv_composites.h"
#include "ops/conv_act_max_pool.h"
#include "ops/conv_relu_add.h"
#include "ops/cuda/conv/operands.h"
#include "ops/cuda/cuda_types.h"

namespace torchfuse::ops {
namespace {

at::Tensor convActMaxPoolCuda(const ConvActMaxPoolArgs& a) {
  const std::optional<at::Tensor> none;
  const auto ca = convActArgs(a, none);
  if (!convAddActHandles(ca)) {
    return convActMaxPoolComposite(a);
  }
  const auto sizes = checkConvAddActInputs(ca, kConvActMaxPool);
  const auto act = parseActivation(a.activation, a.activation_args, kConvActMaxPool);
  if (!conv_cuda::kernelInputs(a.input, a.weight, a.bias) || a.weight.dim() != 4 ||
      a.input.dim() != 4) {
    return convActMaxPoolComposite(a);
  }
  c10::cuda::CUDAGuard guard(a.input.device());
  auto conv = convolve(a.input, a.weight, std::nullopt, a.stride, a.padding, a.dilation, a.groups);
  const bool nchw = conv.is_contiguous();
  const bool ambiguous =
      std::any_of(sizes.begin() + 1, sizes.end(), [](int64_t s) { return s == 1; });
  // NB: max_pool2d on Meta: ATen's checks of the pool arguments, and the
  // pooled output's sizes and strides as the CUDA op would give them.
  const auto pooled = maxPoolOf(onMeta(conv), a);
  const auto format = nchw ? at::MemoryFormat::Contiguous : at::MemoryFormat::ChannelsLast;
  if (conv.numel() == 0 || ambiguous || !(nchw || conv_cuda::isChannelsLast(conv)) ||
      !pooled.is_contiguous(format)) {
    addConvBias(conv, a.bias, a.weight);
    return maxPoolOf(convAddActEpilogueComposite(conv, ca), a);
  }
  auto out = at::empty_strided(pooled.sizes(), pooled.strides(), conv.options());
  const auto w = poolWindow(a);
  const auto bias = a.bias && a.bias->defined() ? a.bias->contiguous() : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(out.scalar_type(), "custom_conv_act_max_pool", [&] {
    using T = CudaType<scalar_t>::type;
    const kernels::ActMaxPoolArgs<T> args{
        cudaPtr<scalar_t>(conv),
        bias.defined() ? cudaPtr<scalar_t>(bias) : nullptr,
        cudaPtr<scalar_t>(out),
        act,
        sizes[0],
        sizes[1],
        sizes[2],
        sizes[3],
        out.size(2),
        out.size(3),
        w.kh,
        w.kw,
        w.sh,
        w.sw,
        w.ph,
        w.pw,
        w.dh,
        w.dw};
    kernels::actMaxPool(args, /*channels_last=*/!nchw, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  torchfuse::ops::registerConvActMaxPool<torchfuse::ops::convActMaxPoolCuda>(m);
}
