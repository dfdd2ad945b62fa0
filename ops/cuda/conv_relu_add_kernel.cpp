// NB: until the cuDNN kernels land, CUDA runs the reference composition, so
// fused graphs already run on GPUs.
#include <torch/library.h>

#include "ops/conv_relu_add.h"

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
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
