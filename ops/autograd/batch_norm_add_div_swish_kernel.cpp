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
// arguments (input, weight?, bias?, running_mean, running_var, other) and the
// others as BatchNormAddDivSwishArgs orders them.
void saveArgs(AutogradContext* ctx, const BatchNormAddDivSwishArgs& a) {
  ctx->saved_data["has_weight"] = a.weight.has_value() && a.weight->defined();
  ctx->saved_data["has_bias"] = a.bias.has_value() && a.bias->defined();
  ctx->saved_data["eps"] = a.eps;
  ctx->saved_data["divisor"] = a.divisor;
  ctx->saved_data["silu"] = a.silu;
}

// mean and invstd: the batch statistics (training) or the running ones.
void saveTensors(
    AutogradContext* ctx,
    const BatchNormAddDivSwishArgs& a,
    const at::Tensor& mean,
    const at::Tensor& invstd) {
  ctx->save_for_backward(
      {a.input, orUndefined(a.weight), orUndefined(a.bias), a.other, mean, invstd});
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
  const auto weight = toOptional(saved[1]);
  const auto bias = toOptional(saved[2]);
  const auto divisor = ctx->saved_data["divisor"].toScalar();
  const std::array<bool, 4> mask{needs(0), needs(1), needs(2), needs(5)};
  const bool silu = ctx->saved_data["silu"].toBool();
  auto [grad_input, grad_weight, grad_bias, grad_other] = batchNormAddDivSwishBackward(
      {grad_output, input, weight, bias, mean, invstd, training, other, divisor, mask, silu});
  return {grad_input, grad_weight, grad_bias, grad_other};
}

// The Functions of the train op and of its _eval form (eval: the running
// statistics are read-only; its arguments have training false).
// NB: apply takes the struct's fields one by one, as it records an edge for
// each tensor argument; forward packs them again.
template <typename Derived, bool eval>
class BatchNormAddDivSwishFunctionBase : public torch::autograd::Function<Derived> {
 public:
  template <typename... Args>
  static at::Tensor forward(AutogradContext* ctx, const Args&... args) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const BatchNormAddDivSwishArgs a{args...};
    saveArgs(ctx, a);
    ctx->saved_data["training"] = a.training;
    if (eval || !a.training) {
      auto out = eval ? batchNormAddDivSwishEval(a) : batchNormAddDivSwishTrain(a);
      saveTensors(ctx, a, a.running_mean, a.running_var);
      return out;
    }
    auto [out, save_mean, save_invstd] = batchNormAddDivSwishForward(a);
    saveTensors(ctx, a, save_mean, save_invstd);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const bool training = ctx->saved_data["training"].toBool();
    const auto g = backwardFromSaved(ctx, grads[0], training);
    return {g[0], g[1], g[2], at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), g[3], at::Tensor(), at::Tensor()};
  }

  static at::Tensor run(const BatchNormAddDivSwishArgs& a) {
    // NB: absent weight and bias go to apply as optionals, which apply skips;
    // undefined at::Tensor inputs fail there ("tensor does not have a device").
    return Derived::apply(
        a.input, a.weight, a.bias, a.running_mean, a.running_var, a.training, a.momentum, a.eps,
        a.other, a.divisor, a.silu);
  }
};

class BatchNormAddDivSwishFunction
    : public BatchNormAddDivSwishFunctionBase<BatchNormAddDivSwishFunction, false> {};
class BatchNormAddDivSwishEvalFunction
    : public BatchNormAddDivSwishFunctionBase<BatchNormAddDivSwishEvalFunction, true> {};

at::Tensor batchNormAddDivSwishAutograd(const BatchNormAddDivSwishArgs& a) {
  if (!batchNormAddDivSwishHandles(a)) {
    // NB: with autograd on: ATen records the original chain's own graph, and
    // batch_norm updates the running statistics once.
    return batchNormAddDivSwishReference(a);
  }
  at::Tensor out;
  if (!needsGraph(a.input, a.weight, a.bias, a.other)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    out = batchNormAddDivSwishTrain(a);
  } else {
    out = BatchNormAddDivSwishFunction::run(a);
  }
  // NB: the running statistics' version counters stay as they are, as
  // aten::batch_norm leaves them: where an eval-mode batch_norm saved the
  // same buffers for its backward, bumping them made that backward raise
  // ("modified by an inplace operation") where the original ran.
  return out;
}

at::Tensor batchNormAddDivSwishEvalAutograd(const BatchNormAddDivSwishArgs& a) {
  if (!batchNormAddDivSwishHandles(a)) {
    return batchNormAddDivSwishReference(a);
  }
  if (!needsGraph(a.input, a.weight, a.bias, a.other)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return batchNormAddDivSwishEval(a);
  }
  return BatchNormAddDivSwishEvalFunction::run(a);
}

BatchNormAddDivSwishGrads batchNormAddDivSwishBackwardAutograd(
    const BatchNormAddDivSwishBackwardArgs& a) {
  if (needsGraph(a.grad_output, a.input, a.weight, a.bias, a.mean, a.invstd, a.other)) {
    // NB: a backward with create_graph=True (or a direct call that records a
    // graph): the composite's ATen ops record the double backward's graph.
    // The plain backward keeps the device kernels below.
    return batchNormAddDivSwishBackwardComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return batchNormAddDivSwishBackward(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  using namespace torchfuse::ops;
  registerBatchNormAddDivSwish<
      batchNormAddDivSwishAutograd, batchNormAddDivSwishEvalAutograd, nullptr,
      batchNormAddDivSwishBackwardAutograd>(m);
}
