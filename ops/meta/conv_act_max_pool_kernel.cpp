// custom_conv_act_max_pool on Meta: custom_conv_add_act's Meta result (the
// conv output's shape, dtype and layout), pooled by ATen's max_pool2d on
// Meta, in symbolic sizes where the inputs have them.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/conv_act_max_pool.h"

namespace torchfuse::ops {
namespace {

at::Tensor convActMaxPoolMeta(const ConvActMaxPoolArgs& a) {
  const std::optional<at::Tensor> none;
  return maxPoolOf(convAddAct(convActArgs(a, none)), a);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  torchfuse::ops::registerConvActMaxPool<torchfuse::ops::convActMaxPoolMeta>(m);
}
