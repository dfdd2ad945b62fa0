// custom_batch_norm_add_div_swish:
//   t = (batch_norm(input, weight, bias, running_mean, running_var, training,
//                   momentum, eps) + other) / divisor;  out = t * sigmoid(t).
//   `silu` picks how the swish is differentiated: as aten::silu does,
//   g·s·(1 + t(1 − s)), or as autograd through `t * sigmoid(t)` does,
//   g·s + ((g·t)(1 − s))·s.  The two agree up to rounding except where g is
//   infinite: there the sum is inf − inf = NaN where the product is ±inf, so
//   the pass passes the spelling it matched.
//   In training mode the running statistics are updated in place as
//   aten::batch_norm does (unbiased variance), hence the (a!)/(b!)
//   annotations; they are not optional because TorchScript's alias analysis
//   does not support `Tensor(a!)?`.
// custom_batch_norm_add_div_swish_eval is the non-mutating eval-mode form:
//   frozen graphs pool identical constants, and a write through one would
//   change another.  It is a separate name rather than an overload because
//   torch.library.opcheck tests only operators without overloads.

#include "ops/batch_norm_add_div_swish.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/ScalarType.h>
#include <torch/library.h>

#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"
#include "torchfuse/ops.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_batch_norm_add_div_swish(Tensor input, Tensor? weight, "
      "Tensor? bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "bool training, float momentum, float eps, Tensor other, "
      "Scalar divisor, bool silu=True) -> Tensor");
  m.def(
      "custom_batch_norm_add_div_swish_eval(Tensor input, Tensor? weight, "
      "Tensor? bias, Tensor running_mean, Tensor running_var, float eps, "
      "Tensor other, Scalar divisor, bool silu=True) -> Tensor");
  m.def(
      "custom_batch_norm_add_div_swish_forward(Tensor input, Tensor? weight, "
      "Tensor? bias, Tensor(a!) running_mean, Tensor(b!) running_var, "
      "bool training, float momentum, float eps, Tensor other, "
      "Scalar divisor, bool silu=True) -> (Tensor, Tensor, Tensor)");
  m.def(
      "custom_batch_norm_add_div_swish_backward(Tensor grad_output, "
      "Tensor input, Tensor? weight, Tensor? bias, Tensor mean, "
      "Tensor invstd, bool training, Tensor other, Scalar divisor, "
      "bool[4] output_mask, bool silu=True) -> (Tensor, Tensor, Tensor, Tensor)");
}

namespace torchfuse {

namespace {
using OptTensor = std::optional<at::Tensor>;
// The train and _forward ops' arguments.
template <typename Ret>
using TrainSignature =
    Ret(const at::Tensor&,
        const OptTensor&,
        const OptTensor&,
        at::Tensor&,
        at::Tensor&,
        bool,
        double,
        double,
        const at::Tensor&,
        const at::Scalar&,
        bool);
using EvalSignature = at::Tensor(
    const at::Tensor&, const OptTensor&, const OptTensor&, const at::Tensor&,
    const at::Tensor&, double, const at::Tensor&, const at::Scalar&, bool);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    const at::Tensor&, const at::Tensor&, bool, const at::Tensor&,
    const at::Scalar&, std::array<bool, 4>, bool);
} // namespace

at::Tensor custom_batch_norm_add_div_swish(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    at::Tensor& running_mean,
    at::Tensor& running_var,
    bool training,
    double momentum,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish", "")
                       .typed<TrainSignature<at::Tensor>>();
  return op.call(
      input, weight, bias, running_mean, running_var, training, momentum, eps,
      other, divisor, silu);
}

at::Tensor custom_batch_norm_add_div_swish_eval(
    const at::Tensor& input,
    const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias,
    const at::Tensor& running_mean,
    const at::Tensor& running_var,
    double eps,
    const at::Tensor& other,
    const at::Scalar& divisor,
    bool silu) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish_eval", "")
                       .typed<EvalSignature>();
  return op.call(input, weight, bias, running_mean, running_var, eps, other, divisor, silu);
}

namespace ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_batch_norm_add_div_swish";

bool defined(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined();
}

// weight and bias: C elements, in any shape, as batch_norm takes them.
void checkAffine(
    const char* name,
    const at::Tensor& t,
    const at::Tensor& input,
    int64_t channels) {
  TORCH_CHECK(
      t.numel() == channels, kOp, ": expected ", name, " to have input.size(1) = ", channels,
      " elements, got ", t.numel());
  checkSameDevice(kOp, name, t, input);
}

void checkRunningStat(
    const char* name,
    const at::Tensor& t,
    const at::Tensor& input,
    int64_t channels) {
  checkDim(kOp, name, t, 1);
  TORCH_CHECK(
      t.size(0) == channels, kOp, ": expected ", name,
      " to have input.size(1) = ", channels, " elements, got ", t.size(0));
  checkSameDevice(kOp, name, t, input);
}

bool reducedFloat(at::ScalarType s) {
  return s == at::kHalf || s == at::kBFloat16;
}

// The parameters as native batch_norm on the CPU takes them: one dtype,
// the input's or, for a 16-bit input, float32.
struct Param {
  const char* name;
  const at::Tensor* tensor;
};
std::vector<Param> presentParams(const BatchNormAddDivSwishArgs& a) {
  std::vector<Param> params;
  if (defined(a.weight)) {
    params.push_back({"weight", &*a.weight});
  }
  if (defined(a.bias)) {
    params.push_back({"bias", &*a.bias});
  }
  params.push_back({"running_mean", &a.running_mean});
  params.push_back({"running_var", &a.running_var});
  return params;
}

bool paramDtypesAsBatchNorm(const BatchNormAddDivSwishArgs& a) {
  const auto params = presentParams(a);
  const auto p = params.front().tensor->scalar_type();
  for (const auto& param : params) {
    if (param.tensor->scalar_type() != p) {
      return false;
    }
  }
  return p == a.input.scalar_type() || (reducedFloat(a.input.scalar_type()) && p == at::kFloat);
}

void checkParamDtypes(const BatchNormAddDivSwishArgs& a) {
  const auto in = a.input.scalar_type();
  const bool reduced = reducedFloat(in);
  const auto params = presentParams(a);
  for (const auto& param : params) {
    const auto p = param.tensor->scalar_type();
    TORCH_CHECK(
        p == in || (reduced && p == at::kFloat), kOp, ": expected ", param.name,
        " to have the input's dtype (", in, reduced ? ") or Float" : ")",
        ", as batch_norm requires on the CPU, got ", p);
  }
  const auto& first = params.front();
  for (const auto& param : params) {
    TORCH_CHECK(
        param.tensor->scalar_type() == first.tensor->scalar_type(), kOp, ": expected ",
        param.name, " to have the dtype of ", first.name, " (", first.tensor->scalar_type(),
        "): batch_norm requires one dtype for weight, bias and the running statistics, got ",
        param.tensor->scalar_type());
  }
}

// NB: the schema's Tensor(a!) is at::Tensor& in C++; see
// BatchNormAddDivSwishArgs for why the struct holds a const one.
at::Tensor& written(const at::Tensor& t) {
  return const_cast<at::Tensor&>(t);
}
} // namespace

// NB: each check stands for an error of the original chain (batch_norm's,
// add's), so that the fused op fails where it fails, only with a clearer
// message; what the chain accepts and the kernels do not takes the reference
// (batchNormAddDivSwishHandles).  A zero divisor is no error: the chain gives
// inf/nan.
void checkBatchNormAddDivSwishInputs(const BatchNormAddDivSwishArgs& a) {
  const auto& input = a.input;
  checkDefined(kOp, "input", input);
  checkDefined(kOp, "running_mean", a.running_mean);
  checkDefined(kOp, "running_var", a.running_var);
  checkDefined(kOp, "other", a.other);
  TORCH_CHECK(
      input.dim() >= 2, kOp, ": expected input to be at least 2-D (N, C, *), got ",
      input.dim(), "-D");
  checkFloating(kOp, "input", input);
  const int64_t channels = input.size(1);
  if (defined(a.weight)) {
    checkAffine("weight", *a.weight, input, channels);
  }
  if (defined(a.bias)) {
    checkAffine("bias", *a.bias, input, channels);
  }
  checkRunningStat("running_mean", a.running_mean, input, channels);
  checkRunningStat("running_var", a.running_var, input, channels);
  // NB: the CPU's batch_norm refuses every other mix of dtypes; on CUDA some
  // run (e.g. float64 running statistics without weight), and there such
  // mixes take the reference.
  if (input.is_cpu()) {
    checkParamDtypes(a);
  }
  if (!(a.other.dim() == 0 && a.other.is_cpu())) { // add takes a 0-dim CPU tensor anywhere
    checkSameDevice(kOp, "other", a.other, input);
  }
  checkBroadcastable(kOp, a.other, input.sizes());
}

bool batchNormAddDivSwishHandles(const BatchNormAddDivSwishArgs& a) {
  const auto& input = a.input;
  for (const auto& t :
       {input, orUndefined(a.weight), orUndefined(a.bias), a.running_mean, a.running_var,
        a.other}) {
    if (!isPlainDenseTensor(t)) {
      return false;
    }
  }
  if (!input.defined() || input.dim() < 2) {
    return true;  // the checks' error
  }
  // NB: batch_norm takes a weight or bias of C elements in any shape.
  // SymInts: sizes() raises or specialises under symbolic tracing.
  const auto channels = input.sym_size(1);
  for (const auto* t : {&a.weight, &a.bias}) {
    if (defined(*t) && (*t)->dim() != 1 && (*t)->sym_numel() == channels) {
      return false;
    }
  }
  if (!input.is_cpu()) {
    if (a.other.defined() && a.other.dim() == 0 && a.other.is_cpu()) {
      return false;  // the kernels read other on the input's device
    }
    if (a.running_mean.defined() && a.running_var.defined() && !paramDtypesAsBatchNorm(a)) {
      return false;
    }
  }
  return true;
}

at::Tensor batchNormOf(const BatchNormAddDivSwishArgs& a) {
  return at::batch_norm(
      a.input, a.weight, a.bias, a.running_mean, a.running_var, a.training, a.momentum, a.eps,
      /*cudnn_enabled=*/true);
}

at::Tensor addDivSwish(
    const at::Tensor& bn, const at::Tensor& other, const at::Scalar& divisor, bool silu) {
  const auto t = at::div(at::add(bn, other), divisor);
  return silu ? at::silu(t) : at::mul(t, at::sigmoid(t));
}

at::Tensor batchNormAddDivSwishReference(const BatchNormAddDivSwishArgs& a) {
  return addDivSwish(batchNormOf(a), a.other, a.divisor, a.silu);
}

at::ScalarType batchNormOpmathType(at::ScalarType input) {
  return input == at::kHalf || input == at::kBFloat16 ? at::kFloat : input;
}

// NB: float32 inputs get float64 backward sums (the composite computes in
// float64 throughout; the CUDA kernels accumulate in float64).  The
// per-channel sums and the gradient of `other` (a sum over every element)
// cancel heavily; computed in float32 in another order than eager's, they
// missed the bound of 2x eager's error against float64 for some seeds on an
// H200.
at::ScalarType batchNormBackwardType(at::ScalarType input, at::ScalarType grad_output) {
  const auto base = input == at::kHalf || input == at::kBFloat16 ? at::kFloat : at::kDouble;
  return c10::promoteTypes(base, grad_output);
}

BatchNormParamGradTypes batchNormParamGradTypes(const BatchNormAddDivSwishBackwardArgs& a) {
  const auto ct = batchNormBackwardType(a.input.scalar_type(), a.grad_output.scalar_type());
  const auto of = [&](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() ? t->scalar_type() : ct;
  };
  return {of(a.weight), of(a.bias), a.other.scalar_type()};
}

at::Tensor batchNormAddDivSwishTrain(const BatchNormAddDivSwishArgs& a) {
  return custom_batch_norm_add_div_swish(
      a.input, a.weight, a.bias, written(a.running_mean), written(a.running_var), a.training,
      a.momentum, a.eps, a.other, a.divisor, a.silu);
}

at::Tensor batchNormAddDivSwishEval(const BatchNormAddDivSwishArgs& a) {
  TORCH_INTERNAL_ASSERT(!a.training);
  return custom_batch_norm_add_div_swish_eval(
      a.input, a.weight, a.bias, a.running_mean, a.running_var, a.eps, a.other, a.divisor, a.silu);
}

BatchNormAddDivSwishStats batchNormAddDivSwishForward(const BatchNormAddDivSwishArgs& a) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish_forward", "")
                       .typed<TrainSignature<ops::BatchNormAddDivSwishStats>>();
  return op.call(
      a.input, a.weight, a.bias, written(a.running_mean), written(a.running_var), a.training,
      a.momentum, a.eps, a.other, a.divisor, a.silu);
}

BatchNormAddDivSwishGrads batchNormAddDivSwishBackward(const BatchNormAddDivSwishBackwardArgs& a) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("torchfuse::custom_batch_norm_add_div_swish_backward", "")
          .typed<BackwardSignature>();
  return op.call(
      a.grad_output, a.input, a.weight, a.bias, a.mean, a.invstd, a.training, a.other, a.divisor,
      a.output_mask, a.silu);
}

} // namespace ops
} // namespace torchfuse

// Backends without a torchfuse kernel (QuantizedCPU, SparseCPU, ...) run the
// original chain.
TORCH_LIBRARY_IMPL(torchfuse, CompositeExplicitAutograd, m) {
  using namespace torchfuse::ops;
  registerBatchNormAddDivSwish<batchNormAddDivSwishReference, batchNormAddDivSwishReference>(m);
}
