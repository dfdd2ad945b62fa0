// CUDA kernels of torchfuse::custom_linear_add_relu:
//   out = relu(linear(input, weight, bias) + alpha * other)
// on cuBLASLt (kernels/cublaslt/linear_gemm.h), for float32 (TF32 when
// PyTorch's matmul flag allows it), float16 and bfloat16 with float32
// accumulation.
//
// Forward: one GEMM with the BIAS epilogue, then our in-place ReLU pass.
// `other` enters the GEMM in one of two ways:
//   - per feature (numel == N along the last dim) or one element: folded
//     into the epilogue's bias vector, which is float32 for every dtype, so
//     the pre-ReLU sum is rounded once, from float32; an [N] `other` with no
//     linear bias and alpha == 1 is used as the bias as it is, no copy;
//   - of linear's full shape: as C with beta = alpha.
// Anything else (other broadcasts, mixed dtypes, a weight or input whose
// rows are not unit-stride, empty sizes, no cuBLASLt algorithm) runs
// linearAddReluReference.  The fallbacks are silent: a TORCH_WARN_ONCE would
// be promoted to an error by the test suite's warning filter, and the
// composite gives the same results.
//
// NB: the ReLU is not the RELU_BIAS epilogue: that maps NaN to 0, whereas
// torch.relu keeps NaN, and a clamped NaN leaves no trace in the output.  The
// extra pass over y costs ≈ 0.015 ms at 1024 x 8192 fp32 on an H200, and
// with TF32 BIAS + pass is faster than RELU_BIAS (kernels.md §1.2).
//
// NB: folding `other` in 16 bits (the earlier code) rounded the bias vector
// once more than eager does, which moved pre-ReLU values near 0 across it
// and flipped ReLU masks (a flipped mask changes a whole row of grad input).
// With a float32 bias the mask is that of the exact sum up to float32
// rounding, i.e. at least as exact as eager's.
//
// Backward: g = threshold_backward(grad_output, result, 0) (one pass; the
// mask is read off the saved output), then
//   grad_input  = g · W (a cuBLASLt GEMM),
//   grad_weight = gᵀ · x with the BGRADB epilogue giving grad_bias = Σ_rows g
//                 in the same GEMM (the Autograd kernel also asks for it as
//                 the gradient of a per-feature `other`).
// With TF32 and a large GEMM, x and g are first copied transposed so that
// both operands of the weight GEMM are K-major (kernels.md §1.2).  `other`
// broadcasting beyond linear's shape and mixed dtypes take the composite.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "kernels/cublaslt/linear_gemm.h"
#include "kernels/elementwise/relu.cuh"
#include "ops/cuda/cuda_types.h"
#include "ops/cuda/linear_gemm_context.h"
#include "ops/linear_add_relu.h"

namespace torchfuse::ops {
namespace {

// `other` folds into the bias vector when it is per-feature or one element
// and broadcasting it leaves linear's shape unchanged.
bool otherFoldsIntoBias(const at::Tensor& other, const at::Tensor& input, int64_t n) {
  if (other.dim() > input.dim()) {
    return false;  // would add leading dims to the result
  }
  if (other.numel() == 1) {
    return true;
  }
  return other.numel() == n && other.dim() >= 1 && other.size(-1) == n;
}

// input (*, K) · weight[N, K]ᵀ as the GEMM [M, K] · [K, N].
struct LinearProblem {
  std::optional<kernels::GemmDtype> dtype;
  int64_t m, n, k;
  std::optional<int64_t> ldw;
  at::DimVector sizes;  // of the linear output: (*, N)

  LinearProblem(const at::Tensor& input, const at::Tensor& weight)
      : dtype(gemmDtype(input.scalar_type())),
        m(0),
        n(weight.size(0)),
        k(input.size(-1)),
        ldw(rowStride(weight)),
        sizes(input.sizes().begin(), input.sizes().end()) {
    m = k > 0 ? input.numel() / k : 0;
    sizes.back() = n;
  }

  // Whether cuBLASLt can take it at all.
  bool gemmable(const at::Tensor& input, const at::Tensor& weight) const {
    return dtype.has_value() && input.is_cuda() && m > 0 && n > 0 && k > 0 &&
        ldw.has_value() && weight.scalar_type() == input.scalar_type();
  }
};

at::Tensor linearAddReluCuda(const LinearAddReluArgs& a) {
  if (!linearAddReluHandles(a)) {
    return linearAddReluReference(a);
  }
  const auto& [input, weight, bias, other, alpha] = a;
  const bool has_bias = bias.has_value() && bias->defined();
  const LinearProblem p(input, weight);
  const int64_t m = p.m, n = p.n, k = p.k;
  const bool fold = otherFoldsIntoBias(other, input, n);
  const bool full = !fold && other.sizes() == at::IntArrayRef(p.sizes);
  const bool fast = p.gemmable(input, weight) &&
      other.scalar_type() == input.scalar_type() && !alpha.isComplex() &&
      (!has_bias || bias->is_contiguous()) &&
      // NB: with beta = 0 cuBLASLt does not read C, so a NaN or Inf in
      // `other` would not reach the output as 0 * other does in eager.
      (fold || (full && alpha.toDouble() != 0.0));
  if (!fast) {
    return linearAddReluReference(a);
  }

  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor x = input;
  auto ldx = rowStride(input);
  if (!ldx) {
    x = input.contiguous();
    ldx = k;
  }
  kernels::LinearForwardArgs f{};
  f.m = m;
  f.n = n;
  f.k = k;
  f.x = x.const_data_ptr();
  f.ldx = *ldx;
  f.w = weight.const_data_ptr();
  f.ldw = *p.ldw;

  at::Tensor bias_vec;  // keeps a computed bias alive until the launch
  at::Tensor c = other;
  if (fold) {
    if (!has_bias && alpha.equal(1) && other.numel() == n && other.is_contiguous()) {
      bias_vec = other;  // no copy; already in the output's dtype
      f.bias_fp32 = other.scalar_type() == at::kFloat;
    } else {
      const auto other_f = other.to(at::kFloat);
      const auto vec =
          other.numel() == 1 ? other_f.reshape({1}).expand({n}) : other_f.reshape({n});
      bias_vec = (has_bias ? at::add(bias->to(at::kFloat), vec, alpha) : at::mul(vec, alpha))
                     .contiguous();
      f.bias_fp32 = true;
    }
    f.bias = bias_vec.const_data_ptr();
  } else {
    auto ldc = rowStride(other);
    if (!ldc) {
      c = other.contiguous();
      ldc = n;
    }
    f.c = c.const_data_ptr();
    f.ldc = *ldc;
    f.beta = alpha.to<float>();
    if (has_bias) {
      bias_vec = *bias;
      f.bias = bias_vec.const_data_ptr();
      f.bias_fp32 = bias_vec.scalar_type() == at::kFloat;
    }
  }

  auto y = at::empty(p.sizes, input.options());
  f.y = y.mutable_data_ptr();
  f.ldy = n;
  const auto ctx = gemmContext(*p.dtype);
  if (!kernels::linearForward(ctx, f)) {
    // No algorithm for this problem: nothing was launched.
    return linearAddReluReference(a);
  }
  // In place: every element is read, then written, by the same thread.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "custom_linear_add_relu", [&] {
    kernels::reluForward(
        cudaPtr<scalar_t>(y), cudaPtr<scalar_t>(y), nullptr, y.numel(), ctx.stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

// NB: below this size (M·N·K) the transposing copies for TF32 cost more
// launches than the faster GEMM saves.
constexpr double kTransposeMinVolume = 1 << 30;

LinearAddReluGrads linearAddReluBackwardCuda(const LinearAddReluBackwardArgs& a) {
  const auto& [grad_output, input, weight, result, output_mask] = a;
  const LinearProblem p(input, weight);
  const int64_t m = p.m, n = p.n, k = p.k;
  const bool fast = p.gemmable(input, weight) &&
      grad_output.scalar_type() == input.scalar_type() &&
      result.scalar_type() == input.scalar_type() &&
      grad_output.sizes() == at::IntArrayRef(p.sizes) && result.sizes() == grad_output.sizes();
  if (!fast) {
    return linearAddReluBackwardComposite(a);
  }

  c10::cuda::CUDAGuard guard(input.device());
  // threshold_backward's rule, as eager relu's: the gradient passes where
  // !(result <= 0), so a NaN output passes it.
  auto g = at::threshold_backward(grad_output, result, 0);
  if (!g.is_contiguous()) {
    g = g.contiguous();
  }
  const auto g2d = g.view({m, n});
  const auto ctx = gemmContext(*p.dtype);

  at::Tensor grad_input, grad_weight, grad_bias;
  if (output_mask[0]) {
    grad_input = at::empty(input.sizes(), input.options());
    if (!kernels::linearGradInput(
            ctx, m, n, k, g.const_data_ptr(), n, weight.const_data_ptr(), *p.ldw,
            grad_input.mutable_data_ptr(), k)) {
      grad_input = g2d.mm(weight).view(input.sizes());
    }
  }
  if (output_mask[1]) {
    grad_weight = at::empty({n, k}, weight.options().memory_format(at::MemoryFormat::Contiguous));
    if (output_mask[2]) {
      grad_bias = at::empty({n}, g.options());
    }
    kernels::LinearGradWeightArgs wg{};
    wg.m = m;
    wg.n = n;
    wg.k = k;
    wg.dw = grad_weight.mutable_data_ptr();
    wg.lddw = k;
    wg.db = output_mask[2] ? grad_bias.mutable_data_ptr() : nullptr;
    at::Tensor xs, gs;  // keep the operands alive until the launch
    wg.transposed = ctx.allow_tf32 &&
        static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) >=
            kTransposeMinVolume;
    if (wg.transposed) {
      xs = input.reshape({m, k}).t().contiguous();
      gs = g2d.t().contiguous();
      wg.ldx = m;
      wg.ldg = m;
    } else {
      const auto ldx = rowStride(input);
      xs = ldx ? input : input.contiguous();
      gs = g;
      wg.ldx = ldx ? *ldx : k;
      wg.ldg = n;
    }
    wg.x = xs.const_data_ptr();
    wg.g = gs.const_data_ptr();
    bool ok = kernels::linearGradWeight(ctx, wg);
    if (!ok && wg.db != nullptr) {
      // No algorithm with the BGRADB epilogue: the plain GEMM and a sum.
      wg.db = nullptr;
      ok = kernels::linearGradWeight(ctx, wg);
      if (ok) {
        grad_bias = g2d.sum(0);
      }
    }
    if (!ok) {
      grad_weight = g2d.t().mm(input.reshape({m, k}));
      if (output_mask[2]) {
        grad_bias = g2d.sum(0);
      }
    }
  } else if (output_mask[2]) {
    grad_bias = g2d.sum(0);
  }
  return {grad_input, grad_weight, grad_bias, g};
}

} // namespace
} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CUDA, m) {
  using namespace torchfuse::ops;
  registerLinearAddRelu<linearAddReluCuda, linearAddReluBackwardCuda>(m);
}
