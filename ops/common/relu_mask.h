#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

namespace torchfuse::ops {

// NB: a ReLU mask holds one bit per element, in logical row-major order,
// packed little-endian into 32-bit words and stored as uint8.  That is the
// layout the CUDA kernels write with one warp ballot per word, so every
// device and the Meta kernels agree on it.  A set bit means the gradient
// passes: !(y <= 0), which, like PyTorch's threshold_backward, lets a NaN
// output pass its gradient.

int64_t reluMaskBytes(int64_t numel);
c10::SymInt reluMaskBytes(const c10::SymInt& numel);

// The mask of !(t <= 0) for each element of t, any shape and strides: for a
// relu output that is the keep mask, and for a bool tensor it is t itself.
// NB: on the CPU a direct pass over t's data; it allocates nothing but the
// mask.  Elsewhere ATen ops with one byte per element of temporaries.
at::Tensor packReluMask(const at::Tensor& t);

// The bool tensor of shape `sizes` that packReluMask packed.
// NB: SymInt sizes for the differentiable backwards, which trace with
// symbolic shapes (torch.compile, torch.export).
at::Tensor unpackReluMask(const at::Tensor& mask, c10::SymIntArrayRef sizes);
at::Tensor unpackReluMask(const at::Tensor& mask, at::IntArrayRef sizes);

// Writes into `out` (grad's shape, any strides) grad where the mask bit is
// set, 0 elsewhere (a NaN gradient included, as threshold_backward gives),
// and returns it.  NB: on the CPU a direct pass that allocates nothing.
at::Tensor applyReluMask(const at::Tensor& grad, const at::Tensor& mask, at::Tensor out);

// !(y <= 0) for a ReLU output y.
at::Tensor reluKeep(const at::Tensor& y);

} // namespace torchfuse::ops
