#pragma once

// The math path of scaled_dot_product_attention without a mask, in float32,
// as one kernel: out = safe_softmax((q * qs) @ (k * ks)^T) @ v, with ATen's
// order of roundings (q and k scaled before the product, softmax as
// exp(x - max) / sum, a row whose scores are all -inf giving zeros), so that
// NaN and Inf come out where the math path's do.  A block takes 32 query
// rows of one (b0, b1) matrix pair and keeps their scores, and all of K, then
// V, in shared memory: short sequences (BERT's 128 tokens), where the math
// path's eight kernels and four copies cost several times the arithmetic.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace torchfuse::kernels {

// A [b0][b1][rows][cols] operand by its element strides.
struct AttentionOperand {
  const float* data = nullptr;
  int64_t stride_b0 = 0;
  int64_t stride_b1 = 0;
  int64_t stride_row = 0;
  int64_t stride_col = 0;
};

struct MathAttentionArgs {
  AttentionOperand query; // [b0][b1][l][e]
  AttentionOperand key;   // [b0][b1][s][e]
  AttentionOperand value; // [b0][b1][s][ev]
  float* out;             // [b0][b1][l][ev], contiguous
  int64_t b0, b1, l, s, e, ev;
  float query_scale; // ATen's sqrt(scale), negated for a negative scale
  float key_scale;   // ATen's sqrt(|scale|)
};

// The dynamic shared memory a launch for these extents takes, in bytes.
size_t mathAttentionSharedBytes(int64_t s, int64_t e, int64_t ev);

// The grid's limits: b1 and b0 are grid dimensions y and z.
constexpr int64_t kMathAttentionMaxGridYZ = 65535;

void mathAttentionF32(const MathAttentionArgs& a, cudaStream_t stream);

} // namespace torchfuse::kernels
