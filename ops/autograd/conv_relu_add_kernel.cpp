#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

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

// The relu's gradient inside custom_conv_relu_add's backward, recorded so
// that it can be differentiated again (the backward runs with grad mode on):
// dy (the conv output's gradient) where the mask is set, 0 elsewhere, with
// `edge` (ConvReluAddFunction's empty second output) as an input that
// receives a zero gradient, as eager's threshold_backward gives its `self`
// (relu's result).  Higher orders recurse.
class ConvReluGradFunction : public torch::autograd::Function<ConvReluGradFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& dy,
      const at::Tensor& mask,
      const at::Tensor& edge,
      bool batched,
      int64_t order) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, edge});
    ctx->saved_data["batched"] = batched;
    ctx->saved_data["order"] = order;
    return masked(dy, mask, batched, order);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& mask = saved[0];
    const auto& edge = saved[1];
    const bool batched = ctx->saved_data["batched"].toBool();
    const int64_t order = ctx->saved_data["order"].toInt();
    auto grad = c10::GradMode::is_enabled()
        ? ConvReluGradFunction::apply(grads[0], mask, edge, batched, order)
        : masked(grads[0], mask, batched, order);
    return {std::move(grad), at::Tensor(), at::zeros_like(edge), at::Tensor(), at::Tensor()};
  }

  // NB: a select, not a product: a masked NaN or Inf gradient gives 0, as
  // threshold_backward's.  The unpacked mask lives only for this call.
  static at::Tensor masked(
      const at::Tensor& dy,
      const at::Tensor& mask,
      bool batched,
      int64_t order) {
    return at::where(
        unpackConvMask(mask, dy.sym_sizes(), batched, static_cast<ConvMaskOrder>(order)), dy,
        at::zeros({}, dy.options()));
  }
};

// Saves input, weight and a 1-bit ReLU mask of the conv output; other only by
// its shape.
// NB: eager's relu saves its result, and in a double backward
// threshold_backward gives that result a zero gradient, which flows back
// through relu into the conv (x, w, b), not into other (0 times an infinite
// derivative, as of x / 0, is NaN).  The empty second output `edge` stands
// for relu's result there: ConvReluGradFunction takes it as an input, so
// that zero gradient reaches this node without relu's result existing; the
// backward tells it from out's gradient (grads are not materialized), and
// gives it to the conv's inputs alone.
// NB: apply takes ConvReluAddArgs' fields one by one, as it records an edge
// for each tensor argument; forward packs them again.
class ConvReluAddFunction : public torch::autograd::Function<ConvReluAddFunction> {
 public:
  template <typename... Args>
  static variable_list forward(AutogradContext* ctx, const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const ConvReluAddArgs a{args...};
    auto [out, mask] = convReluAddForward(a);
    auto edge = at::empty({0}, out.options());
    ctx->save_for_backward({a.input, a.weight, mask, edge});
    ctx->set_materialize_grads(false);
    ctx->saved_data["stride"] = a.stride.vec();
    ctx->saved_data["padding"] = a.padding.vec();
    ctx->saved_data["dilation"] = a.dilation.vec();
    ctx->saved_data["groups"] = a.groups;
    // NB: sym_sizes: with symbolic sizes (torch.compile, torch.export)
    // sizes() raises or specialises every dimension.
    ctx->saved_data["other_sizes"] = c10::IValue(a.other.sym_sizes());
    ctx->saved_data["alpha"] = a.alpha;
    ctx->saved_data["has_bias"] = a.bias.has_value() && a.bias->defined();
    // NB: the order the mask was written in, for the backward to read it
    // in: the saved input's and weight's layouts may change before it runs
    // (layoutsForMaskOrder).
    ctx->saved_data["mask_order"] = static_cast<int64_t>(convMaskOrder(a.input, a.weight));
    return {out, edge};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& grad_out = grads[0];
    // Undefined where out's gradient did not reach this node: only the
    // zero gradient of relu's result (through `edge`) did.
    const bool has_grad_out = grad_out.defined();
    if (!has_grad_out && !grads[1].defined()) {
      return variable_list(9);
    }
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto needs = [&](size_t arg) {
      return needsTensorGrad(ctx, {true, true, has_bias, true}, arg);
    };
    const auto other_sizes = ctx->saved_data["other_sizes"].toSymIntVector();
    const auto& input = saved[0];
    const auto& weight = saved[1];
    const auto stride = ctx->saved_data["stride"].toIntVector();
    const auto padding = ctx->saved_data["padding"].toIntVector();
    const auto dilation = ctx->saved_data["dilation"].toIntVector();
    const int64_t groups = ctx->saved_data["groups"].toInt();
    const auto alpha = ctx->saved_data["alpha"].toScalar();
    const int64_t mask_order = ctx->saved_data["mask_order"].toInt();
    const bool needs_other = needs(3) && has_grad_out;
    const auto conv_sizes = convOutputSymSizes(input, weight, stride, padding, dilation);
    // relu's result's gradient: out's (summed to the conv output's shape by
    // the backward), else the zero that reached `edge`.
    const auto dy = has_grad_out ? grad_out : at::zeros_symint(conv_sizes, grads[1].options());
    at::Tensor grad_input, grad_weight, grad_bias, grad_other;
    if (c10::GradMode::is_enabled()) {
      // NB: a backward with create_graph=True: differentiable ATen ops (the
      // composite's convolutions), with the mask applied by
      // ConvReluGradFunction so that a double backward gives relu's result
      // its zero gradient.
      if (needs(0) || needs(1) || needs(2)) {
        const bool batched = input.dim() == weight.dim();
        const auto grad = ConvReluGradFunction::apply(
            dy.sum_to_size_symint(conv_sizes).to(input.scalar_type()), saved[2], saved[3], batched,
            mask_order);
        std::tie(grad_input, grad_weight, grad_bias) = convolveBackward(
            grad, input, weight, stride, padding, dilation, groups, {needs(0), needs(1), needs(2)},
            /*recording=*/true);
      }
      if (needs_other) {
        grad_other = scaledBy(grad_out.sum_to_size_symint(other_sizes), alpha);
      }
    } else {
      // NB: a scalar-like other's gradient sums every element: ATen's
      // reduction accumulates it in float32, where a sum of per-channel
      // sums, each rounded to a 16-bit gradient's dtype, loses accuracy.
      c10::SymInt other_numel = 1;
      for (const auto& size : other_sizes) {
        other_numel = other_numel * size;
      }
      const bool scalar_like = other_numel == 1;
      const bool channel_other = needs_other && !scalar_like &&
          channelShaped(other_sizes, input.dim(), weight.dim() - 2, weight.sym_size(0));
      const std::array<bool, 4> mask{needs(0), needs(1), needs(2), channel_other};
      at::Tensor grad_channels;
      std::tie(grad_input, grad_weight, grad_bias, grad_channels) = convReluAddBackward(
          {dy, saved[2], input, weight, stride, padding, dilation, groups, mask}, mask_order);
      if (needs_other) {
        grad_other = channel_other ? grad_channels.reshape_symint(other_sizes)
                                   : grad_out.sum_to_size_symint(other_sizes);
        grad_other = scaledBy(grad_other, alpha);
      }
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
      a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups, a.other, a.alpha)[0];
}

ConvReluAddGrads convReluAddBackwardAutograd(const ConvReluAddBackwardArgs& a) {
  if (needsGraph(a.grad_output, a.input, a.weight)) {
    // NB: a direct call that records a graph (custom_conv_relu_add's own
    // backward with create_graph=True takes ConvReluAddFunction's path,
    // which also gives relu's result its zero gradient): the composite's
    // ATen ops record the graph, the mask a constant, and
    // convolution_backward differentiated by ATen's formula.  The plain
    // backward keeps the device kernels below.
    return convReluAddBackwardComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  // NB: the order named, not left to the layouts: a graph traced below
  // this kernel (AOTAutograd's) records this call, and Inductor may
  // restride its input and weight (layoutsForMaskOrder).
  return convReluAddBackward(a, static_cast<int64_t>(convMaskOrder(a.input, a.weight)));
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  using namespace torchfuse::ops;
  registerConvReluAdd<convReluAddAutograd, nullptr, convReluAddBackwardAutograd>(m);
}
