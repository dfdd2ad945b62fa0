#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>

#include <array>
#include <optional>
#include <tuple>

namespace torchfuse::ops {

// Raises, with the op and argument named, for arguments the original chain
// also rejects: ranks, sizes, devices, and on the CPU the parameters' dtypes
// (one dtype, the input's or float32 for a 16-bit input).
void checkBatchNormAddDivSwishInputs(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    const at::Tensor& other);

// Whether the op's own kernels take these arguments (both forms): dense
// strided tensors on CPU, CUDA or Meta (isPlainDenseTensor), a 1-D weight and
// bias, and off the CPU `other` on the input's device and the parameters'
// dtypes as the CPU's batch_norm takes them.  Never throws.  Where false,
// every entry point runs the reference.
bool batchNormAddDivSwishHandles(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    const at::Tensor& other);

// (bn + other) / divisor, then silu(t) or t * sigmoid(t).
at::Tensor addDivSwish(
    const at::Tensor& bn, const at::Tensor& other, const at::Scalar& divisor, bool silu);

// The original chain as ATen ops: batch_norm (updating the running
// statistics once, in training), add, div and the swish's spelling.  ATen's
// own errors, results and autograd (double backward included).
at::Tensor batchNormAddDivSwishReference(
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
    bool silu);

at::Tensor batchNormAddDivSwishEvalReference(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu);

// The dtype of the saved statistics.
at::ScalarType batchNormOpmathType(at::ScalarType input);

// The dtype of the backward's sums and of its grad_weight, grad_bias and
// grad_other outputs: float32 for 16-bit inputs, float64 otherwise, promoted
// with grad_output's dtype.
at::ScalarType batchNormBackwardType(at::ScalarType input, at::ScalarType grad_output);

// Reference kernels: ATen compositions that run on any device.  `silu`
// (every op's last argument) is the swish's spelling in the original: the
// forward computes silu(t) or t * sigmoid(t), the backward differentiates it
// as autograd would (see ops/batch_norm_add_div_swish.cpp).
at::Tensor batchNormAddDivSwishComposite(
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
    bool silu);

at::Tensor batchNormAddDivSwishEvalComposite(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu);

// Returns (output, save_mean, save_invstd); in eval mode the statistics are
// empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor> batchNormAddDivSwishForwardComposite(
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
    bool silu);

// mean and invstd are the batch statistics (training) or the running mean and
// 1/sqrt(running_var + eps) (eval).  Returns (grad_input, grad_weight,
// grad_bias, grad_other), each undefined where output_mask is false;
// grad_other has other's shape (the gradient of `batch_norm + other` summed
// to it).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
batchNormAddDivSwishBackwardComposite(
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
    bool silu);

at::Tensor batchNormAddDivSwishEval(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu);

std::tuple<at::Tensor, at::Tensor, at::Tensor> batchNormAddDivSwishForward(
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
    bool silu);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
batchNormAddDivSwishBackward(
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
    bool silu);

} // namespace torchfuse::ops
