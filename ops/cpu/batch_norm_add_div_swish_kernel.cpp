#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/batch_norm_add_div_swish.h"

namespace torchfuse::ops {
namespace {

// The per-channel vector t viewed to broadcast along dim 1 of an n-D input.
// NB: SymInts here and in the backward: the differentiable backward traces
// with symbolic shapes (torch.compile, torch.export).
at::Tensor perChannel(const at::Tensor& t, int64_t dim) {
  std::vector<c10::SymInt> shape(dim, 1);
  shape[1] = t.sym_numel();
  return t.view_symint(shape);
}

} // namespace

at::Tensor batchNormAddDivSwishComposite(const BatchNormAddDivSwishArgs& a) {
  if (batchNormAddDivSwishHandles(a)) {
    checkBatchNormAddDivSwishInputs(a);
  }
  return batchNormAddDivSwishReference(a);
}

BatchNormAddDivSwishStats batchNormAddDivSwishForwardComposite(const BatchNormAddDivSwishArgs& a) {
  checkBatchNormAddDivSwishInputs(a);
  const auto& input = a.input;
  const auto stats = input.options().dtype(batchNormOpmathType(input.scalar_type()));
  if (input.numel() == 0) {
    // NB: native_batch_norm refuses empty inputs; batch_norm returns an empty
    // result and leaves the running statistics alone.  The backward of an
    // empty input reads no statistics, so zeros of the right shape do.
    const auto bn = batchNormOf(a);
    const auto zeros = at::zeros({a.training ? input.size(1) : 0}, stats);
    return {addDivSwish(bn, a.other, a.divisor, a.silu), zeros, zeros.clone()};
  }
  auto [bn, save_mean, save_invstd] = at::native_batch_norm(
      input, a.weight, a.bias, a.running_mean, a.running_var, a.training, a.momentum, a.eps);
  const auto out = addDivSwish(bn, a.other, a.divisor, a.silu);
  if (!a.training) {
    return {out, at::empty({0}, stats), at::empty({0}, stats)};
  }
  return {out, save_mean.to(stats.dtype()), save_invstd.to(stats.dtype())};
}

BatchNormAddDivSwishGrads batchNormAddDivSwishBackwardComposite(
    const BatchNormAddDivSwishBackwardArgs& a) {
  const auto& [grad_output, input, weight, bias, mean, invstd, training, other, divisor, output_mask, silu] =
      a;
  const auto ct =
      batchNormBackwardType(input.scalar_type(), grad_output.scalar_type());
  const int64_t dim = input.dim();
  std::vector<int64_t> reduce_dims;
  for (int64_t d = 0; d < dim; ++d) {
    if (d != 1) {
      reduce_dims.push_back(d);
    }
  }
  // Recompute t and sigmoid(t) rather than saving them.
  const auto x_hat =
      (input.to(ct) - perChannel(mean.to(ct), dim)) * perChannel(invstd.to(ct), dim);
  const auto w = weight.has_value() && weight->defined()
      ? perChannel(weight->to(ct), dim)
      : at::ones({}, input.options().dtype(ct));
  auto bn = x_hat * w;
  if (bias.has_value() && bias->defined()) {
    bn = bn + perChannel(bias->to(ct), dim);
  }
  const auto t = at::div(at::add(bn, other.to(ct)), divisor);
  auto s = at::sigmoid(t);
  const auto g_out = grad_output.to(ct);
  // NB: where eager's sigmoid (float32 in silu_backward, the input's dtype as
  // the tensor of t * sigmoid(t)) rounds to 0 or 1, an infinite gradient
  // meets s = 0 or 1 - s = 0 and gives NaN; s takes that rounding there (and
  // only where the gradient is infinite: elsewhere it is just an error).
  const auto eager_dtype = silu ? batchNormOpmathType(input.scalar_type()) : input.scalar_type();
  if (c10::elementSize(eager_dtype) < c10::elementSize(ct)) {
    // NB: eager's own sigmoid, not s rounded: float32's 1 / (1 + exp(-t))
    // is 1 from t > 16.64, where 1 + exp(-t) rounds to 1, not from 17.33.
    const auto r = at::sigmoid(t.to(eager_dtype)).to(ct);
    s = at::where(r.eq(0).logical_or_(r.eq(1)).logical_and_(g_out.isinf()), r, s);
  }
  // d/dt [t * sigmoid(t)] = s * (1 + t * (1 - s)), in the original's form:
  // silu_backward's one product, or the sum of mul's and sigmoid's backwards.
  const auto grad_t =
      silu ? g_out * s * (1 + t * (1 - s)) : g_out * s + g_out * t * (1 - s) * s;
  const auto grad_sum = at::div(grad_t, divisor);
  const auto g = grad_sum.sum_to_size_symint(input.sym_sizes());
  const auto sum_g = g.sum(reduce_dims);
  const auto sum_g_xhat = (g * x_hat).sum(reduce_dims);

  at::Tensor grad_input, grad_weight, grad_bias, grad_other;
  if (output_mask[0]) {
    const auto scale = w * perChannel(invstd.to(ct), dim);
    if (training) {
      const c10::Scalar m(input.sym_numel() / input.sym_size(1));
      grad_input = scale / m *
          (g * m - perChannel(sum_g, dim) - x_hat * perChannel(sum_g_xhat, dim));
    } else {
      grad_input = g * scale;
    }
    grad_input = grad_input.to(input.scalar_type());
  }
  const auto types = batchNormParamGradTypes(a);
  if (output_mask[1]) {
    grad_weight = sum_g_xhat.to(types.weight);
  }
  if (output_mask[2]) {
    grad_bias = sum_g.to(types.bias);
  }
  if (output_mask[3]) {
    grad_other = grad_sum.sum_to_size_symint(other.sym_sizes()).to(types.other);
  }
  return {grad_input, grad_weight, grad_bias, grad_other};
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CPU, m) {
  using namespace torchfuse::ops;
  registerBatchNormAddDivSwish<
      batchNormAddDivSwishComposite, batchNormAddDivSwishComposite,
      batchNormAddDivSwishForwardComposite, batchNormAddDivSwishBackwardComposite>(m);
}
