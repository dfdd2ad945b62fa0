// custom_linear_act on CUDA: one cuBLASLt GEMM (kernels/cublaslt/
// linear_gemm.h: plan cached per problem, candidates timed on first use),
// then one in-place pass over its output (kernels/conv/add_act_epilogue in
// its channels-last mode: a linear's output [rows, features] is "nhwc" with
// one image, rows positions and features channels), computing in float and
// rounding once.
//
//   float32: the GEMM without bias (COMPUTE_32F, or FAST_TF32 where torch's
//     matmul precision allows it), then bias + activation in the pass.  NB:
//     profiled on an H200 (vgg16's classifier, 16 x 25088 -> 4096 and
//     16 x 4096 -> 4096), ATen's addmm took cuBLAS's sgemm_largek_lds64
//     (447 µs for the two) where a bias-free GEMM ran an xmma kernel (242 µs).
//   float16 / bfloat16: the GEMM with the BIAS epilogue (bias in the
//     output's dtype), then the activation in the pass (none: no pass).
//     NB: the linear output is then rounded to 16 bits once, before the
//     activation, as eager's addmm + activation do; cuBLASLt's fp16 nvjet
//     kernels run the epilogue for free.
//
// The activation is our own pass, never a cuBLASLt epilogue: RELU maps NaN
// to 0 where torch.relu keeps it, and GELU is the tanh approximation.
//
// The residual (`other` of the linear output's sizes, contiguous, of its
// dtype) enters the GEMM as C: D = x·Wᵀ + bias + beta·C, the bias in the
// BIAS epilogue for every dtype, so the sum is rounded once where eager
// rounds the linear output and then the sum.  beta = alpha for y + alpha ·
// other; for other + alpha · y only alpha = 1, where the two are the same
// sum.  NB: alpha = 0 is the composite's: with beta = 0 cuBLASLt does not
// read C, so NaN or Inf in `other` would not reach the output as 0 · other
// does in eager.  Any other residual (broadcast, another dtype, strided)
// runs the composite.
//
// Anything else (float64, a non-contiguous input or weight, empty sizes,
// torch's fp16-accumulation flag, no cuBLASLt algorithm) runs the
// composite.  The result has linear's sizes and strides: a view of a
// contiguous [rows, features] matrix, as aten::linear returns.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "kernels/conv/add_act_epilogue.cuh"
#include "ops/cuda/cuda_types.h"
#include "ops/cuda/linear_gemm_context.h"
#include "ops/linear_act.h"

namespace torchfuse::ops {
namespace {

// No residual, or one the GEMM takes as C (see the file's comment).
bool residualTakenAsC(const LinearActArgs& a, int64_t m, int64_t n) {
  if (!a.other.has_value() || !a.other->defined()) {
    return true;
  }
  const auto& other = *a.other;
  if (a.alpha.isComplex() || a.alpha.isBoolean()) {
    return false;
  }
  const double alpha = a.alpha.toDouble();
  return other.scalar_type() == a.input.scalar_type() && other.is_contiguous() &&
      other.numel() == m * n && other.dim() >= 1 && other.size(-1) == n &&
      other.dim() == a.input.dim() && alpha != 0.0 && (!a.other_first || alpha == 1.0) &&
      std::equal(other.sizes().begin(), other.sizes().end() - 1, a.input.sizes().begin());
}

at::Tensor linearActCuda(const LinearActArgs& a) {
  if (!linearActHandles(a)) {
    return linearActComposite(a);
  }
  checkLinearActInputs(a); // NB: the composite's fallbacks check again: cheap
  const auto act = linearActActivation(a);
  const auto& input = a.input;
  const auto& weight = a.weight;
  const bool has_bias = a.bias.has_value() && a.bias->defined();
  const auto dtype = gemmDtype(input.scalar_type());
  const int64_t k = input.size(-1);
  const int64_t n = weight.size(0);
  const int64_t m = k > 0 ? input.numel() / k : 0;
  const bool fast = dtype.has_value() && !atenAccumulatesInHalf(*dtype) && m > 0 && n > 0 &&
      k > 0 && input.is_contiguous() && weight.is_contiguous() &&
      (!has_bias || a.bias->is_contiguous());
  if (!fast || !residualTakenAsC(a, m, n)) {
    return linearActComposite(a);
  }

  c10::cuda::CUDAGuard guard(input.device());
  auto y = at::empty({m, n}, input.options());
  const bool has_other = a.other.has_value() && a.other->defined();
  const bool bias_in_gemm = has_bias && (has_other || *dtype != kernels::GemmDtype::kFloat32);
  kernels::LinearForwardArgs f{};
  f.m = m;
  f.n = n;
  f.k = k;
  f.x = input.const_data_ptr();
  f.ldx = k;
  f.w = weight.const_data_ptr();
  f.ldw = k;
  if (bias_in_gemm) {
    f.bias = a.bias->const_data_ptr();
    f.bias_fp32 = false;
  }
  if (has_other) {
    f.c = a.other->const_data_ptr();
    f.ldc = n;
    f.beta = static_cast<float>(a.alpha.toDouble());
  }
  f.y = y.mutable_data_ptr();
  f.ldy = n;
  const auto ctx = gemmContext(*dtype);
  if (!kernels::linearForward(ctx, f)) {
    // No algorithm for this problem: nothing was launched.
    return linearActComposite(a);
  }
  const bool bias_in_pass = has_bias && !bias_in_gemm;
  if (bias_in_pass || act.kind != kernels::ActivationKind::kNone) {
    TORCHFUSE_DISPATCH_KERNEL_TYPES(y.scalar_type(), "custom_linear_act", [&] {
      const kernels::ConvAddActEpilogueArgs<CudaType<scalar_t>::type> args{
          cudaPtr<scalar_t>(y),
          bias_in_pass ? cudaPtr<scalar_t>(*a.bias) : nullptr,
          nullptr,
          1.0f,
          act,
          /*n=*/1,
          /*c=*/n,
          /*s=*/m,
          /*scale=*/nullptr,
          /*shift=*/nullptr};
      kernels::convAddActEpilogue(args, /*channels_last=*/true, ctx.stream);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  // NB: linear's own sizes: aten::linear views its 2-D addmm/mm result.
  auto sizes = input.sizes().vec();
  sizes.back() = n;
  return y.view(sizes);
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  torchfuse::ops::registerLinearAct<torchfuse::ops::linearActCuda>(m);
}
