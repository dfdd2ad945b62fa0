// custom_conv_act_max_pool: max_pool2d(act(convolution(input, weight, bias,
//   ...)), kernel_size, pool_stride, pool_padding, pool_dilation, ceil_mode).
//   The conv and activation are custom_conv_add_act's without an add (its
//   activations and in-place spellings); the pool is aten::max_pool2d's.

#include "ops/conv_act_max_pool.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_conv_act_max_pool(Tensor input, Tensor weight, Tensor? bias, int[] stride, "
      "int[] padding, int[] dilation, int groups, str activation, float[] activation_args, "
      "int[] kernel_size, int[] pool_stride, int[] pool_padding, int[] pool_dilation, "
      "bool ceil_mode) -> Tensor",
      {at::Tag::flexible_layout});
}

namespace torchfuse {

namespace {
using ConvActMaxPoolSignature = at::Tensor(
    const at::Tensor&,
    const at::Tensor&,
    const std::optional<at::Tensor>&,
    at::IntArrayRef,
    at::IntArrayRef,
    at::IntArrayRef,
    int64_t,
    c10::string_view,
    at::ArrayRef<double>,
    at::IntArrayRef,
    at::IntArrayRef,
    at::IntArrayRef,
    at::IntArrayRef,
    bool);
} // namespace

at::Tensor custom_conv_act_max_pool(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    c10::string_view activation,
    at::ArrayRef<double> activation_args,
    at::IntArrayRef kernel_size,
    at::IntArrayRef pool_stride,
    at::IntArrayRef pool_padding,
    at::IntArrayRef pool_dilation,
    bool ceil_mode) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_conv_act_max_pool", "")
                       .typed<ConvActMaxPoolSignature>();
  return op.call(
      input, weight, bias, stride, padding, dilation, groups, activation, activation_args,
      kernel_size, pool_stride, pool_padding, pool_dilation, ceil_mode);
}

namespace ops {

namespace {
const at::Scalar kOne = 1;
} // namespace

ConvAddActArgs convActArgs(const ConvActMaxPoolArgs& a, const std::optional<at::Tensor>& none) {
  return ConvAddActArgs{a.input,  a.weight, a.bias, a.stride, a.padding,    a.dilation,
                        a.groups, none,     kOne,   false,    a.activation, a.activation_args};
}

// NB: each list as two values (an empty stride as the kernel size), as
// F.max_pool2d passes them: ATen takes one value for both dimensions, but a
// graph traced through this composite (AOTAutograd's) records the lists as
// given, and Inductor's lowering of max_pool2d_with_indices_backward takes
// two values only.
at::Tensor maxPoolOf(const at::Tensor& activated, const ConvActMaxPoolArgs& a) {
  const auto pair = [](at::IntArrayRef v) {
    return v.size() == 1 ? std::vector<int64_t>{v[0], v[0]} : v.vec();
  };
  const auto stride = a.pool_stride.empty() ? a.kernel_size : a.pool_stride;
  return at::max_pool2d(
      activated, pair(a.kernel_size), pair(stride), pair(a.pool_padding), pair(a.pool_dilation),
      a.ceil_mode);
}

at::Tensor convActMaxPoolComposite(const ConvActMaxPoolArgs& a) {
  const std::optional<at::Tensor> none;
  return maxPoolOf(convAddActComposite(convActArgs(a, none)), a);
}

at::Tensor convActMaxPool(const ConvActMaxPoolArgs& a) {
  return custom_conv_act_max_pool(
      a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups, a.activation,
      a.activation_args, a.kernel_size, a.pool_stride, a.pool_padding, a.pool_dilation,
      a.ceil_mode);
}

PoolWindow poolWindow(const ConvActMaxPoolArgs& a) {
  // NB: only read after ATen's max_pool2d accepted the same lists (1 or 2
  // values each; stride may be empty).
  const auto at2 = [](at::IntArrayRef v, size_t i) { return v.size() == 1 ? v[0] : v[i]; };
  const auto stride = a.pool_stride.empty() ? a.kernel_size : a.pool_stride;
  return PoolWindow{at2(a.kernel_size, 0),   at2(a.kernel_size, 1),  at2(stride, 0),
                    at2(stride, 1),          at2(a.pool_padding, 0), at2(a.pool_padding, 1),
                    at2(a.pool_dilation, 0), at2(a.pool_dilation, 1)};
}

} // namespace ops
} // namespace torchfuse

// Backends without a torchfuse kernel run the original chain.
TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  torchfuse::ops::registerConvActMaxPool<torchfuse::ops::convActMaxPoolComposite>(m);
}
