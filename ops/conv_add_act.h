#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "kernels/common/activation.h"

namespace torchfuse::ops {

// The arguments of custom_conv_add_act, as its kernels and helpers take
// them.  NB: references to the dispatcher's arguments, valid for the call.
struct ConvAddActArgs {
  const at::Tensor& input;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  at::IntArrayRef stride;
  at::IntArrayRef padding;
  at::IntArrayRef dilation;
  int64_t groups;
  const std::optional<at::Tensor>& other;
  const at::Scalar& alpha;
  bool promote;
  c10::string_view activation;
  at::ArrayRef<double> activation_args;
};

template <auto F>
at::Tensor convAddActKernel(
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
  return F(ConvAddActArgs{
      input, weight, bias, stride, padding, dilation, groups, other, alpha, promote, activation,
      activation_args});
}

// Registers one dispatch key's kernel for custom_conv_add_act.
template <auto Op>
void registerConvAddAct(torch::Library& m) {
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_conv_add_act"), TORCH_FN(convAddActKernel<Op>));
}

// The activation named by `activation` with `activation_args`; raises,
// naming `op` and the argument, for an unknown name or a wrong number of
// arguments.  A trailing '_' ("relu_") names the in-place spelling
// (activatesInPlace).
kernels::Activation parseActivation(
    c10::string_view activation,
    at::ArrayRef<double> activation_args,
    const char* op = "torchfuse::custom_conv_add_act");

// Whether `activation` names the in-place spelling ("relu_").  NB: the values
// are the same; the output's strides are not where the conv output's layout
// is ambiguous (size-1 dimensions): an in-place activation keeps the conv
// output's, an out-of-place one takes TensorIterator's.
bool activatesInPlace(c10::string_view activation);

// The activation as ATen's own op (its values, errors and derivatives), in
// the spelling named: in place on `t` (a fresh intermediate of the chain)
// for "relu_" and the like, else out of place.  Shared with
// custom_linear_act.
at::Tensor applyActivation(
    at::Tensor& t,
    c10::string_view activation,
    at::ArrayRef<double> activation_args);

// Whether eager's chain has an out-of-place op (the activation, or the add,
// an in-place activation after it included) over a conv output `conv_sizes`
// with a size-1 dimension: that op picks the strides of the ambiguous
// dimensions itself, and the in-place ops after it keep them.  Not
// hardtanh (and relu6), whose out-of-place result takes its input's strides
// (empty_like).  `act` is parseActivation's result for `a`.
bool outOfPlaceOverAmbiguousLayout(
    const ConvAddActArgs& a,
    const kernels::Activation& act,
    at::IntArrayRef conv_sizes);

// The strides eager's out-of-place op gives its result over the conv output
// `out` where every operand has out's strides (outOfPlaceOverAmbiguousLayout's
// op: the activation, or the add with an `other` of out's strides):
// TensorIterator's fast setup allocates canonical contiguous strides where out
// is contiguous, canonical channels-last ones where out is 4-d channels-last,
// else out's own.  They differ from out's only in size-1 dimensions, so the
// elements stay where they are.
std::vector<int64_t> outOfPlaceStrides(const at::Tensor& out);

// `other` when present (defined), else undefined.
at::Tensor otherOf(const ConvAddActArgs& a);

// Checks every argument and returns the conv output's shape; `op` names
// the op in messages.
std::vector<int64_t> checkConvAddActInputs(
    const ConvAddActArgs& a,
    const char* op = "torchfuse::custom_conv_add_act");

// Whether the op's own kernels take these tensors (convKernelsHandle).
bool convAddActHandles(const ConvAddActArgs& a);

// The pointwise part on `conv`, the convolution (bias included) already
// computed and not seen by anyone else: conv + alpha * other (out of place
// when promote, else in place), then the activation, as ATen ops (with
// ATen's autograd where recording).
at::Tensor convAddActEpilogueComposite(at::Tensor conv, const ConvAddActArgs& a);

// The original chain as ATen ops: the numerical oracle (the CPU kernel), the
// Autograd kernel's recording path, and every fallback.
at::Tensor convAddActComposite(const ConvAddActArgs& a);

// The op through the dispatcher.
at::Tensor convAddAct(const ConvAddActArgs& a);

} // namespace torchfuse::ops
