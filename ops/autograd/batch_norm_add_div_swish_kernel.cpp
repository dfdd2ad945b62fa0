#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "ops/batch_norm_add_div_swish.h"
#include "ops/common/autograd_utils.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Saved: input, weight, bias, other and per-channel statistics; t and
// sigmoid(t) are recomputed in the backward.  Both Functions take the tensor
// arguments (input, weight?, bias?, running_mean, running_var, other).
void saveOptionalPresence(
    AutogradContext* ctx,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias) {
  ctx->saved_data["has_weight"] = weight.has_value() && weight->defined();
  ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
}

variable_list backwardFromSaved(
    AutogradContext* ctx,
    const at::Tensor& grad_output,
    bool training) {
  const auto saved = ctx->get_saved_variables();
  const bool has_weight = ctx->saved_data["has_weight"].toBool();
  const bool has_bias = ctx->saved_data["has_bias"].toBool();
  const auto needs = [&](size_t arg) {
    return needsTensorGrad(ctx, {true, has_weight, has_bias, true, true, true}, arg);
  };
  const auto& input = saved[0];
  const auto& other = saved[3];
  at::Tensor mean = saved[4];
  at::Tensor invstd = saved[5];
  if (training && c10::GradMode::is_enabled()) {
    // NB: a backward with create_graph=True: the batch statistics computed
    // again from input with ATen ops, so that the double backward sees their
    // dependence on input (the saved ones are constants); the backward op
    // then takes its differentiable composite.
    const auto x = input.to(batchNormBackwardType(input.scalar_type(), grad_output.scalar_type()));
    std::vector<int64_t> dims;
    for (int64_t d = 0; d < x.dim(); ++d) {
      if (d != 1) {
        dims.push_back(d);
      }
    }
    auto [var, batch_mean] = at::var_mean(x, dims, /*correction=*/0);
    mean = batch_mean;
    invstd = var.add(ctx->saved_data["eps"].toDouble()).rsqrt();
  } else if (!training) {
    // saved[4], saved[5] are the running statistics.
    invstd = invstd.to(batchNormBackwardType(input.scalar_type(), grad_output.scalar_type()))
                 .add(ctx->saved_data["eps"].toDouble())
                 .rsqrt();
  }
  auto [grad_input, grad_weight, grad_bias, grad_other] = batchNormAddDivSwishBackward(
      grad_output, input, toOptional(saved[1]), toOptional(saved[2]), mean, invstd,
      training, other, ctx->saved_data["divisor"].toScalar(),
      {needs(0), needs(1), needs(2), needs(5)}, ctx->saved_data["silu"].toBool());
  return {grad_input, grad_weight, grad_bias, grad_other};
}

class BatchNormAddDivSwishFunction
    : public torch::autograd::Function<BatchNormAddDivSwishFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const std::optional<at::Tensor>& weight,
      const std::optional<at::Tensor>& bias,
      at::Tensor running_mean,
      at::Tensor running_var,
      bool training,
      double momentum,
      double eps,
      const at::Tensor& other,
      const at::Scalar& divisor,
      bool silu) {
    at::AutoDispatchBelowADInplaceOrView guard;
    saveOptionalPresence(ctx, weight, bias);
    ctx->saved_data["training"] = training;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["silu"] = silu;
    if (!training) {
      auto out = custom_batch_norm_add_div_swish(
          input, weight, bias, running_mean, running_var, training, momentum, eps,
          other, divisor, silu);
      ctx->save_for_backward(
          {input, orUndefined(weight), orUndefined(bias), other, running_mean,
           running_var});
      return out;
    }
    auto [out, save_mean, save_invstd] = batchNormAddDivSwishForward(
        input, weight, bias, running_mean, running_var, training, momentum, eps,
        other, divisor, silu);
    ctx->save_for_backward(
        {input, orUndefined(weight), orUndefined(bias), other, save_mean,
         save_invstd});
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool training = ctx->saved_data["training"].toBool();
    const auto g = backwardFromSaved(ctx, grads[0], training);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), g[3], at::Tensor(), at::Tensor()};
  }
};

class BatchNormAddDivSwishEvalFunction
    : public torch::autograd::Function<BatchNormAddDivSwishEvalFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& input,
      const std::optional<at::Tensor>& weight,
      const std::optional<at::Tensor>& bias,
      const at::Tensor& running_mean,
      const at::Tensor& running_var,
      double eps,
      const at::Tensor& other,
      const at::Scalar& divisor,
      bool silu) {
    at::AutoDispatchBelowADInplaceOrView guard;
    saveOptionalPresence(ctx, weight, bias);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["divisor"] = divisor;
    ctx->saved_data["silu"] = silu;
    ctx->save_for_backward(
        {input, orUndefined(weight), orUndefined(bias), other, running_mean,
         running_var});
    return batchNormAddDivSwishEval(
        input, weight, bias, running_mean, running_var, eps, other, divisor, silu);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto g = backwardFromSaved(ctx, grads[0], /*training=*/false);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor(), g[3], at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor batchNormAddDivSwishAutograd(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    at::Tensor& running_mean,
    at::Tensor& running_var,
    bool training,
    double momentum,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  if (!batchNormAddDivSwishHandles(input, weight, bias, running_mean, running_var, other)) {
    // NB: with autograd on: ATen records the original chain's own graph, and
    // batch_norm updates the running statistics once.
    return batchNormAddDivSwishReference(
        input, weight, bias, running_mean, running_var, training, momentum, eps, other, divisor,
        silu);
  }
  at::Tensor out;
  if (!needsGraph(input, weight, bias, other)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = custom_batch_norm_add_div_swish(
        input, weight, bias, running_mean, running_var, training, momentum, eps,
        other, divisor, silu);
  } else {
    // NB: absent weight and bias go to apply as optionals, which apply skips;
    // undefined at::Tensor inputs fail there ("tensor does not have a device").
    out = BatchNormAddDivSwishFunction::apply(
        input, weight, bias, running_mean, running_var,
        training, momentum, eps, other, divisor, silu);
  }
  // NB: the running statistics' version counters stay as they are, as
  // aten::batch_norm leaves them: where an eval-mode batch_norm saved the
  // same buffers for its backward, bumping them made that backward raise
  // ("modified by an inplace operation") where the original ran.
  return out;
}

at::Tensor batchNormAddDivSwishEvalAutograd(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  if (!batchNormAddDivSwishHandles(input, weight, bias, running_mean, running_var, other)) {
    return batchNormAddDivSwishEvalReference(
        input, weight, bias, running_mean, running_var, eps, other, divisor, silu);
  }
  if (!needsGraph(input, weight, bias, other)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return batchNormAddDivSwishEval(
        input, weight, bias, running_mean, running_var, eps, other, divisor, silu);
  }
  return BatchNormAddDivSwishEvalFunction::apply(
      input, weight, bias, running_mean, running_var, eps, other, divisor, silu);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
batchNormAddDivSwishBackwardAutograd(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& mean,
    const at::Tensor& invstd,
    bool training,
    const at::Tensor& other,
    const at::Scalar& divisor,
    std::array<bool, 4> output_mask,
    bool silu) {
  if (needsGraph(grad_output, input, weight, bias, mean, invstd, other)) {
    // NB: a backward with create_graph=True (or a direct call that records a
    // graph): the composite's ATen ops record the double backward's graph.
    // The plain backward keeps the device kernels below.
    return batchNormAddDivSwishBackwardComposite(
        grad_output, input, weight, bias, mean, invstd, training, other, divisor, output_mask,
        silu);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return batchNormAddDivSwishBackward(
      grad_output, input, weight, bias, mean, invstd, training, other, divisor,
      output_mask, silu);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish"),
      TORCH_FN(batchNormAddDivSwishAutograd));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_eval"),
      TORCH_FN(batchNormAddDivSwishEvalAutograd));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_backward"),
      TORCH_FN(batchNormAddDivSwishBackwardAutograd));
}
