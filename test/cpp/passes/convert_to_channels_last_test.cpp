#include "passes/convert_to_channels_last.h"
#include "test/cpp/passes/pass_test_utils.h"
#include "torchfuse/optimize.h"
#include "torchfuse/passes.h"

#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/testing/file_check.h>

#include <string>
#include <vector>

namespace torchfuse::passes {
namespace {

using testing::runGraph;
using torch::jit::testing::FileCheck;

// Parses `body` after a header of frozen-style constants: weights %w1
// [8, 3, 3, 3], %w2 [8, 8, 3, 3], %wg [8, 2, 3, 3] (groups 4), bias %b [8],
// and the usual int lists.  The tensor constants get seeded signed values.
std::shared_ptr<torch::jit::Graph> frozen(const std::string& inputs, const std::string& body) {
  const std::string ir = "graph(" + inputs + R"IR():
  %w1 : Float(8, 3, 3, 3, strides=[27, 9, 3, 1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %w2 : Float(8, 8, 3, 3, strides=[72, 9, 3, 1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %w0 : Float(8, 1, 3, 3, strides=[9, 9, 3, 1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %wg : Float(8, 2, 3, 3, strides=[18, 9, 3, 1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %b : Float(8, strides=[1], requires_grad=0, device=cpu) = prim::Constant[value=<Tensor>]()
  %none : NoneType = prim::Constant()
  %one : int[] = prim::Constant[value=[1, 1]]()
  %two : int[] = prim::Constant[value=[2, 2]]()
  %zero : int[] = prim::Constant[value=[0, 0]]()
  %g1 : int = prim::Constant[value=1]()
  %g4 : int = prim::Constant[value=4]()
  %alpha : int = prim::Constant[value=1]()
  %start : int = prim::Constant[value=1]()
  %end : int = prim::Constant[value=-1]()
)IR" + body;
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get(), /*parse_tensor_constants=*/true);
  torch::manual_seed(0);
  for (auto* n : graph->nodes()) {
    if (n->kind() == c10::prim::Constant && n->hasAttribute(c10::attr::value) &&
        n->kindOf(c10::attr::value) == torch::jit::AttributeKind::t) {
      const auto t = n->t(c10::attr::value);
      // NB: 1-D ones (biases, BatchNorm's statistics) positive
      n->t_(c10::attr::value, t.dim() == 1 ? at::rand(t.sizes()) + 0.5 : at::randn(t.sizes()));
    }
  }
  return graph;
}

at::Tensor weightOf(torch::jit::Graph& graph, const char* kind) {
  for (auto* n : graph.nodes()) {
    if (n->kind() == c10::Symbol::fromQualString(kind)) {
      return torch::jit::toIValue(n->input(1))->toTensor();
    }
  }
  ADD_FAILURE() << "no " << kind;
  return {};
}

// The inputs each test runs: NCHW, channels-last, both again for a batch of
// one (whose channels-last strides are ambiguous where C = 1), a sliced
// one, a transposed one, and unbatched ones, NCHW and channels-last.
std::vector<at::Tensor> images(int64_t channels, bool unbatched = true) {
  torch::manual_seed(1);
  const auto x = at::randn({2, channels, 9, 9});
  const auto one = at::randn({1, channels, 9, 9});
  std::vector<at::Tensor> in = {
      x,
      x.contiguous(at::MemoryFormat::ChannelsLast),
      one,
      one.contiguous(at::MemoryFormat::ChannelsLast),
      at::randn({2, channels, 9, 12}).slice(3, 1, 10),
      at::randn({2, channels, 9, 9}).permute({0, 1, 3, 2}),
  };
  if (unbatched) {
    in.push_back(at::randn({channels, 9, 9}));
    in.push_back(at::randn({channels, 9, 9}).permute({1, 2, 0}).contiguous().permute({2, 0, 1}));
  }
  return in;
}

// Every output of `converted` has the values and the strides of
// `original`'s, for each image.
void expectSameLayoutsAndValues(
    const std::shared_ptr<torch::jit::Graph>& original,
    const std::shared_ptr<torch::jit::Graph>& converted,
    const std::vector<at::Tensor>& inputs) {
  for (const auto& x : inputs) {
    const auto expected = runGraph(original, {x});
    const auto actual = runGraph(converted, {x});
    ASSERT_EQ(actual.size(), expected.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      const auto e = expected[i].toTensor();
      const auto a = actual[i].toTensor();
      EXPECT_EQ(a.sizes(), e.sizes());
      EXPECT_EQ(a.strides(), e.strides()) << "output " << i << " for input strides " << x.strides();
      EXPECT_TRUE(at::allclose(a, e, 1e-4, 1e-5))
          << "output " << i << " max abs diff " << (a - e).abs().max().item<double>();
    }
  }
}

int64_t force(std::shared_ptr<torch::jit::Graph>& g) {
  return ConvertToChannelsLast(g, /*force=*/true);
}

const char* kStack = R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %r : Tensor = aten::relu_(%y)
  %p : Tensor = aten::max_pool2d(%r, %two, %two, %zero, %one, %false)
  %z : Tensor = aten::conv2d(%p, %w2, %none, %one, %one, %one, %g1)
  %s : Tensor = aten::add(%z, %p, %alpha)
  %h : Tensor = aten::hardswish(%s)
  return (%h))IR";

TEST(ConvertToChannelsLast, ConvertsWeightsAndRestoresAtTheOutput) {
  auto graph =
      frozen("%x : Tensor", std::string("  %false : bool = prim::Constant[value=0]()") + kStack);
  auto converted = graph->copy();
  EXPECT_EQ(force(converted), 2);
  converted->lint();
  FileCheck()
      .check("aten::conv2d")
      ->check("aten::conv2d")
      ->check("aten::hardswish")
      ->check("torchfuse::custom_restore_layout(")
      ->check_next("return")
      ->run(*converted);
  EXPECT_TRUE(weightOf(*converted, "aten::conv2d").is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_FALSE(weightOf(*converted, "aten::conv2d").is_contiguous());
  expectSameLayoutsAndValues(graph, converted, images(3));
}

TEST(ConvertToChannelsLast, RestoresBeforeAViewAndLeavesMetadataReadsAlone) {
  auto graph = frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %n : int = aten::size(%y, %g1)
  %f : Tensor = aten::flatten(%y, %start, %end)
  %t : Tensor = aten::transpose(%y, %start, %end)
  return (%f, %t, %n))IR");
  auto converted = graph->copy();
  EXPECT_EQ(force(converted), 1);
  converted->lint();
  FileCheck()
      .check("aten::size(")
      ->check("torchfuse::custom_restore_layout(")
      ->check_next("aten::flatten")
      ->check_not("torchfuse::custom_restore_layout")
      ->run(*converted);
  const std::vector<at::Tensor> in = images(3);
  for (const auto& x : in) {
    const auto e = runGraph(graph, {x});
    const auto a = runGraph(converted, {x});
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(a[i].toTensor().strides(), e[i].toTensor().strides());
      EXPECT_TRUE(at::allclose(a[i].toTensor(), e[i].toTensor(), 1e-4, 1e-5));
    }
    EXPECT_EQ(a[2].toInt(), e[2].toInt());
  }
}

// custom_add_layer_norm normalizes the last dims, as aten::layer_norm: a
// region value reaching it is restored to the original's layout first.
TEST(ConvertToChannelsLast, RestoresBeforeAnAddLayerNorm) {
  auto graph = frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %r : Tensor = aten::relu(%y)
  %ns : int[] = prim::Constant[value=[9]]()
  %eps : float = prim::Constant[value=1.0000000000000001e-05]()
  %true : bool = prim::Constant[value=1]()
  %o : Tensor, %s : Tensor = torchfuse::custom_add_layer_norm(%y, %r, %alpha, %true, %ns, %none, %none, %eps, %true)
  return (%o, %s))IR");
  auto converted = graph->copy();
  EXPECT_EQ(force(converted), 1);
  converted->lint();
  FileCheck()
      .check("aten::relu")
      ->check("torchfuse::custom_restore_layout(")
      ->check("torchfuse::custom_add_layer_norm")
      ->run(*converted);
  expectSameLayoutsAndValues(graph, converted, images(3));
}

TEST(ConvertToChannelsLast, KeepsCatPoolingBatchNormAndTheSeGateInside) {
  auto graph = frozen("%x : Tensor", R"IR(
  %false : bool = prim::Constant[value=0]()
  %eps : float = prim::Constant[value=1e-05]()
  %mom : float = prim::Constant[value=0.1]()
  %out1 : int[] = prim::Constant[value=[1, 1]]()
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %bn : Tensor = aten::batch_norm(%y, %b, %b, %b, %b, %false, %mom, %eps, %false)
  %q : Tensor = aten::avg_pool2d(%bn, %two, %two, %zero, %false, %false, %none)
  %a : Tensor = aten::adaptive_avg_pool2d(%q, %out1)
  %s : Tensor = aten::sigmoid(%a)
  %m : Tensor = aten::mul(%q, %s)
  %z : Tensor = aten::conv2d(%m, %wg, %none, %one, %one, %one, %g4)
  %l : Tensor[] = prim::ListConstruct(%z, %m)
  %c : Tensor = aten::cat(%l, %g1)
  return (%c))IR");
  auto converted = graph->copy();
  EXPECT_EQ(force(converted), 2);
  converted->lint();
  FileCheck().check_count("torchfuse::custom_restore_layout", 1, /*exactly=*/true)->run(*converted);
  // The squeeze: the same values and strides, without ATen's NHWC staging.
  FileCheck()
      .check_not("aten::adaptive_avg_pool2d")
      ->check("torchfuse::custom_spatial_mean(")
      ->run(*converted);
  FileCheck()
      .check("aten::cat")
      ->check_next("torchfuse::custom_restore_layout(")
      ->check_next("return")
      ->run(*converted);
  // NB: batch_norm reads an unbatched [C, H, W] input's dim 1 as channels
  expectSameLayoutsAndValues(graph, converted, images(3, /*unbatched=*/false));
}

// The If's blocks hold `block0` (one of them an op the region does not
// admit, or only admitted ones); the restore op goes before it or after.
void expectIfRestoredAt(const std::string& block0, bool before_if) {
  auto graph = frozen("%x : Tensor, %k : bool", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %o : Tensor = prim::If(%k)
    block0():
)IR" + block0 + R"IR(
      -> (%n)
    block1():
      -> (%y)
  return (%o))IR");
  auto converted = graph->copy();
  EXPECT_EQ(force(converted), 1);
  converted->lint();
  if (before_if) {
    FileCheck().check("torchfuse::custom_restore_layout(")->check_next("prim::If")->run(*converted);
  } else {
    FileCheck()
        .check("prim::If")
        ->check("block1")
        ->check("torchfuse::custom_restore_layout(")
        ->run(*converted);
  }
  for (const auto& x : images(3)) {
    for (bool k : {true, false}) {
      const auto e = runGraph(graph, {x, k})[0].toTensor();
      const auto a = runGraph(converted, {x, k})[0].toTensor();
      EXPECT_EQ(a.strides(), e.strides());
      EXPECT_TRUE(at::allclose(a, e, 1e-4, 1e-5));
    }
  }
}

TEST(ConvertToChannelsLast, RestoresWhereAValueEntersABlock) {
  // admitIf's negative form: clone is not a region op
  expectIfRestoredAt("      %n : Tensor = aten::clone(%y, %none)\n", /*before_if=*/true);
}

TEST(ConvertToChannelsLast, KeepsAnIfOfAdmittedBlocksInside) {
  expectIfRestoredAt("      %n : Tensor = aten::neg(%y)\n", /*before_if=*/false);
}

TEST(ConvertToChannelsLast, GivesAmbiguousSingleChannelImagesTheOriginalsLayout) {
  // NB: [N, 1, H, W] and [N, C, 1, 1] are contiguous in both formats; the
  // convolution goes by suggest_memory_format, and so does the restore op.
  auto graph = frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w0, %b, %one, %one, %one, %g1)
  %r : Tensor = aten::relu(%y)
  %z : Tensor = aten::conv2d(%r, %w2, %none, %one, %one, %one, %g1)
  return (%z, %r))IR");
  auto converted = graph->copy();
  EXPECT_EQ(force(converted), 2);
  torch::manual_seed(2);
  std::vector<at::Tensor> in = images(1);
  for (const auto& t :
       {at::randn({2, 1, 1, 1}), at::randn({3, 1, 1, 7}), at::randn({1, 1, 1, 1})}) {
    in.push_back(t);
    in.push_back(t.contiguous(at::MemoryFormat::ChannelsLast));
  }
  expectSameLayoutsAndValues(graph, converted, in);
}

void expectUnchanged(std::shared_ptr<torch::jit::Graph> graph) {
  const auto before = graph->toString();
  EXPECT_EQ(force(graph), 0);
  EXPECT_EQ(graph->toString(), before);
}

TEST(ConvertToChannelsLast, SkipsTwoDynamicEntries) {
  expectUnchanged(frozen("%x : Tensor, %x2 : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %z : Tensor = aten::conv2d(%x2, %w1, %b, %one, %one, %one, %g1)
  %s : Tensor = aten::add(%y, %z, %alpha)
  return (%s))IR"));
}

TEST(ConvertToChannelsLast, SkipsAnUnknownOpBetweenConvolutions) {
  // NB: the second conv's input comes from outside the region: a second entry
  expectUnchanged(frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %t : Tensor = aten::transpose(%y, %start, %end)
  %z : Tensor = aten::conv2d(%t, %w2, %none, %one, %one, %one, %g1)
  return (%z))IR"));
}

TEST(ConvertToChannelsLast, SkipsAWeightANonConvolutionReads) {
  expectUnchanged(frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %n : Tensor = aten::neg(%w1)
  return (%y, %n))IR"));
}

TEST(ConvertToChannelsLast, SkipsAValueWrittenAfterItLeaves) {
  expectUnchanged(frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %f : Tensor = aten::flatten(%y, %start, %end)
  %r : Tensor = aten::relu_(%y)
  return (%f))IR"));
}

TEST(ConvertToChannelsLast, SkipsAWrittenEntry) {
  expectUnchanged(frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %r : Tensor = aten::relu_(%x)
  return (%y))IR"));
}

TEST(ConvertToChannelsLast, SkipsWeightsOffCudaInAutoMode) {
  auto graph = frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %one, %one, %one, %g1)
  %z : Tensor = aten::conv2d(%y, %w2, %none, %one, %one, %one, %g1)
  return (%z))IR");
  const auto before = graph->toString();
  EXPECT_EQ(ConvertToChannelsLast(graph, /*force=*/false), 0);
  EXPECT_EQ(graph->toString(), before);
  // ... although its cost model favours channels-last for these convs
  EXPECT_LT(*channelsLastFlopRatio(graph), 1.0);
}

TEST(ConvertToChannelsLast, CostModelRejectsGroupedConvolutions) {
  // NB: grouped (2 input channels per group) convs dominate the FLOPs
  auto graph = frozen("%x : Tensor", R"IR(
  %y : Tensor = aten::conv2d(%x, %w1, %b, %two, %one, %one, %g1)
  %z : Tensor = aten::conv2d(%y, %wg, %none, %one, %one, %one, %g4)
  %z2 : Tensor = aten::conv2d(%z, %wg, %none, %one, %one, %one, %g4)
  return (%z2))IR");
  EXPECT_GT(*channelsLastFlopRatio(graph), 1.0);
  auto empty = frozen("%x : Tensor", "  return (%x)");
  EXPECT_FALSE(channelsLastFlopRatio(empty).has_value());
}

TEST(ConvertToChannelsLast, OptimizeRunsItOnlyWhereAsked) {
  torch::jit::Module m("m");
  torch::manual_seed(0);
  m.register_parameter("w", at::randn({4, 3, 3, 3}), false);
  m.define(R"JIT(
def forward(self, x):
    return torch.relu(torch.conv2d(x, self.w, None, [1, 1], [1, 1]))
)JIT");
  m.eval();
  const auto restores = [](const torch::jit::Module& out) {
    return out.get_method("forward").graph()->toString().find("custom_restore_layout") !=
        std::string::npos;
  };
  OptimizeOptions options;
  options.freeze = true;
  EXPECT_FALSE(restores(optimize(m, options))); // auto: CPU weights keep NCHW
  options.layout = Layout::Keep;
  EXPECT_FALSE(restores(optimize(m, options)));
  options.layout = Layout::ChannelsLast;
  auto out = optimize(m, options);
  EXPECT_TRUE(restores(out));
  const auto x = at::randn({2, 3, 5, 5});
  const auto e = m.forward({x}).toTensor();
  const auto a = out.forward({x}).toTensor();
  EXPECT_EQ(a.strides(), e.strides());
  EXPECT_TRUE(at::allclose(a, e, 1e-4, 1e-5));
  // Unfrozen: the weight converted per call, the same values and strides.
  options.freeze = false;
  auto unfrozen = optimize(m, options);
  const auto graph = unfrozen.get_method("forward").graph()->toString();
  EXPECT_NE(graph.find("custom_channels_last_weight"), std::string::npos);
  EXPECT_TRUE(restores(unfrozen));
  const auto u = unfrozen.forward({x}).toTensor();
  EXPECT_EQ(u.strides(), e.strides());
  EXPECT_TRUE(at::allclose(u, e, 1e-4, 1e-5));
  options.layout = Layout::Auto; // CPU weights: unchanged
  EXPECT_FALSE(restores(optimize(m, options)));
}

} // namespace
} // namespace torchfuse::passes
