// custom_unmasked_attention: scaled_dot_product_attention(query, key, value)
// without a mask.  DropAllTrueAttentionMasks (passes/) puts it in place of a
// call whose boolean mask the graph proves true everywhere, which masks
// nothing.
//
// NB: where nothing is recorded for autograd (no_grad, inference mode, or
// no input that requires grad: a frozen model's inference) it calls
// scaled_dot_product_attention without a mask, so that ATen runs its fused
// flash or memory-efficient kernels.  Where autograd records, it passes a
// mask that is true everywhere, with the strides of the one transformers
// traces (an [L, 1] column expanded: stride 0 in its last dim), so that ATen
// picks the backend it picked for the original (CUDA: the math path, whose
// derivatives are differentiable again; the fused kernels have no double
// backward): gradients and double gradients stay the original's.
//
// NB: CompositeImplicitAutograd, as scaled_dot_product_attention: it is made
// of ATen calls, so it runs on every backend (Meta included), autograd
// differentiates the nested call, and autocast casts that call as it cast
// the original.

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <optional>

#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_unmasked_attention(Tensor query, Tensor key, Tensor value, *, float? scale=None, "
      "bool enable_gqa=False) -> Tensor");
}

namespace torchfuse {

at::Tensor custom_unmasked_attention(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    std::optional<double> scale,
    bool enable_gqa) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_unmasked_attention", "")
                       .typed<at::Tensor(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           std::optional<double>, bool)>();
  return op.call(query, key, value, scale, enable_gqa);
}

namespace ops {
namespace {

constexpr const char* kOp = "torchfuse::custom_unmasked_attention";

at::Tensor unmaskedAttention(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    std::optional<double> scale,
    bool enable_gqa) {
  checkDefined(kOp, "query", query);
  checkDefined(kOp, "key", key);
  checkDefined(kOp, "value", value);
  const bool recorded = c10::GradMode::is_enabled() &&
      (query.requires_grad() || key.requires_grad() || value.requires_grad());
  if (!recorded || query.dim() < 2 || key.dim() < 2) {
    // NB: a rank ATen rejects gets ATen's error from the unmasked call.
    return at::scaled_dot_product_attention(
        query, key, value, std::nullopt, 0.0, false, scale, enable_gqa);
  }
  // [..., L, S], the attention weights' shape, true everywhere
  auto sizes = query.sym_sizes().vec();
  sizes.back() = key.sym_size(-2);
  const auto mask = at::ones_symint({query.sym_size(-2), 1}, query.options().dtype(at::kBool))
                        .expand_symint(c10::SymIntArrayRef(sizes));
  return at::scaled_dot_product_attention(query, key, value, mask, 0.0, false, scale, enable_gqa);
}

} // namespace
} // namespace ops
} // namespace torchfuse

TORCH_LIBRARY_IMPL(torchfuse, CompositeImplicitAutograd, m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_unmasked_attention"),
      TORCH_FN(torchfuse::ops::unmaskedAttention));
}
