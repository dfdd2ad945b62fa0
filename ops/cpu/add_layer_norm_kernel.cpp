// custom_add_layer_norm on CPU: the composite (the op's checks, then eager's
// add and layer_norm).

#include <torch/library.h>

#include "ops/add_layer_norm.h"

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  torchfuse::ops::registerAddLayerNorm<torchfuse::ops::addLayerNormComposite>(m);
}
