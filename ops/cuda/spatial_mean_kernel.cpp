#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/pool/spatial_mean.cuh"
#include "ops/cuda/cuda_types.h"
#include "ops/spatial_mean.h"

namespace torchfuse::ops {
namespace {

// NB: the output takes the strides ATen's adaptive_avg_pool2d gives a
// channels-last input, [C, 1, C, C].
at::Tensor spatialMeanCuda(const at::Tensor& input) {
  if (!spatialMeanHandles(input)) {
    return spatialMeanReference(input);
  }
  c10::cuda::CUDAGuard guard(input.device());
  const int64_t n = input.size(0), c = input.size(1), hw = input.size(2) * input.size(3);
  auto out = at::empty_strided({n, c, 1, 1}, {c, 1, c, c}, input.options());
  const kernels::SpatialMeanArgs args{
      n, c, hw,
      // NB: ATen's factor (mean_kernel_impl): outputs over elements, in float.
      static_cast<float>(n * c) / static_cast<float>(input.numel()),
      at::cuda::getCurrentDeviceProperties()->multiProcessorCount};
  const int64_t ws = kernels::spatialMeanWorkspace(args);
  at::Tensor workspace;
  if (ws > 0) {
    workspace = at::empty({ws}, input.options().dtype(at::kFloat));
  }
  const auto stream = at::cuda::getCurrentCUDAStream();
  TORCHFUSE_DISPATCH_KERNEL_TYPES(input.scalar_type(), "custom_spatial_mean", [&] {
    kernels::spatialMeanNhwc<CudaType<scalar_t>::type>(
        cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(out),
        workspace.defined() ? workspace.data_ptr<float>() : nullptr, args, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  torchfuse::ops::registerSpatialMean<torchfuse::ops::spatialMeanCuda>(m);
}
