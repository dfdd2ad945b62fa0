// custom_linear_act on Meta: the result's shape, dtype and strides, those of
// the original chain: the composite (ATen's own meta functions of linear and
// the activation) on the meta tensors, in symbolic sizes where the inputs
// have them.

#include <torch/library.h>

#include "ops/linear_act.h"

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  torchfuse::ops::registerLinearAct<torchfuse::ops::linearActComposite>(m);
}
