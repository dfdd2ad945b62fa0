#pragma once

#include "ops/cuda/conv/operands.h"

namespace torchfuse::ops::conv_cuda {

enum class ConvPass { kForward, kDataGradient, kWeightGradient };

// Whether eager's convolution (or one of its gradient convolutions) of
// exactly this problem rounds its inputs to TF32.  Asked of eager itself,
// once per problem and pass (cached); synchronizes the device the first time.
bool eagerConvIsTf32(const ConvProblem& p, ConvPass pass = ConvPass::kForward);

} // namespace torchfuse::ops::conv_cuda
