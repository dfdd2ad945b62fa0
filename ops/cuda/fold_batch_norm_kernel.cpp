#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/batch_norm/fold_into_conv.cuh"
#include "ops/cuda/cuda_types.h"
#include "ops/cuda/fold_batch_norm.h"

namespace torchfuse::ops {
namespace {

bool perChannel(const std::optional<at::Tensor>& t, const at::Tensor& weight) {
  return !t || !t->defined() ||
      (t->scalar_type() == weight.scalar_type() && t->device() == weight.device() &&
       t->dim() == 1 && t->size(0) == weight.size(0) && t->is_contiguous());
}

template <typename T>
const typename CudaType<T>::type* optionalPtr(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? cudaPtr<T>(*t) : nullptr;
}

} // namespace

std::optional<std::pair<at::Tensor, at::Tensor>> foldBatchNormCuda(
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps) {
  const auto dtype = weight.scalar_type();
  const bool kernel_type = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  if (!kernel_type || !weight.is_cuda() || weight.dim() < 1 || weight.size(0) == 0 ||
      !weight.is_non_overlapping_and_dense() ||
      weight.stride(0) != weight.numel() / weight.size(0) || !perChannel(bias, weight) ||
      !perChannel(bn_weight, weight) || !perChannel(bn_bias, weight) ||
      !perChannel(running_mean, weight) || !perChannel(running_var, weight)) {
    return std::nullopt;
  }
  c10::cuda::CUDAGuard guard(weight.device());
  auto w_out = at::empty_like(weight);
  auto shift = at::empty({weight.size(0)}, weight.options());
  const kernels::batch_norm::FoldArgs args{
      weight.size(0), weight.numel() / weight.size(0), static_cast<float>(eps)};
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(dtype, "custom_conv_batch_norm_act", [&] {
    kernels::batch_norm::foldIntoConv<CudaType<scalar_t>::type>(
        cudaPtr<scalar_t>(weight), optionalPtr<scalar_t>(bias), optionalPtr<scalar_t>(bn_weight),
        optionalPtr<scalar_t>(bn_bias), cudaPtr<scalar_t>(running_mean),
        cudaPtr<scalar_t>(running_var), cudaPtr<scalar_t>(w_out), cudaPtr<scalar_t>(shift), args,
        stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return std::make_pair(w_out, shift);
}

} // namespace torchfuse::ops
