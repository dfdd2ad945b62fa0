// custom_conv_relu_add on CPU: the composites (ops/common/conv_composites.h).

#include <torch/library.h>

#include "ops/common/conv_composites.h"

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  using namespace torchfuse::ops;
  registerConvReluAdd<
      convReluAddComposite, convReluAddForwardComposite, convReluAddBackwardComposite>(m);
}
