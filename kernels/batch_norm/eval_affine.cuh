#pragma once

// Eval BatchNorm after a convolution as a per-channel affine map of the conv
// output (without its bias): y = conv * scale[c] + shift[c], with
// scale[c] = gamma[c] / sqrt(var[c] + eps) and
// shift[c] = (bias[c] - mean[c]) * scale[c] + beta[c], in float.  The
// conv's epilogue applies it (kernels/conv/add_act_epilogue.cuh), so the
// call needs no folded weight: nothing weight-sized is allocated.
// bias, gamma and beta may be null (no bias: 0; affine=False: 1 and 0).

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels::batch_norm {

template <typename T>
struct EvalAffineArgs {
  const T* bias;
  const T* gamma;
  const T* beta;
  const T* mean;
  const T* var;
  float* scale; // channels values
  float* shift; // channels values
  int64_t channels;
  float eps;
};

template <typename T>
void evalAffine(const EvalAffineArgs<T>& a, cudaStream_t stream);

} // namespace torchfuse::kernels::batch_norm
