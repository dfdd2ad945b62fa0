// custom_conv_relu_add on CUDA: eager's own convolution (the same backend,
// engine and precision as at::conv2d picks, so results match eager's), then
// our kernels for everything around it:
//   forward:  one in-place pass over the conv output adding the conv bias,
//             applying relu, adding a per-channel or scalar `other` and
//             writing the 1-bit mask, where eager spends three passes;
//   backward: one pass masking grad_output and summing the conv bias's
//             and `other`'s gradients, then eager's convolution_backward.
// NB: the inference forward of a large float32 NCHW convolution that eager
// itself runs in TF32 takes the channels-last route, which is faster: x
// converted to NHWC, cuDNN's channels-last convolution, and one pass back to
// NCHW with the epilogue fused in (kernels/conv/README.md, variant E); on
// sm_90, where the problem fits it, our implicit-GEMM kernel replaces the
// last two with one that writes NCHW with the epilogue fused (variant F),
// and converts x to NHWC itself on its idle warps (variant J).
// Elsewhere it would be less accurate than eager's: for many shapes cuDNN's
// NCHW choice is exact float32 while its channels-last engines are TF32.
// In training, only the implicit-GEMM kernel takes the route's forward, with
// the relu mask written by its epilogue; elsewhere training keeps eager's
// convolution (E's mask saved nothing).  Its relu decisions near zero are
// its own, as any TF32 engine's: its gradients are judged, as eager's are,
// against float64 (variant I).  The route's backward runs cuDNN's
// channels-last gradient convolutions (variant H), the input gradient by
// the implicit-GEMM kernel where it takes the problem (variant I).
// Small float32 convolutions with few channels (the inference forward)
// take our direct convolution instead, one kernel for the convolution and
// the epilogue (variant G): there cuDNN's launches and host overhead cost
// more than the arithmetic.
// Other dtypes run the reference composition; conv outputs that neither
// epilogue takes run its pointwise part on the convolution already computed.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "kernels/conv/conv_relu_add.cuh"
#include "kernels/conv/direct_conv.cuh"
#include "kernels/conv/implicit_gemm_sm90.cuh"
#include "ops/conv_relu_add.h"
#include "ops/cuda/cuda_types.h"

// The dtypes fastPath admits.
#define DISPATCH_KERNEL_TYPES(TYPE, NAME, ...)              \
  AT_DISPATCH_SWITCH(                                      \
      TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
      AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)              \
      AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace torchfuse::ops {
namespace {

bool kernelDtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

bool isChannelsLast(const at::Tensor& t) {
  return t.is_contiguous(at::MemoryFormat::ChannelsLast) ||
      t.is_contiguous(at::MemoryFormat::ChannelsLast3d);
}

// Tensors the kernels take: CUDA, a kernel dtype throughout, grid-sized.
bool kernelInputs(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias) {
  const auto dtype = input.scalar_type();
  const bool bias_ok = !bias || !bias->defined() ||
      (bias->scalar_type() == dtype && bias->is_cuda());
  constexpr int64_t kMaxGridZ = 65535;  // the grad prologue's grid
  return input.is_cuda() && weight.is_cuda() && kernelDtype(dtype) &&
      weight.scalar_type() == dtype && bias_ok &&
      (input.dim() < weight.dim() || input.size(0) <= kMaxGridZ);
}

// `other` as C per-channel values when it is per-channel or scalar-like over
// the conv output and has its dtype; else undefined.
at::Tensor perChannel(
    const at::Tensor& other, at::IntArrayRef sizes, int64_t channel_dim, at::ScalarType dtype) {
  if (other.scalar_type() != dtype || !other.is_cuda() || other.dim() > int64_t(sizes.size())) {
    return {};
  }
  const int64_t other_channel_dim = other.dim() - (int64_t(sizes.size()) - channel_dim);
  for (int64_t d = 0; d < other.dim(); ++d) {
    if (d != other_channel_dim && other.size(d) != 1) {
      return {};
    }
  }
  const int64_t channels = sizes[channel_dim];
  if (other.numel() == 1) {
    return other.reshape({1}).expand({channels}).contiguous();
  }
  return other_channel_dim >= 0 && other.size(other_channel_dim) == channels
      ? other.reshape({channels}).contiguous()
      : at::Tensor();
}

// What every epilogue kernel reads besides the conv output: the conv bias,
// contiguous, and `other` as C per-channel values where it is one
// (perChannel); either undefined where there is none to fuse.
struct EpilogueOperands {
  at::Tensor bias, other;

  EpilogueOperands(
      const std::optional<at::Tensor>& conv_bias,
      const at::Tensor& other_in,
      at::IntArrayRef sizes,
      int64_t channel_dim,
      at::ScalarType dtype)
      : bias(conv_bias && conv_bias->defined() ? conv_bias->contiguous() : at::Tensor()),
        other(perChannel(other_in, sizes, channel_dim, dtype)) {}

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

// ---- variant E: the channels-last route for NCHW inputs

// NB: below this many output elements the route's two extra launches cost
// more than its passes save (the convolution is launch-bound there).
constexpr int64_t kRouteMinElements = int64_t(1) << 24;

enum class RouteMode { kAuto, kNever, kAlways };  // envChoice's order

// The value of the environment variable `name` (read at every call) as an
// index into `choices`, 0 when unset; any other value is an error that
// names the variable and the choices.
size_t envChoice(const char* name, std::initializer_list<const char*> choices) {
  const char* env = std::getenv(name);
  if (env == nullptr) {
    return 0;
  }
  const auto match = std::find_if(choices.begin(), choices.end(), [&](const char* choice) {
    return std::strcmp(env, choice) == 0;
  });
  const auto listed = [&] {  // "a, b or c"
    std::string text;
    for (auto it = choices.begin(); it != choices.end(); ++it) {
      text += (it == choices.begin() ? "" : it + 1 == choices.end() ? " or " : ", ");
      text += *it;
    }
    return text;
  };
  TORCH_CHECK(
      match != choices.end(), "torchfuse::custom_conv_relu_add: expected the environment variable ",
      name, " to be ", listed(), ", got \"", env, "\"");
  return size_t(match - choices.begin());
}

// TORCHFUSE_CONV_CHANNELS_LAST: unset or "auto"; "never"; "always": the
// forward and the backward take the route wherever its kernels apply,
// whatever the size or precision (tests use it with inputs that are exact
// in TF32).
RouteMode routeMode() {
  return static_cast<RouteMode>(
      envChoice("TORCHFUSE_CONV_CHANNELS_LAST", {"auto", "never", "always"}));
}

enum class ConvPass { kForward, kDataGradient, kWeightGradient };

// Whether eager's convolution (or one of its gradient convolutions) of
// exactly this problem rounds its inputs to TF32.  NB: asked of eager
// itself, once per problem and pass: ATen caches one plan per problem
// (sizes, strides, dtype, device, flags), so the pass run on constants runs
// the engine eager runs.  One operand is 1 + d, the other 1; d = 3 * 2^-13
// needs 13 mantissa bits: TF32 (10) rounds it away under any rounding mode,
// float32 keeps it, so the result's sum grows by the factor 1 + d against
// 1 exactly when the engine computes in float32.
bool eagerConvIsTf32(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    ConvPass pass = ConvPass::kForward) {
  const auto& ctx = at::globalContext();
  std::vector<int64_t> key = {
      static_cast<int64_t>(pass), input.get_device(), static_cast<int64_t>(input.scalar_type()),
      groups, ctx.userEnabledCuDNN(), ctx.benchmarkCuDNN(), ctx.deterministicCuDNN(),
      ctx.deterministicAlgorithms(), ctx.allowTF32CuDNN(at::Float32Op::CONV)};
  for (const auto list : {input.sizes(), input.strides(), weight.sizes(), weight.strides(),
                          stride, padding, dilation}) {
    key.push_back(static_cast<int64_t>(list.size()));
    key.insert(key.end(), list.begin(), list.end());
  }
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(key); it != known.end()) {
    return it->second;
  }
  constexpr double kDelta = 3.0 / 8192;
  auto x = at::empty_strided(input.sizes(), input.strides(), input.options()).fill_(1);
  auto w = at::empty_strided(weight.sizes(), weight.strides(), weight.options()).fill_(1);
  at::Tensor g;
  if (pass != ConvPass::kForward) {  // in the layout eager's relu backward gives
    g = at::empty_like(convolve(x, w, std::nullopt, stride, padding, dilation, groups)).fill_(1);
  }
  // the pass with one operand filled with `value`, the other with 1
  const auto result = [&](double value) {
    const bool data = pass == ConvPass::kDataGradient;
    (data ? g : x).fill_(value);
    if (pass == ConvPass::kForward) {
      return convolve(x, w, std::nullopt, stride, padding, dilation, groups);
    }
    const auto grads =
        convolveBackward(g, x, w, stride, padding, dilation, groups, {data, !data, false});
    return data ? std::get<0>(grads) : std::get<1>(grads);
  };
  const auto sum = [&](double value) { return result(value).sum(at::kDouble).item<double>(); };
  const double grown = sum(1 + kDelta) / sum(1);
  const bool tf32 = grown < 1 + kDelta / 2;
  known.emplace(std::move(key), tf32);
  return tf32;
}

bool takesChannelsLastRoute(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    at::IntArrayRef sizes) {
  const auto mode = routeMode();
  const int64_t elements = c10::multiply_integers(sizes);
  // An NCHW 2-D convolution whose mask would be positions-inner: its output
  // is NCHW in eager, as the route writes it.
  if (mode == RouteMode::kNever || input.dim() != 4 || weight.dim() != 4 ||
      !input.is_contiguous() || !weight.is_contiguous() ||
      convMaskOrder(input, weight) != ConvMaskOrder::PositionsInner || elements == 0) {
    return false;
  }
  if (mode == RouteMode::kAlways) {
    return true;
  }
  // NB: the probe synchronizes, which a capturing stream does not allow.
  return input.scalar_type() == at::kFloat && elements >= kRouteMinElements &&
      at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None &&
      eagerConvIsTf32(input, weight, stride, padding, dilation, groups);
}

// The route's backward (float32, the gradient of the input or the weight
// asked for): where the route would take the forward, and by default only
// where eager's own gradient convolutions asked for are TF32 as well, so
// that both round alike.
bool takesChannelsLastBackward(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    at::IntArrayRef sizes,
    std::array<bool, 4> output_mask) {
  if (input.scalar_type() != at::kFloat || !(output_mask[0] || output_mask[1]) ||
      !takesChannelsLastRoute(input, weight, stride, padding, dilation, groups, sizes)) {
    return false;
  }
  const auto tf32 = [&](bool asked, ConvPass pass) {
    return !asked || eagerConvIsTf32(input, weight, stride, padding, dilation, groups, pass);
  };
  return routeMode() == RouteMode::kAlways ||
      (tf32(output_mask[0], ConvPass::kDataGradient) &&
       tf32(output_mask[1], ConvPass::kWeightGradient));
}

// TORCHFUSE_CONV_IMPLICIT_GEMM: unset or "auto": the route convolves, and
// takes the training forward and the input gradient, with our sm_90
// implicit-GEMM kernel wherever it takes the problem (variants F and I);
// "never": always with cuDNN's (E, and C's training forward).
bool implicitGemmAllowed() {
  return envChoice("TORCHFUSE_CONV_IMPLICIT_GEMM", {"auto", "never"}) == 0;
}

// Whether the implicit-GEMM kernel may run a route's convolution: float32
// under cuDNN's TF32 flag (the kernel is TF32 only), one group, stride and
// dilation 1.
bool implicitGemmApplies(
    const at::Tensor& input,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups) {
  const auto ones = [](at::IntArrayRef v) {
    return std::all_of(v.begin(), v.end(), [](int64_t e) { return e == 1; });
  };
  return input.scalar_type() == at::kFloat && groups == 1 && padding.size() == 2 && ones(stride) &&
      ones(dilation) && at::globalContext().allowTF32CuDNN(at::Float32Op::CONV) &&
      implicitGemmAllowed();
}

std::optional<kernels::ImplicitGemmConv> takenProblem(
    const kernels::ImplicitGemmConv& g, bool with_mask) {
  return kernels::implicitGemmConvTakes(g, with_mask) ? std::optional(g) : std::nullopt;
}

// The route's problem as the implicit-GEMM kernel sees it, where that kernel
// takes it (with the relu mask, for training, when with_mask).
std::optional<kernels::ImplicitGemmConv> implicitGemmProblem(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    at::IntArrayRef sizes,
    bool with_mask) {
  if (!implicitGemmApplies(input, stride, padding, dilation, groups)) {
    return std::nullopt;
  }
  return takenProblem(
      {input.size(0), input.size(1), input.size(2), input.size(3), weight.size(0), weight.size(2),
       weight.size(3), padding[0], padding[1], sizes[2], sizes[3]},
      with_mask);
}

// The route's input gradient as an implicit-GEMM problem, where the kernel
// takes it (variant I): for stride and dilation 1 it is the convolution of
// g (nhwc, K channels) with the weight flipped in space and transposed to
// [C][R][S][K], padding R - 1 - pad_h and S - 1 - pad_w, written nchw.
std::optional<kernels::ImplicitGemmConv> dataGradientProblem(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    at::IntArrayRef sizes) {
  if (!implicitGemmApplies(input, stride, padding, dilation, groups)) {
    return std::nullopt;
  }
  const int64_t r = weight.size(2), s = weight.size(3);
  if (padding[0] > r - 1 || padding[1] > s - 1) {
    return std::nullopt;
  }
  return takenProblem(
      {sizes[0], sizes[1], sizes[2], sizes[3], input.size(1), r, s, r - 1 - padding[0],
       s - 1 - padding[1], input.size(2), input.size(3)},
      /*with_mask=*/false);
}

// TORCHFUSE_CONV_CONVERSION: unset or "auto": the implicit-GEMM kernel
// converts x to nhwc itself where it can (variant J); "separate": a pass of
// its own converts x before the kernel (F); a number from 1 to 64: the
// kernel converts x at most that many images ahead of the convolution (for
// measuring).  Returns -1 for a separate pass, else the lookahead (0: the
// kernel's own).
int conversionFor(const kernels::ImplicitGemmConv& g) {
  constexpr const char* kName = "TORCHFUSE_CONV_CONVERSION";
  const char* env = std::getenv(kName);
  const std::string setting = env == nullptr ? "auto" : env;
  int lookahead = 0;
  if (setting != "auto" && setting != "separate") {
    const bool digits = !setting.empty() && setting.size() <= 2 &&
        std::all_of(setting.begin(), setting.end(), [](char c) { return c >= '0' && c <= '9'; });
    lookahead = digits ? std::stoi(setting) : 0;
    TORCH_CHECK(
        lookahead >= 1 && lookahead <= 64, "torchfuse::custom_conv_relu_add: expected the "
        "environment variable ", kName, " to be auto, separate or a number from 1 to 64, got \"",
        setting, "\"");
  }
  return setting == "separate" || !kernels::implicitGemmConvConvertsNchw(g) ? -1 : lookahead;
}

// Variant F: x to nhwc and the weight to [k][r][s][c], both rounded to TF32,
// then one kernel for the convolution and the epilogue (and the relu mask,
// where mask is not null); variant J: x converted inside that kernel.
at::Tensor forwardImplicitGemm(
    const at::Tensor& input,
    const at::Tensor& weight,
    const EpilogueOperands& operands,
    const at::Tensor& other,
    const at::Scalar& alpha,
    at::IntArrayRef sizes,
    const kernels::ImplicitGemmConv& g,
    uint32_t* mask) {
  c10::cuda::CUDAGuard guard(input.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  auto x = at::empty_like(input, at::MemoryFormat::ChannelsLast);
  auto w = at::empty({g.k, g.r, g.s, g.c}, weight.options());
  kernels::transposeBatchedTf32(
      cudaPtr<float>(weight), cudaPtr<float>(w), g.k, g.c, g.r * g.s, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto out = at::empty(sizes, input.options());
  // the kernel reads x in 16-byte loads
  const int lookahead =
      reinterpret_cast<uintptr_t>(input.data_ptr()) % 16 == 0 ? conversionFor(g) : -1;
  bool launched = false;
  if (lookahead >= 0) {
    auto workspace = at::empty(
        {kernels::implicitGemmConvWorkspaceWords(g)}, input.options().dtype(at::kInt));
    launched = kernels::implicitGemmConvReluAddFromNchw(
        cudaPtr<float>(input), cudaPtr<float>(x),
        reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>()), lookahead,
        cudaPtr<float>(w), operands.biasPtr<float>(), operands.otherPtr<float>(), alpha.toFloat(),
        cudaPtr<float>(out), mask, g, stream);
  } else {
    kernels::transposeBatchedTf32(
        cudaPtr<float>(input), cudaPtr<float>(x), g.n, g.c, g.h * g.w, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    launched = kernels::implicitGemmConvReluAdd(
        cudaPtr<float>(x), cudaPtr<float>(w), operands.biasPtr<float>(),
        operands.otherPtr<float>(), alpha.toFloat(), cudaPtr<float>(out), mask, g, stream);
  }
  TORCH_CHECK(
      launched,
      "torchfuse::custom_conv_relu_add: the CUDA driver refused the tensor maps of the "
      "implicit-GEMM convolution");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return operands.addUnfused(out, other, alpha);
}

at::Tensor forwardChannelsLast(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha,
    at::IntArrayRef sizes) {
  c10::cuda::CUDAGuard guard(input.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto dtype = input.scalar_type();
  const int64_t images = input.size(0), in_channels = input.size(1);
  const EpilogueOperands operands(bias, other, sizes, 1, dtype);
  if (const auto g = implicitGemmProblem(
          input, weight, stride, padding, dilation, groups, sizes, /*with_mask=*/false)) {
    return forwardImplicitGemm(input, weight, operands, other, alpha, sizes, *g, nullptr);
  }
  auto x = at::empty_like(input, at::MemoryFormat::ChannelsLast);
  DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add", [&] {
    kernels::transposeBatched(
        cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(x), images, in_channels,
        input.numel() / std::max<int64_t>(1, images * in_channels), stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto conv = convolve(
      x, weight.contiguous(at::MemoryFormat::ChannelsLast), std::nullopt, stride, padding,
      dilation, groups);
  x.reset();
  if (!conv.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    conv = conv.contiguous(at::MemoryFormat::ChannelsLast);  // not seen: the epilogue reads NHWC
  }
  const auto e = convExtents(sizes, /*batched=*/true);
  auto out = at::empty(sizes, input.options());
  DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add", [&] {
    kernels::convReluAddEpilogueNhwcToNchw(
        cudaPtr<scalar_t>(conv), operands.biasPtr<scalar_t>(), operands.otherPtr<scalar_t>(),
        alpha.toFloat(), cudaPtr<scalar_t>(out), e.images, e.channels, e.positions, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return operands.addUnfused(out, other, alpha);
}

// ---- variant G: the direct convolution for few channels

// TORCHFUSE_CONV_DIRECT: unset or "auto": the inference forward takes the
// direct convolution wherever it applies; "never": it does not.
bool directAllowed() {
  return envChoice("TORCHFUSE_CONV_DIRECT", {"auto", "never"}) == 0;
}

// The problem as the direct kernel sees it, where it takes it: a float32
// batched 2-D convolution of one group on NCHW-contiguous input and weight
// (eager's output is then NCHW, as the kernel writes it), up to
// kRouteMinElements output elements, where launches dominate (measured to
// 7.4M: x[512, 3, 32, 32] to 16 channels).  Larger ones keep cuDNN.
std::optional<kernels::DirectConv> directProblem(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    at::IntArrayRef sizes) {
  if (input.scalar_type() != at::kFloat || input.dim() != 4 || weight.dim() != 4 || groups != 1 ||
      stride.size() != 2 || padding.size() != 2 || dilation.size() != 2 ||
      !input.is_contiguous() || !weight.is_contiguous() ||
      c10::multiply_integers(sizes) > kRouteMinElements || !directAllowed()) {
    return std::nullopt;
  }
  const kernels::DirectConv g{
      input.size(0), input.size(1), input.size(2), input.size(3), weight.size(0), weight.size(2),
      weight.size(3), stride[0],    stride[1],    padding[0],    padding[1],    dilation[0],
      dilation[1],   sizes[2],      sizes[3]};
  if (!kernels::directConvTakes(g)) {
    return std::nullopt;
  }
  return g;
}

at::Tensor forwardDirect(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& other,
    const at::Scalar& alpha,
    at::IntArrayRef sizes,
    const kernels::DirectConv& g) {
  c10::cuda::CUDAGuard guard(input.device());
  const EpilogueOperands operands(bias, other, sizes, 1, at::kFloat);
  auto out = at::empty(sizes, input.options());
  kernels::directConvReluAdd(
      cudaPtr<float>(input), cudaPtr<float>(weight), operands.biasPtr<float>(),
      operands.otherPtr<float>(), alpha.toFloat(), cudaPtr<float>(out), g,
      at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return operands.addUnfused(out, other, alpha);
}

std::tuple<at::Tensor, at::Tensor> forwardCuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha,
    bool with_mask) {
  const auto sizes =
      checkConvReluAddInputs(input, weight, bias, stride, padding, dilation, groups, other);
  const bool usable = kernelInputs(input, weight, bias);
  if (usable && !with_mask) {
    if (const auto g =
            directProblem(input, weight, stride, padding, dilation, groups, sizes)) {
      return {forwardDirect(input, weight, bias, other, alpha, sizes, *g), at::Tensor()};
    }
  }
  if (usable && takesChannelsLastRoute(input, weight, stride, padding, dilation, groups, sizes)) {
    if (!with_mask) {
      return {
          forwardChannelsLast(
              input, weight, bias, stride, padding, dilation, groups, other, alpha, sizes),
          at::Tensor()};
    }
    // Training: F with the mask (variant I); where F does not take the
    // problem, C's eager convolution below (E's mask saved nothing).
    if (const auto g = implicitGemmProblem(
            input, weight, stride, padding, dilation, groups, sizes, /*with_mask=*/true)) {
      const auto e = convExtents(sizes, /*batched=*/true);
      // zeroed: the kernel ORs in the words two tiles share
      auto mask = at::zeros(
          {convMaskBytes(e, ConvMaskOrder::PositionsInner)}, input.options().dtype(at::kByte));
      const EpilogueOperands operands(bias, other, sizes, 1, at::kFloat);
      return {
          forwardImplicitGemm(
              input, weight, operands, other, alpha, sizes, *g,
              reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>())),
          mask};
    }
  }
  auto out = usable ? convolve(input, weight, std::nullopt, stride, padding, dilation, groups)
                    : at::Tensor();
  const bool batched = input.dim() == weight.dim();
  const auto order = convMaskOrder(input, weight);
  // An nchw conv output streams (with a positions-inner mask, if any); a
  // channels-last one, or an nchw one whose mask must be channels-inner, takes
  // the channels-inner passes.  The mask must be in the order convMaskOrder
  // defines, whatever layout the convolution produced: a channels-last output
  // where that order is positions-inner (rare: an unbatched conv with a
  // channels-last weight), or an output in neither layout, takes neither.
  const bool streaming = usable && out.is_contiguous() &&
      (!with_mask || order == ConvMaskOrder::PositionsInner);
  const bool staged = usable && !streaming && (out.is_contiguous() || isChannelsLast(out)) &&
      (!with_mask || order == ConvMaskOrder::ChannelsInner);
  if (!usable) {
    return with_mask ? convReluAddForwardComposite(
                           input, weight, bias, stride, padding, dilation, groups, other, alpha)
                     : std::make_tuple(
                           convReluAddComposite(
                               input, weight, bias, stride, padding, dilation, groups, other, alpha),
                           at::Tensor());
  }
  if (out.numel() == 0 || (!streaming && !staged)) {
    // NB: the composite's pointwise part on `out`, not the composite, which
    // would compute the convolution again.  The bias is added in place after
    // the convolution, as eager's cuDNN convolution adds it, so `out` holds
    // what convolve(..., bias, ...) gives, in the layout it gives.
    if (bias && bias->defined()) {
      std::vector<int64_t> bias_sizes(weight.dim() - 1, 1);  // [C, 1, ...]: unbatched too
      bias_sizes[0] = bias->size(0);
      out.add_(bias->reshape(bias_sizes));
    }
    return convReluAddEpilogueComposite(out, input, weight, other, alpha, with_mask);
  }
  c10::cuda::CUDAGuard guard(input.device());
  const auto e = convExtents(sizes, batched);
  at::Tensor mask;
  if (with_mask) {
    mask = at::empty({convMaskBytes(e, order)}, input.options().dtype(at::kByte));
  }
  const auto dtype = input.scalar_type();
  const EpilogueOperands operands(bias, other, sizes, batched ? 1 : 0, dtype);
  uint32_t* mask_ptr = with_mask ? reinterpret_cast<uint32_t*>(mask.data_ptr<uint8_t>()) : nullptr;
  const auto stream = at::cuda::getCurrentCUDAStream();
  DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add", [&] {
    const auto* bias_ptr = operands.biasPtr<scalar_t>();
    const auto* other_ptr = operands.otherPtr<scalar_t>();
    if (streaming) {
      kernels::convReluAddEpiloguePositionsInner(
          cudaPtr<scalar_t>(out), bias_ptr, other_ptr, alpha.toFloat(), cudaPtr<scalar_t>(out),
          mask_ptr, e.images, e.channels, e.positions, stream);
    } else {
      kernels::convReluAddEpilogueChannelsInner(
          cudaPtr<scalar_t>(out), bias_ptr, other_ptr, alpha.toFloat(), cudaPtr<scalar_t>(out),
          /*nchw=*/!isChannelsLast(out), mask_ptr, e.images, e.channels, e.positions, stream);
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {operands.addUnfused(out, other, alpha), mask};
}

at::Tensor convReluAddCuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  if (!convReluAddHandles(input, weight, bias, stride, padding, dilation, groups, other, alpha)) {
    return convReluAddReference(input, weight, bias, stride, padding, dilation, groups, other, alpha);
  }
  return std::get<0>(forwardCuda(
      input, weight, bias, stride, padding, dilation, groups, other, alpha, /*with_mask=*/false));
}

std::tuple<at::Tensor, at::Tensor> convReluAddForwardCuda(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const at::Tensor& other,
    const at::Scalar& alpha) {
  return forwardCuda(
      input, weight, bias, stride, padding, dilation, groups, other, alpha, /*with_mask=*/true);
}

// The partial sums a masking pass writes: `parts` rows of C doubles, for the
// bias gradient (sum_g) and grad_channels (sum_dy), where asked for.
struct GradSums {
  at::Tensor g, dy;

  GradSums(int64_t parts, int64_t channels, const at::Tensor& like, std::array<bool, 4> output_mask) {
    const auto options = like.options().dtype(at::kDouble);
    if (output_mask[2]) {
      g = at::empty({parts, channels}, options);
    }
    if (output_mask[3]) {
      dy = at::empty({parts, channels}, options);
    }
  }

  static double* ptr(const at::Tensor& t) {
    return t.defined() ? t.data_ptr<double>() : nullptr;
  }
  double* gPtr() const { return ptr(g); }
  double* dyPtr() const { return ptr(dy); }

  // The first `parts` rows reduced: (grad_bias, grad_channels).
  std::tuple<at::Tensor, at::Tensor> reduce(int64_t parts, at::ScalarType dtype) const {
    const auto total = [&](const at::Tensor& t) {
      return t.defined() ? t.narrow(0, 0, parts).sum(0).to(dtype) : at::Tensor();
    };
    return {total(g), total(dy)};
  }
};

// The route's backward for an NCHW convolution: cuDNN's channels-last
// data- and weight-gradient convolutions took 3.5 ms against 5.3 in NCHW on
// conv_relu_bias (kernels/conv/README.md, variant H).
// g is made NHWC in the masking pass itself, which also sums the bias's and
// other's gradients.  The input gradient: on sm_90, where the problem fits,
// our implicit-GEMM kernel writes it NCHW from g rounded to TF32 in that
// pass (variant I); else cuDNN's, converted back to eager's NCHW.  The
// weight gradient: cuDNN's, with x converted to NHWC.
ConvReluAddGrads backwardChannelsLast(
    const at::Tensor& dy,
    const uint32_t* mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 4> output_mask,
    at::IntArrayRef sizes) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  const auto dtype = input.scalar_type();
  const int64_t images = sizes[0], channels = sizes[1], positions = sizes[2] * sizes[3];
  const auto dgrad = output_mask[0]
      ? dataGradientProblem(input, weight, stride, padding, dilation, groups, sizes)
      : std::nullopt;
  const auto src = dy.contiguous();
  auto g = at::empty(sizes, src.options().memory_format(at::MemoryFormat::ChannelsLast));
  const GradSums sums(
      kernels::convReluAddGradNchwToNhwcParts(images, channels, positions), channels, src,
      output_mask);
  int64_t parts = 0;
  DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add_backward", [&] {
    parts = kernels::convReluAddGradNchwToNhwc(
        cudaPtr<scalar_t>(src), mask, cudaPtr<scalar_t>(g), /*tf32=*/dgrad.has_value(),
        sums.gPtr(), sums.dyPtr(), images, channels, positions, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor grad_input, grad_weight;
  if (dgrad) {
    const auto flipped = weight.flip({2, 3});
    auto w = at::empty({dgrad->k, dgrad->r, dgrad->s, dgrad->c}, weight.options());
    kernels::transposeBatchedTf32(
        cudaPtr<float>(flipped), cudaPtr<float>(w), 1, dgrad->c, dgrad->k * dgrad->r * dgrad->s,
        stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_input = at::empty(input.sizes(), input.options());
    TORCH_CHECK(
        kernels::implicitGemmConv(
            cudaPtr<float>(g), cudaPtr<float>(w), cudaPtr<float>(grad_input), *dgrad, stream),
        "torchfuse::custom_conv_relu_add_backward: the CUDA driver refused the tensor maps of "
        "the implicit-GEMM convolution");
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const bool cudnn_dgrad = output_mask[0] && !dgrad;
  if (cudnn_dgrad || output_mask[1]) {
    auto x = at::empty_like(input, at::MemoryFormat::ChannelsLast);
    DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add_backward", [&] {
      kernels::transposeBatched(
          cudaPtr<scalar_t>(input), cudaPtr<scalar_t>(x), input.size(0), input.size(1),
          input.size(2) * input.size(3), stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    at::Tensor grad_x;
    std::tie(grad_x, grad_weight, std::ignore) = convolveBackward(
        g, x, weight.contiguous(at::MemoryFormat::ChannelsLast), stride, padding, dilation, groups,
        {cudnn_dgrad, output_mask[1], false});
    x.reset();
    if (grad_x.defined()) {
      grad_x = grad_x.contiguous(at::MemoryFormat::ChannelsLast);  // cuDNN's is already
      grad_input = at::empty(input.sizes(), input.options());
      DISPATCH_KERNEL_TYPES(dtype, "custom_conv_relu_add_backward", [&] {
        kernels::transposeBatched(
            cudaPtr<scalar_t>(grad_x), cudaPtr<scalar_t>(grad_input), input.size(0),
            input.size(2) * input.size(3), input.size(1), stream);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
  if (grad_weight.defined()) {
    grad_weight = grad_weight.contiguous();
  }
  const auto [grad_bias, grad_channels] = sums.reduce(parts, dtype);
  return {grad_input, grad_weight, grad_bias, grad_channels};
}

ConvReluAddGrads convReluAddBackwardCuda(
    const at::Tensor& grad_output,
    const at::Tensor& mask,
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    std::array<bool, 4> output_mask) {
  const auto sizes = checkConvReluAddBackwardInputs(
      grad_output, mask, input, weight, stride, padding, dilation, groups);
  // `other` may broadcast the result beyond the conv output's shape.
  auto dy = grad_output.sizes() == at::IntArrayRef(sizes) ? grad_output
                                                           : grad_output.sum_to_size(sizes);
  if (!kernelInputs(input, weight, std::nullopt) || dy.scalar_type() != input.scalar_type() ||
      !mask.is_contiguous() || reinterpret_cast<uintptr_t>(mask.data_ptr()) % 4 != 0 ||
      dy.numel() == 0) {
    return convReluAddBackwardComposite(
        grad_output, mask, input, weight, stride, padding, dilation, groups, output_mask);
  }
  c10::cuda::CUDAGuard guard(input.device());
  const bool batched = input.dim() == weight.dim();
  const auto e = convExtents(sizes, batched);
  const auto order = convMaskOrder(input, weight);
  const auto* mask_ptr = reinterpret_cast<const uint32_t*>(mask.data_ptr<uint8_t>());
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (takesChannelsLastBackward(
          input, weight, stride, padding, dilation, groups, sizes, output_mask)) {
    return backwardChannelsLast(
        dy, mask_ptr, input, weight, stride, padding, dilation, groups, output_mask, sizes);
  }
  // g goes to convolution_backward in the conv output's layout, as eager's
  // relu backward gives it; that layout is the mask's order.
  at::Tensor g;
  int64_t parts = 0;
  std::optional<GradSums> sums;
  if (order == ConvMaskOrder::PositionsInner) {
    // NB: a dy in another layout costs one ATen copy here: the streaming
    // pass reads dy in the mask's (nchw) order.
    dy = dy.contiguous();
    g = at::empty(sizes, dy.options());
    parts = kernels::convReluAddGradPartsPositionsInner(e.images, e.channels, e.positions);
    sums.emplace(parts, e.channels, dy, output_mask);
    DISPATCH_KERNEL_TYPES(dy.scalar_type(), "custom_conv_relu_add_backward", [&] {
      kernels::convReluAddGradProloguePositionsInner(
          cudaPtr<scalar_t>(dy), mask_ptr, cudaPtr<scalar_t>(g), sums->gPtr(), sums->dyPtr(),
          e.images, e.channels, e.positions, stream);
    });
  } else {
    const auto format = convOutputMemoryFormat(input, weight);  // channels-last
    if (!dy.is_contiguous() && !isChannelsLast(dy)) {
      dy = dy.contiguous(format);
    }
    g = at::empty(sizes, dy.options().memory_format(format));
    parts = kernels::convReluAddGradPartsChannelsInner(e.images, e.channels, e.positions);
    sums.emplace(parts, e.channels, dy, output_mask);
    DISPATCH_KERNEL_TYPES(dy.scalar_type(), "custom_conv_relu_add_backward", [&] {
      kernels::convReluAddGradPrologueChannelsInner(
          cudaPtr<scalar_t>(dy), /*dy_nchw=*/!isChannelsLast(dy), mask_ptr,
          cudaPtr<scalar_t>(g), /*g_nchw=*/false, sums->gPtr(), sums->dyPtr(), e.images,
          e.channels, e.positions, stream);
    });
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor grad_input, grad_weight;
  if (output_mask[0] || output_mask[1]) {
    std::tie(grad_input, grad_weight, std::ignore) = convolveBackward(
        g, input, weight, stride, padding, dilation, groups,
        {output_mask[0], output_mask[1], false});
  }
  const auto [grad_bias, grad_channels] = sums->reduce(parts, input.scalar_type());
  return {grad_input, grad_weight, grad_bias, grad_channels};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  m.impl(TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add"), TORCH_FN(convReluAddCuda));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_forward"),
      TORCH_FN(convReluAddForwardCuda));
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_relu_add_backward"),
      TORCH_FN(convReluAddBackwardCuda));
}
