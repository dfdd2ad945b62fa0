#pragma once

// The activations custom_conv_add_act applies, as the kernels take them: a
// kind and its (at most two) float arguments.  Plain C++, so that ops/
// parses the op's `activation` string into it and kernels/ computes it
// (kernels/common/activation.cuh).

namespace torchfuse::kernels {

enum class ActivationKind : int {
  kNone,
  kRelu,
  kHardtanh, // a = min, b = max
  kSilu,
  kHardswish,
  kHardsigmoid,
  kSigmoid,
  kGelu, // exact, erf
  kGeluTanh,
  kLeakyRelu, // a = negative slope
};

struct Activation {
  ActivationKind kind = ActivationKind::kNone;
  float a = 0.f;
  float b = 0.f;
};

} // namespace torchfuse::kernels
