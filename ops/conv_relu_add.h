#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Scalar.h>
#include <c10/core/SymInt.h>
#include <torch/library.h>

#include <array>
#include <cstddef>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torchfuse::ops {

// The arguments of custom_conv_relu_add and of its _forward form, as their
// kernels and helpers take them.
// NB: references to the dispatcher's arguments, so a value lives no longer
// than the call that packed it.
struct ConvReluAddArgs {
  const at::Tensor& input;
  const at::Tensor& weight;
  const std::optional<at::Tensor>& bias;
  at::IntArrayRef stride;
  at::IntArrayRef padding;
  at::IntArrayRef dilation;
  int64_t groups;
  const at::Tensor& other;
  const at::Scalar& alpha;
};

// The arguments of custom_conv_relu_add_backward: mask is what
// custom_conv_relu_add_forward returned for input and weight.
struct ConvReluAddBackwardArgs {
  const at::Tensor& grad_output;
  const at::Tensor& mask;
  const at::Tensor& input;
  const at::Tensor& weight;
  at::IntArrayRef stride;
  at::IntArrayRef padding;
  at::IntArrayRef dilation;
  int64_t groups;
  std::array<bool, 4> output_mask;
};

// custom_conv_relu_add_backward's result: (grad_input, grad_weight,
// grad_bias, grad_channels), undefined where output_mask is false.
// grad_channels is grad_output, summed to the conv output's shape, summed
// over all but the channel dimension: C values in grad_output's dtype, the
// gradient of a per-channel or scalar-like `other` before alpha (which
// reduces it in the same pass that masks it).  The gradient of any other
// `other` is grad_output itself, reduced by the caller.
using ConvReluAddGrads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The kernels registered for the ops, one template a schema: they unpack the
// dispatcher's arguments into the structs above and call F (the op and its
// _forward form share the first).
template <auto F>
auto convReluAddKernel(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  return F(ConvReluAddArgs{input, weight, bias, stride, padding, dilation, groups, other, alpha});
}

// input and weight in layouts that give `mask_order` (custom_conv_relu_add_backward's
// argument: the order the forward wrote the mask in), or std::nullopt where
// theirs already do (or it is None).  NB: Inductor's layout optimization may
// restride the saved input and weight between the forward and the backward,
// so their layouts no longer name the mask's order.  Raises, naming
// mask_order, for a value that is no order (0 positions-inner, 1
// channels-inner) or one these tensors cannot give (channels-inner for an
// unbatched or 1-d convolution).
std::optional<std::pair<at::Tensor, at::Tensor>> layoutsForMaskOrder(
    const at::Tensor& input,
    const at::Tensor& weight,
    std::optional<int64_t> mask_order);

template <auto F>
ConvReluAddGrads convReluAddBackwardKernel(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 4> output_mask,
    std::optional<int64_t> mask_order) {
  const auto layouts = layoutsForMaskOrder(input, weight, mask_order);
  return F(ConvReluAddBackwardArgs{
      grad_output, mask, layouts ? layouts->first : input, layouts ? layouts->second : weight,
      stride, padding, dilation, groups, output_mask});
}

// Registers one dispatch key's kernels: Op for custom_conv_relu_add, and
// Forward and Backward for _forward and _backward where not nullptr.
template <auto Op, auto Forward = nullptr, auto Backward = nullptr>
void registerConvReluAdd(torch::Library& m) {
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"), TORCH_FN(convReluAddKernel<Op>));
  if constexpr (!std::is_same_v<decltype(Forward), std::nullptr_t>) {
    m.impl(
        TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_forward"),
        TORCH_FN(convReluAddKernel<Forward>));
  }
  if constexpr (!std::is_same_v<decltype(Backward), std::nullptr_t>) {
    m.impl(
        TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_backward"),
        TORCH_FN(convReluAddBackwardKernel<Backward>));
  }
}

// The memory format of a batched convolution's output in eager PyTorch:
// channels-last when the input or the weight is.
at::MemoryFormat convOutputMemoryFormat(const at::Tensor& input, const at::Tensor& weight);

// Checks the arguments and returns the convolution's output shape.  Raises,
// with the op and argument named, only for arguments the original chain
// also rejects; the output's size is overflow-checked (at most 2^63 - 1
// bytes), for the CPU, CUDA and Meta kernels alike.
std::vector<int64_t> checkConvReluAddInputs(const ConvReluAddArgs& a);

// The checks the conv ops share (custom_conv_relu_add, custom_conv_add_act),
// with `op` named in their messages: the convolution's arguments and its
// bias (returns the conv output's shape, overflow-checked), and `other`
// (defined; on the input's device, or a 0-dim CPU tensor, as add takes).
std::vector<int64_t> checkConvAndBias(
    const char* op,
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups);
void checkConvOther(const char* op, const at::Tensor& other, const at::Tensor& input);

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
// NB: SymInt sizes, so that the differentiable backward traces with
// symbolic shapes (torch.compile, torch.export) without specialising them.
at::Tensor unpackConvMask(
    const at::Tensor& mask,
    c10::SymIntArrayRef conv_sizes,
    bool batched,
    ConvMaskOrder order);

// Element i of a conv's stride, padding or dilation list: conv{1,2,3}d
// accept a single value for every spatial dimension.
inline int64_t at1(at::IntArrayRef v, int64_t i) {
  return v.size() == 1 ? v[0] : v[i];
}

// The conv output's shape, symbolic where input or weight has symbolic
// sizes; no checks (checkConvReluAddInputs makes them for concrete sizes).
std::vector<c10::SymInt> convOutputSymSizes(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation);

// An empty conv output: convOutputSymSizes in the memory format eager's
// convolution gives (the Meta kernels' result before their epilogue).
at::Tensor emptyConvOutput(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation);

// t itself on Meta, else an empty Meta tensor of its sizes, strides and
// dtype: for ATen's shape and stride rules without their computation.
at::Tensor onMeta(const at::Tensor& t);

// The empty result eager's relu(conv) + alpha * other allocates, on Meta,
// for a conv output `conv` in eager's strides (emptyConvOutput): by
// TensorIterator itself.  NB: not at::relu and at::add on Meta tensors,
// whose kernels keep an ambiguous input's strides where TensorIterator on
// CPU and CUDA picks canonical ones.  Concrete sizes only.
at::Tensor emptyEagerResult(const at::Tensor& conv, const at::Tensor& other);

// `out` (the op's result for `a`, computed in any layout) in the strides
// eager's relu(conv) + alpha * other gives.  They differ only where the
// result has a size-1 dimension, so that its layout is ambiguous: eager's
// out-of-place relu then picks its own strides (outOfPlaceStrides) and the
// add follows them, where a kernel writing its epilogue into the conv
// output keeps the conv's.  Computed (emptyEagerResult) only then.
// A result whose elements lie where eager's do is restrided (no view: it is
// as fresh as `out`), any other one copied.
at::Tensor withEagerStrides(at::Tensor out, const ConvReluAddArgs& a);

// Checks the backward's arguments, the mask's size in the order
// convMaskOrder(input, weight) included, and returns the conv output's shape.
std::vector<int64_t> checkConvReluAddBackwardInputs(const ConvReluAddBackwardArgs& a);

// The mask checks that need no sizes (the Meta kernel's, for symbolic sizes).
void checkConvReluAddBackwardMaskType(const at::Tensor& mask);

// Whether the op's own kernels take these arguments: dense strided tensors on
// CPU, CUDA or Meta (isPlainDenseTensor), `other` on the input's device.
// Never throws.  Where false, every entry point runs convReluAddReference.
bool convReluAddHandles(const ConvReluAddArgs& a);
// The same rule for the conv ops' tensors (other may be undefined).
bool convKernelsHandle(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other);

// The original chain as ATen ops, relu(conv{1,2,3}d(...)) + alpha * other:
// ATen's own errors, results and autograd (double backward included).
at::Tensor convReluAddReference(const ConvReluAddArgs& a);

// The ops through the dispatcher: custom_conv_relu_add, its _forward form
// (which also returns the ReLU mask) and _backward.
at::Tensor convReluAdd(const ConvReluAddArgs& a);
std::tuple<at::Tensor, at::Tensor> convReluAddForward(const ConvReluAddArgs& a);
// mask_order: the order the forward wrote `a.mask` in (layoutsForMaskOrder).
ConvReluAddGrads convReluAddBackward(
    const ConvReluAddBackwardArgs& a,
    std::optional<int64_t> mask_order = std::nullopt);

} // namespace torchfuse::ops
