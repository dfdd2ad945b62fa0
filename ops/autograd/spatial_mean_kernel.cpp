#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/spatial_mean.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

// NB: with a graph to record, the original op, which ATen differentiates
// to any order; the backend kernels run only for calls that record none
// (inference, where the squeeze is on the hot path).
at::Tensor spatialMeanAutograd(const at::Tensor& input) {
  if (needsGraph(input)) {
    return spatialMeanReference(input);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return custom_spatial_mean(input);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  torchfuse::ops::registerSpatialMean<torchfuse::ops::spatialMeanAutograd>(m);
}
