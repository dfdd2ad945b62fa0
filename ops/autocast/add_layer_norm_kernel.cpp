#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include "ops/add_layer_norm.h"
#include "ops/common/autocast.h"

namespace torchfuse::ops {
namespace {

// Whether eager autocast casts aten::layer_norm's inputs on this device: it
// has a kernel under the device's Autocast key (CUDA: the float32 list),
// else the key falls through (CPU: layer_norm runs in its inputs' dtypes).
bool layerNormAutocasts(c10::DeviceType device) {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("aten::layer_norm", "");
  const auto key = device == c10::DeviceType::CUDA ? c10::DispatchKey::AutocastCUDA
                                                   : c10::DispatchKey::AutocastCPU;
  return handle.hasKernelForDispatchKey(key);
}

bool lowerPrecision(const at::Tensor& t) {
  return t.defined() && (t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16);
}

// The original chain under autocast.  add has no autocast policy.  Where
// TorchScript's autocast pass runs (ChainAutocast::full), it casts the
// float16/bfloat16 inputs of add (not of add_) and of layer_norm (the sum,
// weight and bias) to float32.  Eager autocast's layer_norm policy is
// float32 on CUDA and none on CPU (layerNormAutocasts).  Where either would
// cast the sum for the norm, the normalized result is float32 while the sum
// keeps its dtype, which the op cannot return: the chain then runs as ATen
// ops, layer_norm through the dispatcher's autocast, so that every dtype is
// the chain's.
template <c10::DeviceType device>
AddLayerNormResult addLayerNormAutocast(const AddLayerNormArgs& a) {
  const ChainAutocast casts(device);
  const auto x = a.promote ? casts.full(a.input) : a.input;
  const auto o = a.promote ? casts.full(a.other) : a.other;
  const auto w = a.weight && a.weight->defined() ? std::optional(casts.full(*a.weight)) : a.weight;
  const auto b = a.bias && a.bias->defined() ? std::optional(casts.full(*a.bias)) : a.bias;
  const AddLayerNormArgs cast{x, o, a.alpha, a.promote, a.normalized_shape, w, b, a.eps,
                              a.write_sum};
  const auto sum_dtype = a.promote ? at::result_type(x, o) : x.scalar_type();
  const bool sum_lower = sum_dtype == at::kHalf || sum_dtype == at::kBFloat16;
  // NB: after the pass's casts of add's inputs only add_'s sum can still be
  // float16/bfloat16 (a fresh tensor of that dtype).
  const bool jit_casts_sum = !a.promote && casts.fullCasts(x);
  const bool policy_casts = layerNormAutocasts(device) &&
      (sum_lower || (w && lowerPrecision(*w)) || (b && lowerPrecision(*b)));
  if (!jit_casts_sum && !policy_casts) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return addLayerNorm(cast);
  }
  checkAddLayerNormInputs(cast);
  at::Tensor sum;
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    sum = a.promote ? at::add(x, o, a.alpha) : x.clone().add_(o, a.alpha);
  }
  // NB: with the autocast keys on: layer_norm's own policy casts.
  auto normalized = at::layer_norm(casts.full(sum), a.normalized_shape, w, b, a.eps);
  return {std::move(normalized), a.write_sum ? sum : emptySum(sum)};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, AutocastCPU, m) {
  using namespace torchfuse::ops;
  registerAddLayerNorm<addLayerNormAutocast<c10::DeviceType::CPU>>(m);
}

TORCH_LIBRARY_IMPL(torchfuse, AutocastCUDA, m) {
  using namespace torchfuse::ops;
  registerAddLayerNorm<addLayerNormAutocast<c10::DeviceType::CUDA>>(m);
}
