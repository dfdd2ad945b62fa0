// custom_unmasked_attention: scaled_dot_product_attention(query, key, value)
// without a mask.  DropAllTrueAttentionMasks (passes/) puts it in place of a
// call whose boolean mask the graph proves true everywhere, which masks
// nothing.
//
// NB: it makes the unmasked call only where its NaN and Inf are the masked
// call's (unmaskedKeepsNonFinite): where nothing is recorded for autograd
// (no_grad, inference mode, or no input that requires grad: a frozen model's
// inference) and ATen runs the call by flash or cuDNN attention on CUDA.
// Elsewhere (the CPU, CUDA's memory-efficient kernel, the math path, and
// wherever autograd records: the fused kernels' gradients have inf where the
// masked call's have NaN) it passes a mask that is true everywhere with the
// strides of transformers' traced mask (stride 0 in its last dim), so that
// ATen picks the backend it picked for the original.
//
// NB: CompositeImplicitAutograd, as scaled_dot_product_attention: it is made
// of ATen calls, so it runs on every backend (Meta included), and autocast
// casts the nested call as it cast the original.

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <optional>
#include <vector>

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

// Whether the unmasked call gives NaN and Inf where the original's masked
// call does.  Measured on the H200 (float16 and bfloat16, [2, 3, 5, 8] and
// [2, 4, 64, 64], a NaN in a query, +inf in a key, -inf in a value): flash's
// and cuDNN's outputs are NaN and Inf where the masked call's (the math
// path) are; their gradients are not (±inf where the math path's are NaN),
// so only where nothing is recorded for autograd.  Not so the
// memory-efficient kernel (float32 on CUDA: NaN where the masked call gives
// -inf, and where it gives finite values), nor the CPU's flash kernel (0 in a
// row that a NaN in the query made NaN; fuzz seed 20261244 program 287).
// NB: where the choice raises (every backend disabled, say), the masked call
// raises the original's error.
bool unmaskedKeepsNonFinite(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    std::optional<double> scale,
    bool enable_gqa) {
  const bool recorded = c10::GradMode::is_enabled() &&
      (query.requires_grad() || key.requires_grad() || value.requires_grad());
  if (!query.is_cuda() || recorded) {
    return false;
  }
  try {
    const auto backend = static_cast<at::SDPBackend>(
        at::_fused_sdp_choice(query, key, value, std::nullopt, 0.0, false, scale, enable_gqa));
    return backend == at::SDPBackend::flash_attention || backend == at::SDPBackend::cudnn_attention;
  } catch (const c10::Error&) {
    return false;
  }
}

// Autocast's own cast of the call's inputs, where autocast is on for their
// device: scaled_dot_product_attention is a lower-precision op on CPU and
// CUDA.  Made here, before the call, so that unmaskedKeepsNonFinite asks
// ATen's choice for the dtype the call computes in.
at::Tensor autocastInput(const at::Tensor& t) {
  const auto device_type = t.device().type();
  if ((device_type != at::kCPU && device_type != at::kCUDA) ||
      !at::autocast::is_autocast_enabled(device_type)) {
    return t;
  }
  return at::autocast::cached_cast(
      at::autocast::get_lower_precision_fp_from_device_type(device_type), t, device_type);
}

at::Tensor unmaskedAttention(
    const at::Tensor& query_in,
    const at::Tensor& key_in,
    const at::Tensor& value_in,
    std::optional<double> scale,
    bool enable_gqa) {
  checkDefined(kOp, "query", query_in);
  checkDefined(kOp, "key", key_in);
  checkDefined(kOp, "value", value_in);
  const auto query = autocastInput(query_in);
  const auto key = autocastInput(key_in);
  const auto value = autocastInput(value_in);
  if (query.dim() < 2 || key.dim() < 2) {
    // NB: a rank ATen rejects gets ATen's error from the unmasked call.
    return at::scaled_dot_product_attention(
        query, key, value, std::nullopt, 0.0, false, scale, enable_gqa);
  }
  if (unmaskedKeepsNonFinite(query, key, value, scale, enable_gqa)) {
    return at::scaled_dot_product_attention(
        query, key, value, std::nullopt, 0.0, false, scale, enable_gqa);
  }
  // [1, ..., 1, L, S], true everywhere: the attention weights' last two
  // dims, with query's rank.  NB: not the weights' full shape: ATen's math
  // path turns a boolean mask into a float one of the mask's own shape, and
  // one of [B, H, L, S] would raise the peak memory above the original's
  // (transformers' [B, 1, L, S]: BERT-base fp32, 32 x 128, +22 MiB).
  std::vector<c10::SymInt> sizes(query.dim(), c10::SymInt(1));
  sizes[sizes.size() - 2] = query.sym_size(-2);
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
