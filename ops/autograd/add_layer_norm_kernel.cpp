// custom_add_layer_norm under Autograd: where a graph is recorded, the
// original chain as ATen ops, so that gradients and higher-order gradients
// are eager's own; else the device kernels below autograd.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/add_layer_norm.h"
#include "ops/common/autograd_utils.h"

namespace torchfuse::ops {
namespace {

AddLayerNormResult addLayerNormAutograd(const AddLayerNormArgs& a) {
  if (needsGraph(a.input, a.other, a.weight, a.bias)) {
    return addLayerNormComposite(a);
  }
  at::AutoDispatchBelowADInplaceOrView guard;
  return addLayerNorm(a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Autograd, m) {
  torchfuse::ops::registerAddLayerNorm<torchfuse::ops::addLayerNormAutograd>(m);
}
