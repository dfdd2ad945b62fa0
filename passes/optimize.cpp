// The module-level pipeline (docs/passes.md):
//   clone (new types, shared tensors) -> inline free functions, guard
//   loop-carried aliases -> Inline (forward, preserved methods) -> guard again
//   -> [freeze_module] -> ConstantPropagation -> Canonicalize
//   -> FuseConvReluAdd -> FuseLinearAddRelu -> FuseBatchNormAddDivSwish
//   -> ReplaceRelu -> EliminateDeadCode -> guards to their persistent form
//   -> lint

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/freeze_module.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "passes/match_filters.h"
#include "torchfuse/optimize.h"
#include "torchfuse/passes.h"

namespace torchfuse {
namespace {

constexpr const char* kLinearAddRelu = "linear_add_relu";
constexpr const char* kConvReluAdd = "conv_relu_add";
constexpr const char* kBatchNormAddDivSwish = "batch_norm_add_div_swish";
constexpr const char* kRelu = "relu";

bool enabled(const OptimizeOptions& options, const std::string& name) {
  return options.passes.empty() ||
      std::find(options.passes.begin(), options.passes.end(), name) !=
      options.passes.end();
}

std::shared_ptr<torch::jit::Graph> forwardGraph(const torch::jit::Module& module) {
  const auto method = module.find_method("forward");
  TORCH_CHECK(
      method.has_value(), "torchfuse::optimize: the module has no forward method");
  return method->graph();
}

// NB: the result's class types and methods live in a compilation unit of
// their own.  Module::clone() registers them in the input's, which for
// scripted modules is Python's global one: every optimize call would leave
// its method graphs there for good, and a frozen forward holds the
// parameters as constants (one parameter copy leaked per call).  Graphs may
// still name the input's non-module classes, whose methods that unit owns
// through raw pointers, so the new unit keeps it alive.
std::shared_ptr<torch::jit::CompilationUnit> resultCompilationUnit(
    const torch::jit::Module& module) {
  return std::shared_ptr<torch::jit::CompilationUnit>(
      new torch::jit::CompilationUnit(),
      [source = module._ivalue()->compilation_unit()](torch::jit::CompilationUnit* cu) {
        delete cu;  // before `source`, which its graphs may reference
      });
}

// Module::clone(/*inplace=*/true) into `cu`: new class types (shared ones
// stay shared) with copies of their methods and constants, and the same
// attribute values: parameters and buffers are the input's tensors, so tied
// weights and shared buffers stay shared, and an optimizer built on the
// input's parameters trains the result.
torch::jit::Module cloneSharingState(
    const torch::jit::Module& module,
    const std::shared_ptr<torch::jit::CompilationUnit>& cu,
    std::unordered_map<c10::TypePtr, c10::TypePtr>& type_remap) {
  const auto type = module.type();
  const auto known = type_remap.find(type);
  const bool type_cloned = known != type_remap.end();
  torch::jit::Module result = type_cloned
      ? torch::jit::Module(cu, known->second->expect<c10::ClassType>())
      : torch::jit::Module(*type->name(), cu, /*shouldMangle=*/true);
  if (!type_cloned) {
    type_remap[type] = result.type();
  }
  for (size_t i = 0; i < type->numAttributes(); ++i) {
    const auto& name = type->getAttributeName(i);
    const auto& attr_type = type->getAttribute(i);
    const auto value = module._ivalue()->getSlot(i);
    if (attr_type->is_module()) {
      // As clone_impl: an interface-typed attribute keeps its type.
      const auto sub = cloneSharingState(value.toModule(), cu, type_remap);
      result.type()->addOrCheckAttribute(
          name, attr_type->cast<c10::ClassType>() ? sub.type() : attr_type);
      result._ivalue()->setAttr(name, sub._ivalue());
    } else {
      result.register_attribute(
          name, attr_type, value, type->is_parameter(i), type->is_buffer(i));
    }
  }
  if (type_cloned) {
    return result;
  }
  for (size_t i = 0; i < type->numConstants(); ++i) {
    result.type()->addConstant(type->getConstantName(i), type->getConstant(i));
  }
  const auto remap = [&](c10::TypePtr in) {
    const auto it = type_remap.find(in);
    return it == type_remap.end() ? in : it->second;
  };
  for (auto* fn : type->methods()) {
    auto graph = torch::jit::toGraphFunction(*fn).graph()->copy();
    graph->remapTypes(remap);
    auto* copied = cu->create_function(
        c10::QualifiedName(*result.type()->name(), fn->name()), graph);
    result.type()->addMethod(copied);
    copied->setSchema(fn->getSchema().cloneWithRemappedTypes(remap));
  }
  // As clone_impl: custom class members are set up by the class itself.
  if (auto setstate = result.find_method("__setstate__")) {
    auto getstate = result.find_method("__getstate__");
    TORCH_INTERNAL_ASSERT(getstate, "a module with __setstate__ has no __getstate__");
    (*setstate)({(*getstate)({})});
  }
  return result;
}

// The submodule that owns `path`'s last component ("sub.fc.weight" ->
// sub.fc), checking that it names an attribute or a method, as
// freeze_module's preserved attributes may.
torch::jit::Module preservedOwner(
    const torch::jit::Module& module, const std::string& path) {
  torch::jit::Module owner = module;
  std::string where = "the module";
  std::string::size_type start = 0;
  while (true) {
    const auto dot = path.find('.', start);
    const auto name = path.substr(start, dot == std::string::npos ? dot : dot - start);
    const bool last = dot == std::string::npos;
    const bool found = !name.empty() &&
        (last ? owner.hasattr(name) || owner.find_method(name).has_value()
              : owner.hasattr(name) && owner.attr(name).isModule());
    TORCH_CHECK(
        found, "torchfuse::optimize: preserved_attrs names '", path, "', but ", where,
        " has no ", last ? "attribute or method" : "submodule", " '", name, "'");
    if (last) {
      return owner;
    }
    owner = owner.attr(name).toModule();
    where = "submodule '" + path.substr(0, dot) + "'";
    start = dot + 1;
  }
}

bool isInside(const torch::jit::Node* n, const torch::jit::Block* block) {
  for (const auto* b = n->owningBlock(); b != nullptr;
       b = b->owningNode() != nullptr ? b->owningNode()->owningBlock() : nullptr) {
    if (b == block) {
      return true;
    }
  }
  return false;
}

// NB: AliasDb (AliasDb::analyzeLoop) lets a loop body's carried input alias
// only the loop's initial input, not the value the previous iteration
// returned.  In `v2 = relu(v1); for ...: v1.add_(b); v1 = v2` the add_ of the
// second iteration writes v2, but AliasDb sees a write to v1's first value
// only: EliminateDeadCode (ours, ConstantPropagation's, freeze_module's)
// drops it once v1's producer is inlined, and CSE merges reads of v2 across
// the loop.  A slot whose body returns another value than it received is
// exposed when the returned value may alias something that outlives the
// iteration (a value from outside the body, a graph input, an attribute, a
// constant, another slot's received value) and the body writes it, or when
// the body writes the received value and the returned one may alias any of
// those or another slot's returned value.  A value created in the iteration
// and carried by one slot (`h = relu_(fc(h))`) is reachable only through
// that slot, which AliasDb models.
bool loopCarriedWriteHiddenFromAliasDb(
    const torch::jit::AliasDb& db, torch::jit::Node* loop, size_t slot) {
  auto* body = loop->blocks().at(0);
  auto* received = body->inputs().at(slot + 1);   // after the trip count
  auto* returned = body->outputs().at(slot + 1);  // after the condition
  if (received == returned) {
    return false;
  }
  const auto writtenInBody = [&](torch::jit::Value* v) {
    bool written = false;
    passes::forEachNode(body, [&](torch::jit::Node* n) {
      written = written || db.writesToAlias(n, {v});
    });
    return written;
  };
  const bool receivedWritten = writtenInBody(received);
  if (!receivedWritten && !writtenInBody(returned)) {
    return false;
  }
  torch::jit::ValueSet persistent(
      loop->owningGraph()->inputs().begin(), loop->owningGraph()->inputs().end());
  const auto collect = [&](torch::jit::Node* n) {
    for (auto* input : n->inputs()) {
      if (!isInside(input->node(), body)) {
        persistent.insert(input);
      }
    }
    if (n->kind() == c10::prim::GetAttr || n->kind() == c10::prim::Constant) {
      persistent.insert(n->output());
    }
  };
  passes::forEachNode(body, collect);
  collect(body->return_node());
  torch::jit::ValueSet otherReturned;
  for (size_t j = 1; j < body->inputs().size(); ++j) {
    if (j != slot + 1) {
      persistent.insert(body->inputs().at(j));
      otherReturned.insert(body->outputs().at(j));
    }
  }
  const torch::jit::ValueSet r = {returned};
  return db.mayAlias(r, persistent) ||
      (receivedWritten && db.mayAlias(r, otherReturned));
}

const c10::Symbol kLoopAliasGuard =
    c10::Symbol::attr("torchfuse_loop_alias_guard");

bool isLoopAliasGuard(const torch::jit::Node* n) {
  return n->kind() == c10::prim::Print && n->hasAttribute(kLoopAliasGuard);
}

// For each exposed slot, puts the received and the returned value into a
// tuple at the end of the body: a tuple's elements (and everything they may
// point to) become AliasDb wildcards, which may alias each other, so every
// AliasDb client sees the write.  A prim::Print of the tuple (a side effect)
// keeps it through torch's passes; nothing runs before the guards are
// removed.
void guardLoopCarriedAliases(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<std::pair<torch::jit::Node*, std::vector<torch::jit::Value*>>> guards;
  {
    torch::jit::AliasDb db(graph);
    passes::forEachNode(graph->block(), [&](torch::jit::Node* n) {
      if (n->kind() != c10::prim::Loop ||
          isLoopAliasGuard(n->blocks().at(0)->return_node()->prev())) {
        return;  // not a loop, or guarded already (a type shared by submodules)
      }
      std::vector<torch::jit::Value*> values;
      for (size_t i = 0; i < n->outputs().size(); ++i) {
        if (loopCarriedWriteHiddenFromAliasDb(db, n, i)) {
          values.push_back(n->blocks().at(0)->inputs().at(i + 1));
          values.push_back(n->blocks().at(0)->outputs().at(i + 1));
        }
      }
      if (!values.empty()) {
        guards.emplace_back(n, std::move(values));
      }
    });
  }
  for (auto& [loop, values] : guards) {
    auto* body = loop->blocks().at(0);
    torch::jit::WithInsertPoint insert(body->return_node());
    auto* tuple = graph->insertNode(graph->createTuple(values));
    auto* print =
        graph->insertNode(graph->create(c10::prim::Print, {tuple->output()}, 0));
    print->i_(kLoopAliasGuard, 1);
  }
}

// Removes the guards (with copies made by loop unrolling), then what only
// they kept alive, as far as it writes nothing and has no side effects:
// EliminateDeadCode would again drop the writes AliasDb misses.
void removeLoopCarriedAliasGuards(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<torch::jit::Node*> prints;
  passes::forEachNode(graph->block(), [&](torch::jit::Node* n) {
    if (isLoopAliasGuard(n)) {
      prints.push_back(n);
    }
  });
  std::vector<torch::jit::Node*> work;
  for (auto* print : prints) {
    work.push_back(print->input()->node());
    print->destroy();
  }
  const torch::jit::AliasDb db(graph);
  std::unordered_set<torch::jit::Node*> destroyed;
  while (!work.empty()) {
    auto* n = work.back();
    work.pop_back();
    if (destroyed.count(n) > 0 || n->kind() == c10::prim::Param ||
        !n->blocks().empty() || n->hasSideEffects() || db.isMutable(n) ||
        std::any_of(n->outputs().begin(), n->outputs().end(),
                    [](const torch::jit::Value* v) { return v->hasUses(); })) {
      continue;
    }
    for (auto* input : n->inputs()) {
      work.push_back(input->node());
    }
    destroyed.insert(n);
    n->destroy();
  }
}

// NB: a free function (prim::CallFunction), or a method of a TorchScript
// class that is not a module, is shared by every graph that calls it, and
// its optimized graph is cached on first use: Inline would insert one built
// while the executor's optimization is on (DCE included, so a write AliasDb
// misses may already be gone), and would leave it cached for the caller's
// module too.  Insert a copy of the callee's own graph instead, its calls
// inlined the same way, so the guards see the loops before any DCE and the
// shared function is not touched.
bool callsSharedFunction(torch::jit::Node* n) {
  if (n->kind() == c10::prim::CallFunction) {
    return true;
  }
  if (n->kind() != c10::prim::CallMethod) {
    return false;
  }
  const auto type = n->input(0)->type()->cast<c10::ClassType>();
  return type != nullptr && !type->is_module();
}

void inlineSharedFunctions(torch::jit::Block* block) {
  for (auto it = block->nodes().begin(); it != block->nodes().end();) {
    torch::jit::Node* n = *it++;
    for (auto* b : n->blocks()) {
      inlineSharedFunctions(b);
    }
    if (!callsSharedFunction(n)) {
      continue;
    }
    auto* callee = torch::jit::tryToGraphFunction(n);
    if (callee == nullptr) {
      continue;
    }
    const auto body = callee->graph()->copy();
    inlineSharedFunctions(body->block());
    if (n->kind() == c10::prim::CallFunction) {
      n->removeInput(0);  // the function constant, not a graph input
    }
    torch::jit::inlineCallTo(n, callee, body.get());
  }
}

// The persistent form of a guard: the body returns `[returned, received][0]`.
// NB: putting a value in a list makes it an AliasDb wildcard, as the
// guard's tuple does, and the list stays as long as the slot does, with no
// side effect.  Unlike the guard it survives serialization: loading compiles
// the saved code again, whose DCE would otherwise drop the write once the
// producer is visible (it does so in the inlined forward).  The optimizing
// executor's list peephole folds it, as it drops the write in the original.
bool isSealedLoopSlot(const torch::jit::Node* loop, size_t slot) {
  auto* body = loop->blocks().at(0);
  const auto* returned = body->outputs().at(slot + 1)->node();
  if (returned->kind() != c10::aten::__getitem__ ||
      returned->input(0)->node()->kind() != c10::prim::ListConstruct) {
    return false;
  }
  const auto index = torch::jit::constant_as<int64_t>(returned->input(1));
  const auto* list = returned->input(0)->node();
  return index == 0 && list->inputs().size() == 2 &&
      list->input(1) == body->inputs().at(slot + 1);
}

void sealLoopCarriedAliases(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<std::pair<torch::jit::Node*, size_t>> slots;
  {
    torch::jit::AliasDb db(graph);
    passes::forEachNode(graph->block(), [&](torch::jit::Node* n) {
      if (n->kind() != c10::prim::Loop) {
        return;
      }
      for (size_t i = 0; i < n->outputs().size(); ++i) {
        if (!isSealedLoopSlot(n, i) && loopCarriedWriteHiddenFromAliasDb(db, n, i)) {
          slots.emplace_back(n, i);
        }
      }
    });
  }
  for (const auto& [loop, slot] : slots) {
    auto* body = loop->blocks().at(0);
    auto* received = body->inputs().at(slot + 1);
    auto* returned = body->outputs().at(slot + 1);
    if (!returned->type()->isSubtypeOf(*received->type())) {
      continue;  // not a well-typed slot; nothing to build the list from
    }
    torch::jit::WithInsertPoint insert(body->return_node());
    auto* list = graph->insertNode(
        graph->createList(received->type(), {returned, received}));
    body->replaceOutput(
        slot + 1,
        graph->insert(c10::aten::__getitem__, {list->output(), int64_t{0}}));
  }
}

// Calls fn on the graph of every method of `module` and its submodules.
void forEachMethod(
    const torch::jit::Module& module,
    const std::function<void(torch::jit::GraphFunction&)>& fn) {
  for (const auto& m : module.modules()) {
    for (const auto& method : m.get_methods()) {
      if (auto* f = torch::jit::tryToGraphFunction(method.function())) {
        fn(*f);
      }
    }
  }
}

} // namespace

const std::vector<std::string>& passNames() {
  static const std::vector<std::string> names = {
      kLinearAddRelu, kConvReluAdd, kBatchNormAddDivSwish, kRelu};
  return names;
}

torch::jit::Module optimize(
    const torch::jit::Module& module,
    const OptimizeOptions& options,
    FusionReport* report) {
  for (const auto& name : options.passes) {
    const auto& names = passNames();
    TORCH_CHECK(
        std::find(names.begin(), names.end(), name) != names.end(),
        "torchfuse::optimize: unknown pass '", name,
        "'; expected one of linear_add_relu, conv_relu_add, "
        "batch_norm_add_div_swish, relu");
  }
  forwardGraph(module);  // checks there is a forward before cloning

  // NB: Inline (ours, and freeze_module's) inserts each callee's
  // optimized_graph(), which is itself inlined only while the graph
  // executor's optimization is on: under torch.jit.optimized_execution(False)
  // nested calls would survive, nothing inside a submodule would fuse, and
  // freeze_module would leave calls to methods it removes.  The functions of
  // the clone below are fresh, so their optimized graphs are built under
  // this guard.
  torch::jit::GraphOptimizerEnabledGuard optimizer_enabled(true);

  // NB: a frozen module (our result included) has no training attribute,
  // for which is_training() answers true; it can only be in eval mode.
  TORCH_CHECK(
      !options.freeze || !(module.hasattr("training") && module.is_training()),
      "torchfuse::optimize: freeze=True needs a module in eval mode; call "
      ".eval() first");
  for (const auto& path : options.preserved_attrs) {
    preservedOwner(module, path);
  }

  // NB: the clone gives the result its own class types and method graphs,
  // and shares the attribute values: the caller's module, and other
  // instances sharing its type, keep their methods; tensors stay shared, as
  // with torch.compile.  freeze_module (not torch::jit::freeze) keeps
  // BatchNorm nodes: the frozen graph optimizations would fold them into a
  // preceding layer.
  std::unordered_map<c10::TypePtr, c10::TypePtr> type_remap;
  torch::jit::Module result =
      cloneSharingState(module, resultCompilationUnit(module), type_remap);
  // NB: guard the loops before any torch pass sees a producer that inlining
  // shows to be fresh: Inline inserts each callee's optimized graph, whose
  // preoptimization already runs DCE, and freeze_module runs more.  Calls
  // hide what they write, so the guards are decided again once inlined.
  // The methods are the clone's own; the free functions they call are
  // shared, so they are inlined unoptimized first.
  forEachMethod(result, [](torch::jit::GraphFunction& f) {
    inlineSharedFunctions(f.graph()->block());
    guardLoopCarriedAliases(f.graph());
  });
  // freeze_module inlines the methods it keeps as well as forward.
  std::vector<std::shared_ptr<torch::jit::Graph>> inlined = {forwardGraph(result)};
  if (options.freeze) {
    for (const auto& path : options.preserved_attrs) {
      const auto name = path.substr(path.rfind('.') + 1);
      if (auto method = preservedOwner(result, path).find_method(name)) {
        if (std::find(inlined.begin(), inlined.end(), method->graph()) == inlined.end()) {
          inlined.push_back(method->graph());
        }
      }
    }
  }
  for (const auto& g : inlined) {
    torch::jit::Inline(*g);
    removeLoopCarriedAliasGuards(g);
    guardLoopCarriedAliases(g);
  }
  if (options.freeze) {
    // NB: freeze_module clones in place: attributes the forward writes (a
    // buffer's add_, a training-mode BN's statistics) stay attributes that
    // share their tensors with the input, as the other attributes do.
    result = torch::jit::freeze_module(result, options.preserved_attrs);
  }

  auto graph = forwardGraph(result);
  torch::jit::ConstantPropagation(graph);
  torch::jit::EliminateDeadCode(graph);

  FusionReport counts;
  counts.nodes_before = passes::countNodes(graph->block());
  passes::Canonicalize(graph);
  if (enabled(options, kConvReluAdd)) {
    counts.conv_relu_add = passes::FuseConvReluAdd(graph);
  }
  if (enabled(options, kLinearAddRelu)) {
    counts.linear_add_relu = passes::FuseLinearAddRelu(graph);
  }
  if (enabled(options, kBatchNormAddDivSwish)) {
    counts.batch_norm_add_div_swish = passes::FuseBatchNormAddDivSwish(graph);
  }
  if (enabled(options, kRelu)) {
    counts.relu = passes::ReplaceRelu(graph);
  }
  torch::jit::EliminateDeadCode(graph);
  // NB: the cached optimized graphs hold guards; they are rebuilt on use.
  forEachMethod(result, [](torch::jit::GraphFunction& f) {
    removeLoopCarriedAliasGuards(f.graph());
    sealLoopCarriedAliases(f.graph());
    f.clear_optimized_graphs();
  });
  graph->lint();
  counts.nodes_after = passes::countNodes(graph->block());
  GRAPH_DUMP("After torchfuse::optimize", graph);
  if (report != nullptr) {
    *report = counts;
  }
  return result;
}

FusionReport report(const torch::jit::Module& module) {
  FusionReport counts;
  auto graph = forwardGraph(module);
  const auto linear = c10::Symbol::fromQualString("torchfuse::custom_linear_add_relu");
  const auto conv = c10::Symbol::fromQualString("torchfuse::custom_conv_relu_add");
  const auto bn = c10::Symbol::fromQualString("torchfuse::custom_batch_norm_add_div_swish");
  const auto bn_eval =
      c10::Symbol::fromQualString("torchfuse::custom_batch_norm_add_div_swish_eval");
  const auto relu = c10::Symbol::fromQualString("torchfuse::custom_relu");
  passes::forEachNode(graph->block(), [&](torch::jit::Node* n) {
    ++counts.nodes_after;
    const auto k = n->kind();
    counts.linear_add_relu += k == linear;
    counts.conv_relu_add += k == conv;
    counts.batch_norm_add_div_swish += k == bn || k == bn_eval;
    counts.relu += k == relu;
  });
  counts.nodes_before = counts.nodes_after;
  return counts;
}

} // namespace torchfuse
