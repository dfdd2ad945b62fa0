#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "kernels/elementwise/relu.cuh"
#include "ops/common/relu_mask.h"
#include "ops/cuda/cuda_types.h"
#include "ops/relu.h"

namespace torchfuse::ops {
namespace {

// The logical row-major walk over `sizes` with strides a (and b), size-1 dims
// dropped and dims merged where both stride sets allow; nullopt where more
// than kReluMaxDims dims remain.
std::optional<kernels::ReluStrides> reluStrides(
    at::IntArrayRef sizes, at::IntArrayRef a, at::IntArrayRef b) {
  kernels::ReluStrides s{};
  s.ndim = 0;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) {
      continue;
    }
    if (s.ndim > 0 && s.a[s.ndim - 1] == a[d] * sizes[d] &&
        s.b[s.ndim - 1] == b[d] * sizes[d]) {
      s.sizes[s.ndim - 1] *= sizes[d];
      s.a[s.ndim - 1] = a[d];
      s.b[s.ndim - 1] = b[d];
      continue;
    }
    if (s.ndim == kernels::kReluMaxDims) {
      return std::nullopt;
    }
    s.sizes[s.ndim] = sizes[d];
    s.a[s.ndim] = a[d];
    s.b[s.ndim] = b[d];
    ++s.ndim;
  }
  return s;
}

// NB: a dense input of any stride order is processed in memory order, and the
// output takes the same strides, as eager's relu gives.
at::Tensor reluCuda(const at::Tensor& input) {
  if (!reluHandles(input) || !input.is_non_overlapping_and_dense()) {
    return reluReference(input);
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

// The mask is in logical order: a contiguous input takes one fused pass; any
// other the output pass, then a mask pass reading the output through its
// strides.  NB: neither allocates more than the output and the mask.
std::tuple<at::Tensor, at::Tensor> reluForwardMaskCuda(const at::Tensor& input) {
  if (!reluHandles(input)) {
    return reluForwardMaskComposite(input);
  }
  c10::cuda::CUDAGuard guard(input.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto mask = at::empty({reluMaskBytes(input.numel())}, input.options().dtype(at::kByte));
  auto* words = reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>());
  if (input.is_contiguous()) {
    auto out = at::empty_like(input);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "custom_relu_forward_mask", [&] {
      kernels::reluForward(
          cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(out), words, input.numel(), stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return {out, mask};
  }
  auto out = reluCuda(input);
  const auto s = reluStrides(out.sizes(), out.strides(), out.strides());
  if (!s) {
    return {out, packReluMask(out)};
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "custom_relu_forward_mask", [&] {
    kernels::reluMaskStrided(cudaPtr<scalar_t>(out), *s, words, out.numel(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, mask};
}

// NB: grad_output of any strides (an expanded gradient of a sum included) is
// read in place: no contiguous copy.  grad_input is written in the layout
// reluGradInput gives.
at::Tensor reluBackwardCuda(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    at::OptionalIntArrayRef dim_order) {
  checkReluBackwardMask(grad_output, mask);
  auto grad_input = reluGradInput(grad_output, dim_order);
  if (!reluHandles(grad_output)) {
    return applyReluMask(grad_output, mask, grad_input);
  }
  c10::cuda::CUDAGuard guard(grad_output.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  // A mask that is a view with an offset may be misaligned for 32-bit
  // words; a copy of it is mask-sized.
  const bool aligned = mask.is_contiguous() &&
      reinterpret_cast<uintptr_t>(mask.const_data_ptr()) % 4 == 0;
  const auto bits = aligned ? mask : mask.clone(at::MemoryFormat::Contiguous);
  const auto* words = reinterpret_cast<const uint32_t*>(bits.const_data_ptr<uint8_t>());
  if (grad_output.is_contiguous() && grad_input.is_contiguous()) {
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, grad_output.scalar_type(), "custom_relu_backward", [&] {
          kernels::reluBackward<CudaType<scalar_t>::type>(
              {cudaPtr<scalar_t>(grad_output), words, cudaPtr<scalar_t>(grad_input),
               grad_output.numel()},
              stream);
        });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return grad_input;
  }
  const auto s = reluStrides(grad_output.sizes(), grad_output.strides(), grad_input.strides());
  if (!s) {
    return applyReluMask(grad_output, mask, grad_input);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad_output.scalar_type(), "custom_relu_backward", [&] {
        kernels::reluBackwardStrided<CudaType<scalar_t>::type>(
            {cudaPtr<scalar_t>(grad_output), words, cudaPtr<scalar_t>(grad_input),
             grad_output.numel()},
            *s, stream);
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_input;
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  registerRelu<reluCuda, reluForwardMaskCuda, reluBackwardCuda>(m);
}
