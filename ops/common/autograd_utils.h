#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/core/Scalar.h>

#include <initializer_list>
#include <optional>

namespace torchfuse::ops {

inline bool requiresGrad(const at::Tensor& t) {
  return t.defined() && t.requires_grad();
}
inline bool requiresGrad(const std::optional<at::Tensor>& t) {
  return t.has_value() && requiresGrad(*t);
}

// NB: the Autograd kernel still runs under NoGradGuard, so it checks by itself
// whether a graph will be recorded, and otherwise skips masks and saved state.
template <typename... Ts>
bool needsGraph(const Ts&... tensors) {
  return c10::GradMode::is_enabled() && (requiresGrad(tensors) || ...);
}

inline at::Tensor orUndefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}
inline std::optional<at::Tensor> toOptional(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// NB: Function::apply skips an absent optional tensor argument (an undefined
// at::Tensor argument would fail there), so needs_input_grad indexes only the
// tensor arguments that are present.  `present` lists, for each tensor
// argument in order, whether it is present; returns needs_input_grad of
// tensor argument `arg`.
template <typename Context>
bool needsTensorGrad(
    Context* ctx,
    std::initializer_list<bool> present,
    size_t arg) {
  size_t index = 0;
  size_t i = 0;
  for (const bool p : present) {
    if (i == arg) {
      return p && ctx->needs_input_grad(index);
    }
    index += p ? 1 : 0;
    ++i;
  }
  return false;
}

// The gradient of `alpha * other`, skipping the product for alpha == 1 as
// aten::add's derivative does.
inline at::Tensor scaledBy(const at::Tensor& grad, const c10::Scalar& alpha) {
  return alpha.equal(1) ? grad : grad.mul(alpha);
}

// The Autograd kernel of a custom_*_backward op: its gradient has no formula,
// so recording one is refused with a clear error instead of the autograd
// fallback's warning.
template <typename... Ts>
void refuseDoubleBackward(const char* op, const Ts&... tensors) {
  TORCH_CHECK(
      !needsGraph(tensors...), op,
      ": double backward is not supported");
}

} // namespace torchfuse::ops
