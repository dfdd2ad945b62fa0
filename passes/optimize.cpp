// The module-level pipeline (docs/passes.md):
//   clone (new types, shared tensors) -> inline free functions, guard
//   loop-carried aliases -> Inline (forward, preserved methods) -> forward's
//   dropouts that are their input removed -> guard again
//   -> [freeze_module] -> ConstantPropagation -> [the frozen graph
//   optimizations, where their BatchNorm folding keeps the meaning]
//   -> fuseGraph (zero dropouts removed, Canonicalize, then the registry's
//   fusions in order, ReplaceRelu last)
//   -> [FoldResidualConvBias -> ConvertToChannelsLast] -> EliminateDeadCode
//   -> guards to their persistent form -> outer values read in loop bodies
//   carried through the loops -> lint

#include <torch/csrc/jit/api/function_impl.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/freeze_module.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <functional>
#include <unordered_map>
#include <vector>

#include "passes/frozen_optimizations.h"
#include "passes/loop_alias_guards.h"
#include "passes/loop_outer_reads.h"
#include "passes/match_filters.h"
#include "torchfuse/optimize.h"
#include "torchfuse/passes.h"
#include "torchfuse/registry.h"

namespace torchfuse {
namespace {

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

void checkPassNames(const std::vector<std::string>& passes) {
  for (const auto& name : passes) {
    TORCH_CHECK(
        contains(passNames(), name), "torchfuse::optimize: unknown pass '",
        name, "'; expected one of ", c10::Join(", ", passNames()));
  }
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

// A new object of each module in the tree, of the same class types: the
// methods, and with them their graph executors, stay the input's, as do the
// attribute values (tensors, and objects of other classes); the modules are
// new, so setting an attribute or the training mode of the result leaves the
// input alone.  A submodule object reachable twice is copied once.
torch::jit::Module copySharingTypes(
    const torch::jit::Module& module,
    std::unordered_map<c10::ivalue::Object*, c10::intrusive_ptr<c10::ivalue::Object>>& copied) {
  const auto known = copied.find(module._ivalue().get());
  if (known != copied.end()) {
    return torch::jit::Module(known->second);
  }
  const auto type = module.type();
  auto object = c10::ivalue::Object::create(
      c10::StrongTypePtr(module._ivalue()->compilation_unit(), type), type->numAttributes());
  copied.emplace(module._ivalue().get(), object);
  for (size_t i = 0; i < type->numAttributes(); ++i) {
    const auto& value = module._ivalue()->getSlot(i);
    object->setSlot(
        i,
        type->getAttribute(i)->is_module()
            ? c10::IValue(copySharingTypes(value.toModule(), copied)._ivalue())
            : value);
  }
  return torch::jit::Module(object);
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

// The attribute paths of `module` whose tensors share storage (tied
// parameters, shared buffers; views of one another too), as slots of the
// forward graph's `self` ("input 0.fc2.weight"), each mapped to the first
// path of its group.
passes::SharedSlots sharedSlots(const torch::jit::Module& module) {
  std::unordered_map<const c10::StorageImpl*, std::vector<std::string>> groups;
  std::vector<const c10::StorageImpl*> order;
  const std::function<void(const torch::jit::Module&, const std::string&)> visit =
      [&](const torch::jit::Module& m, const std::string& prefix) {
        const auto type = m.type();
        for (size_t i = 0; i < type->numAttributes(); ++i) {
          const auto value = m._ivalue()->getSlot(i);
          const auto path = prefix + "." + type->getAttributeName(i);
          if (value.isModule()) {
            visit(value.toModule(), path);
          } else if (value.isTensor() && value.toTensor().defined() &&
                     value.toTensor().has_storage()) {
            const auto* storage = value.toTensor().storage().unsafeGetStorageImpl();
            auto& group = groups[storage];
            if (group.empty()) {
              order.push_back(storage);
            }
            group.push_back(path);
          }
        }
      };
  visit(module, "input 0");
  passes::SharedSlots slots;
  for (const auto* storage : order) {
    const auto& group = groups[storage];
    for (size_t i = 1; i < group.size(); ++i) {
      slots[group[i]] = group[0];
    }
  }
  return slots;
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

// NB: torch.jit.save pools equal tensor constants across a module's
// methods, strides aside: a weight stored channels-last in forward and NCHW
// in another kept method would come back in one layout for both.  The
// layout pass runs only where forward is the one method.
bool onlyForwardIsKept(const torch::jit::Module& module) {
  const auto methods = module.get_methods();
  return methods.size() == 1 && methods[0].name() == "forward";
}

} // namespace

const std::vector<std::string>& passNames() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> n;
    for (const auto& f : fusions()) {
      n.push_back(f.name);
    }
    return n;
  }();
  return names;
}

FusionReport fuseGraph(
    std::shared_ptr<torch::jit::Graph>& graph,
    const std::vector<std::string>& passes) {
  checkPassNames(passes);
  FusionReport counts;
  counts.nodes_before = passes::countNodes(graph->block());
  // NB: before Canonicalize, whose RemoveTensorMutation takes a dropout's
  // result for a fresh tensor: it made `relu_(dropout(x, 0.0, True))` a
  // functional relu, which the dropout's removal then left reading x, so x
  // was no longer written as in eager (fuzz seed 20261203 program 92).
  counts.zero_dropouts_removed = passes::RemoveZeroDropouts(graph);
  passes::Canonicalize(graph);
  counts.attention_masks_dropped = passes::DropAllTrueAttentionMasks(graph);
  for (const auto& f : fusions()) {
    const bool run = passes.empty() ? f.by_default : contains(passes, f.name);
    counts.fused[f.name] = run ? f.run(graph) : 0;
  }
  passes::RestoreInPlace(graph);
  counts.nodes_after = passes::countNodes(graph->block());
  return counts;
}

torch::jit::Module optimize(
    const torch::jit::Module& module,
    const OptimizeOptions& options,
    FusionReport* report) {
  checkPassNames(options.passes);
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
  // with torch.compile.  freeze_module, not torch::jit::freeze: its frozen
  // graph optimizations fold a BatchNorm left in training mode too, so they
  // run below only where that cannot happen.
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
    passes::inlineSharedFunctions(f.graph()->block());
    passes::guardLoopCarriedAliases(f.graph());
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
  // NB: forward's dropouts that are their input go before ConstantPropagation
  // and freeze_module, whose dead-code elimination would take an in-place
  // write through a train=False one for a write to a dead fresh tensor
  // (RemoveZeroDropouts); fuseGraph takes those constant only after them.
  int64_t early_dropouts = 0;
  for (const auto& g : inlined) {
    torch::jit::Inline(*g);
    if (g == inlined.front()) {
      auto forward = g;
      early_dropouts = passes::RemoveZeroDropouts(forward);
    }
    passes::removeLoopCarriedAliasGuards(g);
    passes::guardLoopCarriedAliases(g);
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
  if (options.freeze) {
    // NB: what torch.jit.freeze folds (a BatchNorm into the conv or linear
    // before it, constant scales and shifts into a conv) is folded first:
    // a frozen result is then never behind torch.jit.freeze's, and the
    // fusions take the chains that remain.
    passes::optimizeFrozenGraph(graph);
  }

  // NB: a write through one name of a shared tensor (a training BN on a
  // buffer that is another BN's running_var too) is a write to the others.
  FusionReport counts;
  {
    passes::SharedSlotsScope shared(sharedSlots(result));
    counts = fuseGraph(graph, options.passes);
  }
  counts.zero_dropouts_removed += early_dropouts;
  if (options.freeze) {
    // NB: after the fusions, whose custom_conv_add_act takes the residual
    // conv's bias into its own.
    passes::FoldResidualConvBias(graph);
  }
  // NB: after the fusions, which match the conv chains it then treats as
  // convolutions.
  const bool force_layout = options.layout == Layout::ChannelsLast;
  if (options.freeze && options.layout != Layout::Keep && onlyForwardIsKept(result)) {
    counts.channels_last_weights = passes::ConvertToChannelsLast(graph, force_layout);
  } else if (!options.freeze && options.layout != Layout::Keep) {
    // NB: each call converts the first weight and every convolution's
    // weight again inside ATen (and the backward its gradient back), host
    // work the FLOP cost model does not see: measured on an H200, 0.87x
    // TorchScript for mobilenet_v3_large eval fp32 and, in one of three
    // runs, 0.92x for resnet50 training (docs/passes.md).  So Auto leaves
    // the decision to each call site's measured choice.  Forward alone: the
    // other methods keep their graphs.
    counts.channels_last_weights =
        passes::ConvertToChannelsLastUnfrozen(graph, result, force_layout);
  }
  torch::jit::EliminateDeadCode(graph);
  const bool fused = counts.channels_last_weights > 0 || counts.attention_masks_dropped > 0 ||
      counts.zero_dropouts_removed > 0 ||
      std::any_of(counts.fused.begin(), counts.fused.end(),
                  [](const auto& c) { return c.second > 0; });
  if (!fused && !options.freeze) {
    // NB: with nothing fused, dropped or removed, the result runs the input's
    // own methods and executors.  A fresh executor is not the same program
    // as one that already ran: torch.jit.trace's check runs the traced
    // module under no_grad, so its executor never builds differentiable
    // graphs, whose autodiff runs a p = 0 dropout as native_dropout, which
    // drops values on CUDA (RemoveZeroDropouts).
    std::unordered_map<c10::ivalue::Object*, c10::intrusive_ptr<c10::ivalue::Object>> copied;
    auto plain = copySharingTypes(module, copied);
    counts.nodes_after = passes::countNodes(forwardGraph(plain)->block());
    if (report != nullptr) {
      *report = counts;
    }
    return plain;
  }
  // NB: the cached optimized graphs hold guards; they are rebuilt on use.
  forEachMethod(result, [](torch::jit::GraphFunction& f) {
    passes::removeLoopCarriedAliasGuards(f.graph());
    passes::sealLoopCarriedAliases(f.graph());
    // NB: last: a fusion can make a loop's user a single op, and DCE can
    // leave the body nothing but reads of outer values.
    passes::carryOuterValuesThroughLoops(f.graph());
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

std::map<std::string, int64_t> report(const torch::jit::Module& module) {
  std::map<std::string, int64_t> counts;
  std::map<c10::Symbol, std::string> owner;
  for (const auto& f : fusions()) {
    counts[f.name] = 0;
    for (const auto& op : f.ops) {
      owner[c10::Symbol::fromQualString(op)] = f.name;
    }
  }
  passes::forEachNode(forwardGraph(module)->block(), [&](torch::jit::Node* n) {
    const auto it = owner.find(n->kind());
    if (it != owner.end()) {
      ++counts[it->second];
    }
  });
  return counts;
}

} // namespace torchfuse
