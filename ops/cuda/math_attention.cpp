#include "ops/cuda/math_attention.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <initializer_list>

#include "kernels/attention/math_attention.cuh"

namespace torchfuse::ops {
namespace {

kernels::AttentionOperand operand(const at::Tensor& t) {
  const bool batched = t.dim() == 4;
  return {
      t.const_data_ptr<float>(), batched ? t.stride(0) : 0, t.stride(-3), t.stride(-2),
      t.stride(-1)};
}

} // namespace

std::optional<at::Tensor> mathAttentionCuda(
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    std::optional<double> scale) {
  const int64_t rank = query.dim();
  if (!query.is_cuda() || (rank != 3 && rank != 4)) {
    return std::nullopt;
  }
  for (const at::Tensor* t : {&query, &key, &value}) {
    if (t->dim() != rank || t->scalar_type() != at::kFloat || t->device() != query.device() ||
        t->numel() == 0 || t->sizes().slice(0, rank - 2) != query.sizes().slice(0, rank - 2)) {
      return std::nullopt;
    }
  }
  const int64_t l = query.size(-2), e = query.size(-1), s = key.size(-2), ev = value.size(-1);
  // NB: mismatched extents get ATen's error from the masked call.
  if (key.size(-1) != e || value.size(-2) != s) {
    return std::nullopt;
  }
  const int64_t b0 = rank == 4 ? query.size(0) : 1, b1 = query.size(-3);
  if (b0 > kernels::kMathAttentionMaxGridYZ || b1 > kernels::kMathAttentionMaxGridYZ) {
    return std::nullopt;
  }
  c10::cuda::CUDAGuard guard(query.device());
  if (kernels::mathAttentionSharedBytes(s, e, ev) >
      at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin) {
    return std::nullopt;
  }
  auto sizes = query.sizes().vec();
  sizes.back() = ev;
  auto out = at::empty(sizes, query.options());
  // ATen's math path scales q and k by sqrt(scale) each (sdp::calculate_scale,
  // in double), the query's factor negated for a negative scale; the float
  // kernels it runs round the factor to float.
  const bool negative = scale.has_value() && *scale < 0.0;
  const double factor =
      std::sqrt(scale.has_value() ? std::abs(*scale) : 1.0 / std::sqrt(static_cast<double>(e)));
  const kernels::MathAttentionArgs args{
      operand(query),
      operand(key),
      operand(value),
      out.data_ptr<float>(),
      b0,
      b1,
      l,
      s,
      e,
      ev,
      static_cast<float>(negative ? 0.0 - factor : factor),
      static_cast<float>(factor)};
  kernels::mathAttentionF32(args, at::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

} // namespace torchfuse::ops
