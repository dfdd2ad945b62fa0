// custom_conv_add_act on CUDA: one cuDNN graph where it applies and wins
// (ops/cuda/conv/cudnn_fusion.h); otherwise eager's own convolution without its bias (the
// same backend, engine and precision flags as at::conv2d, so results match
// eager's), then one in-place pass over its output adding the bias,
// alpha * other and the activation in float, rounded once, where eager
// spends up to three passes, each rounding.  An nchw output and a
// channels-last one each take one streaming pass.  `other` joins the pass
// only with the output's exact sizes, strides and dtype (the residual of a
// network in one layout); any other `other`, and outputs in neither layout,
// take the composite's pointwise part on the convolution already computed.
// Where eager's last op is out of place over an output with size-1
// dimensions (whose strides that op picks), the result takes that op's
// strides (outOfPlaceStrides): the SE blocks' convolutions of [N, C, 1, 1].

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/conv/add_act_epilogue.cuh"
#include "ops/common/conv_composites.h"
#include "ops/conv_add_act.h"
#include "ops/conv_relu_add.h"
#include "ops/cuda/conv/cudnn_fusion.h"
#include "ops/cuda/conv/operands.h"
#include "ops/cuda/cuda_types.h"

namespace torchfuse::ops {
namespace {

using conv_cuda::isChannelsLast;

// `other` is read by the pass: elementwise in the output's own memory order.
bool fusesOther(const at::Tensor& other, const at::Tensor& out) {
  return other.scalar_type() == out.scalar_type() && other.device() == out.device() &&
      other.sizes() == out.sizes() && other.strides() == out.strides();
}

// Eager's convolution, then the epilogue pass (or the composite's
// pointwise part).
at::Tensor convThenEpilogue(
    const ConvAddActArgs& a,
    const kernels::Activation& act,
    const at::Tensor& other,
    at::IntArrayRef sizes) {
  auto out = convolve(a.input, a.weight, std::nullopt, a.stride, a.padding, a.dilation, a.groups);
  const bool nchw = out.is_contiguous();
  const bool fast = out.numel() > 0 && (nchw || isChannelsLast(out)) &&
      (!other.defined() || fusesOther(other, out));
  if (!fast) {
    // NB: the bias in place, as eager's cuDNN convolution adds it, then the
    // composite's pointwise part: never the convolution again.
    addConvBias(out, a.bias, a.weight);
    return convAddActEpilogueComposite(out, a);
  }
  const auto e = convExtents(sizes, a.input.dim() == a.weight.dim());
  const auto bias = a.bias && a.bias->defined() ? a.bias->contiguous() : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(out.scalar_type(), "custom_conv_add_act", [&] {
    const kernels::ConvAddActEpilogueArgs<CudaType<scalar_t>::type> args{
        cudaPtr<scalar_t>(out),
        bias.defined() ? cudaPtr<scalar_t>(bias) : nullptr,
        other.defined() ? cudaPtr<scalar_t>(other) : nullptr,
        a.alpha.toFloat(),
        act,
        e.images,
        e.channels,
        e.positions,
        /*scale=*/nullptr,
        /*shift=*/nullptr};
    kernels::convAddActEpilogue(args, /*channels_last=*/!nchw, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (outOfPlaceOverAmbiguousLayout(a, act, sizes)) {
    const auto strides = outOfPlaceStrides(out);
    if (out.strides() != at::IntArrayRef(strides)) {
      return out.as_strided(out.sizes(), strides);
    }
  }
  return out;
}

at::Tensor convAddActCuda(const ConvAddActArgs& a) {
  if (!convAddActHandles(a)) {
    return convAddActComposite(a);
  }
  const auto sizes = checkConvAddActInputs(a);
  const auto act = parseActivation(a.activation, a.activation_args);
  if (!conv_cuda::kernelInputs(a.input, a.weight, a.bias)) {
    return convAddActComposite(a);
  }
  c10::cuda::CUDAGuard guard(a.input.device());
  const auto other = otherOf(a);
  const auto unfused = [&] { return convThenEpilogue(a, act, other, sizes); };
  auto fused = conv_cuda::convAddActCudnnFused(a, act, other, sizes, unfused);
  return fused.defined() ? fused : unfused();
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  torchfuse::ops::registerConvAddAct<torchfuse::ops::convAddActCuda>(m);
}
