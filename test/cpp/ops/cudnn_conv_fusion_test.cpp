// kernels/cudnn/conv_fusion.h on the CPU: which activations the cuDNN graph
// expresses with eager's values, and that an inexpressible problem is
// refused (nullptr) before cuDNN is asked, never thrown.  The graphs
// themselves run in test/python/test_cuda_conv_fusion.py on a GPU.

#include <gtest/gtest.h>

#include "kernels/cudnn/conv_fusion.h"

namespace {

using torchfuse::kernels::Activation;
using torchfuse::kernels::ActivationKind;
namespace kc = torchfuse::kernels::cudnn;

TEST(CudnnConvFusion, ExpressesTheActivationsWithEagersValues) {
  for (const auto kind :
       {ActivationKind::kNone, ActivationKind::kRelu, ActivationKind::kLeakyRelu,
        ActivationKind::kSilu, ActivationKind::kSigmoid, ActivationKind::kGelu,
        ActivationKind::kHardsigmoid, ActivationKind::kHardswish}) {
    EXPECT_TRUE(kc::expressible(Activation{kind, 0.f, 0.f})) << static_cast<int>(kind);
  }
  EXPECT_TRUE(kc::expressible(Activation{ActivationKind::kHardtanh, 0.f, 6.f}));
  EXPECT_TRUE(kc::expressible(Activation{ActivationKind::kHardtanh, -1.f, -1.f}));
  // hardtanh with min > max raises in eager; cuDNN's tanh-GELU is less
  // accurate than ATen's
  EXPECT_FALSE(kc::expressible(Activation{ActivationKind::kHardtanh, 1.f, -1.f}));
  EXPECT_FALSE(kc::expressible(Activation{ActivationKind::kGeluTanh, 0.f, 0.f}));
}

kc::ConvFusionProblem problem(Activation act, int64_t groups = 1) {
  kc::ConvFusionProblem p;
  p.n = 2, p.c = 8, p.h = 6, p.w = 6, p.k = 8, p.r = 3, p.s = 3, p.p = 6, p.q = 6;
  p.padding = {1, 1};
  p.groups = groups;
  p.act = act;
  return p;
}

TEST(CudnnConvFusion, RefusesWhatItCannotExpressWithoutAskingCudnn) {
  // NB: no handle: a refusal must come before any cuDNN call
  EXPECT_EQ(kc::ConvFusion::create(problem({ActivationKind::kGeluTanh}), nullptr, 1, 0), nullptr);
  EXPECT_EQ(
      kc::ConvFusion::create(problem({ActivationKind::kHardtanh, 2.f, 1.f}), nullptr, 1, 0),
      nullptr);
  EXPECT_EQ(kc::ConvFusion::create(problem({ActivationKind::kRelu}, 3), nullptr, 1, 0), nullptr);
  EXPECT_EQ(kc::ConvFusion::create(problem({ActivationKind::kRelu}, 0), nullptr, 1, 0), nullptr);
}

} // namespace
