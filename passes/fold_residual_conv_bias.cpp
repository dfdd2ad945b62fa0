// FoldResidualConvBias (frozen graphs, after the fusions):
//   o = conv(x, W2, b2, ...)
//   out = custom_conv_add_act(y, W1, b1, ..., other=o, alpha, ...)
//   =>  o = conv(x, W2, None, ...)
//       out = custom_conv_add_act(y, W1, b1 + alpha * b2, ..., other=o, alpha, ...)
// resnet's downsampling blocks: relu(conv3(y) + b3 + downsample(x) + b_ds).
// NB: the op computes act(conv(y) + b1 + alpha * (conv(x) + b2)); where b1
// and b2 are per-channel biases of the same channels this is
// act(conv(y) + (b1 + alpha * b2) + alpha * conv(x)), up to rounding (one
// rounding of the folded bias, in float64, instead of one per element).  On
// CUDA, ATen's cuDNN path adds a conv's bias in a separate broadcast add over
// the whole output; the fused op adds its own in its epilogue.
// Where the conv is: aten::conv{1,2,3}d (either padding overload) or a
// non-transposed aten::_convolution, whose output only the op reads.
// Skipped: a bias or alpha that is not a constant (unfrozen graphs), biases
// of other dtypes, devices or sizes, convolutions of different spatial rank
// (their channel dims are not aligned), non-finite values.

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include <cmath>
#include <optional>
#include <string_view>
#include <vector>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

// custom_conv_add_act's inputs.
constexpr size_t kWeight = 1;
constexpr size_t kBias = 2;
constexpr size_t kOther = 7;
constexpr size_t kAlpha = 8;
constexpr size_t kOpInputs = 12;

bool isConvAddAct(const Node* n) {
  return n->kind() == c10::Symbol::fromQualString("torchfuse::custom_conv_add_act") &&
      n->inputs().size() == kOpInputs && n->outputs().size() == 1;
}

// A convolution whose bias (input 2) is added per output channel, at dim 1
// of a batched output: aten::conv{1,2,3}d, or aten::_convolution with a
// constant transposed=False.
bool isBiasedConv(const Node* n) {
  for (const char* conv : {"aten::conv1d", "aten::conv2d", "aten::conv3d"}) {
    if (hasSchema(n, conv, "") || hasSchema(n, conv, "padding")) {
      return true;
    }
  }
  return hasSchema(n, "aten::_convolution", "") && n->inputs().size() == 13 &&
      constantBool(n->input(6)) == false;
}

// The number of spatial dims of the convolution `n` computes: from the op
// for conv{1,2,3}d (it checks the weight), else from its constant weight.
std::optional<int64_t> spatialRank(const Node* n) {
  for (int64_t k = 1; k <= 3; ++k) {
    const auto name = "aten::conv" + std::to_string(k) + "d";
    if (n->maybeSchema() != nullptr && n->maybeSchema()->name() == name) {
      return k;
    }
  }
  const auto weight = constantTensor(n->input(kWeight));
  if (weight && weight->dim() >= 3 && weight->dim() <= 5) {
    return weight->dim() - 2;
  }
  return std::nullopt;
}

bool isFinite(const at::Tensor& t) {
  return at::isfinite(t).all().item<bool>();
}

// ---- the predicates, in the order they are checked ----

// The op's `other` is a convolution output with a bias that only the op
// reads: dropping the bias changes no other reader.
bool otherIsBiasedConvReadOnlyByOp(const Node* op) {
  const Value* other = op->input(kOther);
  const Node* conv = other->node();
  return isBiasedConv(conv) && conv->outputs().size() == 1 && hasSingleUse(other, op) &&
      !conv->input(kBias)->mustBeNone();
}

// alpha is a constant finite int or float: a runtime alpha cannot scale the
// folded bias, and with an infinite alpha, alpha * (c + b2) and
// alpha * b2 + alpha * c differ (inf vs nan for c + b2 > 0 > b2).
bool alphaIsFiniteConstant(const Node* op) {
  const auto alpha = torch::jit::toIValue(op->input(kAlpha));
  return alpha && (alpha->isInt() || (alpha->isDouble() && std::isfinite(alpha->toDouble())));
}

// b2 is a constant 1-d floating-point tensor of finite values, and b1 is a
// constant None or one too (a frozen graph's parameters are constants).
bool biasesAreFiniteConstants(const Node* op, const Node* conv) {
  const auto ok = [](const std::optional<at::Tensor>& b) {
    return b && b->dim() == 1 && at::isFloatingType(b->scalar_type()) && isFinite(*b);
  };
  const Value* b1 = op->input(kBias);
  return ok(constantTensor(conv->input(kBias))) && (b1->mustBeNone() || ok(constantTensor(b1)));
}

// b1 and b2 have one dtype, device and size; without b1, b2 takes its place,
// so it must be a bias the op's conv takes: of its constant weight's dtype
// and device, one value per output channel.
bool biasesAgree(const Node* op, const Node* conv) {
  const auto b2 = *constantTensor(conv->input(kBias));
  const auto like = [&](const at::Tensor& t) {
    return t.scalar_type() == b2.scalar_type() && t.device() == b2.device();
  };
  if (const auto b1 = constantTensor(op->input(kBias))) {
    return like(*b1) && b1->numel() == b2.numel();
  }
  const auto w1 = constantTensor(op->input(kWeight));
  return w1 && w1->dim() >= 1 && like(*w1) && w1->size(0) == b2.numel();
}

// NB: a frozen graph has no shapes, but a convolution with k spatial dims
// puts its channels k + 1 dims from the end, batched or not: when both
// convolutions have k spatial dims, the add (which aligns trailing dims when
// it broadcasts) adds b1 and b2 to the same dim of the output, whatever the
// ranks of the inputs.  Of different k (conv1d into a conv2d chain), b2
// indexes another dim.
bool residualConvsShareChannelDim(const Node* op, const Node* conv) {
  const auto k1 = spatialRank(op);
  const auto k2 = spatialRank(conv);
  return k1 && k2 && *k1 == *k2;
}

// Folds at `op` where every predicate holds; returns whether it did.
bool foldAt(Node* op) {
  if (!otherIsBiasedConvReadOnlyByOp(op)) {
    return false;
  }
  Node* conv = op->input(kOther)->node();
  if (!alphaIsFiniteConstant(op) || !biasesAreFiniteConstants(op, conv) || !biasesAgree(op, conv) ||
      !residualConvsShareChannelDim(op, conv)) {
    return false;
  }
  const auto b2 = *constantTensor(conv->input(kBias));
  const auto b1 = constantTensor(op->input(kBias));
  const auto alpha = torch::jit::toIValue(op->input(kAlpha))->toScalar().toDouble();
  at::Tensor folded;
  {
    at::NoGradGuard no_grad;
    const auto host = [](const at::Tensor& t) { return t.to(at::kCPU, at::kDouble); };
    auto sum = host(b2).mul(alpha);
    if (b1) {
      sum.add_(host(*b1));
    }
    folded = sum.to(b2.device(), b2.scalar_type()).contiguous();
  }
  auto& graph = *op->owningGraph();
  {
    torch::jit::WithInsertPoint guard(op);
    op->replaceInput(kBias, graph.insertConstant(folded));
  }
  {
    torch::jit::WithInsertPoint guard(conv);
    conv->replaceInput(kBias, graph.insertConstant(c10::IValue()));
  }
  return true;
}

} // namespace

int64_t FoldResidualConvBias(std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<Node*> ops;
  forEachNode(graph->block(), [&](Node* n) {
    if (isConvAddAct(n)) {
      ops.push_back(n);
    }
  });
  int64_t folded = 0;
  for (auto* op : ops) {
    folded += foldAt(op) ? 1 : 0;
  }
  GRAPH_DUMP("After FoldResidualConvBias", graph);
  return folded;
}

} // namespace torchfuse::passes
