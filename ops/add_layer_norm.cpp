// custom_add_layer_norm: s = input + alpha * other; (layer_norm(s), s).
//   input and other broadcast as aten::add's operands; normalized_shape the
//   trailing sizes of s; weight and bias of normalized_shape or None;
//   promote: s takes add's promoted dtype (true) or input's (false: the
//   graph's add_ into a fresh tensor); write_sum: the second result is s
//   (pre-LN blocks read the residual stream again) or an empty tensor.
//
// Inputs the kernels do not take (addLayerNormHandles) run the composite,
// the original ATen chain, from every entry point; it is also the
// CompositeExplicitAutograd kernel, which backends without a torchfuse
// kernel reach.

#include "ops/add_layer_norm.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_add_layer_norm(Tensor input, Tensor other, Scalar alpha, bool promote, "
      "int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, bool write_sum) "
      "-> (Tensor, Tensor)");
}

namespace torchfuse {

namespace {
using AddLayerNormSignature = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&,
    const at::Tensor&,
    const c10::Scalar&,
    bool,
    at::IntArrayRef,
    const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&,
    double,
    bool);
} // namespace

std::tuple<at::Tensor, at::Tensor> custom_add_layer_norm(
    const at::Tensor& input,
    const at::Tensor& other,
    const c10::Scalar& alpha,
    bool promote,
    at::IntArrayRef normalized_shape,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    double eps,
    bool write_sum) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_add_layer_norm", "")
                       .typed<AddLayerNormSignature>();
  return op.call(input, other, alpha, promote, normalized_shape, weight, bias, eps, write_sum);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_add_layer_norm";

bool present(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined();
}

bool kernelDtype(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}

// Whether `t` is a contiguous tensor of `ref`'s dtype and device with
// `sizes` (weight and bias).
bool matchesParameter(const at::Tensor& t, const at::Tensor& ref, at::IntArrayRef sizes) {
  return isPlainDenseTensor(t) && t.scalar_type() == ref.scalar_type() &&
      t.device() == ref.device() && t.sizes() == sizes && t.is_contiguous();
}
} // namespace

void checkAddLayerNormInputs(const AddLayerNormArgs& a) {
  checkDefined(kOp, "input", a.input);
  checkDefined(kOp, "other", a.other);
  TORCH_CHECK(
      !a.normalized_shape.empty(), kOp,
      ": expected normalized_shape to have at least 1 dimension, got 0");
  if (anySymbolic({a.input, a.other, orUndefined(a.weight), orUndefined(a.bias)})) {
    return;
  }
  // NB: the sum's sizes: aten::add's broadcast (add_ further requires them
  // to be input's, which ATen checks with its own message).
  const auto in = a.input.sizes();
  const auto ot = a.other.sizes();
  const size_t dims = std::max(in.size(), ot.size());
  std::vector<int64_t> sizes(dims, 1);
  for (size_t i = 0; i < dims; ++i) {
    const int64_t x = i + in.size() >= dims ? in[i + in.size() - dims] : 1;
    const int64_t y = i + ot.size() >= dims ? ot[i + ot.size() - dims] : 1;
    TORCH_CHECK(
        x == y || x == 1 || y == 1, kOp, ": expected other (sizes ", ot,
        ") to broadcast with input (sizes ", in, ")");
    sizes[i] = x == 1 ? y : x;
  }
  const auto& ns = a.normalized_shape;
  const bool trailing = ns.size() <= sizes.size() &&
      std::equal(ns.begin(), ns.end(), sizes.end() - static_cast<std::ptrdiff_t>(ns.size()));
  TORCH_CHECK(
      trailing, kOp, ": expected normalized_shape ", ns,
      " to be the trailing sizes of input + other (sizes ", at::IntArrayRef(sizes), ")");
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{
                                    "weight", &a.weight},
                                {"bias", &a.bias}}) {
    if (present(*t)) {
      TORCH_CHECK(
          (*t)->sizes() == ns, kOp, ": expected ", name, " to have sizes normalized_shape = ",
          ns, ", got ", (*t)->sizes());
    }
  }
}

bool addLayerNormHandles(const AddLayerNormArgs& a) {
  const auto& x = a.input;
  const auto& o = a.other;
  if (!x.defined() || !o.defined() || !isPlainDenseTensor(x) || !isPlainDenseTensor(o)) {
    return false;
  }
  if (anySymbolic({x, o, orUndefined(a.weight), orUndefined(a.bias)})) {
    return false;
  }
  // NB: alpha as aten::add takes it on floating tensors (a complex one is
  // ATen's error to give).
  if (!(a.alpha.isFloatingPoint() || a.alpha.isIntegral(/*includeBool=*/false))) {
    return false;
  }
  if (!kernelDtype(x.scalar_type()) || o.scalar_type() != x.scalar_type() ||
      o.device() != x.device() || x.sizes() != o.sizes() || !x.is_contiguous() ||
      !o.is_contiguous() || x.numel() == 0) {
    return false;
  }
  const auto& ns = a.normalized_shape;
  if (ns.empty() || ns.size() > static_cast<size_t>(x.dim()) ||
      !std::equal(ns.begin(), ns.end(), x.sizes().end() - static_cast<std::ptrdiff_t>(ns.size()))) {
    return false;
  }
  return (!present(a.weight) || matchesParameter(*a.weight, x, ns)) &&
      (!present(a.bias) || matchesParameter(*a.bias, x, ns));
}

at::Tensor emptySum(const at::Tensor& like) {
  return at::empty({0}, like.options());
}

AddLayerNormResult addLayerNormComposite(const AddLayerNormArgs& a) {
  checkAddLayerNormInputs(a);
  // NB: add_ writes a copy: the op's input is not the graph's fresh tensor.
  const auto sum = a.promote ? at::add(a.input, a.other, a.alpha)
                             : a.input.clone().add_(a.other, a.alpha);
  auto normalized = at::layer_norm(sum, a.normalized_shape, a.weight, a.bias, a.eps);
  return {std::move(normalized), a.write_sum ? sum : emptySum(sum)};
}

AddLayerNormResult addLayerNorm(const AddLayerNormArgs& a) {
  return custom_add_layer_norm(
      a.input, a.other, a.alpha, a.promote, a.normalized_shape, a.weight, a.bias, a.eps,
      a.write_sum);
}

} // namespace ops
} // namespace torchfuse

// Backends without a torchfuse kernel run the original chain.
TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  torchfuse::ops::registerAddLayerNorm<torchfuse::ops::addLayerNormComposite>(m);
}
