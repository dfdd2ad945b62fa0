#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "ops/common/autograd_utils.h"
#include "ops/relu.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The gradient of custom_relu's input, recorded so that it can be
// differentiated again (the backward runs with grad mode on): grad_output
// masked, with `edge` (ReluFunction's empty second output) as an input that
// receives a zero gradient, as eager's threshold_backward gives its `self`
// (relu's result).  Higher orders recurse.
class ReluGradFunction : public torch::autograd::Function<ReluGradFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& grad_output,
      const at::Tensor& mask,
      const at::Tensor& edge,
      at::OptionalIntArrayRef dim_order) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask, edge});
    return reluBackward(grad_output, mask, dim_order);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& mask = saved[0];
    const auto& edge = saved[1];
    auto grad = c10::GradMode::is_enabled()
        ? ReluGradFunction::apply(grads[0], mask, edge, std::nullopt)
        : reluBackward(grads[0], mask);
    return {std::move(grad), at::Tensor(), at::zeros_like(edge), at::Tensor()};
  }
};

// NB: saves a 1-bit mask, not the output: the backward then reads 1/32 of the
// bytes the output would take, and the output's memory stays the caller's.
// Eager's relu saves its result, and in a double backward
// threshold_backward gives that result a zero gradient, which flows back
// through relu into the input's graph (where 0 times an infinite
// derivative, as of x / 0, is NaN).  The empty second output `edge` stands
// for the output there: ReluGradFunction takes it as an input, so that zero
// gradient reaches this node (as the materialized zero gradient of the
// output) without the output being kept alive.
class ReluFunction : public torch::autograd::Function<ReluFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mask] = reluForwardMask(input);
    auto edge = at::empty({0}, out.options());
    ctx->save_for_backward({mask, edge});
    // NB: grad_input takes the output's layout, as eager's threshold_backward
    // gives: for an expanded gradient (of a sum) that is the input's, which
    // AccumulateGrad keeps instead of copying the gradient into it.
    if (auto order = reluDimOrder(out)) {
      ctx->saved_data["dim_order"] = std::move(*order);
    }
    return {out, edge};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& mask = saved[0];
    const auto found = ctx->saved_data.find("dim_order");
    std::vector<int64_t> order;
    at::OptionalIntArrayRef dim_order;
    if (found != ctx->saved_data.end()) {
      order = found->second.toIntVector();
      dim_order = order;
    }
    if (c10::GradMode::is_enabled()) {
      return {ReluGradFunction::apply(grads[0], mask, saved[1], dim_order)};
    }
    return {reluBackward(grads[0], mask, dim_order)};
  }
};

// custom_relu_backward is linear in grad_output, with relu's second
// derivative 0: its gradient is custom_relu_backward of the incoming
// gradient with the same mask, so double (and higher) backward keeps the
// 1-bit mask and the fast kernels.
class ReluBackwardFunction : public torch::autograd::Function<ReluBackwardFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& grad_output,
      const at::Tensor& mask,
      at::OptionalIntArrayRef dim_order) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({mask});
    return reluBackward(grad_output, mask, dim_order);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto mask = ctx->get_saved_variables()[0];
    return {reluBackward(grads[0], mask), at::Tensor(), at::Tensor()};
  }
};

at::Tensor reluAutograd(const at::Tensor& input) {
  if (!reluHandles(input)) {
    // Autograd still on: ATen records its own graph.
    return reluReference(input);
  }
  if (!needsGraph(input)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return custom_relu(input);
  }
  return ReluFunction::apply(input)[0];
}

at::Tensor reluBackwardAutograd(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    at::OptionalIntArrayRef dim_order) {
  if (needsGraph(grad_output)) {
    return ReluBackwardFunction::apply(grad_output, mask, dim_order);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return reluBackward(grad_output, mask, dim_order);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  using namespace torchfuse::ops;
  registerRelu<reluAutograd, nullptr, reluBackwardAutograd>(m);
}
