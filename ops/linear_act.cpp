// custom_linear_act: act(linear(input, weight, bias) [+ residual]).
//   input (*, in_features), at least 1-D; weight (out_features,
//   in_features); bias (out_features,) or None.  other (None: no add),
//   alpha, promote and other_first spell the residual add as the graph did:
//   add(y, other, alpha) (promote), y.add_(other, alpha) (!promote, in place
//   on the fresh linear output y) or add(other, y, alpha) (other_first).
//   activation as custom_conv_add_act takes it: none, relu, hardtanh (min, max), silu,
//   hardswish, hardsigmoid, sigmoid, gelu (exact, erf), gelu_tanh,
//   leaky_relu (slope); a trailing '_' names the in-place spelling.
//
// Inputs the kernels do not take (linearActHandles) run the composite, the
// original ATen chain, from every entry point; it is also the
// CompositeExplicitAutograd kernel, which backends without a torchfuse
// kernel reach.

#include "ops/linear_act.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/conv_add_act.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_linear_act(Tensor input, Tensor weight, Tensor? bias, str activation, "
      "float[] activation_args, Tensor? other=None, Scalar alpha=1, bool promote=True, "
      "bool other_first=False) -> Tensor");
}

namespace torchfuse {

namespace {
using LinearActSignature = at::Tensor(
    const at::Tensor&,
    const at::Tensor&,
    const std::optional<at::Tensor>&,
    c10::string_view,
    at::ArrayRef<double>,
    const std::optional<at::Tensor>&,
    const at::Scalar&,
    bool,
    bool);
} // namespace

at::Tensor custom_linear_act(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::string_view activation,
    at::ArrayRef<double> activation_args,
    const std::optional<at::Tensor>& other,
    const at::Scalar& alpha,
    bool promote,
    bool other_first) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_linear_act", "")
                       .typed<LinearActSignature>();
  return op.call(
      input, weight, bias, activation, activation_args, other, alpha, promote, other_first);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_linear_act";

bool hasBias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() && bias->defined();
}

bool hasOther(const LinearActArgs& a) {
  return a.other.has_value() && a.other->defined();
}

bool kernelDtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}
} // namespace

kernels::Activation linearActActivation(const LinearActArgs& a) {
  return parseActivation(a.activation, a.activation_args, kOp);
}

void checkLinearActInputs(const LinearActArgs& a) {
  linearActActivation(a);
  checkDefined(kOp, "input", a.input);
  checkDefined(kOp, "weight", a.weight);
  TORCH_CHECK(a.input.dim() >= 1, kOp, ": expected input to be at least 1-D, got 0-D");
  // NB: aten::linear takes a 1-D weight (a matrix-vector product).
  TORCH_CHECK(
      a.weight.dim() == 1 || a.weight.dim() == 2, kOp, ": expected weight to be 1-D or 2-D, got ",
      a.weight.dim(), "-D");
  TORCH_CHECK(
      a.input.size(-1) == a.weight.size(-1), kOp,
      ": expected input.size(-1) to equal weight.size(-1) (in_features = ", a.weight.size(-1),
      "), got ", a.input.size(-1));
  checkSameDtype(kOp, "weight", a.weight, a.input);
  checkSameDevice(kOp, "weight", a.weight, a.input);
  if (hasBias(a.bias) && a.bias->dim() == 1 && a.weight.dim() == 2) {
    // NB: a 1-D bias broadcasts to out_features only from 1 or out_features
    // elements; other shapes reach ATen's add, which decides.
    TORCH_CHECK(
        a.bias->size(0) == a.weight.size(0) || a.bias->size(0) == 1, kOp,
        ": expected bias to have weight.size(0) = ", a.weight.size(0), " elements, got ",
        a.bias->size(0));
  }
  TORCH_CHECK(
      a.promote || !a.other_first, kOp,
      ": expected promote=True with other_first=True (the add with the residual first is out "
      "of place), got promote=False");
  if (hasOther(a)) {
    checkSameDevice(kOp, "other", *a.other, a.input);
    auto out = a.input.sizes().vec();
    if (a.weight.dim() == 2) {
      out.back() = a.weight.size(0);
    } else {
      out.pop_back();
    }
    checkBroadcastable(kOp, *a.other, out);
    if (!a.promote && !a.other_first) {
      // NB: add_ writes the linear output: other may not grow it.
      const auto shape = at::infer_size(a.other->sizes(), out);
      TORCH_CHECK(
          at::IntArrayRef(shape) == at::IntArrayRef(out), kOp,
          ": expected other to broadcast to the linear output's shape ", at::IntArrayRef(out),
          " (promote=false adds in place), got ", a.other->sizes());
    }
  }
}

bool linearActHandles(const LinearActArgs& a) {
  const auto& input = a.input;
  const auto& weight = a.weight;
  const auto& bias = a.bias;
  const bool has_bias = hasBias(bias);
  if (!input.defined() || !weight.defined() || !isPlainDenseTensor(input) ||
      !isPlainDenseTensor(weight) || (has_bias && !isPlainDenseTensor(*bias)) ||
      (hasOther(a) && !isPlainDenseTensor(*a.other))) {
    return false;
  }
  const auto dtype = input.scalar_type();
  if (!kernelDtype(dtype) || weight.scalar_type() != dtype ||
      (has_bias && bias->scalar_type() != dtype)) {
    return false;
  }
  if (weight.device() != input.device() || (has_bias && bias->device() != input.device())) {
    return false;
  }
  // NB: symbolic sizes (tracing) cannot be compared without guards; the Meta
  // kernel checks them.
  if (anySymbolic({input, weight, orUndefined(bias), orUndefined(a.other)})) {
    return true;
  }
  return weight.dim() == 2 && input.dim() >= 1 && input.size(-1) == weight.size(1) &&
      (!has_bias || (bias->dim() == 1 && bias->size(0) == weight.size(0)));
}

at::Tensor linearActComposite(const LinearActArgs& a) {
  // NB: this op's errors, whichever path runs, for the sizes that can be
  // read (symbolic ones are checked by ATen's own meta functions).
  if (!anySymbolic({a.input, a.weight, orUndefined(a.bias), orUndefined(a.other)})) {
    checkLinearActInputs(a);
  } else {
    linearActActivation(a);
  }
  auto out = at::linear(a.input, a.weight, a.bias);
  if (hasOther(a)) {
    if (a.other_first) {
      out = at::add(*a.other, out, a.alpha);
    } else if (a.promote) {
      out = at::add(out, *a.other, a.alpha);
    } else {
      out.add_(*a.other, a.alpha);
    }
  }
  return applyActivation(out, a.activation, a.activation_args);
}

at::Tensor linearAct(const LinearActArgs& a) {
  return custom_linear_act(
      a.input, a.weight, a.bias, a.activation, a.activation_args, a.other, a.alpha, a.promote,
      a.other_first);
}

} // namespace ops
} // namespace torchfuse

// Backends without a torchfuse kernel run the original chain.
TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  torchfuse::ops::registerLinearAct<torchfuse::ops::linearActComposite>(m);
}
