#include <c10/util/accumulate.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/conv_composites.h"
#include "ops/conv_relu_add.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether an `other` of these sizes, broadcast over a conv output of `rank`
// dimensions with `spatial` trailing spatial ones and `channels` channels,
// is per-channel or scalar-like: its gradient is then the backward's
// grad_channels (summed, when scalar-like).
bool channelShaped(at::IntArrayRef other, int64_t rank, int64_t spatial, int64_t channels) {
  const int64_t channel_dim = int64_t(other.size()) - 1 - spatial;
  if (int64_t(other.size()) > rank) {
    return false;
  }
  for (int64_t d = 0; d < int64_t(other.size()); ++d) {
    if (other[d] != 1 && (d != channel_dim || other[d] != channels)) {
      return false;
    }
  }
  return true;
}

// Saves input, weight and a 1-bit ReLU mask of the conv output; other only by
// its shape.
class ConvReluAddFunction : public torch::autograd::Function<ConvReluAddFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const at::Tensor& weight,
      const std::optional<at::Tensor>& bias,
      std::vector<int64_t> stride,
      std::vector<int64_t> padding,
      std::vector<int64_t> dilation,
      int64_t groups,
      const at::Tensor& other,
      const at::Scalar& alpha) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mask] = convReluAddForward(
        input, weight, bias, stride, padding, dilation, groups, other, alpha);
    ctx->save_for_backward({input, weight, mask});
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["dilation"] = dilation;
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["other_sizes"] = other.sizes().vec();
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto needs = [&](size_t arg) {
      return needsTensorGrad(ctx, {true, true, has_bias, true}, arg);
    };
    const auto other_sizes = ctx->saved_data["other_sizes"].toIntVector();
    const auto& weight = saved[1];
    // NB: a scalar-like other's gradient sums every element: ATen's
    // reduction accumulates it in float32, where a sum of per-channel sums,
    // each rounded to a 16-bit gradient's dtype, loses accuracy.
    const bool scalar_like = c10::multiply_integers(other_sizes) == 1;
    const bool channel_other = needs(3) && !scalar_like &&
        channelShaped(other_sizes, saved[0].dim(), weight.dim() - 2, weight.size(0));
    auto [grad_input, grad_weight, grad_bias, grad_channels] = convReluAddBackward(
        grads[0], saved[2], saved[0], weight,
        ctx->saved_data["stride"].toIntVector(),
        ctx->saved_data["padding"].toIntVector(),
        ctx->saved_data["dilation"].toIntVector(),
        ctx->saved_data["groups"].toInt(),
        {needs(0), needs(1), needs(2), channel_other});
    at::Tensor grad_other;
    if (needs(3)) {
      grad_other = channel_other ? grad_channels.reshape(other_sizes)
                                 : grads[0].sum_to_size(other_sizes);
      grad_other = scaledBy(grad_other, ctx->saved_data["alpha"].toScalar());
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), grad_other, at::Tensor()};
  }
};

at::Tensor convReluAddAutograd(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  if (!convReluAddHandles(input, weight, bias, stride, padding, dilation, groups, other, alpha)) {
    // NB: with autograd on: ATen records the original chain's own graph.
    return convReluAddReference(input, weight, bias, stride, padding, dilation, groups, other, alpha);
  }
  if (!needsGraph(input, weight, bias, other)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return custom_conv_relu_add(
        input, weight, bias, stride, padding, dilation, groups, other, alpha);
  }
  // NB: an absent bias goes to apply as an optional, which apply skips; an
  // undefined at::Tensor input fails there ("tensor does not have a device").
  return ConvReluAddFunction::apply(
      input, weight, bias, stride.vec(), padding.vec(), dilation.vec(),
      groups, other, alpha);
}

ConvReluAddGrads convReluAddBackwardAutograd(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 4> output_mask) {
  if (needsGraph(grad_output, input, weight)) {
    // NB: a backward with create_graph=True (or a direct call that records a
    // graph): the composite's ATen ops record the double backward's graph,
    // the mask a constant as in relu's own derivative, and
    // convolution_backward differentiated by ATen's formula.  The plain
    // backward keeps the device kernels below.
    return convReluAddBackwardComposite(
        grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return convReluAddBackward(
      grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"),
      TORCH_FN(convReluAddAutograd));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_backward"),
      TORCH_FN(convReluAddBackwardAutograd));
}
