#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include "kernels/common/activation.h"

namespace torchfuse::ops {

// Registers one dispatch key's kernel of custom_gate_mul.
template <auto Op>
void registerGateMul(torch::Library& m) {
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_gate_mul"), TORCH_FN(Op));
}

// The gate's activation: "sigmoid" or "hardsigmoid"; raises, naming the
// argument, for anything else.
kernels::Activation parseGateActivation(c10::string_view activation);

// The original, act(gate) * input (gate_first) or input * act(gate), as
// ATen's ops: what every entry point runs for inputs the CUDA kernel does
// not take, and, with a graph recorded, what autograd differentiates.
at::Tensor gateMulReference(
    const at::Tensor& input,
    const at::Tensor& gate,
    c10::string_view activation,
    bool gate_first);

// True when the CUDA kernel takes these tensors: CUDA tensors of one dtype
// (float32, float16 or bfloat16) on one device; input 4-D with dense nchw
// or dense nhwc strides and no dimension of size 1 but the batch (where
// TensorIterator's output layout is input's); gate [N or 1, C, 1, 1] of
// input's N and C, its channels inner to its images.  Never throws.
bool gateMulHandles(const at::Tensor& input, const at::Tensor& gate);

} // namespace torchfuse::ops
