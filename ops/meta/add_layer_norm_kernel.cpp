// custom_add_layer_norm on Meta: the results' shapes, dtypes and strides,
// those of the original chain: the composite (ATen's own meta functions of
// add and layer_norm) on the meta tensors.

#include <torch/library.h>

#include "ops/add_layer_norm.h"

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  torchfuse::ops::registerAddLayerNorm<torchfuse::ops::addLayerNormComposite>(m);
}
