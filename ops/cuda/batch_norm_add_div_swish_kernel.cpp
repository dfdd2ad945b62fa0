// CUDA kernels of custom_batch_norm_add_div_swish (kernels/batch_norm/
// batch_norm_add_div_swish.cu) for the common case:
//   - input (N, C) or (N, C, *), float32 / float16 / bfloat16, dense with the
//     channel dimension between the others in memory order: contiguous,
//     channels-last, or any permutation of that kind (kernelShape);
//   - weight, bias (optional), running_mean and running_var sharing one dtype,
//     float32 or the input's (as native batch_norm requires);
//   - other with one element, or C elements along input's dim 1, and not
//     changing the result's dtype or shape;
//   - a real divisor.
// Everything else (overlapping or gapped inputs, float64, a full-size or
// otherwise broadcast `other`, empty inputs) runs the reference composition,
// which is correct for all of them.  The fallback is silent, as custom_relu's:
// a warning would turn into an error under `-W error`.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "kernels/batch_norm/batch_norm_add_div_swish.cuh"
#include "ops/batch_norm_add_div_swish.h"
#include "ops/cuda/cuda_types.h"

namespace torchfuse::ops {
namespace {

namespace k = torchfuse::kernels;
using OptTensor = std::optional<at::Tensor>;

std::optional<k::BnDtype> bnDtype(at::ScalarType s) {
  switch (s) {
    case at::kFloat:
      return k::BnDtype::kFloat;
    case at::kHalf:
      return k::BnDtype::kHalf;
    case at::kBFloat16:
      return k::BnDtype::kBFloat16;
    case at::kDouble:
      return k::BnDtype::kDouble;
    default:
      return std::nullopt;
  }
}

bool defined(const OptTensor& t) {
  return t.has_value() && t->defined();
}

// The kernels' (n, c, l) view of input's memory, or nullopt.  A dense
// input's memory is (dims of larger stride than dim 1, C, dims of smaller
// stride), so l = stride(1) and n = numel / (C * l); the kernels reduce over
// n and l alike and write outputs with input's strides (empty_like).
std::optional<k::BnShape> kernelShape(const at::Tensor& input) {
  const auto s = input.scalar_type();
  if (!input.is_cuda() || input.dim() < 2 || input.numel() == 0 ||
      (s != at::kFloat && s != at::kHalf && s != at::kBFloat16) ||
      !input.is_non_overlapping_and_dense()) {
    return std::nullopt;
  }
  k::BnShape shape;
  shape.c = input.size(1);
  // NB: a size-1 dim's stride is arbitrary; one channel is one block anyway.
  shape.l = shape.c == 1 ? 1 : input.stride(1);
  shape.n = input.numel() / (shape.c * shape.l);
  return shape;
}

// A 1-D tensor of C elements (any stride) on input's device.
std::optional<k::BnChannelRef> channelRef(const at::Tensor& t, const at::Tensor& input) {
  const auto dt = bnDtype(t.scalar_type());
  if (!dt || t.dim() != 1 || t.size(0) != input.size(1) ||
      t.device() != input.device()) {
    return std::nullopt;
  }
  return k::BnChannelRef{t.const_data_ptr(), *dt, t.stride(0)};
}

std::optional<k::BnChannelRef> optionalChannelRef(const OptTensor& t, const at::Tensor& input) {
  if (!defined(t)) {
    return k::BnChannelRef{};  // absent
  }
  return channelRef(*t, input);
}

// `other` with one element, or with C elements on the dimension that lines
// up with input's dim 1; in both cases `input + other` has input's shape.
std::optional<k::BnChannelRef> otherRef(const at::Tensor& other, const at::Tensor& input) {
  const auto dt = bnDtype(other.scalar_type());
  if (!dt || other.device() != input.device() || other.dim() > input.dim()) {
    return std::nullopt;
  }
  if (other.numel() == 1) {
    return k::BnChannelRef{other.const_data_ptr(), *dt, 0};
  }
  const int64_t j = other.dim() - (input.dim() - 1);
  if (other.numel() != input.size(1) || j < 0 || other.size(j) != input.size(1)) {
    return std::nullopt;
  }
  return k::BnChannelRef{other.const_data_ptr(), *dt, other.stride(j)};
}

// NB: a zero or non-finite divisor takes the composite: the kernels fold
// 1 / divisor into per-channel coefficients, where eager's inf/nan would
// come out as inf - inf = nan.
std::optional<double> realDivisor(const at::Scalar& divisor) {
  if (divisor.isFloatingPoint() || divisor.isIntegral(/*includeBool=*/false)) {
    const double d = divisor.toDouble();
    if (d != 0.0 && std::isfinite(d)) {
      return d;
    }
  }
  return std::nullopt;
}

// The kernels' view of a forward call, or nullopt for the composite.
struct ForwardPlan {
  k::BnShape shape;
  k::BnAffine affine;
  k::BnChannelRef running_mean;
  k::BnChannelRef running_var;
};

std::optional<ForwardPlan> forwardPlan(const BatchNormAddDivSwishArgs& a) {
  const auto& input = a.input;
  const auto shape = kernelShape(input);
  if (!shape) {
    return std::nullopt;
  }
  // NB: the parameters share one dtype, float32 or the input's, as native
  // batch_norm requires; other mixes make the composite raise its error.
  const auto p = a.running_mean.scalar_type();
  if (p != at::kFloat && p != input.scalar_type()) {
    return std::nullopt;
  }
  for (const at::Tensor* t :
       {&a.running_var, defined(a.weight) ? &*a.weight : nullptr,
        defined(a.bias) ? &*a.bias : nullptr}) {
    if (t != nullptr && t->scalar_type() != p) {
      return std::nullopt;
    }
  }
  // Training writes the running statistics in place: contiguous only.
  if (a.training && (!a.running_mean.is_contiguous() || !a.running_var.is_contiguous())) {
    return std::nullopt;
  }
  // The composite's result dtype is result_type(input, other).
  if (at::result_type(input, a.other) != input.scalar_type()) {
    return std::nullopt;
  }
  const auto w = optionalChannelRef(a.weight, input);
  const auto b = optionalChannelRef(a.bias, input);
  const auto rm = channelRef(a.running_mean, input);
  const auto rv = channelRef(a.running_var, input);
  const auto s = otherRef(a.other, input);
  const auto d = realDivisor(a.divisor);
  if (!w || !b || !rm || !rv || !s || !d) {
    return std::nullopt;
  }
  ForwardPlan plan;
  plan.shape = *shape;
  plan.affine = k::BnAffine{*w, *b, *s, *d};
  plan.running_mean = *rm;
  plan.running_var = *rv;
  return plan;
}

int numSms() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

at::Tensor workspace(const at::Tensor& input, const k::BnShape& shape, int sms) {
  return at::empty(
      {k::batchNormSwishWorkspaceBytes(shape, static_cast<int>(input.element_size()), sms)},
      input.options().dtype(at::kByte));
}

k::BnChannelMut mutRef(const at::Tensor& t) {
  return k::BnChannelMut{t.data_ptr(), *bnDtype(t.scalar_type())};
}

// Returns out; in training also updates the running statistics and fills
// save_mean / save_invstd where defined.
at::Tensor forwardCuda(
    const ForwardPlan& plan,
    const BatchNormAddDivSwishArgs& a,
    const at::Tensor& save_mean = {},
    const at::Tensor& save_invstd = {}) {
  const auto& input = a.input;
  c10::cuda::CUDAGuard guard(input.device());
  const int sms = numSms();
  auto out = at::empty_like(input);
  auto ws = workspace(input, plan.shape, sms);
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(input.scalar_type(), "custom_batch_norm_add_div_swish", [&] {
    const k::BnForward<CudaType<scalar_t>::type> f{cudaPtr<scalar_t>(input),
                                                   cudaPtr<scalar_t>(out),
                                                   plan.shape,
                                                   plan.affine,
                                                   ws.data_ptr(),
                                                   sms};
    if (a.training) {
      k::batchNormSwishTrainForward(
          f,
          {mutRef(a.running_mean), mutRef(a.running_var), a.momentum, a.eps,
           save_mean.defined() ? save_mean.data_ptr<float>() : nullptr,
           save_invstd.defined() ? save_invstd.data_ptr<float>() : nullptr},
          stream);
    } else {
      k::batchNormSwishEvalForward(f, {plan.running_mean, plan.running_var, a.eps}, stream);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Both forms: the _eval op's arguments have training false.
at::Tensor batchNormAddDivSwishCuda(const BatchNormAddDivSwishArgs& a) {
  if (!batchNormAddDivSwishHandles(a)) {
    return batchNormAddDivSwishReference(a);
  }
  checkBatchNormAddDivSwishInputs(a);
  const auto plan = forwardPlan(a);
  if (!plan) {
    return batchNormAddDivSwishComposite(a);
  }
  return forwardCuda(*plan, a);
}

BatchNormAddDivSwishStats batchNormAddDivSwishForwardCuda(const BatchNormAddDivSwishArgs& a) {
  checkBatchNormAddDivSwishInputs(a);
  const auto plan = forwardPlan(a);
  if (!plan) {
    return batchNormAddDivSwishForwardComposite(a);
  }
  // Statistics in batchNormOpmathType(input) = float32 for the kernel dtypes.
  const auto& input = a.input;
  const auto stats = input.options().dtype(at::kFloat);
  if (!a.training) {
    return {forwardCuda(*plan, a), at::empty({0}, stats), at::empty({0}, stats)};
  }
  auto save_mean = at::empty({input.size(1)}, stats);
  auto save_invstd = at::empty({input.size(1)}, stats);
  auto out = forwardCuda(*plan, a, save_mean, save_invstd);
  return {out, save_mean, save_invstd};
}

BatchNormAddDivSwishGrads batchNormAddDivSwishBackwardCuda(
    const BatchNormAddDivSwishBackwardArgs& a) {
  const auto& grad_output = a.grad_output;
  const auto& input = a.input;
  const auto fallback = [&] { return batchNormAddDivSwishBackwardComposite(a); };
  // NB: with grad_output in the input's dtype the composite computes in
  // batchNormBackwardType: float64 for float32 inputs, float32 for 16-bit
  // ones.  The kernels' sums are float64, their per-element terms float64
  // for float32 inputs and float32 for 16-bit ones; the parameter gradients
  // are rounded once to batchNormParamGradTypes, as the composite's.
  const auto shape = kernelShape(input);
  if (!shape || !grad_output.defined() ||
      grad_output.scalar_type() != input.scalar_type() ||
      grad_output.sizes() != input.sizes() ||
      grad_output.device() != input.device()) {
    return fallback();
  }
  const auto w = optionalChannelRef(a.weight, input);
  const auto b = optionalChannelRef(a.bias, input);
  const auto mu = a.mean.defined() ? channelRef(a.mean, input) : std::nullopt;
  const auto is = a.invstd.defined() ? channelRef(a.invstd, input) : std::nullopt;
  const auto s = a.other.defined() ? otherRef(a.other, input) : std::nullopt;
  const auto d = realDivisor(a.divisor);
  if (!w || !b || !mu || !is || !s || !d) {
    return fallback();
  }
  c10::cuda::CUDAGuard guard(input.device());
  const int sms = numSms();
  // The kernels read grad_output in input's memory order.
  const auto g = grad_output.strides() == input.strides()
      ? grad_output
      : at::empty_like(input).copy_(grad_output);
  const auto types = batchNormParamGradTypes(a);
  const k::BnAffine affine{*w, *b, *s, *d};
  at::Tensor grad_input, grad_weight, grad_bias, grad_other;
  if (a.output_mask[0]) {
    grad_input = at::empty_like(input);
  }
  if (a.output_mask[1]) {
    grad_weight = at::empty({shape->c}, input.options().dtype(types.weight));
  }
  if (a.output_mask[2]) {
    grad_bias = at::empty({shape->c}, input.options().dtype(types.bias));
  }
  if (a.output_mask[3]) {
    // One value, or C contiguous values along other's channel dimension.
    grad_other = at::empty(a.other.sizes(), input.options().dtype(types.other));
  }
  const auto mut = [](const at::Tensor& t) {
    return t.defined() ? mutRef(t) : k::BnChannelMut{};
  };
  const k::BnParamGrads grads{mut(grad_weight), mut(grad_bias), mut(grad_other)};
  auto ws = workspace(input, *shape, sms);
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(
      input.scalar_type(), "custom_batch_norm_add_div_swish_backward", [&] {
        k::batchNormSwishBackward<CudaType<scalar_t>::type>(
            {cudaPtr<scalar_t>(g), cudaPtr<scalar_t>(input), *shape, affine, *mu, *is, a.training,
             a.silu, grad_input.defined() ? cudaPtr<scalar_t>(grad_input) : nullptr, grads,
             ws.data_ptr(), sms},
            stream);
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_input, grad_weight, grad_bias, grad_other};
}

} // namespace

bool batchNormAddDivSwishCudaTakes(const BatchNormAddDivSwishArgs& a) {
  return batchNormAddDivSwishHandles(a) && forwardPlan(a).has_value();
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  registerBatchNormAddDivSwish<
      batchNormAddDivSwishCuda, batchNormAddDivSwishCuda, batchNormAddDivSwishForwardCuda,
      batchNormAddDivSwishBackwardCuda>(m);
}
