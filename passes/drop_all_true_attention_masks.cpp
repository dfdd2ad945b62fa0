// DropAllTrueAttentionMasks: an attention mask that the graph proves true
// everywhere is no mask.
//
// transformers builds its attention masks with tensor ops whenever it is
// traced (it cannot look at values then), even where there is nothing to
// mask: BERT without an attention_mask traces `arange(S)[None, None, :,
// None] + 0 >= 0`, expanded to [B, 1, S, S].  ATen's flash attention takes
// no mask and its memory-efficient attention declines this one (stride 0 in
// its last dim; measured on an H100), so every call falls back to the math
// path: float32 copies of q, k and v, two float32 matmuls and a masked
// softmax.  A boolean mask that is true everywhere masks nothing: the call
// becomes torchfuse::custom_unmasked_attention (ops/unmasked_attention.cpp),
// which runs the fused kernels (in training too; a backward that records a
// graph differentiates the math path, as the original's).
//
// The proof: a constant boolean tensor (a frozen graph folds the chain) is
// looked at; otherwise a lower bound on values: arange starts at its start,
// an add of a non-negative multiple of a bounded value keeps a bound, views
// and expansions keep their source's bound; `x >= c` (or `x > c`) is true
// everywhere when x's bound is at least (above) c.

#include <ATen/core/interned_strings.h>
#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>

#include <cmath>
#include <optional>
#include <vector>

#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using torch::jit::AliasDb;
using torch::jit::Node;
using torch::jit::Value;

// NB: a proof follows at most this many nodes; a mask chain has about ten.
constexpr int kMaxDepth = 24;

// NB: integers beyond 2^53 do not round-trip through double, which could
// round a bound up.
constexpr double kExactInt = 9007199254740992.0;

std::optional<double> constantNumber(const Value* v) {
  const auto iv = torch::jit::toIValue(v);
  if (!iv) {
    return std::nullopt;
  }
  if (iv->isInt()) {
    const auto d = static_cast<double>(iv->toInt());
    return std::abs(d) < kExactInt ? std::optional<double>(d) : std::nullopt;
  }
  if (iv->isDouble()) {
    return iv->toDouble();
  }
  if (iv->isBool()) {
    return iv->toBool() ? 1.0 : 0.0;
  }
  return std::nullopt;
}

bool isNone(const Value* v) {
  return v->type()->kind() == c10::TypeKind::NoneType;
}

// Ops whose result's elements are some of their first input's elements
// (views, expansions, copies): bounds and all-true carry over.
bool selectsElements(const Node* n) {
  return n->matches(
             "aten::expand(Tensor(a) self, SymInt[] size, *, bool implicit=False) -> Tensor(a)") ||
      n->matches("aten::expand_as(Tensor(a) self, Tensor other) -> Tensor(a)") ||
      n->matches("aten::unsqueeze(Tensor(a) self, int dim) -> Tensor(a)") ||
      n->matches("aten::squeeze.dim(Tensor(a) self, int dim) -> Tensor(a)") ||
      n->matches(
          "aten::slice.Tensor(Tensor(a) self, int dim=0, SymInt? start=None, SymInt? end=None, "
          "SymInt step=1) -> Tensor(a)") ||
      n->matches("aten::select.int(Tensor(a) self, int dim, SymInt index) -> Tensor(a)") ||
      n->matches("aten::view(Tensor(a) self, SymInt[] size) -> Tensor(a)") ||
      n->matches("aten::reshape(Tensor(a) self, SymInt[] shape) -> Tensor(a)") ||
      n->matches(
          "aten::contiguous(Tensor(a) self, *, MemoryFormat memory_format=contiguous_format) -> Tensor(a)");
}

class Prover {
 public:
  explicit Prover(AliasDb& alias_db) : alias_db_(alias_db) {}

  // The least value any element of v has, where the graph proves one.
  std::optional<double> lowerBound(const Value* v, int depth = 0) {
    if (depth > kMaxDepth || !unwritten(v)) {
      return std::nullopt;
    }
    if (const auto c = constantNumber(v)) {
      return c;
    }
    const Node* n = v->node();
    if (n->kind() == c10::prim::Constant) {
      const auto iv = torch::jit::toIValue(v);
      if (iv && iv->isTensor() && iv->toTensor().numel() > 0 && !iv->toTensor().is_complex() &&
          iv->toTensor().scalar_type() != at::kBool) {
        const auto t = iv->toTensor();
        const double lo = t.min().item<double>();
        const bool exact = t.is_floating_point() || std::abs(lo) < kExactInt;
        return exact ? std::optional<double>(lo) : std::nullopt;
      }
      return std::nullopt;
    }
    if (selectsElements(n)) {
      return lowerBound(n->input(0), depth + 1);
    }
    // NB: the dtype must be None (int64 for integer arguments, the default
    // float type otherwise) or int64: in a narrow integer type the values
    // could wrap below the start.
    const auto dtype_ok = [&](const Value* dtype) {
      const auto d = constantNumber(dtype);
      return isNone(dtype) || (d && *d == static_cast<double>(static_cast<int>(at::kLong)));
    };
    if (n->matches(
            "aten::arange(Scalar end, *, ScalarType? dtype=None, Layout? layout=None, Device? device=None, "
            "bool? pin_memory=None) -> Tensor")) {
      return dtype_ok(n->namedInput("dtype")) ? std::optional<double>(0.0) : std::nullopt;
    }
    if (n->matches(
            "aten::arange.start(Scalar start, Scalar end, *, ScalarType? dtype=None, Layout? layout=None, "
            "Device? device=None, bool? pin_memory=None) -> Tensor")) {
      return dtype_ok(n->namedInput("dtype")) ? constantNumber(n->namedInput("start"))
                                              : std::nullopt;
    }
    const bool add_tensor =
        n->matches("aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor");
    if (add_tensor ||
        n->matches("aten::add.Scalar(Tensor self, Scalar other, Scalar alpha=1) -> Tensor")) {
      const auto alpha = constantNumber(n->namedInput("alpha"));
      if (!alpha || *alpha < 0) {
        return std::nullopt;
      }
      const auto a = lowerBound(n->namedInput("self"), depth + 1);
      const auto b = lowerBound(n->namedInput("other"), depth + 1);
      if (!a || !b) {
        return std::nullopt;
      }
      return *a + *alpha * *b;
    }
    return std::nullopt;
  }

  // True when the graph proves v a boolean tensor that is true everywhere.
  bool allTrue(const Value* v, int depth = 0) {
    if (depth > kMaxDepth || !unwritten(v)) {
      return false;
    }
    const Node* n = v->node();
    if (n->kind() == c10::prim::Constant) {
      // NB: freezing folds a traced mask chain into a constant
      const auto iv = torch::jit::toIValue(v);
      return iv && iv->isTensor() && iv->toTensor().scalar_type() == at::kBool &&
          iv->toTensor().all().item<bool>();
    }
    if (selectsElements(n)) {
      return allTrue(n->input(0), depth + 1);
    }
    const bool ge = n->matches("aten::ge.Scalar(Tensor self, Scalar other) -> Tensor");
    if (ge || n->matches("aten::gt.Scalar(Tensor self, Scalar other) -> Tensor")) {
      const auto c = constantNumber(n->namedInput("other"));
      const auto bound = lowerBound(n->namedInput("self"), depth + 1);
      return c && bound && (ge ? *bound >= *c : *bound > *c);
    }
    return false;
  }

 private:
  // NB: an in-place write anywhere in the graph (to the value or anything
  // that may alias it) could change the elements the proof reasons about.
  bool unwritten(const Value* v) {
    return !alias_db_.hasWriters(v);
  }

  AliasDb& alias_db_;
};

bool isSdpa(const Node* n) {
  return n->matches(
      "aten::scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
      "float dropout_p=0., bool is_causal=False, *, float? scale=None, bool enable_gqa=False) -> Tensor");
}

// NB: with is_causal=True ATen rejects any explicit mask; dropping it would
// turn that error into a result.
bool notCausal(const Node* n) {
  const auto causal = torch::jit::constant_as<bool>(n->namedInput("is_causal"));
  return causal.has_value() && !*causal;
}

// NB: the fused kernels draw dropout's random numbers otherwise than the
// math path: with dropout the results would differ, not only round so.
bool noDropout(const Node* n) {
  const auto p = torch::jit::constant_as<double>(n->namedInput("dropout_p"));
  return p.has_value() && *p == 0.0;
}

void collect(torch::jit::Block* block, std::vector<Node*>& out) {
  for (Node* n : block->nodes()) {
    if (isSdpa(n)) {
      out.push_back(n);
    }
    for (auto* b : n->blocks()) {
      collect(b, out);
    }
  }
}

} // namespace

int64_t DropAllTrueAttentionMasks(std::shared_ptr<torch::jit::Graph>& graph) {
  std::vector<Node*> calls;
  collect(graph->block(), calls);
  if (calls.empty()) {
    return 0;
  }
  AliasDb alias_db(graph);
  Prover prover(alias_db);
  std::vector<Node*> drop;
  for (Node* n : calls) {
    const Value* mask = n->namedInput("attn_mask");
    // NB: outsideScriptedAutocast as for the fusions: TorchScript's autocast
    // pass would cast the original call, and cannot see into the op.
    if (!isNone(mask) && notCausal(n) && noDropout(n) && outsideScriptedAutocast(n) &&
        prover.allTrue(mask)) {
      drop.push_back(n);
    }
  }
  // NB: after the proofs, which the AliasDb of the unchanged graph serves.
  static const auto kUnmasked = c10::Symbol::fromQualString("torchfuse::custom_unmasked_attention");
  for (Node* n : drop) {
    Node* u = graph->create(
        kUnmasked,
        {n->namedInput("query"), n->namedInput("key"), n->namedInput("value"),
         n->namedInput("scale"), n->namedInput("enable_gqa")});
    u->insertBefore(n);
    u->output()->copyMetadata(n->output());
    n->output()->replaceAllUsesWith(u->output());
    n->destroy();
  }
  return static_cast<int64_t>(drop.size());
}

} // namespace torchfuse::passes
