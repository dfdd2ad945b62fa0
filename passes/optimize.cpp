// The module-level pipeline (docs/passes.md):
//   clone | freeze_module -> Inline -> ConstantPropagation -> Canonicalize
//   -> FuseConvReluAdd -> FuseLinearAddRelu -> FuseBatchNormAddDivSwish
//   -> ReplaceRelu -> EliminateDeadCode -> lint

#include <torch/csrc/jit/jit_log.h>
#include <torch/csrc/jit/passes/constant_propagation.h>
#include <torch/csrc/jit/passes/dead_code_elimination.h>
#include <torch/csrc/jit/passes/freeze_module.h>
#include <torch/csrc/jit/passes/inliner.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#include <algorithm>

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
  if (options.freeze) {
    // NB: freeze_module clones in place: attributes the forward writes (a
    // buffer's add_, a training-mode BN's statistics) stay attributes that
    // share their tensors with its argument, so freeze our own copy.
    result = torch::jit::freeze_module(result);
  }

  auto graph = forwardGraph(result);
  torch::jit::Inline(*graph);
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
