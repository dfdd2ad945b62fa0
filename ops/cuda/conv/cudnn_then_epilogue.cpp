// Eager's own convolution (the same backend, engine and precision as
// at::conv2d picks, so results match eager's), then one in-place pass over
// its output adding the conv bias, applying relu, adding a per-channel or
// scalar `other` and writing the 1-bit mask, where eager spends three
// passes.  An NCHW output streams; a channels-last one takes the
// channels-inner pass; an output that neither pass takes runs the
// composite's pointwise part on the convolution already computed.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "kernels/conv/conv_relu_add.cuh"
#include "ops/common/conv_composites.h"
#include "ops/cuda/conv/strategies.h"

namespace torchfuse::ops::conv_cuda {

std::tuple<at::Tensor, at::Tensor> forwardCudnnThenEpilogue(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha,
    bool with_mask) {
  const auto& input = p.input;
  const auto& weight = p.weight;
  auto out = convolve(input, weight, std::nullopt, p.stride, p.padding, p.dilation, p.groups);
  const bool batched = input.dim() == weight.dim();
  const auto order = convMaskOrder(input, weight);
  // An nchw conv output streams (with a positions-inner mask, if any); a
  // channels-last one, or an nchw one whose mask must be channels-inner, takes
  // the channels-inner passes.  The mask must be in the order convMaskOrder
  // defines, whatever layout the convolution produced: a channels-last output
  // where that order is positions-inner (rare: an unbatched conv with a
  // channels-last weight), or an output in neither layout, takes neither.
  const bool streaming =
      out.is_contiguous() && (!with_mask || order == ConvMaskOrder::PositionsInner);
  const bool staged = !streaming && (out.is_contiguous() || isChannelsLast(out)) &&
      (!with_mask || order == ConvMaskOrder::ChannelsInner);
  if (out.numel() == 0 || (!streaming && !staged)) {
    // NB: the composite's pointwise part on `out`, not the composite, which
    // would compute the convolution again.  The bias is added in place after
    // the convolution, as eager's cuDNN convolution adds it, so `out` holds
    // what convolve(..., bias, ...) gives, in the layout it gives.
    addConvBias(out, bias, weight);
    return convReluAddEpilogueComposite(out, input, weight, other, alpha, with_mask);
  }
  c10::cuda::CUDAGuard guard(input.device());
  const auto e = convExtents(p.sizes, batched);
  at::Tensor mask;
  if (with_mask) {
    mask = at::empty({convMaskBytes(e, order)}, input.options().dtype(at::kByte));
  }
  const auto dtype = input.scalar_type();
  const EpilogueOperands operands(bias, other, p.sizes, batched ? 1 : 0, dtype);
  uint32_t* mask_ptr = with_mask ? reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>()) : nullptr;
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add", [&] {
    const auto args = kernels::ConvEpilogueArgs<CudaType<scalar_t>::type>{
        cudaPtr<scalar_t>(out),
        operands.biasPtr<scalar_t>(),
        operands.otherPtr<scalar_t>(),
        alpha.toFloat(),
        cudaPtr<scalar_t>(out),
        mask_ptr,
        e.images,
        e.channels,
        e.positions};
    if (streaming) {
      kernels::convReluAddEpiloguePositionsInner(args, stream);
    } else {
      kernels::convReluAddEpilogueChannelsInner(args, /*nchw=*/!isChannelsLast(out), stream);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {operands.addUnfused(out, other, alpha), mask};
}

} // namespace torchfuse::ops::conv_cuda
