#include "passes/match_filters.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/jit_type.h>
#include <torch/csrc/jit/ir/constants.h>

#include <algorithm>
#include <string_view>

namespace torchfuse::passes {

using c10::FloatType;
using c10::IntType;
using c10::ListType;
using c10::NoneType;
using c10::OptionalType;
using c10::TensorType;

namespace {

// The node's resolved schema is `name` with overload `overload`.  Nodes the
// JIT cannot resolve (unknown op, mismatched input types) have no schema.
bool hasSchema(const Node* n, std::string_view name, std::string_view overload) {
  const auto* schema = n->maybeSchema();
  return schema != nullptr && schema->name() == name &&
      schema->overload_name() == overload;
}

bool isIntOrFloat(const Value* v) {
  return v->type()->kind() == c10::TypeKind::IntType ||
      v->type()->kind() == c10::TypeKind::FloatType;
}

bool isIntList(const Value* v) {
  return v->type()->isSubtypeOf(*ListType::ofInts());
}

} // namespace

bool isRelu(const Node* n, bool allow_inplace) {
  return hasSchema(n, "aten::relu", "") ||
      (allow_inplace && hasSchema(n, "aten::relu_", ""));
}

bool isTensorAdd(const Node* n, bool allow_inplace) {
  const bool add = hasSchema(n, "aten::add", "Tensor") ||
      (allow_inplace && hasSchema(n, "aten::add_", "Tensor"));
  return add && n->inputs().size() == 3 && isTensor(n->input(0)) &&
      isTensor(n->input(1)) && isIntOrFloat(n->input(2));
}

bool isLinear(const Node* n) {
  return hasSchema(n, "aten::linear", "") && n->inputs().size() == 3 &&
      isTensor(n->input(0)) && isTensor(n->input(1)) &&
      isOptionalTensorArg(n->input(2));
}

bool isIntListConv(const Node* n) {
  const bool conv = hasSchema(n, "aten::conv1d", "") ||
      hasSchema(n, "aten::conv2d", "") || hasSchema(n, "aten::conv3d", "");
  return conv && n->inputs().size() == 7 && isTensor(n->input(0)) &&
      isTensor(n->input(1)) && isOptionalTensorArg(n->input(2)) &&
      isIntList(n->input(3)) && isIntList(n->input(4)) &&
      isIntList(n->input(5)) &&
      n->input(6)->type()->kind() == c10::TypeKind::IntType;
}

bool isBatchNorm(const Node* n) {
  return hasSchema(n, "aten::batch_norm", "") && n->inputs().size() == 9 &&
      isTensor(n->input(0)) &&
      n->input(5)->type()->kind() == c10::TypeKind::BoolType &&
      n->input(6)->type()->kind() == c10::TypeKind::FloatType &&
      n->input(7)->type()->kind() == c10::TypeKind::FloatType;
}

bool isScalarDivisor(const Node* n) {
  return hasSchema(n, "aten::div", "Scalar") && n->inputs().size() == 2 &&
      isTensor(n->input(0)) && isIntOrFloat(n->input(1));
}

bool isSigmoid(const Node* n) {
  return hasSchema(n, "aten::sigmoid", "") && isTensor(n->input(0));
}

bool isTensorMul(const Node* n) {
  return hasSchema(n, "aten::mul", "Tensor") && n->inputs().size() == 2 &&
      isTensor(n->input(0)) && isTensor(n->input(1));
}

bool isSilu(const Node* n) {
  return hasSchema(n, "aten::silu", "") && isTensor(n->input(0));
}

bool isTensor(const Value* v) {
  return v->type()->isSubtypeOf(*TensorType::get());
}

bool isNonOptionalTensor(const Value* v) {
  return isTensor(v);
}

bool isOptionalTensorArg(const Value* v) {
  return isTensor(v) || v->type()->kind() == c10::TypeKind::NoneType ||
      v->type()->isSubtypeOf(*OptionalType::ofTensor());
}

bool alphaIsOne(const Value* alpha) {
  const auto iv = torch::jit::toIValue(alpha);
  if (!iv) {
    return false;
  }
  if (iv->isInt()) {
    return iv->toInt() == 1;
  }
  if (iv->isDouble()) {
    return iv->toDouble() == 1.0;
  }
  return false;
}

bool divisorIsNonZero(const Value* divisor) {
  const auto iv = torch::jit::toIValue(divisor);
  if (!iv) {
    return true;  // a runtime value (e.g. an attribute of an unfrozen module)
  }
  if (iv->isInt()) {
    return iv->toInt() != 0;
  }
  if (iv->isDouble()) {
    return iv->toDouble() != 0.0;
  }
  return false;
}

std::optional<bool> constantBool(const Value* v) {
  const auto iv = torch::jit::toIValue(v);
  if (iv && iv->isBool()) {
    return iv->toBool();
  }
  return std::nullopt;
}

bool hasSingleUse(const Value* v, const Node* user) {
  return v->uses().size() == 1 && v->uses()[0].user == user;
}

bool inSameBlock(std::initializer_list<const Node*> nodes) {
  const Block* block = nullptr;
  for (const Node* n : nodes) {
    if (block == nullptr) {
      block = n->owningBlock();
    } else if (n->owningBlock() != block) {
      return false;
    }
  }
  return true;
}

bool notInPlaceOnLiveTensor(const Node* n, const Value* fresh) {
  const auto* schema = n->maybeSchema();
  if (schema == nullptr) {
    return false;
  }
  const auto& name = schema->name();
  const bool inplace = !name.empty() && name.back() == '_';
  if (!inplace) {
    return true;
  }
  return n->input(0) == fresh && hasSingleUse(fresh, n);
}

namespace {

// Nodes strictly between first and last, with their nested nodes; false if
// `last` does not follow `first` in one block.
bool forEachBetween(Node* first, Node* last, const std::function<bool(Node*)>& ok) {
  if (first->owningBlock() != last->owningBlock() || !first->isBefore(last)) {
    return false;
  }
  for (Node* n = first->next(); n != last; n = n->next()) {
    bool good = true;
    auto visit = [&](Node* m) { good = good && ok(m); };
    visit(n);
    for (Block* b : n->blocks()) {
      forEachNode(b, visit);
    }
    if (!good) {
      return false;
    }
  }
  return true;
}

} // namespace

bool noInterveningWrites(
    const AliasDb& db,
    Node* first,
    Node* last,
    const std::vector<Value*>& values) {
  torch::jit::ValueSet set(values.begin(), values.end());
  return forEachBetween(first, last, [&](Node* n) {
    return !db.writesToAlias(n, set);
  });
}

bool noInterveningAccess(
    const AliasDb& db,
    Node* first,
    Node* last,
    const std::vector<Value*>& values,
    const std::vector<Node*>& chain) {
  torch::jit::ValueSet set(values.begin(), values.end());
  return forEachBetween(first, last, [&](Node* n) {
    // The chain's own nodes become the fused op, which performs the update
    // before it reads `other`, in the original order.
    if (std::find(chain.begin(), chain.end(), n) != chain.end()) {
      return true;
    }
    if (db.writesToAlias(n, set)) {
      return false;
    }
    // NB: prim::GetAttr reads a slot of a module object, not tensor data;
    // its input (e.g. `self`) contains every attribute, the statistics
    // included.  A GetAttr that yields a statistic is caught at its users.
    if (n->kind() == c10::prim::GetAttr) {
      return true;
    }
    for (Value* in : n->inputs()) {
      for (Value* v : values) {
        if (db.mayContainAlias(in, v)) {
          return false;
        }
      }
    }
    return true;
  });
}

bool isFreshUnaliasedTensor(const AliasDb& db, Value* v, const Node* user) {
  if (!isTensor(v) || !hasSingleUse(v, user)) {
    return false;
  }
  Node* p = v->node();
  const auto k = p->kind();
  // NB: constants (pooled in frozen graphs) and attributes persist across
  // calls; writing them is observable even when nothing else reads them here.
  if (k == c10::prim::Param || k == c10::prim::Constant ||
      k == c10::prim::GetAttr || !p->blocks().empty() ||
      p->hasSideEffects() || p->hasAttribute(c10::attr::Subgraph) ||
      p->outputs().size() != 1) {
    return false;
  }
  return !db.mayContainAlias(v, p->inputs());
}

Node* replaceWithFusedOp(
    torch::jit::Graph& graph,
    const char* op,
    const std::vector<Value*>& inputs,
    Node* last) {
  Node* fused = graph.create(c10::Symbol::fromQualString(op), inputs, 1);
  fused->insertBefore(last);
  if (fused->maybeSchema() == nullptr) {
    fused->destroy();
    return nullptr;
  }
  fused->copyMetadata(last);
  fused->output()->setType(last->output()->type());
  last->output()->replaceAllUsesWith(fused->output());
  return fused;
}

void forEachNode(Block* block, const std::function<void(Node*)>& fn) {
  for (Node* n : block->nodes()) {
    fn(n);
    for (Block* b : n->blocks()) {
      forEachNode(b, fn);
    }
  }
}

int64_t countNodes(Block* block) {
  int64_t count = 0;
  forEachNode(block, [&](Node*) { ++count; });
  return count;
}

} // namespace torchfuse::passes
