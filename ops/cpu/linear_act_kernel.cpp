// custom_linear_act on CPU: the composite (the op's checks, then eager's
// chain).

#include <torch/library.h>

#include "ops/linear_act.h"

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  torchfuse::ops::registerLinearAct<torchfuse::ops::linearActComposite>(m);
}
