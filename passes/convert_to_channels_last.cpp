// ConvertToChannelsLast (docs/passes.md, "Channels-last layout"): in a
// frozen graph, store the 2-d convolutions' constant weights channels-last,
// so that ATen's convolution (which goes channels-last when its input or its
// weight is) converts the input once and the activations stay NHWC through
// the layout-agnostic ops after it; every value leaving that region gets the
// memory format the original gives it (torchfuse::custom_restore_layout).
//
// NB: why the meaning is kept.  The region is the set of values computed
// from convolution outputs by admitted ops: each gives the same values for
// any input strides, and with contiguous inputs returns canonical contiguous
// strides.  Its one dynamic entry x is read only by convolutions (as their
// input).  With x channels-last (suggest_memory_format) the original's
// convolutions already run channels-last whatever the weight's layout, so the
// rewritten region computes every value with the original's strides, and the
// restore op returns its argument.  Otherwise the original's region values
// are all contiguous (the weights were), and the restore op makes them so.
// Exceptions are excluded below: a convolution whose input could be an
// [N, 1, 1, 1] region value (channels-last strides that do not suggest
// channels-last) and whose channels-last weight would; constants whose
// strides could steer TensorIterator's output layout (more than one dim of
// size > 1); anything written after it leaves the region, since the restore
// op may copy.
//
// Unfrozen graphs (ConvertToChannelsLastUnfrozen) read the weights from the
// module's attributes on each call, so the region's first convolution reads
// its weight through custom_channels_last_weight, which converts it where
// the input and every region weight suggest NCHW (the original's region is
// then all contiguous), and under layout=auto where the call site's measured
// choice says so; the restore op reads that decision from the weight and
// the op's result.  BatchNorm may train there: its statistics are
// per-channel, whatever the layout.

#include <ATen/ATen.h>
#include <torch/csrc/jit/ir/alias_analysis.h>
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/jit_log.h>

#include <algorithm>
#include <functional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "passes/convert_to_channels_last.h"
#include "passes/match_filters.h"
#include "torchfuse/passes.h"

namespace torchfuse::passes {
namespace {

using torch::jit::AliasDb;
using torch::jit::Node;
using torch::jit::Value;

c10::Symbol sym(const char* name) {
  return c10::Symbol::fromQualString(name);
}

// The convolution forms, with where their groups argument is, and whether
// an `other` operand follows (index 7).
struct ConvForm {
  size_t groups;
  bool other;
  bool transposed_arg; // aten::_convolution / aten::convolution: index 6
  bool pools = false;  // kernel_size and stride of a max_pool2d at 9, 10
  bool batch_norm = false; // BatchNorm's four per-channel tensors at 7-10
};

std::optional<ConvForm> convForm(const Node* n) {
  static const std::unordered_map<c10::Symbol, ConvForm> forms = {
      {sym("aten::conv2d"), {6, false, false}},
      {sym("aten::_convolution"), {8, false, true}},
      {sym("aten::convolution"), {8, false, true}},
      {sym("torchfuse::custom_conv_relu_add"), {6, true, false}},
      {sym("torchfuse::custom_conv_add_act"), {6, true, false}},
      {sym("torchfuse::custom_conv_act_max_pool"), {6, false, false, true}},
      {sym("torchfuse::custom_conv_batch_norm_act"), {6, false, false, false, true}},
  };
  const auto it = forms.find(n->kind());
  if (it == forms.end()) {
    return std::nullopt;
  }
  return it->second;
}

bool mayHoldTensor(const Value* v) {
  const auto& t = v->type();
  if (t->kind() == c10::TypeKind::NoneType) {
    return false;
  }
  return t->isSubtypeOf(*c10::TensorType::get()) ||
      t->isSubtypeOf(*c10::OptionalType::ofTensor()) ||
      t->isSubtypeOf(*c10::ListType::ofTensors()) ||
      t->isSubtypeOf(*c10::ListType::ofOptionalTensors()) || t->kind() == c10::TypeKind::AnyType;
}

bool isNoneConstant(const Value* v) {
  return v->type()->kind() == c10::TypeKind::NoneType;
}

// A constant operand that cannot steer an elementwise op's output layout:
// TensorIterator orders dims by the strides of the operands' non-broadcast
// dims, and one with at most one dim of size > 1 never decides.
bool isLayoutNeutralConstant(const Value* v) {
  const auto t = constantTensor(v);
  if (!t) {
    return false;
  }
  const auto sizes = t->sizes();
  return std::count_if(sizes.begin(), sizes.end(), [](int64_t s) { return s > 1; }) <= 1;
}

// Ops that give the same values for any input strides and, with contiguous
// inputs, return canonical contiguous strides.  The first input is the one
// an in-place form writes.
const std::unordered_set<c10::Symbol>& elementwiseKinds() {
  static const std::unordered_set<c10::Symbol> kinds = [] {
    std::unordered_set<c10::Symbol> k;
    for (const char* name :
         {"relu", "sigmoid", "tanh", "hardtanh", "hardswish", "hardsigmoid", "silu", "gelu",
          "leaky_relu", "elu", "clamp", "clamp_min", "clamp_max", "mish", "add", "sub", "mul",
          "div"}) {
      k.insert(c10::Symbol::aten(name));
      k.insert(c10::Symbol::aten(std::string(name) + "_"));
    }
    for (const char* name :
         {"relu6", "neg", "abs", "exp", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d",
          "batch_norm"}) {
      k.insert(c10::Symbol::aten(name));
    }
    k.insert(sym("torchfuse::custom_relu"));
    k.insert(sym("torchfuse::custom_gate_mul"));
    return k;
  }();
  return kinds;
}

bool isInPlace(const Node* n) {
  const std::string name = n->kind().toUnqualString();
  return n->kind().is_aten() && !name.empty() && name.back() == '_';
}

// Nodes that read only a tensor's metadata, the same in any layout.
bool readsOnlyMetadata(const Node* n) {
  static const std::unordered_set<c10::Symbol> kinds = {
      sym("aten::size"),  sym("aten::dim"),    sym("aten::numel"),  sym("aten::len"),
      sym("prim::dtype"), sym("prim::device"), sym("prim::is_cuda")};
  return kinds.count(n->kind()) > 0;
}

// Inductor's measured channels-last speed ratios (torch/_inductor/graph.py,
// decide_layout_opt): < 1 is faster in NHWC.
constexpr double kGroupedMultiplier = 1.358;
constexpr double kDefaultMultiplier = 0.823;
constexpr double kInOutMultiplier = 0.725;
constexpr double kSmallMultiplier = 0.783;
// NB: the spatial sizes are unknown; only their ratios matter to the
// decision, except after an adaptive pooling (a fixed size), so the entry
// is taken as 224 x 224 (ImageNet's).
constexpr double kNominalEntryArea = 224.0 * 224.0;

// How the conversion is decided: always (on any device); by the cost model
// (CUDA weights); by the cost model, then on CUDA by each call site's
// measured choice (unfrozen graphs, custom_channels_last_weight).
enum class Decision { kForce, kCostModel, kMeasured };

struct Region {
  Value* entry = nullptr;
  std::vector<Node*> nodes; // admitted, in graph order
  std::unordered_set<const Value*> values;
  std::unordered_set<const Node*> lists; // ListConstructs only a region cat reads
  std::vector<Node*> convs;
};

class ChannelsLastConversion {
 public:
  // `module`: the unfrozen graph's module, whose attributes the weights are;
  // nullptr for a frozen graph, whose weights are constants.
  ChannelsLastConversion(
      std::shared_ptr<torch::jit::Graph>& graph,
      const torch::jit::Module* module = nullptr)
      : graph_(graph), module_(module) {}

  int64_t run(Decision decision) {
    if (!buildRegion()) {
      return 0;
    }
    const auto weights = candidateWeights();
    if (weights.empty()) {
      return 0;
    }
    if (decision != Decision::kForce && !(allOnCuda(weights) && flopRatio(weights) <= 1.0)) {
      return 0;
    }
    AliasDb db(graph_);
    if (module_ == nullptr ? !entryUnwritten(db) : !weightLayoutsFixed()) {
      return 0;
    }
    if (module_ == nullptr && !noEqualConstantStays(weights)) {
      return 0;
    }
    const auto exits = exitPoints(db);
    if (!exits) {
      return 0;
    }
    if (module_ != nullptr) {
      const auto [weight, converted] = convertFirstWeight(weights, decision);
      for (const auto& [value, point] : *exits) {
        insertRestore(value, point, {weight, converted});
      }
      replaceSqueezes();
      return static_cast<int64_t>(region_.convs.size());
    }
    Value* none = nullptr;
    {
      torch::jit::WithInsertPoint guard(graph_->block()->nodes().front());
      none = graph_->insertConstant(c10::IValue());
    }
    for (const auto& [value, point] : *exits) {
      insertRestore(value, point, {region_.entry, none});
    }
    for (Value* w : weights) {
      const auto t = constantTensor(w)->detach().contiguous(at::MemoryFormat::ChannelsLast);
      torch::jit::WithInsertPoint guard(w->node());
      Value* converted = graph_->insertConstant(t);
      converted->setType(c10::TensorType::create(t));
      w->replaceAllUsesWith(converted);
      w->node()->destroy();
    }
    replaceSqueezes();
    return static_cast<int64_t>(weights.size());
  }

 private:
  bool inRegion(const Value* v) const {
    return region_.values.count(v) > 0;
  }

  // The attribute names from the graph's module input (input 0) to `v`,
  // read by a chain of prim::GetAttr; nullopt for any other value.
  std::optional<std::vector<std::string>> attributePath(const Value* v) const {
    std::vector<std::string> path;
    while (v != graph_->inputs().at(0)) {
      if (v->node()->kind() != c10::prim::GetAttr) {
        return std::nullopt;
      }
      path.push_back(v->node()->s(c10::attr::name));
      v = v->node()->input(0);
    }
    std::reverse(path.begin(), path.end());
    return path;
  }

  // A convolution's weight as it is now: the constant (frozen), or the
  // module attribute the unfrozen graph reads.
  std::optional<at::Tensor> weightTensor(const Value* w) const {
    if (module_ == nullptr) {
      return constantTensor(w);
    }
    if (graph_->inputs().empty()) {
      return std::nullopt;
    }
    const auto path = attributePath(w);
    if (!path || path->empty()) {
      return std::nullopt;
    }
    c10::IValue value = module_->_ivalue();
    for (const auto& name : *path) {
      if (!value.isObject() || !value.toObjectRef().type()->hasAttribute(name)) {
        return std::nullopt;
      }
      value = value.toObjectRef().getAttr(name);
    }
    if (!value.isTensor()) {
      return std::nullopt;
    }
    return value.toTensor();
  }

  // noEqualConstantStays: no tensor constant left as it is holds a
  // converted weight's values.  NB: TorchScript pools constants by their
  // values, not their strides (ConstantPooling, which the executor's
  // optimization runs, and torch.jit.save's constant table): the two would
  // become one, converted or not, for both uses, and the other use's layout
  // would change (fuzz seed 20261248 program 777: two convolutions of one
  // weight, each with a BatchNorm of unit statistics folded in, one of them
  // in the region).
  bool noEqualConstantStays(const std::vector<Value*>& weights) const {
    std::vector<at::Tensor> converted;
    std::unordered_set<const Node*> nodes;
    for (const Value* w : weights) {
      converted.push_back(*constantTensor(w));
      nodes.insert(w->node());
    }
    bool clash = false;
    forEachNode(graph_->block(), [&](Node* n) {
      if (clash || n->kind() != c10::prim::Constant || nodes.count(n) || n->outputs().size() != 1) {
        return;
      }
      const auto t = constantTensor(n->output());
      if (!t || !t->defined()) {
        return;
      }
      clash = std::any_of(converted.begin(), converted.end(), [&](const at::Tensor& w) {
        return t->sizes() == w.sizes() && t->scalar_type() == w.scalar_type() &&
            t->device() == w.device() && t->equal(w);
      });
    });
    return !clash;
  }

  // Admits a convolution reading region value or entry `input`.
  bool admitConv(const Node* n, const ConvForm& form) const {
    if (form.transposed_arg) {
      const auto transposed = constantBool(n->input(6));
      if (!transposed || *transposed) {
        return false;
      }
    }
    const auto weight = weightTensor(n->input(1));
    if (!weight || weight->dim() != 4) {
      return false;
    }
    // NB: unfrozen weights are checked on each call (custom_channels_last_weight).
    if (module_ == nullptr &&
        (weight->suggest_memory_format() != at::MemoryFormat::Contiguous ||
         !weight->is_contiguous())) {
      return false;
    }
    const Value* bias = n->input(2);
    if (!isNoneConstant(bias) &&
        (module_ == nullptr ? !constantTensor(bias).has_value() : inRegion(bias))) {
      return false;
    }
    if (!constantInts(n->input(form.groups))) {
      return false;
    }
    if (n->input(0)->node()->kind() == c10::prim::Constant || !isTensor(n->input(0))) {
      return false;
    }
    if (form.other) {
      const Value* other = n->input(7);
      if (!isNoneConstant(other) && !inRegion(other) && !isLayoutNeutralConstant(other)) {
        return false;
      }
    }
    // Every other input is a number or a list of them, or one of
    // BatchNorm's per-channel tensors (as admitOther takes batch_norm's).
    for (size_t i = 3; i < n->inputs().size(); ++i) {
      const Value* v = n->input(i);
      if ((form.other && i == 7) || !mayHoldTensor(v)) {
        continue;
      }
      const bool per_channel = form.batch_norm && i >= 7 && i <= 10 && !inRegion(v) &&
          (module_ != nullptr || isNoneConstant(v) || isLayoutNeutralConstant(v));
      if (!per_channel) {
        return false;
      }
    }
    return n->outputs().size() == 1;
  }

  // Admits a non-conv op all of whose tensor inputs are region values (at
  // least one), layout-neutral constants or, for a pure elementwise op,
  // `side` tensors (an If block's fresh contiguous tensors, see admitIf).
  bool admitOther(const Node* n, const std::unordered_set<const Value*>& side = {}) const {
    if (n->outputs().size() != 1 || !isTensor(n->output())) {
      return false;
    }
    bool reads_region = false;
    if (n->kind() == sym("aten::cat")) {
      const Value* list = n->input(0);
      if (region_.lists.count(list->node()) == 0) {
        return false;
      }
      return n->inputs().size() == 2 && constantInts(n->input(1)).has_value();
    }
    if (elementwiseKinds().count(n->kind()) == 0) {
      return false;
    }
    // NB: unfrozen, BatchNorm's parameters and statistics are attributes:
    // per-channel [C] tensors (the op requires it), so layout-neutral.
    const bool batch_norm = n->kind() == sym("aten::batch_norm");
    if (batch_norm && module_ == nullptr) {
      const auto training = constantBool(n->input(5));
      if (!training || *training) {
        return false;
      }
    }
    if (isInPlace(n) && !inRegion(n->input(0))) {
      return false; // writes a tensor outside the region
    }
    for (size_t i = 0; i < n->inputs().size(); ++i) {
      const Value* v = n->input(i);
      if (inRegion(v)) {
        if (batch_norm && i != 0) {
          return false;
        }
        reads_region = true;
      } else if (
          mayHoldTensor(v) && !isLayoutNeutralConstant(v) &&
          !(batch_norm && module_ != nullptr && i >= 1 && i <= 4) &&
          !(side.count(v) > 0 && !batch_norm && !isInPlace(n))) {
        return false;
      }
    }
    return reads_region;
  }

  // A node of an If block that computes apart from the region, as
  // stochastic depth's noise: it reads region values only for their
  // metadata (sizes, dtype, device), and the tensors it makes are fresh and
  // contiguous (aten::empty without a memory format), or in-place updates
  // of those; its nested blocks are such nodes too.  Its tensors join
  // `side`.  NB: an elementwise op of a region value and a side tensor
  // then gives in the original the contiguous result that the restore op
  // gives where the value leaves the region.
  bool sideComputation(const Node* m, std::unordered_set<const Value*>& side) const {
    if (readsOnlyMetadata(m)) {
      return true;
    }
    for (const Value* v : m->inputs()) {
      if (inRegion(v)) {
        return false;
      }
    }
    for (const Value* o : m->outputs()) {
      if (!mayHoldTensor(o)) {
        continue;
      }
      const bool fresh =
          m->kind() == sym("aten::empty") && m->inputs().size() == 6 && isNoneConstant(m->input(5));
      const bool updates_side = isInPlace(m) && side.count(m->input(0)) > 0 && isTensor(o);
      if (!fresh && !updates_side) {
        return false;
      }
    }
    for (const auto* b : m->blocks()) {
      for (const Node* inner : b->nodes()) {
        if (!sideComputation(inner, side)) {
          return false;
        }
      }
      for (const Value* o : b->outputs()) {
        if (inRegion(o) || (mayHoldTensor(o) && side.count(o) == 0)) {
          return false;
        }
      }
    }
    for (const Value* o : m->outputs()) {
      if (mayHoldTensor(o)) {
        side.insert(o);
      }
    }
    return true;
  }

  // Admits an If choosing between region values, each block computing its
  // result with admitted elementwise ops (an unfrozen residual's `if
  // self.use_res_connect: result += input`), with side computations and
  // with Ifs admitted in turn (stochastic depth: `if not training: input
  // else: input * noise`).  Its blocks' admitted nodes, nested ones
  // included, join `admitted` in graph order, before it.
  bool admitIf(Node* n, std::vector<Node*>& admitted) {
    if (n->outputs().size() != 1 || !isTensor(n->output())) {
      return false;
    }
    std::vector<Node*> inner;
    std::unordered_set<const Value*> side;
    bool ok = true;
    for (auto* b : n->blocks()) {
      for (Node* m : b->nodes()) {
        if (!ok) {
          break;
        }
        if (admitOther(m, side) || (m->kind() == c10::prim::If && admitIf(m, inner))) {
          inner.push_back(m);
          region_.values.insert(m->output());
        } else if (!sideComputation(m, side)) {
          ok = false;
        }
      }
      ok = ok && b->outputs().size() == 1 && inRegion(b->outputs()[0]);
    }
    if (!ok) {
      for (Node* m : inner) {
        region_.values.erase(m->output());
      }
      return false;
    }
    admitted.insert(admitted.end(), inner.begin(), inner.end());
    return true;
  }

  // A use inside the region: by a region node, or as a block result of a
  // region If.
  static bool internalUse(
      const torch::jit::Use& use,
      const std::unordered_set<const Node*>& internal) {
    const Node* owner = use.user->owningBlock()->owningNode();
    return internal.count(use.user) > 0 ||
        (use.user->kind() == c10::prim::Return && owner != nullptr && internal.count(owner) > 0);
  }

  bool buildRegion() {
    std::unordered_set<Value*> entries;
    for (Node* n : graph_->nodes()) {
      if (const auto form = convForm(n)) {
        if (!admitConv(n, *form)) {
          continue;
        }
        if (!inRegion(n->input(0))) {
          entries.insert(n->input(0));
        }
        region_.convs.push_back(n);
      } else if (n->kind() == c10::prim::If) {
        if (!admitIf(n, region_.nodes)) {
          continue;
        }
      } else if (n->kind() == c10::prim::ListConstruct) {
        const bool all_region = !n->inputs().empty() &&
            std::all_of(n->inputs().begin(), n->inputs().end(), [&](const Value* v) {
              return inRegion(v);
            });
        const auto& uses = n->output()->uses();
        if (all_region && uses.size() == 1 && uses[0].user->kind() == sym("aten::cat") &&
            uses[0].offset == 0) {
          region_.lists.insert(n);
        }
        continue;
      } else if (!admitOther(n)) {
        continue;
      }
      region_.nodes.push_back(n);
      region_.values.insert(n->output());
    }
    // NB: a list whose cat was not admitted leaves the region there.
    for (auto it = region_.lists.begin(); it != region_.lists.end();) {
      const Node* cat = (*it)->output()->uses()[0].user;
      it = inRegion(cat->output()) ? std::next(it) : region_.lists.erase(it);
    }
    if (entries.size() != 1) {
      return false;
    }
    region_.entry = *entries.begin();
    return true;
  }

  // Region convolutions' weights that only region convolutions read (as
  // their weight), each held by its own storage: converting them adds no
  // copy.  A convolution whose weight has one input channel, groups = 1 and
  // a kernel larger than 1x1 may read an [N, 1, 1, 1] region value, whose
  // channels-last strides do not suggest channels-last while its
  // channels-last weight would: its weight stays.
  std::vector<Value*> candidateWeights() const {
    if (module_ != nullptr) {
      // Unfrozen: the weights stay as they are; each is checked per call.
      std::vector<Value*> weights;
      for (Node* conv : region_.convs) {
        if (std::find(weights.begin(), weights.end(), conv->input(1)) == weights.end()) {
          weights.push_back(conv->input(1));
        }
      }
      return weights;
    }
    std::unordered_set<const Node*> convs(region_.convs.begin(), region_.convs.end());
    std::unordered_map<const c10::StorageImpl*, int> storages;
    for (const Node* n : graph_->nodes()) {
      if (n->kind() == c10::prim::Constant) {
        if (const auto t = constantTensor(n->output()); t && t->has_storage()) {
          ++storages[t->storage().unsafeGetStorageImpl()];
        }
      }
    }
    std::vector<Value*> weights;
    std::unordered_set<const Value*> seen;
    for (Node* conv : region_.convs) {
      Value* w = conv->input(1);
      if (!seen.insert(w).second) {
        continue;
      }
      const auto t = *constantTensor(w);
      if (storages[t.storage().unsafeGetStorageImpl()] != 1) {
        continue;
      }
      const bool only_convs = std::all_of(w->uses().begin(), w->uses().end(), [&](const auto& u) {
        if (convs.count(u.user) == 0 || u.offset != 1) {
          return false;
        }
        const auto groups = (*constantInts(u.user->input(convForm(u.user)->groups)))[0];
        const bool may_read_ambiguous = u.user->input(0) != region_.entry && t.size(1) == 1 &&
            groups == 1 && t.size(2) * t.size(3) > 1;
        return !may_read_ambiguous;
      });
      if (only_convs) {
        weights.push_back(w);
      }
    }
    return weights;
  }

  // NB: cuDNN's NHWC kernels are what the multipliers measure.
  bool allOnCuda(const std::vector<Value*>& weights) const {
    return std::all_of(
        weights.begin(), weights.end(), [&](const Value* w) { return weightTensor(w)->is_cuda(); });
  }

 public:
  // The region's convertible weights, empty when there is no region.
  std::vector<Value*> weights() {
    return buildRegion() ? candidateWeights() : std::vector<Value*>{};
  }

  // decide_layout_opt's inference rule over the convolutions whose weights
  // convert: their FLOPs weighted by Inductor's channels-last ratios over
  // their plain sum (channels-last when <= 1), each conv's FLOPs estimated
  // as Cout * Cin/groups * kH * kW times its output's area, propagated from
  // the entry through the strides of convs and pools.
  double flopRatio(const std::vector<Value*>& weights) const {
    const std::unordered_set<const Value*> converted(weights.begin(), weights.end());
    std::unordered_map<const Value*, double> area = {{region_.entry, kNominalEntryArea}};
    const auto areaOf = [&](const Value* v) {
      const auto it = area.find(v);
      return it == area.end() ? 0.0 : it->second;
    };
    const auto strideArea = [](const Value* v, double fallback) {
      const auto s = constantInts(v);
      if (!s || s->empty()) {
        return fallback;
      }
      return static_cast<double>((*s)[0] * (*s)[s->size() > 1 ? 1 : 0]);
    };
    double total = 0;
    double weighted = 0;
    for (const Node* n : region_.nodes) {
      double a = 0;
      for (const Value* v : n->inputs()) {
        a = std::max(a, areaOf(v));
      }
      if (n->kind() == sym("aten::cat")) {
        for (const Value* v : n->input(0)->node()->inputs()) {
          a = std::max(a, areaOf(v));
        }
      }
      for (const auto* b : n->blocks()) {
        a = std::max(a, areaOf(b->outputs()[0]));
      }
      if (const auto form = convForm(n)) {
        a = areaOf(n->input(0)) / std::max(1.0, strideArea(n->input(3), 1.0));
        if (converted.count(n->input(1)) > 0) {
          const auto w = *weightTensor(n->input(1));
          const auto groups = (*constantInts(n->input(form->groups)))[0];
          const double flops =
              static_cast<double>(w.size(0) * w.size(1) * w.size(2) * w.size(3)) * a;
          double m = kDefaultMultiplier;
          if (groups > 1 && w.size(1) > 1) {
            m = kGroupedMultiplier;
          } else if (w.size(0) <= 64 && w.size(1) <= 64) {
            m = kSmallMultiplier;
          } else if (w.size(0) * 2 <= w.size(1) && w.size(2) > 1) {
            m = kInOutMultiplier;
          }
          total += flops;
          weighted += flops * m;
        }
        if (form->pools) {
          a /= std::max(1.0, strideArea(n->input(10), strideArea(n->input(9), 1.0)));
        }
      } else if (n->kind() == sym("aten::max_pool2d") || n->kind() == sym("aten::avg_pool2d")) {
        // stride [] means the kernel size
        a /= std::max(1.0, strideArea(n->input(2), strideArea(n->input(1), 1.0)));
      } else if (n->kind() == sym("aten::adaptive_avg_pool2d")) {
        const auto s = constantInts(n->input(1));
        if (s && !s->empty()) {
          a = static_cast<double>((*s)[0] * (*s)[s->size() > 1 ? 1 : 0]);
        }
      }
      area[n->output()] = a;
    }
    return total > 0 ? weighted / total : 2.0;
  }

 private:
  // The restore op reads the entry's layout where values leave: nothing may
  // change it in between.
  bool entryUnwritten(const AliasDb& db) const {
    bool written = false;
    const torch::jit::ValueSet entry = {region_.entry};
    forEachNode(graph_->block(), [&](Node* n) { written = written || db.writesToAlias(n, entry); });
    return !written;
  }

  // A region value that its node makes fresh (not an in-place op's or an
  // If's result, which may share another value's storage) and that one
  // node reads: after the rewrite only its restore op reads it, so writes
  // through that reader's aliases (a classifier's in-place dropout on the
  // flattened exit) reach the restore's result and nothing else, as in the
  // original they reached the value and nothing else.
  static bool soleFreshReader(const Value* v) {
    const Node* n = v->node();
    return v->uses().size() == 1 && !isInPlace(n) && n->kind() != c10::prim::If;
  }

  // For each region value read outside the region, the top-level node
  // before which its restore op goes: the first that reads it there (or
  // holds a block that does).  nullopt when something at or after that point
  // writes to it or to an alias of it: the restore op may copy, and the
  // outside readers would miss the write.
  std::optional<std::vector<std::pair<Value*, Node*>>> exitPoints(const AliasDb& db) const {
    std::unordered_set<const Node*> internal(region_.nodes.begin(), region_.nodes.end());
    internal.insert(region_.lists.begin(), region_.lists.end());
    std::vector<std::pair<Value*, Node*>> exits;
    for (Node* n : region_.nodes) {
      Value* v = n->output();
      Node* point = nullptr;
      for (const auto& use : v->uses()) {
        if (internalUse(use, internal) || readsOnlyMetadata(use.user)) {
          continue;
        }
        Node* top = use.user;
        while (top->owningBlock() != graph_->block()) {
          top = top->owningBlock()->owningNode();
        }
        if (point == nullptr || top->isBefore(point)) {
          point = top;
        }
      }
      if (point == nullptr) {
        continue;
      }
      const torch::jit::ValueSet set = {v};
      bool written = false;
      for (Node* m = point; m != graph_->block()->return_node() && !written; m = m->next()) {
        written = db.writesToAlias(m, set);
        for (auto* b : m->blocks()) {
          forEachNode(b, [&](Node* inner) { written = written || db.writesToAlias(inner, set); });
        }
      }
      if (written && !soleFreshReader(v)) {
        return std::nullopt;
      }
      exits.emplace_back(v, point);
    }
    return exits;
  }

  // The region's adaptive_avg_pool2d(v, 1) become custom_spatial_mean(v):
  // the same values and strides for any input layout (the op is the
  // original wherever its kernel does not run), without the global staging
  // buffer ATen's mean takes on channels-last inputs.
  void replaceSqueezes() {
    for (Node*& n : region_.nodes) {
      if (n->kind() != sym("aten::adaptive_avg_pool2d")) {
        continue;
      }
      const auto size = constantInts(n->input(1));
      if (!size || size->empty() || size->size() > 2 ||
          std::any_of(size->begin(), size->end(), [](int64_t e) { return e != 1; })) {
        continue;
      }
      Node* mean = graph_->create(sym("torchfuse::custom_spatial_mean"), {n->input(0)}, 1);
      mean->output()->setType(n->output()->type());
      mean->insertBefore(n);
      region_.values.erase(n->output());
      region_.values.insert(mean->output());
      n->output()->replaceAllUsesWith(mean->output());
      n->destroy();
      n = mean;
    }
  }

  // Unfrozen: custom_channels_last_weight reads the weights' layouts
  // before the region, the convolutions read the weights in it, so nothing
  // may change a layout in between: no attribute assigned, no in-place op
  // that changes a tensor's sizes or strides (in-place arithmetic keeps
  // them).  NB: not AliasDb, for which every attribute may alias every
  // other (a training BatchNorm's num_batches_tracked.add_ would count).
  bool weightLayoutsFixed() const {
    static const std::unordered_set<c10::Symbol> restriding = [] {
      std::unordered_set<c10::Symbol> k = {c10::prim::SetAttr};
      for (const char* name :
           {"set_", "resize_", "resize_as_", "as_strided_", "transpose_", "t_", "squeeze_",
            "unsqueeze_", "swapdims_", "swapaxes_", "permute_"}) {
        k.insert(c10::Symbol::aten(name));
      }
      return k;
    }();
    bool fixed = true;
    forEachNode(
        graph_->block(), [&](Node* n) { fixed = fixed && restriding.count(n->kind()) == 0; });
    return fixed;
  }

  // Unfrozen: the first region convolution (it reads the entry) reads its
  // weight through custom_channels_last_weight(weight, entry, weights),
  // inserted before it with fresh reads of every weight's attribute.
  // Returns (weight, converted), the pair the restore ops read.
  std::pair<Value*, Value*> convertFirstWeight(
      const std::vector<Value*>& weights,
      Decision decision) {
    Node* first = region_.convs.front();
    torch::jit::WithInsertPoint guard(first);
    std::unordered_map<const Value*, Value*> fresh = {
        {graph_->inputs().at(0), graph_->inputs().at(0)}};
    std::function<Value*(Value*)> read = [&](Value* v) -> Value* {
      if (const auto it = fresh.find(v); it != fresh.end()) {
        return it->second;
      }
      Value* parent = read(v->node()->input(0));
      Value* out = graph_->insertGetAttr(parent, v->node()->s(c10::attr::name));
      out->setType(v->type());
      return fresh[v] = out;
    };
    std::vector<Value*> reads;
    reads.reserve(weights.size());
    for (Value* w : weights) {
      reads.push_back(read(w));
    }
    Value* list = graph_->insertNode(graph_->createList(c10::TensorType::get(), reads))->output();
    Value* weight = read(first->input(1));
    Node* entry = graph_->create(
        sym("torchfuse::custom_channels_last_weight"),
        {weight, region_.entry, list, graph_->insertConstant(decision == Decision::kForce),
         graph_->insertConstant(decision == Decision::kMeasured)},
        1);
    entry->output()->setType(first->input(1)->type());
    graph_->insertNode(entry);
    first->replaceInput(1, entry->output());
    return {weight, entry->output()};
  }

  void insertRestore(Value* v, Node* point, const std::vector<Value*>& layout_args) {
    std::unordered_set<const Node*> internal(region_.nodes.begin(), region_.nodes.end());
    internal.insert(region_.lists.begin(), region_.lists.end());
    std::vector<Value*> inputs = {v};
    inputs.insert(inputs.end(), layout_args.begin(), layout_args.end());
    Node* restore = graph_->create(sym("torchfuse::custom_restore_layout"), inputs, 1);
    restore->output()->setType(v->type());
    restore->insertBefore(point);
    const auto uses = v->uses();
    for (const auto& use : uses) {
      if (use.user != restore && !internalUse(use, internal) && !readsOnlyMetadata(use.user)) {
        use.user->replaceInput(use.offset, restore->output());
      }
    }
  }

  std::shared_ptr<torch::jit::Graph>& graph_;
  const torch::jit::Module* module_;
  Region region_;
};

} // namespace

std::optional<double> channelsLastFlopRatio(std::shared_ptr<torch::jit::Graph>& graph) {
  ChannelsLastConversion conversion(graph);
  const auto weights = conversion.weights();
  if (weights.empty()) {
    return std::nullopt;
  }
  return conversion.flopRatio(weights);
}

int64_t ConvertToChannelsLast(std::shared_ptr<torch::jit::Graph>& graph, bool force) {
  const auto converted =
      ChannelsLastConversion(graph).run(force ? Decision::kForce : Decision::kCostModel);
  GRAPH_DUMP("After ConvertToChannelsLast", graph);
  return converted;
}

int64_t ConvertToChannelsLastUnfrozen(
    std::shared_ptr<torch::jit::Graph>& graph,
    const torch::jit::Module& module,
    bool force) {
  if (graph->inputs().empty() ||
      graph->inputs().at(0)->type()->cast<c10::ClassType>() != module.type()) {
    return 0;
  }
  const auto convs =
      ChannelsLastConversion(graph, &module).run(force ? Decision::kForce : Decision::kMeasured);
  GRAPH_DUMP("After ConvertToChannelsLastUnfrozen", graph);
  return convs;
}

} // namespace torchfuse::passes
