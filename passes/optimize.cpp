// The module-level pipeline (docs/passes.md):
//   clone -> inline free functions, guard loop-carried aliases -> Inline
//   -> guard again
//   -> [freeze_module] -> ConstantPropagation -> fuseGraph (Canonicalize,
//   then the registry's fusions in order, ReplaceRelu last)
//   -> EliminateDeadCode -> guards to their persistent form -> lint

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
#include <vector>

#include "passes/loop_alias_guards.h"
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

// NB: Module::clone() copies parameters with Tensor::clone(), which records
// CloneBackward: the copies would be non-leaf tensors whose .grad stays
// empty and which optimizers cannot update.  Make them leaves again, keeping
// the fresh storage (the caller's parameters stay untouched).
void makeParametersLeaves(torch::jit::Module& module) {
  for (const auto& sub : module.modules()) {
    auto m = sub;
    for (const auto& p : sub.named_parameters(/*recurse=*/false)) {
      if (p.value.grad_fn() != nullptr) {
        const bool requires_grad = p.value.requires_grad();
        m.register_parameter(
            p.name, p.value.detach().requires_grad_(requires_grad), false);
      }
    }
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
  passes::Canonicalize(graph);
  for (const auto& f : fusions()) {
    counts.fused[f.name] =
        passes.empty() || contains(passes, f.name) ? f.run(graph) : 0;
  }
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

  // NB: the clone gives the result its own class type, method graphs and
  // tensors: the caller's module, and other instances sharing its type, keep
  // theirs.  freeze_module (not torch::jit::freeze) keeps BatchNorm nodes:
  // the frozen graph optimizations would fold them into a preceding layer.
  TORCH_CHECK(
      !options.freeze || !module.is_training(),
      "torchfuse::optimize: freeze=True needs a module in eval mode; call "
      ".eval() first");
  torch::jit::Module result = module.clone();
  makeParametersLeaves(result);
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
  torch::jit::Inline(*forwardGraph(result));
  passes::removeLoopCarriedAliasGuards(forwardGraph(result));
  passes::guardLoopCarriedAliases(forwardGraph(result));
  if (options.freeze) {
    // NB: freeze_module clones in place: attributes the forward writes (a
    // buffer's add_, a training-mode BN's statistics) stay attributes that
    // share their tensors with its argument, so freeze our own copy.
    result = torch::jit::freeze_module(result);
  }

  auto graph = forwardGraph(result);
  torch::jit::ConstantPropagation(graph);
  torch::jit::EliminateDeadCode(graph);

  FusionReport counts = fuseGraph(graph, options.passes);
  torch::jit::EliminateDeadCode(graph);
  // NB: the cached optimized graphs hold guards; they are rebuilt on use.
  forEachMethod(result, [](torch::jit::GraphFunction& f) {
    passes::removeLoopCarriedAliasGuards(f.graph());
    passes::sealLoopCarriedAliases(f.graph());
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
