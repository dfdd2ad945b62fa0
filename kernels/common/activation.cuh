#pragma once

// The activations of kernels/common/activation.h in float, each as ATen's
// CUDA kernel computes it, so that NaN and Inf come out as eager's: relu and
// hardtanh keep NaN (comparisons with NaN are false), silu(-inf) and
// hardswish(-inf) are NaN (-inf * 0), exact gelu uses erf.

#include <type_traits>

#include "kernels/common/activation.h"

namespace torchfuse::kernels {

// std::max / std::min as ATen's kernels use them: the first argument when
// the comparison is false, so a NaN first argument propagates.
__device__ __forceinline__ float maxKeepNan(float x, float y) {
  return x < y ? y : x;
}
__device__ __forceinline__ float minKeepNan(float x, float y) {
  return y < x ? y : x;
}

// Approx: for results rounded to a 16-bit type.  silu and sigmoid then take
// __expf and __fdividef, whose few float ulps lie far below the result's
// rounding (2^-11 or 2^-8) and which keep NaN, +-inf and the saturated ends
// as expf and the IEEE division do; those two make a pass compute-bound.
template <ActivationKind K, bool Approx = false>
__device__ __forceinline__ float activate(float x, float a, float b) {
  if constexpr (K == ActivationKind::kRelu) {
    return x <= 0.f ? 0.f : x;
  } else if constexpr (K == ActivationKind::kHardtanh) {
    return minKeepNan(maxKeepNan(x, a), b); // clamp(x, a, b), as ATen's hardtanh
  } else if constexpr (K == ActivationKind::kSilu) {
    return Approx ? __fdividef(x, 1.f + __expf(-x)) : x / (1.f + expf(-x));
  } else if constexpr (K == ActivationKind::kHardswish) {
    return x * minKeepNan(maxKeepNan(x + 3.f, 0.f), 6.f) / 6.f;
  } else if constexpr (K == ActivationKind::kHardsigmoid) {
    return minKeepNan(maxKeepNan(x + 3.f, 0.f), 6.f) / 6.f;
  } else if constexpr (K == ActivationKind::kSigmoid) {
    return Approx ? __fdividef(1.f, 1.f + __expf(-x)) : 1.f / (1.f + expf(-x));
  } else if constexpr (K == ActivationKind::kGelu) {
    return x * 0.5f * (1.f + erff(x * 0.70710678118654752440f));
  } else if constexpr (K == ActivationKind::kGeluTanh) {
    constexpr float kBeta = 0.79788456080286535588f; // sqrt(2 / pi)
    constexpr float kKappa = 0.044715f;
    return 0.5f * x * (1.f + tanhf(kBeta * (x + kKappa * x * x * x)));
  } else if constexpr (K == ActivationKind::kLeakyRelu) {
    return x > 0.f ? x : x * a;
  } else {
    return x;
  }
}

// Calls f(std::integral_constant<ActivationKind, K>{}) for the kind at
// hand: one kernel instantiation per activation, picked on the host.
template <typename F>
void forActivation(ActivationKind kind, F&& f) {
  using K = ActivationKind;
  switch (kind) {
    case K::kNone:
      return f(std::integral_constant<K, K::kNone>{});
    case K::kRelu:
      return f(std::integral_constant<K, K::kRelu>{});
    case K::kHardtanh:
      return f(std::integral_constant<K, K::kHardtanh>{});
    case K::kSilu:
      return f(std::integral_constant<K, K::kSilu>{});
    case K::kHardswish:
      return f(std::integral_constant<K, K::kHardswish>{});
    case K::kHardsigmoid:
      return f(std::integral_constant<K, K::kHardsigmoid>{});
    case K::kSigmoid:
      return f(std::integral_constant<K, K::kSigmoid>{});
    case K::kGelu:
      return f(std::integral_constant<K, K::kGelu>{});
    case K::kGeluTanh:
      return f(std::integral_constant<K, K::kGeluTanh>{});
    case K::kLeakyRelu:
      return f(std::integral_constant<K, K::kLeakyRelu>{});
  }
}

} // namespace torchfuse::kernels
