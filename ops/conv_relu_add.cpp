// custom_conv_relu_add: relu(convolution(input, weight, bias, ...)) + alpha * other.
//   1-d, 2-d and 3-d convolutions (weight 3-, 4- or 5-D), batched or not,
//   integer padding only; other broadcasts with the conv output: a
//   per-channel (C, 1, 1), a scalar-like (1,), or a full tensor.

#include "ops/conv_relu_add.h"

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/accumulate.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "ops/common/conv_composites.h"
#include "ops/common/relu_mask.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_conv_relu_add(Tensor input, Tensor weight, Tensor? bias, "
      "int[] stride, int[] padding, int[] dilation, int groups, Tensor other, "
      "Scalar alpha=1) -> Tensor",
      {at::Tag::flexible_layout});
  m.def(
      "custom_conv_relu_add_forward(Tensor input, Tensor weight, Tensor? bias, "
      "int[] stride, int[] padding, int[] dilation, int groups, Tensor other, "
      "Scalar alpha=1) -> (Tensor, Tensor)");
  m.def(
      "custom_conv_relu_add_backward(Tensor grad_output, Tensor mask, "
      "Tensor input, Tensor weight, int[] stride, int[] padding, "
      "int[] dilation, int groups, bool[4] output_mask, int? mask_order=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

namespace torchfuse {

namespace {
// The op's and its _forward form's, whose result is R.
template <typename R>
using ConvSignature =
    R(const at::Tensor&,
      const at::Tensor&,
      const std::optional<at::Tensor>&,
      at::IntArrayRef,
      at::IntArrayRef,
      at::IntArrayRef,
      int64_t,
      const at::Tensor&,
      const at::Scalar&);
using ConvBackwardSignature = ops::ConvReluAddGrads(
    const at::Tensor&,
    const at::Tensor&,
    const at::Tensor&,
    const at::Tensor&,
    at::IntArrayRef,
    at::IntArrayRef,
    at::IntArrayRef,
    int64_t,
    std::array<bool, 4>,
    std::optional<int64_t>);
} // namespace

at::Tensor custom_conv_relu_add(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_conv_relu_add", "")
                       .typed<ConvSignature<at::Tensor>>();
  return op.call(input, weight, bias, stride, padding, dilation, groups, other, alpha);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_conv_relu_add";

void checkParam(
    const char* op, const char* name, at::IntArrayRef v, int64_t spatial, int64_t min) {
  TORCH_CHECK(
      v.size() == 1 || static_cast<int64_t>(v.size()) == spatial, op,
      ": expected ", name, " to have 1 or ", spatial, " elements, got ", v.size());
  for (const auto x : v) {
    TORCH_CHECK(x >= min, op, ": expected ", name, " values >= ", min, ", got ", v);
  }
}
} // namespace

ConvExtents convExtents(at::IntArrayRef conv_sizes, bool batched) {
  const int64_t images = batched ? conv_sizes[0] : 1;
  const int64_t channels = conv_sizes[batched ? 1 : 0];
  return {images, channels, c10::multiply_integers(conv_sizes.slice(batched ? 2 : 1))};
}

ConvMaskOrder convMaskOrder(const at::Tensor& input, const at::Tensor& weight) {
  const bool batched = input.dim() == weight.dim();
  return batched && convOutputMemoryFormat(input, weight) != at::MemoryFormat::Contiguous
      ? ConvMaskOrder::ChannelsInner
      : ConvMaskOrder::PositionsInner;
}

c10::SymInt convMaskBytes(
    const c10::SymInt& images,
    const c10::SymInt& channels,
    const c10::SymInt& positions,
    ConvMaskOrder order) {
  return order == ConvMaskOrder::PositionsInner
      ? reluMaskBytes(images * channels * positions)
      : images * positions * ((channels + 31) / 32) * 4;
}

int64_t convMaskBytes(const ConvExtents& e, ConvMaskOrder order) {
  return convMaskBytes(e.images, e.channels, e.positions, order).expect_int();
}

namespace {
int64_t paddedChannels(int64_t channels) {
  return (channels + 31) / 32 * 32;
}
} // namespace

// NB: ATen ops, so that one definition serves every device; the CUDA kernels
// (kernels/conv/conv_relu_add.cuh) write and read the same bits directly.
at::Tensor packConvMask(const at::Tensor& keep, bool batched, ConvMaskOrder order) {
  if (order == ConvMaskOrder::PositionsInner) {
    return packReluMask(keep);  // logical order
  }
  const auto e = convExtents(keep.sizes(), batched);
  const auto k = keep.reshape({e.images, e.channels, e.positions});
  auto padded = at::zeros(
      {e.images, e.positions, paddedChannels(e.channels)}, k.options().dtype(at::kBool));
  padded.narrow(2, 0, e.channels).copy_(k.transpose(1, 2));
  return packReluMask(padded);
}

at::Tensor unpackConvMask(
    const at::Tensor& mask,
    c10::SymIntArrayRef conv_sizes,
    bool batched,
    ConvMaskOrder order) {
  if (order == ConvMaskOrder::PositionsInner) {
    return unpackReluMask(mask, conv_sizes);
  }
  const auto images = batched ? conv_sizes[0] : c10::SymInt(1);
  const auto& channels = conv_sizes[batched ? 1 : 0];
  c10::SymInt positions = 1;
  for (const auto& s : conv_sizes.slice(batched ? 2 : 1)) {
    positions = positions * s;
  }
  const auto keep = unpackReluMask(mask, {images, positions, (channels + 31) / 32 * 32});
  return keep.narrow_symint(2, 0, channels).transpose(1, 2).reshape_symint(conv_sizes);
}

std::vector<c10::SymInt> convOutputSymSizes(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  const bool batched = input.dim() == weight.dim();
  std::vector<c10::SymInt> sizes;
  if (batched) {
    sizes.push_back(input.sym_size(0));
  }
  sizes.push_back(weight.sym_size(0));
  const int64_t first = batched ? 2 : 1;
  for (int64_t d = 0; d < weight.dim() - 2; ++d) {
    const auto extent = input.sym_size(first + d) + 2 * at1(padding, d) -
        at1(dilation, d) * (weight.sym_size(2 + d) - 1) - 1;
    sizes.push_back(extent / at1(stride, d) + 1);
  }
  return sizes;
}

at::MemoryFormat convOutputMemoryFormat(const at::Tensor& input, const at::Tensor& weight) {
  for (const auto format : {at::MemoryFormat::ChannelsLast, at::MemoryFormat::ChannelsLast3d}) {
    if (input.suggest_memory_format() == format || weight.suggest_memory_format() == format) {
      return format;
    }
  }
  return at::MemoryFormat::Contiguous;
}

namespace {
// The convolution's own arguments, which the forward's and the backward's
// arguments both hold.
struct Convolution {
  const at::Tensor& input;
  const at::Tensor& weight;
  at::IntArrayRef stride;
  at::IntArrayRef padding;
  at::IntArrayRef dilation;
  int64_t groups;
};

// The output's shape, each step overflow-checked: the one check, shared by
// the CPU, CUDA and Meta kernels (forward and backward), that no padding,
// dilation or input size wraps int64.
// NB: unchecked, a padding of 2**62 turned the padded size negative (a
// misleading "kernel larger than input"), and padding 2**31 - 1 on a 2x2
// input gave an output whose byte size wraps to 0: oneDNN then died of
// SIGFPE, as eager's conv2d does.
std::vector<int64_t> checkedConvOutputSizes(const char* op, const Convolution& c) {
  const auto& [input, weight, stride, padding, dilation, groups] = c;
  const bool batched = input.dim() == weight.dim();
  std::vector<int64_t> out;
  if (batched) {
    out.push_back(input.size(0));
  }
  out.push_back(weight.size(0));
  const int64_t first = batched ? 2 : 1;
  for (int64_t d = 0; d < weight.dim() - 2; ++d) {
    int64_t twice = 0, padded = 0, span = 0, dilated = 0;
    TORCH_CHECK(
        !c10::mul_overflows(at1(padding, d), int64_t{2}, &twice) &&
            !c10::add_overflows(input.size(first + d), twice, &padded),
        op, ": expected the padded input size (input.size(", first + d,
        ") + 2 * padding) to fit in int64, got input ", input.sizes(), " with padding ", padding);
    TORCH_CHECK(
        !c10::mul_overflows(at1(dilation, d), weight.size(2 + d) - 1, &span) &&
            !c10::add_overflows(span, int64_t{1}, &dilated),
        op, ": expected the dilated kernel size (dilation * (kernel size - 1) + 1) to fit in "
        "int64, got weight ", weight.sizes(), " with dilation ", dilation);
    TORCH_CHECK(
        padded >= dilated, op, ": expected the padded input (", input.sizes(), " with padding ",
        padding, ") to be at least the dilated kernel size (", weight.sizes(),
        " with dilation ", dilation, ")");
    out.push_back((padded - dilated) / at1(stride, d) + 1);
  }
  // The output's bytes, as at::empty would count them (0 for an empty one).
  bool wraps = false;
  uint64_t bytes = input.element_size();
  for (const int64_t s : out) {
    wraps = wraps || c10::mul_overflows(bytes, static_cast<uint64_t>(s), &bytes);
  }
  const bool empty = std::find(out.begin(), out.end(), 0) != out.end();
  TORCH_CHECK(
      empty || (!wraps && bytes <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())),
      op, ": expected the conv output to have at most 2^63 - 1 bytes, got sizes ",
      at::IntArrayRef(out), " of ", input.element_size(), "-byte elements (input ",
      input.sizes(), ", weight ", weight.sizes(), ", stride ", stride, ", padding ", padding,
      ", dilation ", dilation, ")");
  return out;
}

// The checks on the convolution's own arguments; returns its output's shape.
std::vector<int64_t> checkConvolution(const char* op, const Convolution& c) {
  const auto& [input, weight, stride, padding, dilation, groups] = c;
  checkDefined(op, "input", input);
  checkDefined(op, "weight", weight);
  TORCH_CHECK(
      weight.dim() >= 3 && weight.dim() <= 5, op,
      ": expected weight to be 3-D, 4-D or 5-D (a 1-d, 2-d or 3-d convolution), got ",
      weight.dim(), "-D");
  const int64_t spatial = weight.dim() - 2;
  TORCH_CHECK(
      input.dim() == weight.dim() || input.dim() == weight.dim() - 1, op,
      ": expected input to be ", weight.dim(), "-D (batched) or ",
      weight.dim() - 1, "-D (unbatched) for a ", weight.dim(),
      "-D weight, got ", input.dim(), "-D");
  checkFloating(op, "input", input);
  checkSameDtype(op, "weight", weight, input);
  checkSameDevice(op, "weight", weight, input);
  TORCH_CHECK(groups >= 1, op, ": expected groups >= 1, got ", groups);
  checkParam(op, "stride", stride, spatial, 1);
  checkParam(op, "padding", padding, spatial, 0);
  checkParam(op, "dilation", dilation, spatial, 1);
  const bool batched = input.dim() == weight.dim();
  const int64_t channels = input.size(batched ? 1 : 0);
  int64_t expected_channels = 0;
  TORCH_CHECK(
      !c10::mul_overflows(weight.size(1), groups, &expected_channels), op,
      ": expected weight.size(1) * groups to fit in int64, got ", weight.size(1), " * ", groups);
  TORCH_CHECK(
      channels == expected_channels, op, ": expected input to have ", expected_channels,
      " channels (weight.size(1) * groups), got ", channels);
  TORCH_CHECK(
      weight.size(0) % groups == 0, op,
      ": expected weight.size(0) to be divisible by groups (", groups,
      "), got ", weight.size(0));
  return checkedConvOutputSizes(op, c);
}

// other may also be a 0-dim CPU tensor, which add takes on any device.
void checkOtherDevice(const char* op, const at::Tensor& other, const at::Tensor& input) {
  if (!(other.dim() == 0 && other.is_cpu())) {
    checkSameDevice(op, "other", other, input);
  }
}
} // namespace

std::vector<int64_t> checkConvAndBias(
    const char* op,
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  const auto out = checkConvolution(op, {input, weight, stride, padding, dilation, groups});
  if (bias.has_value() && bias->defined()) {
    checkDim(op, "bias", *bias, 1);
    TORCH_CHECK(
        bias->size(0) == weight.size(0), op,
        ": expected bias to have weight.size(0) = ", weight.size(0), " elements, got ",
        bias->size(0));
    checkSameDtype(op, "bias", *bias, input);
    checkSameDevice(op, "bias", *bias, input);
  }
  return out;
}

void checkConvOther(const char* op, const at::Tensor& other, const at::Tensor& input) {
  checkDefined(op, "other", other);
  checkOtherDevice(op, other, input);
}

std::vector<int64_t> checkConvReluAddInputs(const ConvReluAddArgs& a) {
  const auto& [input, weight, bias, stride, padding, dilation, groups, other, alpha] = a;
  const auto out = checkConvAndBias(kOp, input, weight, bias, stride, padding, dilation, groups);
  checkConvOther(kOp, other, input);
  checkBroadcastable(kOp, other, out);
  return out;
}

namespace {
// t in memory format `format`: itself where it suggests that format, else a
// copy with that format's canonical strides (which an ambiguous layout, a
// size-1 dimension, needs: contiguous() would return it as it is).
at::Tensor suggesting(const at::Tensor& t, at::MemoryFormat format) {
  if (t.suggest_memory_format() == format) {
    return t;
  }
  return at::empty_symint(t.sym_sizes(), t.options().memory_format(format)).copy_(t);
}
} // namespace

std::optional<std::pair<at::Tensor, at::Tensor>> layoutsForMaskOrder(
    const at::Tensor& input,
    const at::Tensor& weight,
    std::optional<int64_t> mask_order) {
  constexpr const char* kBackward = "torchfuse::custom_conv_relu_add_backward";
  if (!mask_order.has_value()) {
    return std::nullopt;
  }
  TORCH_CHECK(
      *mask_order == static_cast<int64_t>(ConvMaskOrder::PositionsInner) ||
          *mask_order == static_cast<int64_t>(ConvMaskOrder::ChannelsInner),
      kBackward,
      ": expected mask_order to be None, 0 (positions-inner) or 1 (channels-inner), got ",
      *mask_order);
  checkDefined(kBackward, "input", input);
  checkDefined(kBackward, "weight", weight);
  const auto order = static_cast<ConvMaskOrder>(*mask_order);
  if (order == convMaskOrder(input, weight)) {
    return std::nullopt;
  }
  if (order == ConvMaskOrder::PositionsInner) {
    return std::make_pair(
        suggesting(input, at::MemoryFormat::Contiguous),
        suggesting(weight, at::MemoryFormat::Contiguous));
  }
  const bool batched = input.dim() == weight.dim();
  TORCH_CHECK(
      batched && (input.dim() == 4 || input.dim() == 5), kBackward,
      ": expected mask_order 1 (channels-inner) only for a batched 2-d or 3-d convolution, got a ",
      batched ? "batched" : "unbatched", " ", input.dim(), "-D input");
  const auto format =
      input.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
  return std::make_pair(suggesting(input, format), weight);
}

std::vector<int64_t> checkConvReluAddBackwardInputs(const ConvReluAddBackwardArgs& a) {
  const auto& [grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask] =
      a;
  constexpr const char* kBackward = "torchfuse::custom_conv_relu_add_backward";
  const auto out = checkConvolution(kBackward, {input, weight, stride, padding, dilation, groups});
  checkDefined(kBackward, "grad_output", grad_output);
  checkDefined(kBackward, "mask", mask);
  checkSameDevice(kBackward, "grad_output", grad_output, input);
  checkSameDevice(kBackward, "mask", mask, input);
  const bool batched = input.dim() == weight.dim();
  const int64_t bytes = convMaskBytes(convExtents(out, batched), convMaskOrder(input, weight));
  TORCH_CHECK(
      mask.scalar_type() == at::kByte && mask.dim() == 1 && mask.numel() == bytes, kBackward,
      ": expected mask to be the 1-D uint8 tensor of ", bytes,
      " bytes that custom_conv_relu_add_forward returns for a conv output of shape ",
      at::IntArrayRef(out), ", got ", mask.scalar_type(), " of shape ", mask.sizes());
  return out;
}

void checkConvReluAddBackwardMaskType(const at::Tensor& mask) {
  checkDefined("torchfuse::custom_conv_relu_add_backward", "mask", mask);
  TORCH_CHECK(
      mask.scalar_type() == at::kByte && mask.dim() == 1,
      "torchfuse::custom_conv_relu_add_backward: expected mask to be the 1-D uint8 tensor that "
      "custom_conv_relu_add_forward returns, got ", mask.scalar_type(), " of shape ",
      mask.sym_sizes());
}

bool convKernelsHandle(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other) {
  if (!isPlainDenseTensor(input) || !isPlainDenseTensor(weight) ||
      !isPlainDenseTensor(orUndefined(bias)) || !isPlainDenseTensor(other)) {
    return false;
  }
  // NB: add takes a 0-dim CPU `other` on any device; the CUDA kernels read
  // other on the input's device.
  return !(
      other.defined() && input.defined() && other.dim() == 0 && other.is_cpu() && !input.is_cpu());
}

bool convReluAddHandles(const ConvReluAddArgs& a) {
  return convKernelsHandle(a.input, a.weight, a.bias, a.other);
}

at::Tensor onMeta(const at::Tensor& t) {
  return t.is_meta() ? t : at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
}

at::Tensor emptyEagerResult(const at::Tensor& conv, const at::Tensor& other) {
  at::Tensor relu, sum;
  const auto r = at::TensorIterator::unary_op(relu, onMeta(conv));
  const auto s = at::TensorIterator::binary_op(sum, r.output(), onMeta(other));
  return s.output();
}

at::Tensor withEagerStrides(at::Tensor out, const ConvReluAddArgs& a) {
  const auto sizes = out.sizes();
  if (std::none_of(sizes.begin(), sizes.end(), [](int64_t s) { return s == 1; })) {
    return out;
  }
  const auto want = emptyEagerResult(
      emptyConvOutput(onMeta(a.input), onMeta(a.weight), a.stride, a.padding, a.dilation), a.other);
  if (out.strides() == want.strides()) {
    return out;
  }
  bool same_places = want.sizes() == sizes;
  for (size_t d = 0; same_places && d < sizes.size(); ++d) {
    same_places = sizes[d] == 1 || out.stride(d) == want.stride(d);
  }
  if (same_places) {
    // NB: set_, not as_strided: the result is no view, as eager's is not.
    auto fresh = at::empty({0}, out.options());
    fresh.set_(out.storage(), out.storage_offset(), sizes, want.strides());
    return fresh;
  }
  return at::empty_strided(sizes, want.strides(), out.options()).copy_(out);
}

at::Tensor convReluAddReference(const ConvReluAddArgs& a) {
  return at::add(at::relu(convolve(a)), a.other, a.alpha);
}

at::Tensor convReluAdd(const ConvReluAddArgs& a) {
  return custom_conv_relu_add(
      a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups, a.other, a.alpha);
}

std::tuple<at::Tensor, at::Tensor> convReluAddForward(const ConvReluAddArgs& a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_conv_relu_add_forward", "")
                       .typed<ConvSignature<std::tuple<at::Tensor, at::Tensor>>>();
  return op.call(
      a.input, a.weight, a.bias, a.stride, a.padding, a.dilation, a.groups, a.other, a.alpha);
}

ConvReluAddGrads convReluAddBackward(
    const ConvReluAddBackwardArgs& a,
    std::optional<int64_t> mask_order) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_conv_relu_add_backward", "")
                       .typed<ConvBackwardSignature>();
  return op.call(
      a.grad_output, a.mask, a.input, a.weight, a.stride, a.padding, a.dilation, a.groups,
      a.output_mask, mask_order);
}

} // namespace ops
} // namespace torchfuse

// Backends without a torchfuse kernel (QuantizedCPU, SparseCPU, ...) run the
// original chain.
TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  using namespace torchfuse::ops;
  registerConvReluAdd<convReluAddReference>(m);
}
