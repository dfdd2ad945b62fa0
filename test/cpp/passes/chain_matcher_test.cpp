#include "passes/chain_matcher.h"
#include "test/cpp/passes/pass_test_utils.h"

namespace torchfuse::passes {
namespace {

using testing::parse;
using torch::jit::testing::FileCheck;

// linear -> add (either operand) -> relu, the links of FuseLinearAddRelu.
std::vector<Link> linearAddRelu() {
  return {
      {[](const Node* n) { return isLinear(n); }, {}},
      {[](const Node* n) { return isTensorAdd(n); }, {0, 1}},
      {[](const Node* n) { return isRelu(n); }, {0}},
  };
}

Node* returned(const std::shared_ptr<torch::jit::Graph>& g, size_t i = 0) {
  return g->outputs().at(i)->node();
}

constexpr const char* kBothOperands = R"IR(
graph(%x : Tensor, %w : Tensor, %v : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::linear(%x, %w, %none)
  %b : Tensor = aten::linear(%x, %v, %none)
  %s : Tensor = aten::add(%a, %b, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR";

TEST(ChainMatcher, FindsTheChainThroughEitherOperandInOrder) {
  auto g = parse(kBothOperands);
  const auto chains = matchChains(returned(g), linearAddRelu());
  ASSERT_EQ(chains.size(), 2u);
  EXPECT_EQ(chains[0].operand, (std::vector<size_t>{0, 0, 0}));
  EXPECT_EQ(chains[1].operand, (std::vector<size_t>{0, 1, 0}));
  EXPECT_EQ(chains[0].head()->input(1)->debugName(), "w");
  EXPECT_EQ(chains[1].head()->input(1)->debugName(), "v");
  EXPECT_EQ(chains[0].otherOperand(1), chains[1].head()->output());
  EXPECT_EQ(chains[1].otherOperand(1), chains[0].head()->output());
  EXPECT_EQ(chains[0].tail(), returned(g));
}

TEST(ChainMatcher, ExternalInputsAreTheInputsNoChainNodeProduces) {
  auto g = parse(kBothOperands);
  const auto chains = matchChains(returned(g), linearAddRelu());
  const auto& chain = chains.at(0);
  const auto inputs = chain.externalInputs();
  ASSERT_EQ(inputs.size(), 5u);
  EXPECT_EQ(inputs[0], g->inputs()[0]);  // x
  EXPECT_EQ(inputs[1], g->inputs()[1]);  // w
  EXPECT_EQ(inputs[2], chain.head()->input(2));  // the None bias
  EXPECT_EQ(inputs[3], chains.at(1).head()->output());  // the other linear
  EXPECT_EQ(inputs[4], chain.nodes[1]->input(2));  // alpha
}

TEST(ChainMatcher, SkipsAnIntermediateWithAnotherUse) {
  auto g = parse(R"IR(
graph(%x : Tensor, %w : Tensor, %r : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::linear(%x, %w, %none)
  %s : Tensor = aten::add(%a, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o, %a))IR");
  EXPECT_TRUE(matchChains(returned(g), linearAddRelu()).empty());
}

TEST(ChainMatcher, SkipsAnInPlaceLinkOnALiveTensor) {
  // add_ writes %r, the chain's other operand, not the linear output.
  auto g = parse(R"IR(
graph(%x : Tensor, %w : Tensor, %r : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::linear(%x, %w, %none)
  %s : Tensor = aten::add_(%r, %a, %one)
  %o : Tensor = aten::relu(%s)
  return (%o))IR");
  EXPECT_TRUE(matchChains(returned(g), linearAddRelu()).empty());
}

TEST(ChainMatcher, SkipsAChainAcrossBlocks) {
  auto g = parse(R"IR(
graph(%c : bool, %x : Tensor, %w : Tensor, %r : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::linear(%x, %w, %none)
  %o : Tensor = prim::If(%c)
    block0():
      %s : Tensor = aten::add(%a, %r, %one)
      %t : Tensor = aten::relu(%s)
      -> (%t)
    block1():
      -> (%r)
  return (%o))IR");
  Node* relu = nullptr;
  forEachNode(g->block(), [&](Node* n) {
    relu = isRelu(n) ? n : relu;
  });
  ASSERT_NE(relu, nullptr);
  EXPECT_TRUE(matchChains(relu, linearAddRelu()).empty());
}

TEST(ChainMatcher, FuseChainsRewritesAndDestroysTheChain) {
  auto g = parse(kBothOperands);
  const auto fused = fuseChains(
      g, linearAddRelu(), "torchfuse::custom_linear_add_relu",
      [](const Chain&, const AliasDb&) { return true; },
      [](const Chain& c) -> std::vector<Value*> {
        return {c.head()->input(0), c.head()->input(1), c.head()->input(2),
                c.otherOperand(1), c.nodes[1]->input(2)};
      });
  EXPECT_EQ(fused, 1);
  g->lint();
  FileCheck()
      .check("aten::linear(%x, %v")
      ->check("torchfuse::custom_linear_add_relu(%x, %w")
      ->check_not("aten::relu")
      ->run(*g);
}

TEST(ChainMatcher, FuseChainsSkipsWritesBetweenHeadAndTail) {
  auto g = parse(R"IR(
graph(%x : Tensor, %w : Tensor, %r : Tensor):
  %none : NoneType = prim::Constant()
  %one : int = prim::Constant[value=1]()
  %a : Tensor = aten::linear(%x, %w, %none)
  %z : Tensor = aten::mul_(%r, %one)
  %s : Tensor = aten::add(%a, %r, %one)
  %o : Tensor = aten::relu(%s)
  return (%o, %z))IR");
  const auto before = g->toString();
  const auto fused = fuseChains(
      g, linearAddRelu(), "torchfuse::custom_linear_add_relu",
      [](const Chain&, const AliasDb&) { return true; },
      [](const Chain&) { return std::vector<Value*>{}; });
  EXPECT_EQ(fused, 0);
  EXPECT_EQ(g->toString(), before);
}

TEST(ChainMatcher, ReplaceChainLeavesTheGraphWhenNoSchemaMatches) {
  auto g = parse(kBothOperands);
  const auto before = g->toString();
  const auto chain = matchChains(returned(g), linearAddRelu()).at(0);
  EXPECT_FALSE(replaceChain(
      *g, chain, "torchfuse::custom_linear_add_relu", {chain.head()->input(0)}));
  EXPECT_EQ(g->toString(), before);
}

} // namespace
} // namespace torchfuse::passes
