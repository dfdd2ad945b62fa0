#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/SymInt.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace torchfuse::ops {

// The shape of the convolution's output (before broadcasting with other).
std::vector<int64_t> convOutputSizes(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation);

// The memory format of a batched convolution's output in eager PyTorch:
// channels-last when the input or the weight is.
at::MemoryFormat convOutputMemoryFormat(const at::Tensor& input, const at::Tensor& weight);

// Checks the arguments and returns the convolution's output shape.  Raises,
// with the op and argument named, only for arguments the original chain
// also rejects; the output's size is overflow-checked (at most 2^63 - 1
// bytes), for the CPU, CUDA and Meta kernels alike.
std::vector<int64_t> checkConvReluAddInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other);

// A conv output [N, C, spatial...] seen as images x channels x positions
// (the product of the spatial sizes); an unbatched output [C, spatial...]
// counts as one image.
struct ConvExtents {
  int64_t images, channels, positions;
};
ConvExtents convExtents(at::IntArrayRef conv_sizes, bool batched);

// NB: the one definition of the ReLU mask's bit order.  The mask that
// custom_conv_relu_add_forward returns and custom_conv_relu_add_backward
// reads holds one bit per conv output element, !(t <= 0) for the
// pre-activation t, packed little-endian into 32-bit words (stored as
// uint8), in one of two orders, each the memory order of the conv output
// eager gives, so that the CUDA passes stream over output and mask together:
//   PositionsInner: the conv output's logical (row-major) order [N][C][S],
//     which is NCHW memory order: bit i % 32 of word i / 32 for element
//     i = (n * C + c) * S + s, no padding (a word may span channels and
//     images): ceil(N * C * S / 32) * 4 bytes, ops/common/relu_mask.h's layout.
//   ChannelsInner: channels-last order [N][S][C] with each position's
//     channels padded to whole words: bit c % 32 of word
//     (n * S + s) * ceil(C / 32) + c / 32; N * S * ceil(C / 32) * 4 bytes.
// convMaskOrder says which: ChannelsInner exactly when the conv output is
// channels-last (convOutputMemoryFormat: a batched convolution whose input
// or weight is channels-last), else PositionsInner.  It is a function of
// input and weight alone, which the forward and the backward both have, so
// every device and path agrees on it, whatever memory format grad_output
// arrives in and whatever layout the convolution actually produced.
enum class ConvMaskOrder { PositionsInner, ChannelsInner };

ConvMaskOrder convMaskOrder(const at::Tensor& input, const at::Tensor& weight);

int64_t convMaskBytes(const ConvExtents& extents, ConvMaskOrder order);
c10::SymInt convMaskBytes(
    const c10::SymInt& images,
    const c10::SymInt& channels,
    const c10::SymInt& positions,
    ConvMaskOrder order);

// keep: a bool tensor shaped like the conv output.
at::Tensor packConvMask(const at::Tensor& keep, bool batched, ConvMaskOrder order);

// The bool tensor shaped `conv_sizes` that packConvMask packed.
at::Tensor unpackConvMask(
    const at::Tensor& mask, at::IntArrayRef conv_sizes, bool batched, ConvMaskOrder order);

// Checks the backward's arguments, the mask's size in the order
// convMaskOrder(input, weight) included, and returns the conv output's shape.
std::vector<int64_t> checkConvReluAddBackwardInputs(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);

// The mask checks that need no sizes (the Meta kernel's, for symbolic sizes).
void checkConvReluAddBackwardMaskType(const at::Tensor& mask);

// Whether the op's own kernels take these arguments: dense strided tensors on
// CPU, CUDA or Meta (isPlainDenseTensor), `other` on the input's device.
// Never throws.  Where false, every entry point runs convReluAddReference.
bool convReluAddHandles(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha);

// The original chain as ATen ops, relu(conv{1,2,3}d(...)) + alpha * other:
// ATen's own errors, results and autograd (double backward included).
at::Tensor convReluAddReference(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha);

// custom_conv_relu_add_backward's result: (grad_input, grad_weight,
// grad_bias, grad_channels), undefined where output_mask is false.
// grad_channels is grad_output, summed to the conv output's shape, summed
// over all but the channel dimension: C values in grad_output's dtype, the
// gradient of a per-channel or scalar-like `other` before alpha (which
// reduces it in the same pass that masks it).  The gradient of any other
// `other` is grad_output itself, reduced by the caller.
using ConvReluAddGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

std::tuple<at::Tensor, at::Tensor> convReluAddForward(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha);

ConvReluAddGrads convReluAddBackward(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 4> output_mask);

} // namespace torchfuse::ops
