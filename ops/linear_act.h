#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <optional>

#include "kernels/common/activation.h"

namespace torchfuse::ops {

// The arguments of custom_linear_act, as its kernels and helpers take them.
// NB: references to the dispatcher's arguments, valid for the call.
struct LinearActArgs {
  const at::Tensor& input;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  c10::string_view activation;
  at::ArrayRef<double> activation_args;
  // The residual: none, or y + alpha * other (add, promote), y.add_(other,
  // alpha) (add_ into the fresh linear output y, !promote), other + alpha * y
  // (add with the residual first, other_first).
  const std::optional<at::Tensor>& other;
  const at::Scalar& alpha;
  bool promote;
  bool other_first;
};

template <auto F>
at::Tensor linearActKernel(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::string_view activation,
    at::ArrayRef<double> activation_args,
    const std::optional<at::Tensor>& other,
    const at::Scalar& alpha,
    bool promote,
    bool other_first) {
  return F(LinearActArgs{
      input, weight, bias, activation, activation_args, other, alpha, promote, other_first});
}

// Registers one dispatch key's kernel for custom_linear_act.
template <auto Op>
void registerLinearAct(torch::Library& m) {
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_linear_act"), TORCH_FN(linearActKernel<Op>));
}

// The activation (parseActivation of ops/conv_add_act.h, errors naming
// custom_linear_act).
kernels::Activation linearActActivation(const LinearActArgs& a);

// Checks every argument with torchfuse's messages, only for inputs that
// aten::linear rejects too (missing tensors, a 0-D input, a weight of rank
// 0 or > 2, in_features, dtype or device mismatches, a 1-D bias of the
// wrong length) or the add does (an `other` that does not broadcast, or
// would grow the linear output that add_ writes), and the activation.
void checkLinearActInputs(const LinearActArgs& a);

// True when the op's own kernels take these inputs: dense strided,
// float32/float64/float16/bfloat16, weight and bias of input's dtype and
// device, a 2-D weight of input.size(-1) in_features, a 1-D bias of
// out_features or none.  Never throws.  Others run the composite (ATen's
// results and errors).
bool linearActHandles(const LinearActArgs& a);

// The original chain as ATen ops, act(linear(input, weight, bias) [+ the
// residual, as LinearActArgs spells it]), the activation in the spelling
// named (in place on the fresh result for "relu_"), after
// checkLinearActInputs: the numerical oracle (the CPU
// kernel), the Meta kernel, the Autograd kernel's recording path, and every
// fallback.
at::Tensor linearActComposite(const LinearActArgs& a);

// The op through the dispatcher.
at::Tensor linearAct(const LinearActArgs& a);

} // namespace torchfuse::ops
