#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/linear_add_relu.h"

namespace torchfuse::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Saves input, weight and the output (the ReLU mask is read off the output);
// other only by its shape.
// NB: apply takes LinearAddReluArgs' fields one by one, as it records an
// edge for each tensor argument; forward packs them again.
class LinearAddReluFunction : public torch::autograd::Function<LinearAddReluFunction> {
 public:
  template <typename... Args>
  static at::Tensor forward(AutogradContext* ctx, const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const LinearAddReluArgs a{args...};
    const auto& [input, weight, bias, other, alpha] = a;
    auto out = linearAddRelu(a);
    ctx->save_for_backward({input, weight, out});
    // NB: sym_sizes: with symbolic sizes (torch.compile, torch.export)
    // sizes() raises or specialises every dimension.
    ctx->saved_data["other_sizes"] = c10::IValue(other.sym_sizes());
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    // A per-feature `other` (N elements along the last dim, adding no dims)
    // has the bias's gradient, which the CUDA backward reduces inside its
    // weight GEMM.  NB: symbolic sizes (tracing) keep the general rule.
    ctx->saved_data["other_per_feature"] = !anySymbolic({other, weight}) && other.dim() >= 1 &&
        other.dim() <= input.dim() && other.numel() == weight.size(0) &&
        other.size(-1) == weight.size(0);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto alpha = ctx->saved_data["alpha"].toScalar();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto needs = [&](size_t arg) {
      return needsTensorGrad(ctx, {true, true, has_bias, true}, arg);
    };
    const auto other_sizes = ctx->saved_data["other_sizes"].toSymIntVector();
    const bool other_from_bias =
        needs(3) && ctx->saved_data["other_per_feature"].toBool();
    const std::array<bool, 3> mask{needs(0), needs(1), needs(2) || other_from_bias};
    auto [grad_input, grad_weight, grad_bias, grad_sum] =
        linearAddReluBackward({grads[0], saved[0], saved[1], saved[2], mask});
    at::Tensor grad_other;
    if (other_from_bias) {
      grad_other = grad_bias.reshape_symint(other_sizes);
      // NB: the two gradients must not share storage: accumulating into one
      // .grad in place would change the other.
      grad_other = needs(2) && alpha.equal(1) ? grad_other.clone() : scaledBy(grad_other, alpha);
    } else if (needs(3)) {
      grad_other = scaledBy(grad_sum.sum_to_size_symint(other_sizes), alpha);
    }
    return {grad_input, grad_weight, needs(2) ? grad_bias : at::Tensor(), grad_other,
            at::Tensor()};
  }
};

at::Tensor linearAddReluAutograd(const LinearAddReluArgs& a) {
  if (!linearAddReluHandles(a)) {
    // Autograd still on: ATen records its own graph.
    return linearAddReluReference(a);
  }
  if (!needsGraph(a.input, a.weight, a.bias, a.other)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return linearAddRelu(a);
  }
  // NB: an absent bias goes to apply as an optional: apply records an
  // undefined at::Tensor as an input and fails ("tensor does not have a
  // device"), while it skips an empty optional.
  return LinearAddReluFunction::apply(a.input, a.weight, a.bias, a.other, a.alpha);
}

LinearAddReluGrads linearAddReluBackwardAutograd(const LinearAddReluBackwardArgs& a) {
  // NB: a graph is recorded when the forward's backward runs with
  // create_graph: the composite's ATen ops then give double backward (the
  // relu mask, read off `result`, is piecewise constant, as in ATen).  The
  // plain backward keeps the device kernels.
  if (needsGraph(a.grad_output, a.input, a.weight, a.result)) {
    return linearAddReluBackwardComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return linearAddReluBackward(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  using namespace torchfuse::ops;
  registerLinearAddRelu<linearAddReluAutograd, linearAddReluBackwardAutograd>(m);
}
