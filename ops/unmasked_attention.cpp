// custom_unmasked_attention: scaled_dot_product_attention(query, key, value)
// without a mask.  DropAllTrueAttentionMasks (passes/) puts it in place of a
// call whose boolean mask the graph proves true everywhere, which masks
// nothing.
//
// NB: where ATen runs the unmasked call by flash or cuDNN attention on CUDA,
// whose NaN and Inf are the masked call's (unmaskedKeepsNonFinite), it makes that
// call: where nothing is recorded for autograd (no_grad, inference mode, or
// no input that requires grad: a frozen model's inference) as it is, and
// where autograd records (training) forward and backward
// (FusedAttentionFunction), so that a training step does not take the math
// path, which the original's mask forces (transformers traces an [L, 1]
// column expanded: stride 0 in its last dim): the fused kernels have no
// double backward, so a backward that records a graph (create_graph=True)
// gives the math path's derivatives, which are differentiable again.
// Elsewhere (the CPU, float32 on CUDA, the math path) it passes a mask that
// is true everywhere with the original's strides, so that ATen picks the
// backend it picked for the original.
//
// NB: CompositeImplicitAutograd, as scaled_dot_product_attention: it is made
// of ATen calls, so it runs on every backend (Meta included), and autocast
// casts the nested call as it cast the original.

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/autocast_mode.h>
#include <c10/core/GradMode.h>
#include <torch/autograd.h>
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

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The unmasked call where autograd records it.  Forward: the call on
// detached copies of query, key and value, recorded in a graph of its own,
// whose fused backward the backward runs.  A backward that records a graph
// differentiates the math path instead, on the saved inputs in the dtype
// the call computed in (the one autocast gave it), so that the second
// derivatives exist and are the original's.
class FusedAttentionFunction : public torch::autograd::Function<FusedAttentionFunction> {
 public:
  static at::Tensor forward(
      AutogradContext* ctx,
      const at::Tensor& query,
      const at::Tensor& key,
      const at::Tensor& value,
      std::optional<double> scale,
      bool enable_gqa) {
    at::AutoGradMode record(true);
    std::vector<at::Tensor> nested{at::Tensor()};
    for (const auto* t : {&query, &key, &value}) {
      nested.push_back(t->detach().requires_grad_(t->requires_grad()));
    }
    nested[0] = at::scaled_dot_product_attention(
        nested[1], nested[2], nested[3], std::nullopt, 0.0, false, scale, enable_gqa);
    // NB: saved variables, not saved_data: the engine releases them after a
    // backward that does not retain the graph, and the nested graph with
    // them, where saved_data would hold it until the outer graph goes.
    ctx->save_for_backward({query, key, value, nested[0], nested[1], nested[2], nested[3]});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["enable_gqa"] = enable_gqa;
    return nested[0].detach();
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list result(5);
    if (!grads[0].defined()) {
      return result;
    }
    const auto saved = ctx->get_saved_variables();
    const variable_list nested(saved.begin() + 3, saved.end());
    const auto scale = ctx->saved_data["scale"].toOptional<double>();
    const bool enable_gqa = ctx->saved_data["enable_gqa"].toBool();
    const bool recording = c10::GradMode::is_enabled();
    at::Tensor out;
    variable_list inputs;
    std::vector<size_t> which;
    if (recording) {
      const auto dtype = nested[0].scalar_type();
      out = std::get<0>(at::_scaled_dot_product_attention_math(
          saved[0].to(dtype), saved[1].to(dtype), saved[2].to(dtype), std::nullopt, 0.0, false,
          std::nullopt, scale, enable_gqa));
    } else {
      out = nested[0];
    }
    for (size_t i = 0; i < 3; ++i) {
      const auto& input = recording ? saved[i] : nested[i + 1];
      if (ctx->needs_input_grad(i) && input.requires_grad()) {
        inputs.push_back(input);
        which.push_back(i);
      }
    }
    if (inputs.empty()) {
      return result;
    }
    // NB: retain_graph: a backward of the outer graph with retain_graph=True
    // may run this node again.
    const auto g = torch::autograd::grad(
        {out}, inputs, {grads[0]}, /*retain_graph=*/true, /*create_graph=*/recording,
        /*allow_unused=*/true);
    for (size_t j = 0; j < which.size(); ++j) {
      result[which[j]] = g[j];
    }
    return result;
  }
};

// Whether the unmasked call gives NaN and Inf where the original's masked
// call does: only where ATen runs it by flash or cuDNN attention on CUDA.
// Measured on the H200 (float16 and bfloat16, a NaN in a query, +inf in a
// key, -inf in a value): their outputs and gradients are NaN and Inf where
// the masked call's (the math path) are.  Not so the memory-efficient kernel
// (float32 on CUDA: NaN where the masked call gives -inf, and where it gives
// finite values), nor the CPU's flash kernel (0 in a row that a NaN in the
// query made NaN; fuzz seed 20261244 program 287).  ATen prefers cuDNN to
// flash on sm_90 for the shapes both take.
// NB: where the choice raises (every backend disabled, say), the masked call
// raises the original's error.
bool unmaskedKeepsNonFinite(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    std::optional<double> scale,
    bool enable_gqa) {
  if (!query.is_cuda()) {
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
// CUDA.  Made here, before the call, so that FusedAttentionFunction saves
// the tensors the call computes on, as the original's backward does:
// autocast's copies, which a later in-place write to the inputs does not
// touch (or the inputs themselves, where no cast is needed).
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
  const bool recorded = c10::GradMode::is_enabled() &&
      (query.requires_grad() || key.requires_grad() || value.requires_grad());
  if (query.dim() < 2 || key.dim() < 2) {
    // NB: a rank ATen rejects gets ATen's error from the unmasked call.
    return at::scaled_dot_product_attention(
        query, key, value, std::nullopt, 0.0, false, scale, enable_gqa);
  }
  if (unmaskedKeepsNonFinite(query, key, value, scale, enable_gqa)) {
    return recorded ? FusedAttentionFunction::apply(query, key, value, scale, enable_gqa)
                    : at::scaled_dot_product_attention(
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
