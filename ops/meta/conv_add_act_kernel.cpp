// custom_conv_add_act on Meta: the result's shape, dtype and memory format,
// those of the original chain (the add's broadcasting and promotion
// included), in symbolic sizes where the inputs have them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/conv_add_act.h"
#include "ops/conv_relu_add.h"

namespace torchfuse::ops {
namespace {

at::Tensor convAddActMeta(const ConvAddActArgs& a) {
  if (!anySymbolic({a.input, a.weight, orUndefined(a.bias), otherOf(a)})) {
    checkConvAddActInputs(a);
  } else {
    parseActivation(a.activation, a.activation_args);
  }
  // NB: the activations keep shape, dtype and layout: the add decides them.
  return convAddActEpilogueComposite(
      emptyConvOutput(a.input, a.weight, a.stride, a.padding, a.dilation), a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  torchfuse::ops::registerConvAddAct<torchfuse::ops::convAddActMeta>(m);
}
