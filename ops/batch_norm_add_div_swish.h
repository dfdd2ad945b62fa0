#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <torch/library.h>

#include <array>
#include <cstddef>
#include <optional>
#include <tuple>
#include <type_traits>

namespace torchfuse::ops {

// The arguments of custom_batch_norm_add_div_swish, as its kernels and
// helpers take them; the _eval op's are the same with training = false and
// momentum = 0.  `silu` is the swish's spelling in the original: the forward
// computes silu(t) or t * sigmoid(t), the backward differentiates it as
// autograd would (see ops/batch_norm_add_div_swish.cpp).
// NB: references to the dispatcher's arguments, so a value lives no longer
// than the call that packed it.  running_mean and running_var are written in
// training (the schema's Tensor(a!)): at::Tensor's in-place ops are const
// methods, the const is the handle's.
struct BatchNormAddDivSwishArgs {
  const at::Tensor& input;
  const std::optional<at::Tensor>& weight;
  const std::optional<at::Tensor>& bias;
  const at::Tensor& running_mean;
  const at::Tensor& running_var;
  bool training;
  double momentum;
  double eps;
  const at::Tensor& other;
  const at::Scalar& divisor;
  bool silu;
};

// The arguments of custom_batch_norm_add_div_swish_backward.  mean and
// invstd are the batch statistics (training) or the running mean and
// 1/sqrt(running_var + eps) (eval).  The results are (grad_input,
// grad_weight, grad_bias, grad_other), each undefined where output_mask is
// false; grad_other has other's shape (the gradient of `batch_norm + other`
// summed to it).
struct BatchNormAddDivSwishBackwardArgs {
  const at::Tensor& grad_output;
  const at::Tensor& input;
  const std::optional<at::Tensor>& weight;
  const std::optional<at::Tensor>& bias;
  const at::Tensor& mean;
  const at::Tensor& invstd;
  bool training;
  const at::Tensor& other;
  const at::Scalar& divisor;
  std::array<bool, 4> output_mask;
  bool silu;
};

using BatchNormAddDivSwishStats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using BatchNormAddDivSwishGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The kernels registered for the ops, one template a schema: they unpack the
// dispatcher's arguments into the structs above and call F (every backend's
// train and forward ops share the first; the _eval op takes the second).
template <auto F>
auto batchNormAddDivSwishKernel(
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
    bool silu) {
  return F(BatchNormAddDivSwishArgs{
      input, weight, bias, running_mean, running_var, training, momentum, eps, other, divisor,
      silu});
}

template <auto F>
at::Tensor batchNormAddDivSwishEvalKernel(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  return F(BatchNormAddDivSwishArgs{
      input, weight, bias, running_mean, running_var, /*training=*/false, /*momentum=*/0.0, eps,
      other, divisor, silu});
}

template <auto F>
BatchNormAddDivSwishGrads batchNormAddDivSwishBackwardKernel(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& mean,
    const at::Tensor& invstd,
    bool training,
    const at::Tensor& other,
    const at::Scalar& divisor,
    std::array<bool, 4> output_mask,
    bool silu) {
  return F(BatchNormAddDivSwishBackwardArgs{
      grad_output, input, weight, bias, mean, invstd, training, other, divisor, output_mask, silu});
}

// Registers one dispatch key's kernels: Train for
// custom_batch_norm_add_div_swish, Eval for its _eval form, and Forward and
// Backward for _forward and _backward where not nullptr.
template <auto Train, auto Eval, auto Forward = nullptr, auto Backward = nullptr>
void registerBatchNormAddDivSwish(torch::Library& m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish"),
      TORCH_FN(batchNormAddDivSwishKernel<Train>));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_eval"),
      TORCH_FN(batchNormAddDivSwishEvalKernel<Eval>));
  if constexpr (!std::is_same_v<decltype(Forward), std::nullptr_t>) {
    m.impl(
        TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_forward"),
        TORCH_FN(batchNormAddDivSwishKernel<Forward>));
  }
  if constexpr (!std::is_same_v<decltype(Backward), std::nullptr_t>) {
    m.impl(
        TORCH_SELECTIVE_NAME("torchfuse::custom_batch_norm_add_div_swish_backward"),
        TORCH_FN(batchNormAddDivSwishBackwardKernel<Backward>));
  }
}

// Raises, with the op and argument named, for arguments the original chain
// also rejects: ranks, sizes, devices, and on the CPU the parameters' dtypes
// (one dtype, the input's or float32 for a 16-bit input).
void checkBatchNormAddDivSwishInputs(const BatchNormAddDivSwishArgs& a);

// Whether the op's own kernels take these arguments (both forms): dense
// strided tensors on CPU, CUDA or Meta (isPlainDenseTensor), a 1-D weight and
// bias, and off the CPU `other` on the input's device and the parameters'
// dtypes as the CPU's batch_norm takes them.  Never throws.  Where false,
// every entry point runs the reference.
bool batchNormAddDivSwishHandles(const BatchNormAddDivSwishArgs& a);

// The chain's batch_norm as ATen's (updating the running statistics once, in
// training).
at::Tensor batchNormOf(const BatchNormAddDivSwishArgs& a);

// (bn + other) / divisor, then silu(t) or t * sigmoid(t).
at::Tensor addDivSwish(
    const at::Tensor& bn,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu);

// The original chain as ATen ops: batch_norm, add, div and the swish's
// spelling.  ATen's own errors, results and autograd (double backward
// included).
at::Tensor batchNormAddDivSwishReference(const BatchNormAddDivSwishArgs& a);

// The dtype of the saved statistics.
at::ScalarType batchNormOpmathType(at::ScalarType input);

// The dtype of the backward's sums: float32 for 16-bit inputs, float64
// otherwise, promoted with grad_output's dtype.
at::ScalarType batchNormBackwardType(at::ScalarType input, at::ScalarType grad_output);

// The dtypes of the backward's grad_weight, grad_bias and grad_other: those
// of weight, bias and other, so that the sums are rounded once there and the
// autograd engine has no cast left to launch; batchNormBackwardType where
// weight or bias is absent.
struct BatchNormParamGradTypes {
  at::ScalarType weight;
  at::ScalarType bias;
  at::ScalarType other;
};
BatchNormParamGradTypes batchNormParamGradTypes(const BatchNormAddDivSwishBackwardArgs& a);

#ifdef TORCHFUSE_WITH_CUDA
// Whether the CUDA kernels (ops/cuda/batch_norm_add_div_swish_kernel.cpp)
// take a forward call's arguments, rather than the reference composition.
// Never throws.
bool batchNormAddDivSwishCudaTakes(const BatchNormAddDivSwishArgs& a);
#endif

// Reference kernels (ops/cpu/): ATen compositions that run on any device.
at::Tensor batchNormAddDivSwishComposite(const BatchNormAddDivSwishArgs& a);

// Returns (output, save_mean, save_invstd); in eval mode the statistics are
// empty.
BatchNormAddDivSwishStats batchNormAddDivSwishForwardComposite(const BatchNormAddDivSwishArgs& a);

BatchNormAddDivSwishGrads batchNormAddDivSwishBackwardComposite(
    const BatchNormAddDivSwishBackwardArgs& a);

// The ops through the dispatcher: custom_batch_norm_add_div_swish, its
// _eval form (a.training false), _forward and _backward.
at::Tensor batchNormAddDivSwishTrain(const BatchNormAddDivSwishArgs& a);
at::Tensor batchNormAddDivSwishEval(const BatchNormAddDivSwishArgs& a);
BatchNormAddDivSwishStats batchNormAddDivSwishForward(const BatchNormAddDivSwishArgs& a);
BatchNormAddDivSwishGrads batchNormAddDivSwishBackward(const BatchNormAddDivSwishBackwardArgs& a);

} // namespace torchfuse::ops
