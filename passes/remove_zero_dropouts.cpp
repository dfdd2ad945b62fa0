// RemoveZeroDropouts: a dropout of constant probability 0, or with a
// constant train=False, is its input.
//
// ATen's dropout returns its input itself when p == 0 (train or not), so
// eager and TorchScript's interpreter compute nothing for it.  TorchScript's
// autodiff does not: in a differentiable graph on CUDA it runs dropout as
// aten::native_dropout, whose fused kernel keeps an element where a uniform
// draw in (0, 1] is < 1 - p and so drops every element that draws exactly
// 1.0 even at p = 0.  A traced BERT-base in training (transformers traces
// its dropouts with the constant p; models for fine-tuning or benchmarking
// set it to 0) then loses a few hidden values per call, differently each
// call, and its outputs differ from eager's by up to 0.4 (measured on an
// H100 and an H200).  Replacing the node by its input is eager's semantics
// exactly (the output is the input, aliasing included) and removes the
// kernel.
// With train=False ATen returns the input itself too, while the schema
// promises a fresh tensor: AliasDb then takes an in-place write through the
// result (`F.relu6(F.dropout(x, 0.5, False), inplace=True)`, which writes x
// in eager) for a write to a dead fresh tensor, and EliminateDeadCode drops
// it.  Replaced by its input, the write is one to x, which stays.
// A dropout whose p or train is known only at run time (p a module
// attribute) may return its input too.  Where its result is written in place,
// it becomes
//   %y = prim::If(p == 0 or not train) -> (%x) else -> (dropout(%x, p, train))
// which AliasDb reads as possibly x, so the write stays (the node alone let
// EliminateDeadCode drop `F.hardtanh(F.dropout(x, self.p, True),
// inplace=True)`, a write to x in eager; fuzz seed 20261204 program 1234).

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include <algorithm>
#include <vector>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using torch::jit::Node;

// The dropouts whose ATen implementation returns the input at p == 0 or
// train == false (at::native::_dropout_impl), in-place forms included (they
// return self unchanged).
bool isDropout(const Node* n) {
  return n->matches("aten::dropout(Tensor input, float p, bool train) -> Tensor") ||
      n->matches("aten::feature_dropout(Tensor input, float p, bool train) -> Tensor") ||
      n->matches("aten::alpha_dropout(Tensor input, float p, bool train) -> Tensor") ||
      n->matches("aten::feature_alpha_dropout(Tensor input, float p, bool train) -> Tensor") ||
      n->matches("aten::dropout_(Tensor(a!) self, float p, bool train) -> Tensor(a!)") ||
      n->matches("aten::feature_dropout_(Tensor(a!) self, float p, bool train) -> Tensor(a!)") ||
      n->matches("aten::alpha_dropout_(Tensor(a!) self, float p, bool train) -> Tensor(a!)") ||
      n->matches(
          "aten::feature_alpha_dropout_(Tensor(a!) self, float p, bool train) -> Tensor(a!)");
}

// p is a constant 0 (traced dropouts' and scripted nn.Dropout's are): one
// read from a module attribute at run time may change.
bool zeroProbability(const Node* n) {
  const auto p = torch::jit::constant_as<double>(n->input(1));
  return p.has_value() && *p == 0.0;
}

// train is a constant false (a dropout called with training=False, or a
// frozen graph's self.training).
bool notTraining(const Node* n) {
  const auto train = torch::jit::constant_as<bool>(n->input(2));
  return train.has_value() && !*train;
}

// The out-of-place dropouts (the in-place ones return self by their schema).
bool isOutOfPlaceDropout(const Node* n) {
  return isDropout(n) && !n->schema().is_mutable();
}

// n is the else branch of guardByItsOwnCondition's If already (the pass
// runs before freezing and again in fuseGraph).
bool guarded(const Node* n) {
  const auto* block = n->owningBlock();
  const auto* owner = block->owningNode();
  return owner != nullptr && owner->kind() == c10::prim::If && owner->blocks().size() == 2 &&
      block == owner->blocks()[1] && block->outputs().size() == 1 &&
      block->outputs()[0] == n->output() && owner->blocks()[0]->outputs().size() == 1 &&
      owner->blocks()[0]->outputs()[0] == n->input(0);
}

// n (a dropout that may return its input) as prim::If(p == 0 or not train):
// its input, else the dropout, moved into the else block.
void guardByItsOwnCondition(torch::jit::Graph& graph, Node* n) {
  torch::jit::WithInsertPoint guard(n);
  Value* zero_p = graph.insert(c10::aten::eq, {n->input(1), 0.0});
  Value* not_train = graph.insert(c10::aten::__not__, {n->input(2)});
  Value* cond = graph.insert(c10::aten::__or__, {zero_p, not_train});
  Node* branch = graph.create(c10::prim::If, {cond}, 1);
  branch->insertBefore(n);
  branch->output()->setType(n->output()->type());
  branch->addBlock()->registerOutput(n->input(0));
  auto* otherwise = branch->addBlock();
  n->output()->replaceAllUsesWith(branch->output());
  n->moveBefore(otherwise->return_node());
  otherwise->registerOutput(n->output());
}

} // namespace

int64_t RemoveZeroDropouts(std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<Node*> zero;
  std::vector<Node*> runtime;
  forEachNode(graph->block(), [&](Node* n) {
    if (!isDropout(n)) {
      return;
    }
    if (zeroProbability(n) || notTraining(n)) {
      zero.push_back(n);
    } else if (isOutOfPlaceDropout(n) && !guarded(n)) {
      runtime.push_back(n);
    }
  });
  if (!runtime.empty()) {
    // NB: the alias analysis only where a run-time dropout exists (most
    // graphs have none); it sees the graph before any rewrite below.
    torch::jit::AliasDb db(graph);
    runtime.erase(
        std::remove_if(
            runtime.begin(), runtime.end(), [&](Node* n) { return !db.hasWriters(n->output()); }),
        runtime.end());
  }
  for (Node* n : zero) {
    n->output()->replaceAllUsesWith(n->input(0));
    n->destroy();
  }
  for (Node* n : runtime) {
    guardByItsOwnCondition(*graph, n);
  }
  return static_cast<int64_t>(zero.size());
}

} // namespace torchfuse::passes
