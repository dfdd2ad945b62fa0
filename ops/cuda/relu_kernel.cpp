#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/elementwise/relu.cuh"
#include "ops/common/relu_mask.h"
#include "ops/cuda/cuda_types.h"
#include "ops/relu.h"

namespace torchfuse::ops {
namespace {

bool kernelDtype(const at::Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}

// NB: a dense input of any stride order is processed in memory order, and the
// output takes the same strides, as eager's relu gives.
at::Tensor reluCuda(const at::Tensor& input) {
  if (!kernelDtype(input) || !input.is_non_overlapping_and_dense()) {
    return reluComposite(input);
  }
  c10::cuda::CUDAGuard guard(input.device());
  auto out = at::empty_like(input);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "custom_relu", [&] {
    kernels::reluForward(
        cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(out), nullptr, input.numel(),
        at::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The mask is in logical order, so the kernel takes contiguous inputs only.
std::tuple<at::Tensor, at::Tensor> reluForwardMaskCuda(const at::Tensor& input) {
  if (!kernelDtype(input) || !input.is_contiguous()) {
    return reluForwardMaskComposite(input);
  }
  c10::cuda::CUDAGuard guard(input.device());
  auto out = at::empty_like(input);
  auto mask = at::empty({reluMaskBytes(input.numel())}, input.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "custom_relu_forward_mask", [&] {
    kernels::reluForward(
        cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(out),
        reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>()), input.numel(),
        at::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, mask};
}

at::Tensor reluBackwardCuda(const at::Tensor& grad_output, const at::Tensor& mask) {
  if (!kernelDtype(grad_output) || mask.scalar_type() != at::kByte ||
      mask.numel() != reluMaskBytes(grad_output.numel()) || !mask.is_contiguous()) {
    return reluBackwardComposite(grad_output, mask);
  }
  c10::cuda::CUDAGuard guard(grad_output.device());
  const auto grad = grad_output.contiguous();
  auto grad_input = at::empty_like(grad);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "custom_relu_backward", [&] {
    kernels::reluBackward(
        cudaPtr<scalar_t>(grad), reinterpret_cast<const uint32_t*>(mask.data_ptr<uint8_t>()),
        cudaPtr<scalar_t>(grad_input), grad.numel(), at::cuda::getCurrentCUDAStream());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_input;
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_relu"), TORCH_FN(reluCuda));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_relu_forward_mask"),
      TORCH_FN(reluForwardMaskCuda));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_relu_backward"),
      TORCH_FN(reluBackwardCuda));
}
