// NB: until the fused kernels land, CUDA runs the reference composition, so
// fused graphs already run on GPUs.
#include <torch/library.h>

#include "ops/batch_norm_add_div_swish.h"

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish"),
      TORCH_FN(batchNormAddDivSwishComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_eval"),
      TORCH_FN(batchNormAddDivSwishEvalComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_forward"),
      TORCH_FN(batchNormAddDivSwishForwardComposite));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_backward"),
      TORCH_FN(batchNormAddDivSwishBackwardComposite));
}
