#include "ops/cuda/conv/plan.h"

#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstdint>

#include "ops/conv_relu_add.h"
#include "ops/cuda/conv/tf32_probe.h"
#include "torchfuse/backends.h"

namespace torchfuse::ops::conv_cuda {
namespace {

using backends::ChannelsLastRoute;
using backends::NchwConversion;

// The options one call plans with, each read once.
struct Settings {
  ChannelsLastRoute route;
  bool implicit_gemm, direct;
  NchwConversion conversion;
  int lookahead;
};

Settings readSettings() {
  const auto& options = backends::conv();
  return {
      options.channelsLastRoute(), options.allowImplicitGemm(), options.allowDirect(),
      options.nchwConversion(), options.conversionLookahead()};
}

// NB: below this many output elements the channels-last route's two extra
// launches cost more than its passes save (the convolution is launch-bound
// there).
constexpr int64_t kRouteMinElements = int64_t(1) << 24;

// The channels-last route for an NCHW 2-D convolution whose mask would be
// positions-inner (its output is NCHW in eager, as the route writes it).
// kAuto: where the route wins and rounds as eager does, i.e. float32, at
// least kRouteMinElements outputs, and eager's own convolution of this
// problem TF32 (for many shapes cuDNN's NCHW choice is exact float32 while
// its channels-last engines are TF32); kAlways: wherever its kernels apply.
bool takesChannelsLastRoute(const ConvProblem& p, const Settings& s) {
  const int64_t elements = c10::multiply_integers(p.sizes);
  if (s.route == ChannelsLastRoute::kNever || p.input.dim() != 4 || p.weight.dim() != 4 ||
      !p.input.is_contiguous() || !p.weight.is_contiguous() ||
      convMaskOrder(p.input, p.weight) != ConvMaskOrder::PositionsInner || elements == 0) {
    return false;
  }
  if (s.route == ChannelsLastRoute::kAlways) {
    return true;
  }
  // NB: the probe synchronizes, which a capturing stream does not allow.
  return p.input.scalar_type() == at::kFloat && elements >= kRouteMinElements &&
      at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None &&
      eagerConvIsTf32(p);
}

// The route's backward (float32, the gradient of the input or the weight
// asked for): where the route would take the forward, and under kAuto only
// where eager's own gradient convolutions asked for are TF32 as well, so
// that both round alike.
bool takesChannelsLastBackward(
    const ConvProblem& p,
    const Settings& s,
    std::array<bool, 4> output_mask) {
  if (p.input.scalar_type() != at::kFloat || !(output_mask[0] || output_mask[1]) ||
      !takesChannelsLastRoute(p, s)) {
    return false;
  }
  const auto tf32 = [&](bool asked, ConvPass pass) { return !asked || eagerConvIsTf32(p, pass); };
  return s.route == ChannelsLastRoute::kAlways ||
      (tf32(output_mask[0], ConvPass::kDataGradient) &&
       tf32(output_mask[1], ConvPass::kWeightGradient));
}

// Whether the implicit-GEMM kernel may run a route's convolution: float32
// under cuDNN's TF32 flag (the kernel is TF32 only), one group, stride and
// dilation 1, and allowed by the options.
bool implicitGemmApplies(const ConvProblem& p, const Settings& s) {
  const auto ones = [](at::IntArrayRef v) {
    return std::all_of(v.begin(), v.end(), [](int64_t e) { return e == 1; });
  };
  return p.input.scalar_type() == at::kFloat && p.groups == 1 && p.padding.size() == 2 &&
      ones(p.stride) && ones(p.dilation) &&
      at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) && s.implicit_gemm;
}

std::optional<kernels::ImplicitGemmConv> takenProblem(
    const kernels::ImplicitGemmConv& g,
    bool with_mask) {
  return kernels::implicitGemmConvTakes(g, with_mask) ? std::optional(g) : std::nullopt;
}

// The route's problem as the implicit-GEMM kernel sees it, where that kernel
// takes it (with the relu mask, for training, when with_mask).
std::optional<kernels::ImplicitGemmConv> implicitGemmProblem(
    const ConvProblem& p,
    const Settings& s,
    bool with_mask) {
  if (!implicitGemmApplies(p, s)) {
    return std::nullopt;
  }
  const auto& x = p.input;
  const auto& w = p.weight;
  return takenProblem(
      {x.size(0), x.size(1), x.size(2), x.size(3), w.size(0), w.size(2), w.size(3), p.padding[0],
       p.padding[1], p.sizes[2], p.sizes[3]},
      with_mask);
}

// The route's input gradient as an implicit-GEMM problem, where the kernel
// takes it: for stride and dilation 1 it is the convolution of g (nhwc, K
// channels) with the weight flipped in space and transposed to
// [C][R][S][K], padding R - 1 - pad_h and S - 1 - pad_w, written nchw.
std::optional<kernels::ImplicitGemmConv> dataGradientProblem(
    const ConvProblem& p,
    const Settings& s) {
  if (!implicitGemmApplies(p, s)) {
    return std::nullopt;
  }
  const int64_t r = p.weight.size(2), s_ = p.weight.size(3);
  if (p.padding[0] > r - 1 || p.padding[1] > s_ - 1) {
    return std::nullopt;
  }
  return takenProblem(
      {p.sizes[0], p.sizes[1], p.sizes[2], p.sizes[3], p.input.size(1), r, s_, r - 1 - p.padding[0],
       s_ - 1 - p.padding[1], p.input.size(2), p.input.size(3)},
      /*with_mask=*/false);
}

// ForwardPlan::x_conversion: the kernel converts x itself where TMA can
// read it as NCHW (rows in whole 16-byte units) from a 16-byte-aligned
// start, unless the options ask for the separate pass.
int xConversion(const ConvProblem& p, const Settings& s, const kernels::ImplicitGemmConv& g) {
  const bool aligned = reinterpret_cast<uintptr_t>(p.input.data_ptr()) % 16 == 0;
  return !aligned || s.conversion == NchwConversion::kSeparate ||
          !kernels::implicitGemmConvConvertsNchw(g)
      ? -1
      : s.lookahead;
}

// The problem as the direct kernel sees it, where it takes it: a float32
// batched 2-D convolution of one group on NCHW-contiguous input and weight
// (eager's output is then NCHW, as the kernel writes it), up to
// kRouteMinElements output elements, where launches dominate (measured to
// 7.4M: x[512, 3, 32, 32] to 16 channels).  Larger ones keep cuDNN.
std::optional<kernels::DirectConv> directProblem(const ConvProblem& p, const Settings& s) {
  const auto& x = p.input;
  const auto& w = p.weight;
  if (x.scalar_type() != at::kFloat || x.dim() != 4 || w.dim() != 4 || p.groups != 1 ||
      p.stride.size() != 2 || p.padding.size() != 2 || p.dilation.size() != 2 ||
      !x.is_contiguous() || !w.is_contiguous() ||
      c10::multiply_integers(p.sizes) > kRouteMinElements || !s.direct) {
    return std::nullopt;
  }
  const kernels::DirectConv g{x.size(0),    x.size(1),     x.size(2),     x.size(3),   w.size(0),
                              w.size(2),    w.size(3),     p.stride[0],   p.stride[1], p.padding[0],
                              p.padding[1], p.dilation[0], p.dilation[1], p.sizes[2],  p.sizes[3]};
  if (!kernels::directConvTakes(g)) {
    return std::nullopt;
  }
  return g;
}

} // namespace

ForwardPlan planForward(
    const ConvProblem& p,
    const std::optional<at::Tensor>& bias,
    bool with_mask) {
  ForwardPlan plan;
  if (!kernelInputs(p.input, p.weight, bias)) {
    plan.strategy = ForwardStrategy::kComposite;
    return plan;
  }
  const auto s = readSettings();
  // NB: the order is the policy: the direct convolution for small
  // inference problems, then the channels-last route for large TF32 ones,
  // else eager's convolution with our epilogue.
  if (!with_mask) {
    if ((plan.direct = directProblem(p, s))) {
      plan.strategy = ForwardStrategy::kDirect;
      return plan;
    }
  }
  if (takesChannelsLastRoute(p, s)) {
    // Training: only the implicit-GEMM kernel, which writes the relu mask
    // in its epilogue; cuDNN's channels-last convolution would save nothing
    // there (the mask needs a pass of its own).
    if ((plan.implicit_gemm = implicitGemmProblem(p, s, with_mask))) {
      plan.strategy = ForwardStrategy::kImplicitGemm;
      plan.x_conversion = xConversion(p, s, *plan.implicit_gemm);
      return plan;
    }
    if (!with_mask) {
      plan.strategy = ForwardStrategy::kChannelsLastCudnn;
      return plan;
    }
  }
  plan.strategy = ForwardStrategy::kCudnnThenEpilogue;
  return plan;
}

BackwardPlan planBackward(
    const ConvProblem& p,
    const at::Tensor& dy,
    const at::Tensor& mask,
    std::array<bool, 4> output_mask) {
  BackwardPlan plan;
  if (!kernelInputs(p.input, p.weight, std::nullopt) || dy.scalar_type() != p.input.scalar_type() ||
      !mask.is_contiguous() || reinterpret_cast<uintptr_t>(mask.data_ptr()) % 4 != 0 ||
      dy.numel() == 0) {
    plan.strategy = BackwardStrategy::kComposite;
    return plan;
  }
  // NB: the probe's convolutions run on the input's device.
  c10::cuda::CUDAGuard guard(p.input.device());
  const auto s = readSettings();
  if (takesChannelsLastBackward(p, s, output_mask)) {
    plan.strategy = BackwardStrategy::kChannelsLast;
    if (output_mask[0]) {
      plan.data_gradient = dataGradientProblem(p, s);
    }
    return plan;
  }
  plan.strategy = BackwardStrategy::kMaskedGradThenCudnn;
  return plan;
}

} // namespace torchfuse::ops::conv_cuda
