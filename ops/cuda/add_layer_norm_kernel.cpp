// custom_add_layer_norm on CUDA: kernels/norm/add_layer_norm.cu, one read
// of input and other and one write of the normalized rows (and of the sum
// when write_sum), where addLayerNormHandles and the kernel's row-length and
// alignment conditions hold: float32/float16/bfloat16, same-sized contiguous
// operands, weight and bias of their dtype.  Anything else (broadcast
// `other`, float64, mixed dtypes, strided or empty tensors, rows longer than
// kAddLayerNormMaxCols or not a multiple of the 16-byte vector) runs the
// composite, eager's add and layer_norm.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/norm/add_layer_norm.cuh"
#include "ops/add_layer_norm.h"
#include "ops/cuda/cuda_types.h"

namespace torchfuse::ops {
namespace {

template <typename T>
const T* optionalPtr(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? reinterpret_cast<const T*>(t->const_data_ptr()) : nullptr;
}

AddLayerNormResult addLayerNormCuda(const AddLayerNormArgs& a) {
  if (!addLayerNormHandles(a)) {
    return addLayerNormComposite(a);
  }
  checkAddLayerNormInputs(a);
  c10::cuda::CUDAGuard guard(a.input.device());
  int64_t cols = 1;
  for (const int64_t s : a.normalized_shape) {
    cols *= s;
  }
  // NB: same dtypes: add and add_ (promote or not) give input's dtype.
  auto out = at::empty_like(a.input, at::MemoryFormat::Contiguous);
  auto sum = a.write_sum ? at::empty_like(a.input, at::MemoryFormat::Contiguous) : emptySum(a.input);
  bool launched = false;
  TORCHFUSE_DISPATCH_KERNEL_TYPES(a.input.scalar_type(), "custom_add_layer_norm", [&] {
    using T = typename CudaType<scalar_t>::type;
    const kernels::AddLayerNormRows<T> rows{
        reinterpret_cast<const T*>(a.input.const_data_ptr()),
        reinterpret_cast<const T*>(a.other.const_data_ptr()),
        static_cast<float>(a.alpha.toDouble()),
        optionalPtr<T>(a.weight),
        optionalPtr<T>(a.bias),
        static_cast<float>(a.eps),
        cudaPtr<scalar_t>(out),
        a.write_sum ? cudaPtr<scalar_t>(sum) : nullptr,
        a.input.numel() / cols,
        cols};
    if (kernels::addLayerNormRowsSupported(rows)) {
      kernels::addLayerNormRows(rows, at::cuda::getCurrentCUDAStream());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      launched = true;
    }
  });
  if (!launched) {
    return addLayerNormComposite(a);
  }
  return {std::move(out), std::move(sum)};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  torchfuse::ops::registerAddLayerNorm<torchfuse::ops::addLayerNormCuda>(m);
}
