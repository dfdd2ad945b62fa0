// NB: until the cuBLASLt kernels land, CUDA runs the reference composition,
// so fused graphs already run on GPUs.
#include <torch/library.h>

#include "ops/linear_add_relu.h"

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu"),
      TORCH_FN(linearAddReluComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_linear_add_relu_backward"),
      TORCH_FN(linearAddReluBackwardComposite));
}
