#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/conv_composites.h"
#include "ops/conv_relu_add.h"

namespace torchfuse::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether an `other` of these sizes, broadcast over a conv output of `rank`
// dimensions with `spatial` trailing spatial ones and `channels` channels,
// is per-channel or scalar-like: its gradient is then the backward's
// grad_channels (summed, when scalar-like).
// NB: SymInts: under symbolic tracing each comparison is a guard on a size
// the choice depends on, not a specialisation of every size.
bool channelShaped(
    c10::SymIntArrayRef other,
    int64_t rank,
    int64_t spatial,
    const c10::SymInt& channels) {
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
// NB: apply takes ConvReluAddArgs' fields one by one, as it records an edge
// for each tensor argument; forward packs them again.
class ConvReluAddFunction : public torch::autograd::Function<ConvReluAddFunction> {
 public:
  template <typename... Args>
  static at::Tensor forward(AutogradContext* ctx, const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const ConvReluAddArgs a{args...};
    auto [out, mask] = convReluAddForward(a);
    ctx->save_for_backward({a.input, a.weight, mask});
    ctx->saved_data["stride"] = a.stride.vec();
    ctx->saved_data["padding"] = a.padding.vec();
    ctx->saved_data["dilation"] = a.dilation.vec();
    ctx->saved_data["groups"] = a.groups;
    // NB: sym_sizes: with symbolic sizes (torch.compile, torch.export)
    // sizes() raises or specialises every dimension.
    ctx->saved_data["other_sizes"] = c10::IValue(a.other.sym_sizes());
    ctx->saved_data["alpha"] = a.alpha;
    ctx->saved_data["has_bias"] = a.bias.has_value() && a.bias->defined();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto needs = [&](size_t arg) {
      return needsTensorGrad(ctx, {true, true, has_bias, true}, arg);
    };
    const auto other_sizes = ctx->saved_data["other_sizes"].toSymIntVector();
    const auto& weight = saved[1];
    // NB: a scalar-like other's gradient sums every element: ATen's
    // reduction accumulates it in float32, where a sum of per-channel sums,
    // each rounded to a 16-bit gradient's dtype, loses accuracy.
    c10::SymInt other_numel = 1;
    for (const auto& s : other_sizes) {
      other_numel = other_numel * s;
    }
    const bool scalar_like = other_numel == 1;
    const bool channel_other = needs(3) && !scalar_like &&
        channelShaped(other_sizes, saved[0].dim(), weight.dim() - 2, weight.sym_size(0));
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const std::array<bool, 4> mask{needs(0), needs(1), needs(2), channel_other};
    auto [grad_input, grad_weight, grad_bias, grad_channels] = convReluAddBackward(
        {grads[0], saved[2], saved[0], weight, stride, padding, dilation,
         ctx->saved_data["groups"].toInt(), mask});
    at::Tensor grad_other;
    if (needs(3)) {
      grad_other = channel_other ? grad_channels.reshape_symint(other_sizes)
                                 : grads[0].sum_to_size_symint(other_sizes);
      grad_other = scaledBy(grad_other, ctx->saved_data["alpha"].toScalar());
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), grad_other, at::Tensor()};
  }
};

at::Tensor convReluAddAutograd(const ConvReluAddArgs& a) {
  if (!convReluAddHandles(a)) {
    // NB: with autograd on: ATen records the original chain's own graph.
    return convReluAddReference(a);
  }
  if (!needsGraph(a.input, a.weight, a.bias, a.other)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return convReluAdd(a);
  }
  // NB: an absent bias goes to apply as an optional, which apply skips; an
  // undefined at::Tensor input fails there ("tensor does not have a device").
  return ConvReluAddFunction::apply(
      a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups, a.other, a.alpha);
}

ConvReluAddGrads convReluAddBackwardAutograd(const ConvReluAddBackwardArgs& a) {
  if (needsGraph(a.grad_output, a.input, a.weight)) {
    // NB: a backward with create_graph=True (or a direct call that records a
    // graph): the composite's ATen ops record the double backward's graph,
    // the mask a constant as in relu's own derivative, and
    // convolution_backward differentiated by ATen's formula.  The plain
    // backward keeps the device kernels below.
    return convReluAddBackwardComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return convReluAddBackward(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  using namespace torchfuse::ops;
  registerConvReluAdd<convReluAddAutograd, nullptr, convReluAddBackwardAutograd>(m);
}
