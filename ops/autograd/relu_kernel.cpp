#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/relu.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// NB: saves a 1-bit mask, not the output: the backward then reads 1/32 of the
// bytes the output would take, and the output's memory stays the caller's.
class ReluFunction : public torch::autograd::Function<ReluFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [out, mask] = reluForwardMask(input);
    ctx->save_for_backward({mask});
    // NB: grad_input takes the output's layout, as eager's threshold_backward
    // gives: for an expanded gradient (of a sum) that is the input's, which
    // AccumulateGrad keeps instead of copying the gradient into it.
    if (auto order = reluDimOrder(out)) {
      ctx->saved_data["dim_order"] = std::move(*order);
    }
    return out;
  }

  // NB: through the dispatcher, so that under create_graph the backward op's
  // Autograd kernel records its own node (double backward).
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto mask = ctx->get_saved_variables()[0];
    const auto order = ctx->saved_data.find("dim_order");
    if (order == ctx->saved_data.end()) {
      return {reluBackward(grads[0], mask)};
    }
    return {reluBackward(grads[0], mask, order->second.toIntVector())};
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
  return ReluFunction::apply(input);
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
