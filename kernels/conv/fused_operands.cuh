#pragma once

// The operands of the kernels that compute a convolution and its epilogue in
// one (direct_conv.cuh, implicit_gemm_sm90.cuh): raw float32 device pointers.

#include <cstdint>

namespace torchfuse::kernels {

// out = (t <= 0 ? 0 : t) + alpha * other[k] with t = conv(x, weight) +
// bias[k], relu(NaN) NaN, and the relu mask of t where the kernel writes one
// and mask is not null.  bias and other (k values) may be null.
struct ConvReluAddOperands {
  const float* x;
  const float* weight;
  const float* bias;
  const float* other;
  float alpha;
  float* out;
  uint32_t* mask;
};

} // namespace torchfuse::kernels
