#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "kernels/batch_norm/eval_affine.cuh"
#include "kernels/conv/add_act_epilogue.cuh"
#include "ops/common/conv_composites.h"
#include "ops/conv_add_act.h"
#include "ops/cuda/conv/operands.h"
#include "ops/cuda/conv_batch_norm_eval.h"
#include "ops/cuda/cuda_types.h"

namespace torchfuse::ops {
namespace {

bool kernelType(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A per-channel tensor the affine kernel reads: none, or 1-d contiguous of
// `like`'s dtype on out's device.
bool readable(const std::optional<at::Tensor>& t, const at::Tensor& like, const at::Tensor& out) {
  return !t || !t->defined() ||
      (t->scalar_type() == like.scalar_type() && t->device() == out.device() && t->is_contiguous());
}

template <typename T>
const typename CudaType<T>::type* optionalPtr(const std::optional<at::Tensor>& t) {
  return t && t->defined() ? cudaPtr<T>(*t) : nullptr;
}

bool epilogueApplies(const ConvBatchNormEvalArgs& a, const at::Tensor& out) {
  const auto sizes = out.sizes();
  const auto& p = a.running_mean;
  return kernelType(out.scalar_type()) && out.numel() > 0 &&
      (out.is_contiguous() || conv_cuda::isChannelsLast(out)) &&
      std::none_of(sizes.begin() + 1, sizes.end(), [](int64_t s) { return s == 1; }) &&
      kernelType(p.scalar_type()) && readable(p, p, out) && readable(a.running_var, p, out) &&
      readable(a.bn_weight, p, out) && readable(a.bn_bias, p, out) && readable(a.bias, p, out);
}

} // namespace

at::Tensor convBatchNormEvalCuda(const ConvBatchNormEvalArgs& a) {
  c10::cuda::CUDAGuard guard(a.input.device());
  auto out = convolve(a.input, a.weight, std::nullopt, a.stride, a.padding, a.dilation, a.groups);
  if (!epilogueApplies(a, out)) {
    addConvBias(out, a.bias, a.weight);
    auto z = at::batch_norm(
        out, a.bn_weight, a.bn_bias, a.running_mean, a.running_var, /*training=*/false, a.momentum,
        a.eps, a.cudnn_enabled);
    return applyActivation(z, a.activation, a.activation_args);
  }
  const auto e = convExtents(out.sizes(), a.input.dim() == a.weight.dim());
  const auto affine = at::empty({2, e.channels}, out.options().dtype(at::kFloat));
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(a.running_mean.scalar_type(), "custom_conv_batch_norm_act", [&] {
    const kernels::batch_norm::EvalAffineArgs<CudaType<scalar_t>::type> args{
        optionalPtr<scalar_t>(a.bias),
        optionalPtr<scalar_t>(a.bn_weight),
        optionalPtr<scalar_t>(a.bn_bias),
        cudaPtr<scalar_t>(a.running_mean),
        cudaPtr<scalar_t>(a.running_var),
        affine.data_ptr<float>(),
        affine.data_ptr<float>() + e.channels,
        e.channels,
        static_cast<float>(a.eps)};
    kernels::batch_norm::evalAffine(args, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(out.scalar_type(), "custom_conv_batch_norm_act", [&] {
    const kernels::ConvAddActEpilogueArgs<CudaType<scalar_t>::type> args{
        cudaPtr<scalar_t>(out),
        /*bias=*/nullptr,
        /*other=*/nullptr,
        /*alpha=*/1.0f,
        a.act,
        e.images,
        e.channels,
        e.positions,
        affine.data_ptr<float>(),
        affine.data_ptr<float>() + e.channels};
    kernels::convAddActEpilogue(args, /*channels_last=*/!out.is_contiguous(), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

} // namespace torchfuse::ops
