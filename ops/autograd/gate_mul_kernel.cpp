#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/gate_mul.h"
#include "torchfuse/ops.h"

namespace torchfuse::ops {
namespace {

// NB: with a graph to record, the original ops, which ATen differentiates
// to any order; the backend kernels run only for calls that record none
// (inference, where the gate is on the hot path).
at::Tensor gateMulAutograd(
    const at::Tensor& input,
    const at::Tensor& gate,
    c10::string_view activation,
    bool gate_first) {
  if (needsGraph(input, gate)) {
    return gateMulReference(input, gate, activation, gate_first);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return custom_gate_mul(input, gate, activation, gate_first);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  torchfuse::ops::registerGateMul<torchfuse::ops::gateMulAutograd>(m);
}
