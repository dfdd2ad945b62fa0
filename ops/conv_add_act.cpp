// custom_conv_add_act: act(convolution(input, weight, bias, ...) + alpha * other).
//   1-d, 2-d and 3-d convolutions (weight 3-, 4- or 5-D), batched or not,
//   integer padding only.  `other` is optional (None: no add).  promote:
//   the add is out of place (`add`: the result takes the promoted dtype and
//   the broadcast shape of conv output and other); else it is `add_` into
//   the fresh conv output (`out += identity`: the conv output's dtype and
//   shape).  activation: none, relu, hardtanh (min, max), silu, hardswish,
//   hardsigmoid, sigmoid, gelu (exact), gelu_tanh, leaky_relu (slope).

#include "ops/conv_add_act.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/MemoryFormat.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <utility>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/common/conv_composites.h"
#include "ops/conv_relu_add.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_conv_add_act(Tensor input, Tensor weight, Tensor? bias, int[] stride, "
      "int[] padding, int[] dilation, int groups, Tensor? other, Scalar alpha, bool promote, "
      "str activation, float[] activation_args) -> Tensor",
      {at::Tag::flexible_layout});
}

namespace torchfuse {

namespace {
using ConvAddActSignature = at::Tensor(
    const at::Tensor&,
    const at::Tensor&,
    const std::optional<at::Tensor>&,
    at::IntArrayRef,
    at::IntArrayRef,
    at::IntArrayRef,
    int64_t,
    const std::optional<at::Tensor>&,
    const at::Scalar&,
    bool,
    c10::string_view,
    at::ArrayRef<double>);
} // namespace

at::Tensor custom_conv_add_act(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const std::optional<at::Tensor>& other,
    const at::Scalar& alpha,
    bool promote,
    c10::string_view activation,
    at::ArrayRef<double> activation_args) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_conv_add_act", "")
                       .typed<ConvAddActSignature>();
  return op.call(
      input, weight, bias, stride, padding, dilation, groups, other, alpha, promote, activation,
      activation_args);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_conv_add_act";

using kernels::ActivationKind;

struct ActivationName {
  const char* name;
  ActivationKind kind;
  size_t args;
};

constexpr std::array<ActivationName, 10> kActivations = {{
    {"none", ActivationKind::kNone, 0},
    {"relu", ActivationKind::kRelu, 0},
    {"hardtanh", ActivationKind::kHardtanh, 2},
    {"silu", ActivationKind::kSilu, 0},
    {"hardswish", ActivationKind::kHardswish, 0},
    {"hardsigmoid", ActivationKind::kHardsigmoid, 0},
    {"sigmoid", ActivationKind::kSigmoid, 0},
    {"gelu", ActivationKind::kGelu, 0},
    {"gelu_tanh", ActivationKind::kGeluTanh, 0},
    {"leaky_relu", ActivationKind::kLeakyRelu, 1},
}};
} // namespace

bool activatesInPlace(c10::string_view activation) {
  return activation.size() > 1 && activation.back() == '_';
}

kernels::Activation parseActivation(
    c10::string_view activation_spelling,
    at::ArrayRef<double> activation_args,
    const char* op) {
  auto activation = activation_spelling;
  if (activatesInPlace(activation)) {
    activation.remove_suffix(1);
  }
  for (const auto& known : kActivations) {
    if (activation == known.name) {
      TORCH_CHECK(
          activation_args.size() == known.args, op, ": expected activation_args to have ",
          known.args, " elements for activation '", known.name, "', got ", activation_args.size());
      kernels::Activation act{known.kind};
      if (known.args > 0) {
        act.a = static_cast<float>(activation_args[0]);
      }
      if (known.args > 1) {
        act.b = static_cast<float>(activation_args[1]);
      }
      return act;
    }
  }
  TORCH_CHECK(
      false, op,
      ": expected activation to be one of none, relu, hardtanh, silu, hardswish, "
      "hardsigmoid, sigmoid, gelu, gelu_tanh, leaky_relu (a trailing '_' for the "
      "in-place spelling), got '",
      std::string(activation_spelling), "'");
}

at::Tensor otherOf(const ConvAddActArgs& a) {
  return orUndefined(a.other);
}

std::vector<int64_t> checkConvAddActInputs(const ConvAddActArgs& a, const char* op) {
  parseActivation(a.activation, a.activation_args, op);
  const auto out =
      checkConvAndBias(op, a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups);
  const auto other = otherOf(a);
  if (other.defined()) {
    checkConvOther(op, other, a.input);
    checkBroadcastable(op, other, out);
    if (!a.promote) {
      // NB: add_ writes the conv output: other may not grow it.
      const auto shape = at::infer_size(other.sizes(), out);
      TORCH_CHECK(
          at::IntArrayRef(shape) == at::IntArrayRef(out), op,
          ": expected other to broadcast to the conv output's shape ", at::IntArrayRef(out),
          " (promote=false adds in place), got ", other.sizes());
    }
  }
  return out;
}

bool convAddActHandles(const ConvAddActArgs& a) {
  return convKernelsHandle(a.input, a.weight, a.bias, otherOf(a));
}

at::Tensor applyActivation(at::Tensor& t, c10::string_view name, at::ArrayRef<double> args) {
  const bool in_place = activatesInPlace(name);
  switch (parseActivation(name, args).kind) {
    case ActivationKind::kNone:
      return t;
    case ActivationKind::kRelu:
      return in_place ? t.relu_() : at::relu(t);
    case ActivationKind::kHardtanh:
      return in_place ? at::hardtanh_(t, args[0], args[1]) : at::hardtanh(t, args[0], args[1]);
    case ActivationKind::kSilu:
      return in_place ? at::silu_(t) : at::silu(t);
    case ActivationKind::kHardswish:
      return in_place ? at::hardswish_(t) : at::hardswish(t);
    case ActivationKind::kHardsigmoid:
      return in_place ? at::hardsigmoid_(t) : at::hardsigmoid(t);
    case ActivationKind::kSigmoid:
      return in_place ? t.sigmoid_() : at::sigmoid(t);
    case ActivationKind::kGelu:
      return in_place ? at::gelu_(t, "none") : at::gelu(t, "none");
    case ActivationKind::kGeluTanh:
      return in_place ? at::gelu_(t, "tanh") : at::gelu(t, "tanh");
    case ActivationKind::kLeakyRelu:
      return in_place ? at::leaky_relu_(t, args[0]) : at::leaky_relu(t, args[0]);
  }
  return t;
}

bool outOfPlaceOverAmbiguousLayout(
    const ConvAddActArgs& a,
    const kernels::Activation& act,
    at::IntArrayRef conv_sizes) {
  // NB: ATen's out-of-place hardtanh (relu6 too) writes into empty_like of
  // its input, so it keeps its input's strides and picks none itself.
  const bool act_picks = act.kind != ActivationKind::kNone &&
      act.kind != ActivationKind::kHardtanh && !activatesInPlace(a.activation);
  const bool out_of_place = act_picks || (otherOf(a).defined() && a.promote);
  return out_of_place &&
      std::any_of(conv_sizes.begin() + 1, conv_sizes.end(), [](int64_t s) { return s == 1; });
}

std::vector<int64_t> outOfPlaceStrides(const at::Tensor& out) {
  if (out.is_contiguous()) {
    const auto strides = c10::contiguous_strides(out.sizes());
    return {strides.begin(), strides.end()};
  }
  if (out.dim() == 4 && out.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    return c10::get_channels_last_strides_2d(out.sizes());
  }
  return out.strides().vec();
}

at::Tensor convAddActEpilogueComposite(at::Tensor conv, const ConvAddActArgs& a) {
  const auto other = otherOf(a);
  if (other.defined()) {
    conv = a.promote ? at::add(conv, other, a.alpha) : conv.add_(other, a.alpha);
  }
  return applyActivation(conv, a.activation, a.activation_args);
}

at::Tensor convAddActComposite(const ConvAddActArgs& a) {
  return convAddActEpilogueComposite(
      convolve(a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups), a);
}

at::Tensor convAddAct(const ConvAddActArgs& a) {
  return custom_conv_add_act(
      a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups, a.other, a.alpha,
      a.promote, a.activation, a.activation_args);
}

} // namespace ops
} // namespace torchfuse

// Backends without a torchfuse kernel run the original chain.
TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  torchfuse::ops::registerConvAddAct<torchfuse::ops::convAddActComposite>(m);
}
