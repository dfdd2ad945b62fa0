// custom_conv_relu_add on CPU: the composites (ops/common/conv_composites.h).

#include <torch/library.h>

#include "ops/common/conv_composites.h"

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"),
      TORCH_FN(convReluAddComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_forward"),
      TORCH_FN(convReluAddForwardComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_backward"),
      TORCH_FN(convReluAddBackwardComposite));
}
