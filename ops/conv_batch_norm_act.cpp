// custom_conv_batch_norm_act: act(batch_norm(conv(x, W, b), ...)), the chain
// of an unfrozen graph, where BatchNorm's statistics and affine parameters
// are module attributes read at run time and its `training` flag a run-time
// value (passes/fuse_conv_batch_norm_act.cpp).
//
// In eval (training false, running statistics present) BatchNorm is the
// per-channel affine map s * (y - mean) + beta, s = gamma / sqrt(var + eps),
// read from the attributes every call (they may change between calls: an
// optimizer step, a load_state_dict).  Where autograd records nothing:
// - on CUDA, the conv's epilogue applies it with the activation
//   (ops/cuda/conv_batch_norm_eval.h), so the conv output is written once
//   instead of three times and no folded weight is allocated;
// - elsewhere, ATen ops fold it into the conv's weight and bias, and the call
//   becomes custom_conv_add_act with the activation in its epilogue, where
//   the weight is smaller than the conv output (the fold's pass over the
//   weight then costs less than BatchNorm's pass over the output).
// In training on CUDA, a 16-bit NCHW batch_norm -> silu (planes of 512
// elements or more) runs as custom_batch_norm_add_div_swish
// (trainSiluPays, batchNormSiluTrain): its kernels compute the batch statistics, update the
// running ones as aten::batch_norm does, and fuse the normalization with
// silu, forward and backward.
// Otherwise the call runs the original ops: in training (the batch
// statistics and running-statistic updates are ATen's), where autograd
// records (its gradients, and no folded weight kept for the backward), and
// under a tracer (fake and functional tensors, dispatch modes), which then
// records the original's ATen ops.
//
// NB: CompositeImplicitAutograd, as custom_unmasked_attention: made of ATen
// and torchfuse calls, it runs on every backend (Meta included), autograd
// differentiates the nested calls (double backward included), and autocast
// casts each nested call as it cast the original's.

#include <ATen/ATen.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/strides.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <utility>
#include <vector>

#include "ops/batch_norm_add_div_swish.h"
#include "ops/common/checks.h"
#include "ops/common/conv_composites.h"
#include "ops/conv_add_act.h"
#include "ops/conv_output_size.h"
#include "torchfuse/ops.h"
#ifdef TORCHFUSE_WITH_CUDA
#include "ops/cuda/conv_batch_norm_eval.h"
#endif

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_conv_batch_norm_act(Tensor input, Tensor weight, Tensor? bias, int[] stride, "
      "int[] padding, int[] dilation, int groups, Tensor? bn_weight, Tensor? bn_bias, "
      "Tensor? running_mean, Tensor? running_var, bool training, float momentum, float eps, "
      "bool cudnn_enabled, str activation, float[] activation_args) -> Tensor");
}

namespace torchfuse {

at::Tensor custom_conv_batch_norm_act(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var,
    bool training,
    double momentum,
    double eps,
    bool cudnn_enabled,
    c10::string_view activation,
    at::ArrayRef<double> activation_args) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_conv_batch_norm_act", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                           at::IntArrayRef, at::IntArrayRef, at::IntArrayRef, int64_t,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool,
                           double, double, bool, c10::string_view, at::ArrayRef<double>)>();
  return op.call(
      input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias, running_mean,
      running_var, training, momentum, eps, cudnn_enabled, activation, activation_args);
}

namespace ops {
namespace {

constexpr const char* kOp = "torchfuse::custom_conv_batch_norm_act";

bool defined(const std::optional<at::Tensor>& t) {
  return t && t->defined();
}

// A per-channel tensor of C elements, or none.
bool perChannelOrNone(const std::optional<at::Tensor>& t, int64_t c) {
  return !defined(t) || (t->dim() == 1 && t->size(0) == c);
}

bool requiresGrad(const std::optional<at::Tensor>& t) {
  return defined(t) && t->requires_grad();
}

// Whether any defined tensor is a tracer's (fake, functional) or a dispatch
// mode is active (at::isTensorSubclassLike).
bool anySubclassLike(std::initializer_list<const std::optional<at::Tensor>*> ts) {
  return std::any_of(ts.begin(), ts.end(), [](const std::optional<at::Tensor>* t) {
    return defined(*t) && at::isTensorSubclassLike(**t);
  });
}

// The element count of the convolution's output (batched or not); 0 where
// the conv rejects the arguments, so that the caller runs the original ops
// and their errors.
int64_t convOutputNumel(
    const at::Tensor& input,
    const at::Tensor& weight,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation) {
  const auto sizes = acceptedConvOutputSizes(input, weight, stride, padding, dilation);
  if (!sizes) {
    return 0;
  }
  int64_t n = 1;
  for (const auto& size : *sizes) {
    n *= size.expect_int(); // NB: tensor subclasses (symbolic sizes) took the original ops
  }
  return n;
}

// The fold with ATen ops, in float (double for double weights), rounded once
// to the weight's dtype: differentiable, and on every backend.
std::pair<at::Tensor, at::Tensor> foldWithAten(
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps) {
  const auto ct = weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto scale = at::reciprocal(at::sqrt(running_var.to(ct) + eps));
  if (defined(bn_weight)) {
    scale = bn_weight->to(ct) * scale;
  }
  auto centred = defined(bias) ? bias->to(ct) - running_mean.to(ct) : -running_mean.to(ct);
  auto shift = centred * scale;
  if (defined(bn_bias)) {
    shift = shift + bn_bias->to(ct);
  }
  std::vector<int64_t> shape(weight.dim(), 1);
  shape[0] = -1;
  auto folded = (weight.to(ct) * scale.view(shape)).to(weight.scalar_type());
  return {folded, shift.to(weight.scalar_type())};
}

#ifdef TORCHFUSE_WITH_CUDA
// Whether a training batch_norm -> silu over the conv output y pays as
// custom_batch_norm_add_div_swish's CUDA kernels: the statistics, the update
// of the running ones, and normalize + silu in two passes over y, their
// backward in two more, from y alone (eager's batch_norm and silu take
// three and four, and keep BatchNorm's output alive for silu's backward).
// NB: where those kernels are the faster (docs/kernels/batch_norm_silu.md,
// measured on efficientnet's shapes): 16-bit y in NCHW order with planes of
// at least kMinTrainSiluPlane elements, and running statistics to update.
// In float32 their backward computes its terms in float64, and in
// channels-last order reduces columns; there cuDNN's BatchNorm and silu
// were faster on most shapes.  Short planes (14x14, 7x7) make the planes'
// reduction read short rows: there the kernels lost on some runs.  NCHW
// also settles the output's layout: eager's silu gives canonical contiguous
// strides, the kernels y's, which are those.  Whether the kernels take the
// BatchNorm tensors is theirs to say (batchNormAddDivSwishCudaTakes).
constexpr int64_t kMinTrainSiluPlane = 512;

bool trainSiluPays(
    const at::Tensor& y,
    const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var) {
  const auto s = y.scalar_type();
  if (!y.is_cuda() || y.numel() == 0 || y.dim() < 3 || (s != at::kHalf && s != at::kBFloat16) ||
      !y.is_contiguous() || y.strides() != at::IntArrayRef(c10::contiguous_strides(y.sizes())) ||
      !defined(running_mean) || !defined(running_var)) {
    return false;
  }
  int64_t plane = 1;
  for (int64_t d = 2; d < y.dim(); ++d) {
    plane *= y.size(d);
  }
  return plane >= kMinTrainSiluPlane;
}

// silu(batch_norm(y)) in training by custom_batch_norm_add_div_swish, with
// other 0 and divisor 1 (t = batch_norm(y) + 0 exactly), where its CUDA
// kernels take the arguments; nullopt otherwise (its reference composition
// would add an add and a div to the original's ops).  NB: autocast is off
// for the nested call: the original's batch_norm and silu have no autocast
// policy and run in y's dtype, where the op's Autocast kernel would cast as
// for the add it stands for.
std::optional<at::Tensor> batchNormSiluTrain(
    const at::Tensor& y,
    const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double momentum,
    double eps) {
  at::Tensor rm = running_mean;
  at::Tensor rv = running_var;
  const auto zero = at::zeros({}, y.options());
  const at::Scalar one(1);
  if (!batchNormAddDivSwishCudaTakes(
          {y, bn_weight, bn_bias, rm, rv, /*training=*/true, momentum, eps, zero, one,
           /*silu=*/true})) {
    return std::nullopt;
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  return custom_batch_norm_add_div_swish(
      y, bn_weight, bn_bias, rm, rv, /*training=*/true, momentum, eps, zero, one, /*silu=*/true);
}
#endif

at::Tensor convBatchNormAct(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    at::IntArrayRef stride,
    at::IntArrayRef padding,
    at::IntArrayRef dilation,
    int64_t groups,
    const std::optional<at::Tensor>& bn_weight,
    const std::optional<at::Tensor>& bn_bias,
    const std::optional<at::Tensor>& running_mean,
    const std::optional<at::Tensor>& running_var,
    bool training,
    double momentum,
    double eps,
    bool cudnn_enabled,
    c10::string_view activation,
    at::ArrayRef<double> activation_args) {
  checkDefined(kOp, "input", input);
  checkDefined(kOp, "weight", weight);
  const auto act = parseActivation(activation, activation_args, kOp);
  const auto normalizeAndActivate = [&](const at::Tensor& y) {
    auto z = at::batch_norm(
        y, bn_weight, bn_bias, running_mean, running_var, training, momentum, eps, cudnn_enabled);
    return applyActivation(z, activation, activation_args);
  };
  const auto original = [&] {
    return normalizeAndActivate(convolve(input, weight, bias, stride, padding, dilation, groups));
  };
  // NB: a tracer (torch.compile, torch.export, make_fx) sees the original's
  // ATen ops: fake tensors have no data for a kernel, and a kernel launched
  // on real ones would not be recorded.
  if (at::isTensorSubclassLike(input) || at::isTensorSubclassLike(weight) ||
      anySubclassLike({&bias, &bn_weight, &bn_bias, &running_mean, &running_var})) {
    return original();
  }
#ifdef TORCHFUSE_WITH_CUDA
  if (training && act.kind == kernels::ActivationKind::kSilu && input.is_cuda()) {
    const auto y = convolve(input, weight, bias, stride, padding, dilation, groups);
    if (trainSiluPays(y, running_mean, running_var)) {
      if (auto out = batchNormSiluTrain(
              y, bn_weight, bn_bias, *running_mean, *running_var, momentum, eps)) {
        return *out;
      }
    }
    return normalizeAndActivate(y);
  }
#endif
  if (training || !defined(running_mean) || !defined(running_var)) {
    return original();
  }
  // NB: a per-channel shape BatchNorm would reject keeps its error.
  const int64_t c = weight.dim() >= 3 ? weight.size(0) : -1;
  const bool foldable = c >= 0 && perChannelOrNone(running_mean, c) &&
      perChannelOrNone(running_var, c) && perChannelOrNone(bn_weight, c) &&
      perChannelOrNone(bn_bias, c) && perChannelOrNone(bias, c);
  // NB: where autograd records, the original ops: their gradients, and no
  // folded weight kept alive for the backward.
  const bool recorded = c10::GradMode::is_enabled() &&
      (input.requires_grad() || weight.requires_grad() || requiresGrad(bias) ||
       requiresGrad(bn_weight) || requiresGrad(bn_bias) || requiresGrad(running_mean) ||
       requiresGrad(running_var));
  if (!foldable || recorded) {
    return original();
  }
#ifdef TORCHFUSE_WITH_CUDA
  if (input.is_cuda()) {
    return convBatchNormEvalCuda(ConvBatchNormEvalArgs{
        input, weight, bias, stride, padding, dilation, groups, bn_weight, bn_bias, *running_mean,
        *running_var, momentum, eps, cudnn_enabled, activation, activation_args, act});
  }
#endif
  // Elsewhere the fold is a pass over the weight that saves BatchNorm's pass
  // over the conv output: it pays where the weight is the smaller.
  if (weight.numel() >= convOutputNumel(input, weight, stride, padding, dilation)) {
    return original();
  }
  const auto folded =
      foldWithAten(weight, bias, bn_weight, bn_bias, *running_mean, *running_var, eps);
  return custom_conv_add_act(
      input, folded.first, folded.second, stride, padding, dilation, groups, std::nullopt, 1, false,
      activation, activation_args);
}

} // namespace
} // namespace ops
} // namespace torchfuse

TORCH_LIBRARY_IMPL(torchfuse, CompositeImplicitAutograd, m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_conv_batch_norm_act"),
      TORCH_FN(torchfuse::ops::convBatchNormAct));
}
