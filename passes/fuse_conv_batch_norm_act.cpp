// FuseConvBatchNormAct: out = act(batch_norm(conv(x, W, b, stride, padding,
//                                 dilation, groups), gamma, beta, mean, var,
//                                 training, momentum, eps, cudnn_enabled))
//   => torchfuse::custom_conv_batch_norm_act(x, W, b, stride, padding,
//        dilation, groups, gamma, beta, mean, var, training, momentum, eps,
//        cudnn_enabled, activation, activation_args)
//
// The unfrozen graph's chain: BatchNorm reads its statistics and affine
// parameters from module attributes and its `training` flag at run time, so
// no freeze folds it.  The op folds it per call in eval and runs the
// original ops in training (ops/conv_batch_norm_act.cpp).  Forms, longest
// first: conv -> batch_norm -> act (act as FuseConvAddAct's), conv ->
// batch_norm.  A batch_norm -> add -> act after the conv keeps its add and
// act: TorchScript's NNC fuses those two into one kernel, which the
// training path of an op ending in the add would split (one more pass over
// the activation per training step).
// A scripted BatchNorm reads its input's shape before it normalizes: its
// rank (`input.dim() != 4` raises) and, in training, its sizes (more than
// one value per channel, or it raises).  Those reads keep the conv output
// alive, so before matching they read the conv's input (the rank, which a
// conv keeps) or the conv's output size computed from its input and weight
// sizes (custom_conv_output_size, where the read was), so that errors come
// where and when they came (detachShapeReads).
// Excluded: a batch_norm whose `training` is the constant true (a module
// traced in training: nothing to fold, ever), chains whose intermediates
// have other uses, chains where a node between the conv and the tail writes
// what the op reads (module attributes other than those it reads do not
// count: the BatchNorm's own `num_batches_tracked += 1` sits there), and
// chains where a node between the batch_norm and the act reads or writes
// the running statistics (the op updates them at the act's position).
// NB: runs after batch_norm_add_div_swish (passes/registry.cpp), whose
// chain starts at the batch_norm.

#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include "passes/chain_matcher.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

constexpr const char* kOp = "torchfuse::custom_conv_batch_norm_act";

const Link kConv = {[](const Node* n) { return isIntListConv(n); }, {}};
const Link kBatchNorm = {[](const Node* n) { return isBatchNorm(n); }, {0}};
const Link kAct = {[](const Node* n) { return isFusableActivation(n); }, {0}};

// The batch_norm can run in eval: its `training` is not the constant true.
bool notTrainingConstant(const Node* bn) {
  const auto training = constantBool(bn->input(5));
  return !training.has_value() || !*training;
}

bool isShapeRead(const Node* n) {
  return hasSchema(n, "aten::dim", "") || hasSchema(n, "aten::size", "");
}

// conv -> batch_norm with nothing else reading the conv output but shape
// reads, and nothing but one node reading the batch_norm's.
bool onlyShapeReadsBesideBatchNorm(Node* conv, Node*& bn) {
  bn = nullptr;
  for (const auto& use : conv->output()->uses()) {
    if (isBatchNorm(use.user) && use.offset == 0 && bn == nullptr) {
      bn = use.user;
    } else if (!isShapeRead(use.user)) {
      return false;
    }
  }
  return bn != nullptr && bn->output()->uses().size() == 1 && notTrainingConstant(bn) &&
      inSameBlock({conv, bn});
}

// Points the shape reads of a conv output that feeds a batch_norm at
// equivalents that leave the conv output to the chain; returns how many.
int64_t detachShapeReads(torch::jit::Graph& graph) {
  std::vector<Node*> convs;
  forEachNode(graph.block(), [&](Node* n) {
    if (isIntListConv(n)) {
      convs.push_back(n);
    }
  });
  int64_t moved = 0;
  for (Node* conv : convs) {
    Node* bn = nullptr;
    if (!onlyShapeReadsBesideBatchNorm(conv, bn)) {
      continue;
    }
    std::vector<Node*> reads;
    for (const auto& use : conv->output()->uses()) {
      if (use.user != bn) {
        reads.push_back(use.user);
      }
    }
    for (Node* read : reads) {
      if (hasSchema(read, "aten::dim", "")) {
        read->replaceInput(0, conv->input(0)); // conv{1,2,3}d keep the rank
      } else {
        torch::jit::WithInsertPoint guard(read);
        auto* sizes = graph.insert(
            c10::Symbol::fromQualString("torchfuse::custom_conv_output_size"),
            {conv->input(0), conv->input(1), conv->input(3), conv->input(4), conv->input(5)});
        read->output()->replaceAllUsesWith(sizes);
        read->destroy();
      }
      ++moved;
    }
  }
  return moved;
}

std::vector<Value*> opInputs(const Chain& c, bool act) {
  Node* conv = c.nodes[0];
  Node* bn = c.nodes[1];
  auto& graph = *conv->owningGraph();
  torch::jit::WithInsertPoint guard(c.tail());
  std::vector<Value*> inputs(conv->inputs().begin(), conv->inputs().end());
  inputs.insert(inputs.end(), bn->inputs().begin() + 1, bn->inputs().end());
  ActivationSpec spec{"none", {}};
  if (act) {
    spec = *activationSpec(c.nodes[2]);
  }
  inputs.push_back(graph.insertConstant(spec.name));
  inputs.push_back(graph.insertConstant(spec.args));
  return inputs;
}

int64_t fuseForm(std::shared_ptr<torch::jit::Graph>& graph, bool act) {
  std::vector<Link> links = {kConv, kBatchNorm};
  if (act) {
    links.push_back(kAct);
  }
  // NB: the writes are judged on each side of the batch_norm, not across
  // it: the chain's own batch_norm writes its running statistics (AliasDb
  // says so wherever `training` is not the constant false), which the op
  // does too, at the same point of the order.
  auto accept = [&](const Chain& c, const AliasDb& db) {
    Node* bn = c.nodes[1];
    const auto inputs = c.externalInputs();
    return noInterveningWritesBesideOtherSlots(db, c.head(), bn, inputs) &&
        notTrainingConstant(bn) &&
        (!act ||
         (activationArgumentsAreConstant(c.nodes[2]) &&
          noInterveningWritesBesideOtherSlots(db, bn, c.tail(), inputs) &&
          noInterveningAccess(db, bn, c.tail(), {bn->input(3), bn->input(4)}, {})));
  };
  return fuseAll(
      graph,
      [&](Node* n, const AliasDb& db) -> std::optional<Chain> {
        for (auto& c : matchChains(n, links)) {
          if (accept(c, db)) {
            return c;
          }
        }
        return std::nullopt;
      },
      [&](torch::jit::Graph& g, const Chain& c) {
        return replaceChain(g, c, kOp, opInputs(c, act));
      });
}

} // namespace

int64_t FuseConvBatchNormAct(std::shared_ptr<torch::jit::Graph>& graph) {
  detachShapeReads(*graph);
  int64_t fused = fuseForm(graph, /*act=*/true);
  fused += fuseForm(graph, /*act=*/false);
  GRAPH_DUMP("After FuseConvBatchNormAct", graph);
  return fused;
}

} // namespace torchfuse::passes
