#pragma once

// Named match conditions shared by the fusion passes.  Each reads as a
// precondition of a rewrite, returns false when it does not hold, and never
// throws: a pass that cannot prove a condition leaves the graph unchanged.

#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/ir.h>

#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace torchfuse::passes {

using torch::jit::AliasDb;
using torch::jit::Block;
using torch::jit::Node;
using torch::jit::Value;

// ---- node kinds and overloads -------------------------------------------

// NB: kinds alone are not enough: aten::add covers Tensor + Tensor and
// Tensor + Scalar (`x + 1.0`), aten::div covers div.Tensor, div.Scalar and
// their rounding_mode forms, aten::conv2d covers the `padding: str` overload.
// These look at the resolved schema, so nodes without one never match.

// The node's resolved schema is `name` with overload `overload`.  Nodes the
// JIT cannot resolve (unknown op, mismatched input types) have no schema.
bool hasSchema(const Node* n, std::string_view name, std::string_view overload);
// aten::relu(Tensor) or, with allow_inplace, aten::relu_(Tensor(a!)).
bool isRelu(const Node* n, bool allow_inplace = true);
// aten::add.Tensor / aten::add_.Tensor with a Tensor `other` and an int or
// float alpha.
bool isTensorAdd(const Node* n, bool allow_inplace = true);
// aten::add.Tensor, out of place (addPromotes): the fused ops compute add,
// whose result takes the promoted dtype of both operands, while add_ keeps
// self's (a float32 `other` on a bfloat16 intermediate under autocast).
bool addPromotes(const Node* n);
// aten::linear(Tensor input, Tensor weight, Tensor? bias).
bool isLinear(const Node* n);
// aten::layer_norm(Tensor input, int[] normalized_shape, Tensor? weight,
// Tensor? bias, float eps, bool cudnn_enable).
bool isLayerNorm(const Node* n);
// aten::conv{1,2,3}d with int-list stride/padding/dilation (not .padding).
bool isIntListConv(const Node* n);
// aten::max_pool2d with int-list kernel_size, stride, padding and dilation
// and a bool ceil_mode (not max_pool2d_with_indices).
bool isMaxPool2d(const Node* n);
// aten::batch_norm.
bool isBatchNorm(const Node* n);
// aten::div.Scalar whose divisor is an int or float (not a Tensor, no
// rounding_mode).
bool isScalarDivisor(const Node* n);
// aten::sigmoid(Tensor).
bool isSigmoid(const Node* n);
// aten::mul.Tensor (out of place).
bool isTensorMul(const Node* n);
// aten::silu(Tensor) (out of place).
bool isSilu(const Node* n);

// An activation custom_conv_add_act computes, in- or out-of-place:
// relu, relu6, hardtanh, silu, hardswish, hardsigmoid, sigmoid, gelu,
// leaky_relu (the Tensor overloads, self the first input).
bool isFusableActivation(const Node* n);
// Its scalar arguments are constants the op takes: hardtanh's min and max,
// leaky_relu's slope (int or float), gelu's approximate ('none' or 'tanh').
// A runtime value (an unfrozen module attribute) leaves the chain alone.
bool activationArgumentsAreConstant(const Node* n);
// The attribute Canonicalize puts on the relus it made from relu_, until
// RestoreInPlace.
c10::Symbol fromInPlaceAttr();
// The node is an in-place spelling: relu_, hardtanh_ and the like, or a relu
// Canonicalize made from relu_.
bool isInPlaceSpelling(const Node* n);

// custom_conv_add_act's `activation` and `activation_args` for a node that
// passes both predicates above (relu6 is hardtanh(0, 6)); the name ends in
// '_' for an in-place spelling (relu_, or a relu Canonicalize made from one).
struct ActivationSpec {
  std::string name;
  std::vector<double> args;
};
std::optional<ActivationSpec> activationSpec(const Node* n);

// ---- values ---------------------------------------------------------------

bool isTensor(const Value* v);
// The type is Tensor, not Tensor? and not None: e.g. BN running statistics.
bool isNonOptionalTensor(const Value* v);
// A constant None, or a value whose type is Tensor / Tensor? (linear and
// conv bias, BN weight and bias).
bool isOptionalTensorArg(const Value* v);
// A constant int or float equal to 1.
bool alphaIsOne(const Value* alpha);
// The divisor is not a constant zero (the fused op rejects zero; eager
// would produce inf/nan, so we keep the eager composition).
bool divisorIsNonZero(const Value* divisor);
// Constant bool, if the value is one.
std::optional<bool> constantBool(const Value* v);
// A constant int or int list, as a list, if the value is one.
std::optional<std::vector<int64_t>> constantInts(const Value* v);
// The defined tensor a constant holds (a frozen graph's parameters).
std::optional<at::Tensor> constantTensor(const Value* v);

// ---- graph structure --------------------------------------------------------

// The value's only use is `user` (a returned value is also used by the
// block's return node, so returned intermediates fail this).
bool hasSingleUse(const Value* v, const Node* user);
// All nodes sit in one block (a match never spans blocks).
bool inSameBlock(std::initializer_list<const Node*> nodes);
// No `with torch.autocast(...)` of the scripted code opens in n's block or in
// a block enclosing it.  NB: TorchScript's autocast pass casts the ops of
// such a scope (and nothing tells the fused ops); the check is by block, not
// by scope, so that a chain straddling the scope's ends stays too.
bool outsideScriptedAutocast(const Node* n);
// An in-place chain node writes only a fresh intermediate of the chain:
// for n = aten::op_(self, ...), self must be `fresh` (the output of the
// previous chain node) and n must be its only user.  Out-of-place nodes
// pass.
bool notInPlaceOnLiveTensor(const Node* n, const Value* fresh);
// No node strictly between `first` and `last` (same block; nested blocks
// included) writes to anything that may alias `values`.  The fused node
// runs at `last`'s position, so the chain's reads move down to there.
bool noInterveningWrites(
    const AliasDb& db,
    Node* first,
    Node* last,
    const std::vector<Value*>& values);
// noInterveningWrites, where a node that writes only module attributes or
// graph inputs other than the tensor `values`' (by GetAttr path, as
// notWrittenAfter tells them apart) does not count: a scripted BatchNorm's
// `num_batches_tracked += 1` sits between a conv and its batch_norm, and
// AliasDb lets it alias the conv's weight.
bool noInterveningWritesBesideOtherSlots(
    const AliasDb& db,
    Node* first,
    Node* last,
    const std::vector<Value*>& values);
// No node strictly between `first` and `last` reads or writes anything that
// may alias `values`: a training batch_norm writes its running statistics,
// and the fused node moves that write down to `last`.
// The chain's own nodes (`chain`) are exempt.
bool noInterveningAccess(
    const AliasDb& db,
    Node* first,
    Node* last,
    const std::vector<Value*>& values,
    const std::vector<Node*>& chain);
// Nothing that may run after `first` and before the caller's backward
// writes to anything that may alias `values`: no node later in first's block
// or an enclosing one, nor anywhere in an enclosing loop's body (the next
// iteration).  A fused op that saves for backward a tensor the unfused chain
// does not save would otherwise fail there ("modified by an inplace
// operation") where the original trains.  NB: AliasDb lets every graph input
// and module attribute alias every other; a write to a different attribute
// (by GetAttr path) or a different graph input is taken as not aliasing,
// i.e. distinct arguments, and attributes that no SharedSlotsScope names as
// one tensor, are assumed to be distinct tensors.
bool notWrittenAfter(
    const AliasDb& db,
    Node* first,
    const std::vector<Value*>& values);
// Attribute paths of the graph's module input ("input 0.bn2.running_mean")
// whose tensors share storage (tied parameters, shared buffers), each
// mapped to one path of its group.  While a SharedSlotsScope lives (on this
// thread), notWrittenAfter takes the paths of a group as one tensor;
// optimize() sets one from the module it fuses.  Without one (fuse_graph on
// a bare graph), distinct attributes are assumed distinct tensors.
using SharedSlots = std::unordered_map<std::string, std::string>;
class SharedSlotsScope {
 public:
  explicit SharedSlotsScope(SharedSlots slots);
  ~SharedSlotsScope();
  SharedSlotsScope(const SharedSlotsScope&) = delete;
  SharedSlotsScope& operator=(const SharedSlotsScope&) = delete;

 private:
  SharedSlots slots_;
  const SharedSlots* previous_;
};
// `v` is a fresh tensor only `user` reads: produced by a plain node (no
// blocks, no side effects, not a graph input, constant or attribute) whose
// inputs cannot alias it, and used once.  Writing it in place is then not
// observable, so `user` may be made functional.
bool isFreshUnaliasedTensor(const AliasDb& db, Value* v, const Node* user);

// ---- rewriting --------------------------------------------------------------

// Inserts `op(inputs)` right before `last`, with last's source range and
// output type, and redirects last's uses to it.  Returns nullptr, leaving the
// graph unchanged, if the inputs do not resolve to a registered schema.
// The caller then destroys the chain, last first.
Node* replaceWithFusedOp(
    torch::jit::Graph& graph,
    const char* op,
    const std::vector<Value*>& inputs,
    Node* last);

// ---- walking ----------------------------------------------------------------

// Calls fn on every node of `block` and, depth first, of its sub-blocks.
void forEachNode(Block* block, const std::function<void(Node*)>& fn);
// Counts nodes the same way.
int64_t countNodes(Block* block);
// Whether n sits in `block` or in a block nested in it.
bool isInBlock(const Node* n, const Block* block);

// Runs a fusion: finds every match on the unmodified graph (one AliasDb,
// matches never overlap), then rewrites them.  matchAt(Node*, const AliasDb&)
// returns std::optional<Match>; rewrite(Graph&, const Match&) returns whether
// the rewrite took.  Returns the number of chains fused.
template <typename MatchFn, typename RewriteFn>
int64_t fuseAll(
    std::shared_ptr<torch::jit::Graph>& graph,
    MatchFn matchAt,
    RewriteFn rewrite) {
  using Match = typename std::invoke_result_t<MatchFn, Node*, const AliasDb&>::value_type;
  std::vector<Match> matches;
  {
    AliasDb db(graph);
    forEachNode(graph->block(), [&](Node* n) {
      if (auto m = matchAt(n, db); m && outsideScriptedAutocast(n)) {
        matches.push_back(*m);
      }
    });
  }
  int64_t fused = 0;
  for (const auto& m : matches) {
    fused += rewrite(*graph, m) ? 1 : 0;
  }
  return fused;
}

} // namespace torchfuse::passes
