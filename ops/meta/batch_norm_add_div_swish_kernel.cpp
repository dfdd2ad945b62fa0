#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/batch_norm_add_div_swish.h"
#include "ops/common/autograd_utils.h"
#include "ops/common/checks.h"

namespace torchfuse::ops {
namespace {

// NB: batch_norm keeps the input's shape and memory format; add, div, mul and
// sigmoid are ATen's own meta functions.
at::Tensor outputMeta(const at::Tensor& input, const at::Tensor& other, const at::Scalar& divisor) {
  const auto bn = at::empty_like(input, input.suggest_memory_format());
  const auto t = at::div(at::add(bn, other), divisor);
  return at::mul(t, at::sigmoid(t));
}

// NB: sizes checked only where concrete (anySymbolic).
void checkConcrete(const BatchNormAddDivSwishArgs& a) {
  if (!anySymbolic(
          {a.input, orUndefined(a.weight), orUndefined(a.bias), a.running_mean, a.running_var,
           a.other})) {
    checkBatchNormAddDivSwishInputs(a);
  }
}

at::Tensor batchNormAddDivSwishMeta(const BatchNormAddDivSwishArgs& a) {
  checkConcrete(a);
  return outputMeta(a.input, a.other, a.divisor);
}

BatchNormAddDivSwishStats batchNormAddDivSwishForwardMeta(const BatchNormAddDivSwishArgs& a) {
  checkConcrete(a);
  const auto stats = a.input.options().dtype(batchNormOpmathType(a.input.scalar_type()));
  const c10::SymInt n = a.training ? a.input.sym_size(1) : c10::SymInt(0);
  return {
      outputMeta(a.input, a.other, a.divisor), at::empty_symint({n}, stats),
      at::empty_symint({n}, stats)};
}

BatchNormAddDivSwishGrads batchNormAddDivSwishBackwardMeta(
    const BatchNormAddDivSwishBackwardArgs& a) {
  const auto types = batchNormParamGradTypes(a);
  const auto channel = [&](at::ScalarType dtype) {
    return at::empty_symint({a.input.sym_size(1)}, a.input.options().dtype(dtype));
  };
  const auto& mask = a.output_mask;
  return {
      mask[0] ? at::empty_like(a.input) : at::Tensor(),
      mask[1] ? channel(types.weight) : at::Tensor(), mask[2] ? channel(types.bias) : at::Tensor(),
      mask[3] ? at::empty_symint(a.other.sym_sizes(), a.input.options().dtype(types.other))
              : at::Tensor()};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, Meta, m) {
  using namespace torchfuse::ops;
  registerBatchNormAddDivSwish<
      batchNormAddDivSwishMeta, batchNormAddDivSwishMeta, batchNormAddDivSwishForwardMeta,
      batchNormAddDivSwishBackwardMeta>(m);
}
