#pragma once

// C++ entry points of the torchfuse ops.  Each call goes through the
// dispatcher, so C++ callers reach the same CPU, CUDA, Meta and Autograd
// kernels as TorchScript graphs do.

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "torchfuse/export.h"

namespace torchfuse {

// The library version, e.g. "0.1.0".
TORCHFUSE_API const char* version();

// relu(linear(input, weight, bias) + alpha * other)
TORCHFUSE_API at::Tensor custom_linear_add_relu(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha = 1);

// relu(convolution(input, weight, bias, ...)) + alpha * other
TORCHFUSE_API at::Tensor custom_conv_relu_add(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha = 1);

// act(convolution(input, weight, bias, ...) + alpha * other), no add where
// other is absent.  promote: the add is out of place (add: promoted dtype,
// broadcast shape); else in place into the conv output (add_).  activation:
// "none", "relu", "hardtanh" (args min, max), "silu", "hardswish",
// "hardsigmoid", "sigmoid", "gelu", "gelu_tanh", "leaky_relu" (args slope).
TORCHFUSE_API at::Tensor custom_conv_add_act(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const std::optional<at::Tensor>& other,
    const at::Scalar& alpha,
    bool promote,
    c10::string_view activation,
    at::ArrayRef<double> activation_args);

// max_pool2d(act(convolution(input, weight, bias, ...)), kernel_size,
// pool_stride, pool_padding, pool_dilation, ceil_mode): activation as
// custom_conv_add_act's.
TORCHFUSE_API at::Tensor custom_conv_act_max_pool(
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
    bool ceil_mode);

// act(linear(input, weight, bias) [+ residual]); activation as
// custom_conv_add_act's ("relu_" and the like: the in-place spelling).  The
// residual, where `other` is given: y + alpha * other (promote), y.add_(other,
// alpha) into the linear output y (!promote), or other + alpha * y
// (other_first).
TORCHFUSE_API at::Tensor custom_linear_act(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::string_view activation,
    at::ArrayRef<double> activation_args,
    const std::optional<at::Tensor>& other = std::nullopt,
    const at::Scalar& alpha = 1,
    bool promote = true,
    bool other_first = false);

// s = input + alpha * other (add's promoted dtype when promote, else
// input's, as add_ into input); returns (layer_norm(s, normalized_shape,
// weight, bias, eps), s), the second an empty tensor unless write_sum.
TORCHFUSE_API std::tuple<at::Tensor, at::Tensor> custom_add_layer_norm(
    const at::Tensor& input,
    const at::Tensor& other,
    const c10::Scalar& alpha,
    bool promote,
    at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    double eps,
    bool write_sum);

// t = (batch_norm(input, ...) + other) / divisor; t * sigmoid(t).
// In training mode running_mean and running_var are updated in place.
// silu: differentiate the swish as aten::silu does (true) or as autograd
// through `t * sigmoid(t)` does (false); they differ where the incoming
// gradient is infinite.
TORCHFUSE_API at::Tensor custom_batch_norm_add_div_swish(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    at::Tensor& running_mean,
    at::Tensor& running_var,
    bool training,
    double momentum,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu = true);

// The eval-mode overload: reads the running statistics, never writes them.
TORCHFUSE_API at::Tensor custom_batch_norm_add_div_swish_eval(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu = true);

TORCHFUSE_API at::Tensor custom_relu(const at::Tensor& input);

// adaptive_avg_pool2d(input, [1, 1]): the mean over H and W, kept as [N, C,
// 1, 1] (the squeeze of a squeeze-and-excitation block).
TORCHFUSE_API at::Tensor custom_spatial_mean(const at::Tensor& input);

// act(gate) * input (gate_first: the product in that order), act "sigmoid"
// or "hardsigmoid": the gate of a squeeze-and-excitation block, gate [N, C,
// 1, 1] broadcast over input's H and W (any broadcastable shapes are
// accepted).
TORCHFUSE_API at::Tensor custom_gate_mul(
    const at::Tensor& input,
    const at::Tensor& gate,
    c10::string_view activation,
    bool gate_first = false);

// act(batch_norm(conv(input, weight, bias, ...), bn_weight, bn_bias,
// running_mean, running_var, training, momentum, eps, cudnn_enabled)), the
// conv as conv{1,2,3}d by weight's rank; activation as custom_conv_add_act's.
// In eval with running statistics, BatchNorm folds into the conv per call.
TORCHFUSE_API at::Tensor custom_conv_batch_norm_act(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var,
    bool training,
    double momentum,
    double eps,
    bool cudnn_enabled,
    c10::string_view activation,
    at::ArrayRef<double> activation_args);

// scaled_dot_product_attention(query, key, value) without a mask: the fused
// kernels where autograd records nothing, a masked call (ATen's math path on
// CUDA, double-differentiable) where it records.
TORCHFUSE_API at::Tensor custom_unmasked_attention(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    std::optional<double> scale = std::nullopt,
    bool enable_gqa = false);

// The measured layout choices of unfrozen graphs optimized with
// layout="auto" (custom_channels_last_weight with measured=true), oldest
// first: each call site's input, mode, calls so far, and once decided
// whether it runs channels-last, with the median block times (ms) it was
// decided by (docs/passes.md, "Unfrozen graphs").
struct MeasuredLayout {
  std::vector<int64_t> input_sizes;
  std::string dtype;
  bool grad = false;
  std::string autocast; // the CUDA autocast dtype, empty without autocast
  int64_t calls = 0;
  std::optional<bool> channels_last;
  std::optional<double> nchw_ms;
  std::optional<double> channels_last_ms;
};
TORCHFUSE_API std::vector<MeasuredLayout> measuredLayouts();

// NB: an app that only loads an optimized .pt references no symbol of the ops
// library, and `--as-needed` would drop it along with its op registrations.
// Every translation unit that includes this header references version().
inline const char* const kOpsLibraryLinked = version();

} // namespace torchfuse
