#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "ops/conv_add_act.h"

namespace torchfuse::ops {

constexpr const char* kConvActMaxPool = "torchfuse::custom_conv_act_max_pool";

// The arguments of custom_conv_act_max_pool, as its kernels and helpers take
// them.  NB: references to the dispatcher's arguments, valid for the call.
struct ConvActMaxPoolArgs {
  const at::Tensor& input;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  at::IntArrayRef stride;
  at::IntArrayRef padding;
  at::IntArrayRef dilation;
  int64_t groups;
  c10::string_view activation;
  at::ArrayRef<double> activation_args;
  at::IntArrayRef kernel_size;
  at::IntArrayRef pool_stride;
  at::IntArrayRef pool_padding;
  at::IntArrayRef pool_dilation;
  bool ceil_mode;
};

template <auto F>
at::Tensor convActMaxPoolKernel(
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
  return F(ConvActMaxPoolArgs{
      input, weight, bias, stride, padding, dilation, groups, activation, activation_args,
      kernel_size, pool_stride, pool_padding, pool_dilation, ceil_mode});
}

// Registers one dispatch key's kernel for custom_conv_act_max_pool.
template <auto Op>
void registerConvActMaxPool(torch::Library& m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_act_max_pool"),
      TORCH_FN(convActMaxPoolKernel<Op>));
}

// The conv and activation part, as custom_conv_add_act's arguments (no add).
// NB: holds references into `a` and to `none`, which must outlive it.
ConvAddActArgs convActArgs(const ConvActMaxPoolArgs& a, const std::optional<at::Tensor>& none);

// max_pool2d of `activated` (the conv -> act output) with the op's pool
// arguments, as ATen's op (its checks, values and derivatives).
at::Tensor maxPoolOf(const at::Tensor& activated, const ConvActMaxPoolArgs& a);

// The original chain as ATen ops: the numerical oracle (the CPU kernel), the
// Autograd kernel's recording path, and every fallback.
at::Tensor convActMaxPoolComposite(const ConvActMaxPoolArgs& a);

// The op through the dispatcher.
at::Tensor convActMaxPool(const ConvActMaxPoolArgs& a);

// The pool's window per spatial dimension, as ATen's max_pool2d reads its
// int lists: one value stands for both dimensions, and an empty stride
// means the kernel size.
struct PoolWindow {
  int64_t kh, kw, sh, sw, ph, pw, dh, dw;
};
PoolWindow poolWindow(const ConvActMaxPoolArgs& a);

} // namespace torchfuse::ops
