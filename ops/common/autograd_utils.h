#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>
#include <c10/core/Scalar.h>

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
