#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace torchfuse::ops {

// The arguments of custom_add_layer_norm, as its kernels and helpers take
// them.  NB: references to the dispatcher's arguments, valid for the call.
struct AddLayerNormArgs {
  const at::Tensor& input;
  const at::Tensor& other;
  const c10::Scalar& alpha;
  bool promote;
  at::IntArrayRef normalized_shape;
  const std::optional<at::Tensor>& weight;
  const std::optional<at::Tensor>& bias;
  double eps;
  bool write_sum;
};

using AddLayerNormResult = std::tuple<at::Tensor, at::Tensor>;

template <auto F>
AddLayerNormResult addLayerNormKernel(
    const at::Tensor& input,
    const at::Tensor& other,
    const c10::Scalar& alpha,
    bool promote,
    at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    double eps,
    bool write_sum) {
  return F(AddLayerNormArgs{
      input, other, alpha, promote, normalized_shape, weight, bias, eps, write_sum});
}

// Registers one dispatch key's kernel for custom_add_layer_norm.
template <auto Op>
void registerAddLayerNorm(torch::Library& m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_add_layer_norm"),
      TORCH_FN(addLayerNormKernel<Op>));
}

// Checks the arguments with torchfuse's messages, only for inputs that the
// original chain rejects too (missing tensors, a normalized_shape that is
// empty or not the trailing sizes of the sum, a weight or bias of another
// shape).  Shapes the checks cannot read (symbolic sizes) are left to ATen.
void checkAddLayerNormInputs(const AddLayerNormArgs& a);

// True when the op's own CUDA kernel takes these inputs: input and other
// dense, contiguous, of one float32/float16/bfloat16 dtype, one device and
// equal sizes (no broadcasting); weight and bias absent or contiguous, of
// that dtype and device, normalized_shape-shaped; normalized_shape the
// trailing sizes; nothing empty.  Never throws.  Others run the composite.
bool addLayerNormHandles(const AddLayerNormArgs& a);

// The original chain as ATen ops: s = add(input, other, alpha) (promote) or
// input.clone().add_(other, alpha) (!promote: add_ into a fresh tensor,
// which keeps input's dtype), then layer_norm(s, normalized_shape, weight,
// bias, eps); returns (normalized, s), s replaced by an empty tensor of its
// dtype unless write_sum.  The numerical oracle (the CPU kernel), the Meta
// kernel, the Autograd kernel's recording path and every fallback.
AddLayerNormResult addLayerNormComposite(const AddLayerNormArgs& a);

// The op through the dispatcher.
AddLayerNormResult addLayerNorm(const AddLayerNormArgs& a);

// The sum's stand-in when write_sum is false: an empty tensor of s's dtype
// and device.
at::Tensor emptySum(const at::Tensor& like);

} // namespace torchfuse::ops
