#include "ops/cuda/conv/operands.h"

#include <ATen/cuda/CUDAContext.h>

#include "kernels/conv/grad_sums.cuh"

namespace torchfuse::ops::conv_cuda {
namespace {

bool kernelDtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

// `other` as C per-channel values when it is per-channel or scalar-like over
// the conv output and has its dtype; else undefined.
at::Tensor perChannel(
    const at::Tensor& other,
    at::IntArrayRef sizes,
    int64_t channel_dim,
    at::ScalarType dtype) {
  if (other.scalar_type() != dtype || !other.is_cuda() || other.dim() > int64_t(sizes.size())) {
    return {};
  }
  const int64_t other_channel_dim = other.dim() - (int64_t(sizes.size()) - channel_dim);
  for (int64_t d = 0; d < other.dim(); ++d) {
    if (d != other_channel_dim && other.size(d) != 1) {
      return {};
    }
  }
  const int64_t channels = sizes[channel_dim];
  if (other.numel() == 1) {
    return other.reshape({1}).expand({channels}).contiguous();
  }
  return other_channel_dim >= 0 && other.size(other_channel_dim) == channels
      ? other.reshape({channels}).contiguous()
      : at::Tensor();
}

} // namespace

bool isChannelsLast(const at::Tensor& t) {
  return t.is_contiguous(at::MemoryFormat::ChannelsLast) ||
      t.is_contiguous(at::MemoryFormat::ChannelsLast3d);
}

bool kernelInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const auto dtype = input.scalar_type();
  const bool bias_ok =
      !bias || !bias->defined() || (bias->scalar_type() == dtype && bias->is_cuda());
  constexpr int64_t kMaxGridZ = 65535; // the grad prologue's grid
  return input.is_cuda() && weight.is_cuda() && kernelDtype(dtype) &&
      weight.scalar_type() == dtype && bias_ok &&
      (input.dim() < weight.dim() || input.size(0) <= kMaxGridZ);
}

EpilogueOperands::EpilogueOperands(
    const std::optional<at::Tensor>& conv_bias,
    const at::Tensor& other_in,
    at::IntArrayRef sizes,
    int64_t channel_dim,
    at::ScalarType dtype)
    : bias(conv_bias && conv_bias->defined() ? conv_bias->contiguous() : at::Tensor()),
      other(perChannel(other_in, sizes, channel_dim, dtype)) {}

GradSums::GradSums(
    int64_t parts,
    int64_t channels,
    const at::Tensor& like,
    std::array<bool, 4> output_mask) {
  const auto options = like.options().dtype(at::kDouble);
  if (output_mask[2]) {
    g = at::empty({parts, channels}, options);
  }
  if (output_mask[3]) {
    dy = at::empty({parts, channels}, options);
  }
}

std::tuple<at::Tensor, at::Tensor> GradSums::reduce(int64_t parts, at::ScalarType dtype) const {
  // NB: one launch for both totals, where ATen's narrow, sum and cast take
  // six operator calls and four launches: small training steps are bound
  // by that host time, not by the GPU.
  const auto& like = g.defined() ? g : dy;
  if (!like.defined()) {
    return {};
  }
  const int64_t channels = like.size(1);
  const auto total = [&](const at::Tensor& rows) {
    return rows.defined() ? at::empty({channels}, rows.options().dtype(dtype)) : at::Tensor();
  };
  auto grad_bias = total(g);
  auto grad_channels = total(dy);
  TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add_backward", [&] {
    const auto out = [](const at::Tensor& t) {
      return t.defined() ? cudaPtr<scalar_t>(t) : nullptr;
    };
    kernels::convGradSumsTotal<CudaType<scalar_t>::type>(
        gPtr(), dyPtr(), parts, channels, out(grad_bias), out(grad_channels),
        at::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {grad_bias, grad_channels};
}

} // namespace torchfuse::ops::conv_cuda
