#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/elementwise/gate_mul.cuh"
#include "ops/cuda/cuda_types.h"
#include "ops/gate_mul.h"

namespace torchfuse::ops {
namespace {

// NB: the output takes input's strides, as TensorIterator gives them for
// the inputs gateMulHandles takes.
at::Tensor gateMulCuda(
    const at::Tensor& input,
    const at::Tensor& gate,
    c10::string_view activation,
    bool gate_first) {
  if (!gateMulHandles(input, gate)) {
    return gateMulReference(input, gate, activation, gate_first);
  }
  const auto act = parseGateActivation(activation);
  c10::cuda::CUDAGuard guard(input.device());
  auto out = at::empty_like(input);
  const int64_t n = input.size(0), c = input.size(1);
  const bool channels_last = input.stride(1) == 1;
  const auto stream = at::cuda::getCurrentCUDAStream();
  bool launched = false;
  TORCHFUSE_DISPATCH_KERNEL_TYPES(input.scalar_type(), "custom_gate_mul", [&] {
    const kernels::GateMulArgs<CudaType<scalar_t>::type> args{
        cudaPtr<scalar_t>(input),
        cudaPtr<scalar_t>(gate),
        cudaPtr<scalar_t>(out),
        act,
        n,
        c,
        input.size(2) * input.size(3),
        gate.size(0) == 1 ? 0 : gate.stride(0),
        gate.stride(1)};
    launched = kernels::gateMul(args, channels_last, stream);
  });
  TORCH_INTERNAL_ASSERT(launched, "torchfuse::custom_gate_mul: no kernel for '", activation, "'");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  torchfuse::ops::registerGateMul<torchfuse::ops::gateMulCuda>(m);
}
