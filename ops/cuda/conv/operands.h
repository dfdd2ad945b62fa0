#pragma once

// What the CUDA strategies of custom_conv_relu_add share: the problem's
// arguments in one struct, the tensors the epilogues read, and the dtype
// dispatch of the kernels.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/core/Scalar.h>

#include <array>
#include <optional>
#include <tuple>

#include "ops/cuda/cuda_types.h"

namespace torchfuse::ops::conv_cuda {

// One call's convolution: its arguments and the conv output's sizes
// (checkConvReluAddInputs).  NB: references, valid for the call only.
struct ConvProblem {
  const at::Tensor& input;
  const at::Tensor& weight;
  at::IntArrayRef stride, padding, dilation;
  int64_t groups;
  at::IntArrayRef sizes;
};

bool isChannelsLast(const at::Tensor& t);

// Tensors the kernels take: CUDA, a kernel dtype throughout, grid-sized.
bool kernelInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias);

// What every epilogue kernel reads besides the conv output: the conv bias,
// contiguous, and `other` as C per-channel values where it is per-channel
// or scalar-like over the conv output and has its dtype; either undefined
// where there is none to fuse.
struct EpilogueOperands {
  at::Tensor bias, other;

  EpilogueOperands(
      const std::optional<at::Tensor>& conv_bias,
      const at::Tensor& other_in,
      at::IntArrayRef sizes,
      int64_t channel_dim,
      at::ScalarType dtype);

  template <typename T>
  auto* biasPtr() const {
    return bias.defined() ? cudaPtr<T>(bias) : nullptr;
  }
  template <typename T>
  auto* otherPtr() const {
    return other.defined() ? cudaPtr<T>(other) : nullptr;
  }

  // out, plus `other` where the kernel did not fuse it: a full or otherwise
  // broadcast `other`, or one of another dtype, takes eager's add, with its
  // broadcasting and type promotion.
  at::Tensor addUnfused(at::Tensor out, const at::Tensor& other_in, const at::Scalar& alpha) const {
    return other.defined() ? out : at::add(out, other_in, alpha);
  }
};

// The partial sums a masking pass writes: `parts` rows of C doubles, for the
// bias gradient (sum_g) and grad_channels (sum_dy), where asked for.
struct GradSums {
  at::Tensor g, dy;

  GradSums(
      int64_t parts,
      int64_t channels,
      const at::Tensor& like,
      std::array<bool, 4> output_mask);

  static double* ptr(const at::Tensor& t) {
    return t.defined() ? t.data_ptr<double>() : nullptr;
  }
  double* gPtr() const {
    return ptr(g);
  }
  double* dyPtr() const {
    return ptr(dy);
  }

  // The first `parts` rows reduced: (grad_bias, grad_channels).
  std::tuple<at::Tensor, at::Tensor> reduce(int64_t parts, at::ScalarType dtype) const;
};

} // namespace torchfuse::ops::conv_cuda
