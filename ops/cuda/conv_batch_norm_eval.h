#pragma once

// custom_conv_batch_norm_act in eval on CUDA, where autograd records
// nothing: eager's convolution without its bias, then one in-place pass
// over its output that applies BatchNorm as a per-channel affine map (the
// conv bias folded into its shift, kernels/batch_norm/eval_affine.cuh) and
// the activation.  Nothing weight-sized is allocated: the call needs no
// more memory than the convolution's own output.

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

#include "kernels/common/activation.h"

namespace torchfuse::ops {

// NB: references to the dispatcher's arguments, valid for the call.
struct ConvBatchNormEvalArgs {
  const at::Tensor& input;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  at::IntArrayRef stride;
  at::IntArrayRef padding;
  at::IntArrayRef dilation;
  int64_t groups;
  const std::optional<at::Tensor>& bn_weight;
  const std::optional<at::Tensor>& bn_bias;
  const at::Tensor& running_mean;
  const at::Tensor& running_var;
  double momentum;
  double eps;
  bool cudnn_enabled;
  c10::string_view activation;
  at::ArrayRef<double> activation_args;
  kernels::Activation act; // parseActivation(activation, activation_args)
};

// act(batch_norm(conv(input, weight, bias), eval statistics)) for a CUDA
// input.  Where the pass does not apply (a dtype other than float, half or
// bfloat16, BatchNorm tensors of mixed dtypes or other devices, an output in
// neither nchw nor channels-last order or with a size-1 dimension, whose
// strides BatchNorm's out-of-place output picks itself), the convolution
// already computed goes through the original ops: its bias added as eager's
// cuDNN convolution adds it, at::batch_norm, the activation.
at::Tensor convBatchNormEvalCuda(const ConvBatchNormEvalArgs& a);

} // namespace torchfuse::ops
