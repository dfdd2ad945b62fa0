#include "passes/match_filters.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/jit_type.h>
#include <torch/csrc/jit/ir/constants.h>

#include <algorithm>
#include <string>
#include <string_view>
#include <utility>

namespace torchfuse::passes {

using c10::FloatType;
using c10::IntType;
using c10::ListType;
using c10::NoneType;
using c10::OptionalType;
using c10::TensorType;

bool hasSchema(const Node* n, std::string_view name, std::string_view overload) {
  const auto* schema = n->maybeSchema();
  return schema != nullptr && schema->name() == name &&
      schema->overload_name() == overload;
}

namespace {

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

bool addPromotes(const Node* n) {
  return isTensorAdd(n, /*allow_inplace=*/false);
}

bool isLinear(const Node* n) {
  return hasSchema(n, "aten::linear", "") && n->inputs().size() == 3 &&
      isTensor(n->input(0)) && isTensor(n->input(1)) &&
      isOptionalTensorArg(n->input(2));
}

bool isLayerNorm(const Node* n) {
  return hasSchema(n, "aten::layer_norm", "") && n->inputs().size() == 6 &&
      isTensor(n->input(0)) && isIntList(n->input(1)) &&
      isOptionalTensorArg(n->input(2)) && isOptionalTensorArg(n->input(3)) &&
      n->input(4)->type()->kind() == c10::TypeKind::FloatType;
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

bool isMaxPool2d(const Node* n) {
  return hasSchema(n, "aten::max_pool2d", "") && n->inputs().size() == 6 && isTensor(n->input(0)) &&
      isIntList(n->input(1)) && isIntList(n->input(2)) && isIntList(n->input(3)) &&
      isIntList(n->input(4)) && n->input(5)->type()->kind() == c10::TypeKind::BoolType;
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

namespace {

// The activations and their scalar arguments after self: the op's name, the
// schema's base name, and the number of arguments.
struct FusableActivation {
  std::string_view schema;
  std::string_view op;
  size_t scalars;
};

constexpr FusableActivation kActivations[] = {
    {"aten::relu", "relu", 0},
    {"aten::relu6", "hardtanh", 0},
    {"aten::hardtanh", "hardtanh", 2},
    {"aten::silu", "silu", 0},
    {"aten::hardswish", "hardswish", 0},
    {"aten::hardsigmoid", "hardsigmoid", 0},
    {"aten::sigmoid", "sigmoid", 0},
    {"aten::gelu", "gelu", 1},
    {"aten::leaky_relu", "leaky_relu", 1},
};

const FusableActivation* fusableActivation(const Node* n) {
  const auto* schema = n->maybeSchema();
  if (schema == nullptr || !schema->overload_name().empty() || n->inputs().empty() ||
      !isTensor(n->input(0))) {
    return nullptr;
  }
  std::string_view name = schema->name();
  if (!name.empty() && name.back() == '_') {
    name.remove_suffix(1);
  }
  for (const auto& a : kActivations) {
    if (a.schema == name && n->inputs().size() == 1 + a.scalars) {
      return &a;
    }
  }
  return nullptr;
}

std::optional<double> constantNumber(const Value* v) {
  const auto iv = torch::jit::toIValue(v);
  if (iv && iv->isInt()) {
    return static_cast<double>(iv->toInt());
  }
  if (iv && iv->isDouble()) {
    return iv->toDouble();
  }
  return std::nullopt;
}

} // namespace

bool isFusableActivation(const Node* n) {
  return fusableActivation(n) != nullptr;
}

bool activationArgumentsAreConstant(const Node* n) {
  return activationSpec(n).has_value();
}

c10::Symbol fromInPlaceAttr() {
  return c10::Symbol::attr("torchfuse_from_inplace");
}

bool isInPlaceSpelling(const Node* n) {
  const std::string_view kind = n->kind().toUnqualString();
  return (!kind.empty() && kind.back() == '_') || n->hasAttribute(fromInPlaceAttr());
}

std::optional<ActivationSpec> activationSpec(const Node* n) {
  const auto* a = fusableActivation(n);
  if (a == nullptr) {
    return std::nullopt;
  }
  ActivationSpec spec{std::string(a->op), {}};
  // NB: "relu_": the op keeps the conv output's strides as the in-place
  // spelling does (they differ where the layout is ambiguous).
  const bool in_place = isInPlaceSpelling(n);
  if (a->schema == "aten::relu6") {
    spec.args = {0.0, 6.0};
  } else if (a->schema == "aten::gelu") {
    const auto approximate = torch::jit::toIValue(n->input(1));
    if (!approximate || !approximate->isString()) {
      return std::nullopt;
    }
    const auto& mode = approximate->toStringRef();
    if (mode != "none" && mode != "tanh") {
      return std::nullopt;
    }
    spec.name = mode == "none" ? "gelu" : "gelu_tanh";
  } else {
    for (size_t i = 1; i < n->inputs().size(); ++i) {
      const auto v = constantNumber(n->input(i));
      if (!v) {
        return std::nullopt;
      }
      spec.args.push_back(*v);
    }
  }
  if (in_place) {
    spec.name += '_';
  }
  return spec;
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

std::optional<at::Tensor> constantTensor(const Value* v) {
  const auto iv = torch::jit::toIValue(v);
  if (!iv || !iv->isTensor() || !iv->toTensor().defined()) {
    return std::nullopt;
  }
  return iv->toTensor();
}

std::optional<bool> constantBool(const Value* v) {
  const auto iv = torch::jit::toIValue(v);
  if (iv && iv->isBool()) {
    return iv->toBool();
  }
  return std::nullopt;
}

std::optional<std::vector<int64_t>> constantInts(const Value* v) {
  const auto iv = torch::jit::toIValue(v);
  if (!iv) {
    return std::nullopt;
  }
  if (iv->isIntList()) {
    return iv->toIntVector();
  }
  if (iv->isInt()) {
    return std::vector<int64_t>{iv->toInt()};
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

bool outsideScriptedAutocast(const Node* n) {
  for (const Block* b = n->owningBlock(); b != nullptr;
       b = b->owningNode() ? b->owningNode()->owningBlock() : nullptr) {
    for (const Node* m : b->nodes()) {
      if (m->kind() != torch::jit::prim::Enter) {
        continue;
      }
      const auto cls = m->input(0)->type()->cast<c10::ClassType>();
      // NB: torch.autocast, torch.amp.autocast and the cuda/cpu.amp ones
      // are all classes of some autocast_mode module.
      if (cls && cls->name() &&
          cls->name()->qualifiedName().find("autocast") != std::string::npos) {
        return false;
      }
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

namespace {
std::string slotOf(const Value* v);
bool writesOnlyOtherSlots(const Node* w, const std::vector<Value*>& values);
} // namespace

bool noInterveningWritesBesideOtherSlots(
    const AliasDb& db,
    Node* first,
    Node* last,
    const std::vector<Value*>& values) {
  std::vector<Value*> tensors;
  for (Value* v : values) {
    if (v->type()->kind() == c10::TypeKind::TensorType || isOptionalTensorArg(v)) {
      tensors.push_back(v);
    }
  }
  // Attributes and inputs by path; other tensors (a previous op's output)
  // by AliasDb, which does not let fresh results alias attributes.
  std::vector<Value*> slotted;
  torch::jit::ValueSet others;
  for (Value* v : tensors) {
    if (slotOf(v).empty()) {
      others.insert(v);
    } else {
      slotted.push_back(v);
    }
  }
  torch::jit::ValueSet set(tensors.begin(), tensors.end());
  return forEachBetween(first, last, [&](Node* n) {
    // NB: a node with blocks is judged by the nodes in them, which are
    // visited too.
    return !db.writesToAlias(n, set) || !n->blocks().empty() ||
        (writesOnlyOtherSlots(n, slotted) && !db.writesToAlias(n, others));
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

namespace {

thread_local const SharedSlots* current_shared_slots = nullptr;

// "input <i>" for a graph input, "<root>.a.b" for a GetAttr chain from one,
// "" for anything else.
std::string rawSlotOf(const Value* v) {
  const Node* n = v->node();
  if (n == v->owningGraph()->param_node()) {
    return "input " + std::to_string(v->offset());
  }
  if (n->kind() == c10::prim::GetAttr) {
    const auto base = rawSlotOf(n->input(0));
    return base.empty() ? base : base + "." + n->s(c10::attr::name);
  }
  return "";
}

// rawSlotOf, with the attribute paths of one shared tensor (SharedSlotsScope)
// named alike.
std::string slotOf(const Value* v) {
  auto slot = rawSlotOf(v);
  if (current_shared_slots != nullptr) {
    const auto it = current_shared_slots->find(slot);
    if (it != current_shared_slots->end()) {
      return it->second;
    }
  }
  return slot;
}

// Every tensor `w` writes (per its schema) is a graph input or attribute
// other than the ones `values` are.
bool writesOnlyOtherSlots(const Node* w, const std::vector<Value*>& values) {
  const auto* schema = w->maybeSchema();
  if (schema == nullptr) {
    return false;
  }
  std::vector<std::string> slots;
  for (const Value* v : values) {
    slots.push_back(slotOf(v));
    if (slots.back().empty()) {
      return false;
    }
  }
  // NB: AliasDb special-cases writers whose schemas carry no annotation:
  // batch_norm and instance_norm write their running statistics (inputs 3
  // and 4).  For any other writer without an annotated write, what it
  // writes is unknown.
  const bool norm = w->kind() == c10::aten::batch_norm ||
      w->kind() == c10::aten::instance_norm;
  size_t written = 0;
  const auto& args = schema->arguments();
  for (size_t i = 0; i < args.size() && i < w->inputs().size(); ++i) {
    const auto* info = args[i].alias_info();
    const bool writes = norm ? (i == 3 || i == 4) : info != nullptr && info->isWrite();
    if (!writes) {
      continue;
    }
    const auto slot = slotOf(w->input(i));
    if (slot.empty() ||
        std::find(slots.begin(), slots.end(), slot) != slots.end()) {
      return false;
    }
    ++written;
  }
  return written > 0;
}

// a and b sit in different blocks of one prim::If: at most one of them runs.
bool inExclusiveBranches(const Node* a, const Node* b) {
  for (const Block* ba = a->owningBlock(); ba->owningNode() != nullptr;
       ba = ba->owningNode()->owningBlock()) {
    for (const Block* bb = b->owningBlock(); bb->owningNode() != nullptr;
         bb = bb->owningNode()->owningBlock()) {
      if (ba->owningNode() == bb->owningNode()) {
        return ba != bb && ba->owningNode()->kind() == c10::prim::If;
      }
    }
  }
  return false;
}

bool isInside(const Node* n, const Node* ancestor) {
  for (const Node* p = n->owningBlock()->owningNode(); p != nullptr;
       p = p->owningBlock()->owningNode()) {
    if (p == ancestor) {
      return true;
    }
  }
  return false;
}

} // namespace

bool notWrittenAfter(
    const AliasDb& db,
    Node* first,
    const std::vector<Value*>& values) {
  std::vector<Value*> tensors;
  for (Value* v : values) {
    if (v->type()->kind() != c10::TypeKind::NoneType) {
      tensors.push_back(v);
    }
  }
  if (tensors.empty()) {
    return true;
  }
  std::vector<const Node*> loops;
  for (const Node* p = first->owningBlock()->owningNode(); p != nullptr;
       p = p->owningBlock()->owningNode()) {
    if (p->kind() == c10::prim::Loop) {
      loops.push_back(p);
    }
  }
  torch::jit::ValueSet set(tensors.begin(), tensors.end());
  bool ok = true;
  forEachNode(first->owningGraph()->block(), [&](Node* w) {
    // NB: a node with blocks counts its nested writes; those are visited
    // themselves.
    if (!ok || w == first || !w->blocks().empty() || !db.writesToAlias(w, set) ||
        writesOnlyOtherSlots(w, tensors)) {
      return;
    }
    const bool in_loop = std::any_of(loops.begin(), loops.end(), [&](const Node* l) {
      return isInside(w, l);
    });
    if (in_loop || (!w->isBefore(first) && !inExclusiveBranches(w, first))) {
      ok = false;
    }
  });
  return ok;
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

bool isInBlock(const Node* n, const Block* block) {
  for (const auto* b = n->owningBlock(); b != nullptr;
       b = b->owningNode() != nullptr ? b->owningNode()->owningBlock() : nullptr) {
    if (b == block) {
      return true;
    }
  }
  return false;
}

int64_t countNodes(Block* block) {
  int64_t count = 0;
  forEachNode(block, [&](Node*) { ++count; });
  return count;
}

SharedSlotsScope::SharedSlotsScope(SharedSlots slots)
    : slots_(std::move(slots)), previous_(current_shared_slots) {
  current_shared_slots = &slots_;
}

SharedSlotsScope::~SharedSlotsScope() {
  current_shared_slots = previous_;
}

} // namespace torchfuse::passes
