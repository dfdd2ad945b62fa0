#pragma once

// Device math shared by the stages: the Welford merge and the statistics'
// shift, the per-channel coefficients as an elementwise pass reads them, the
// sigmoid and the swish's gradient g_bn (float32, and float64 for float32
// inputs).

#include <type_traits>

#include "kernels/batch_norm/plan.cuh"
#include "kernels/common/dtype.cuh"

namespace torchfuse::kernels::batch_norm {

// Chan et al.'s merge of (nb, mb, m2b) into (n, mean, m2).
template <typename F>
__device__ __forceinline__ void welfordMerge(F& n, F& mean, F& m2, F nb, F mb, F m2b) {
  if (nb == F(0)) {
    return;
  }
  if (n == F(0)) {
    n = nb;
    mean = mb;
    m2 = m2b;
    return;
  }
  const F nn = n + nb;
  const F delta = mb - mean;
  const F fb = nb / nn;
  mean += delta * fb;
  m2 += m2b + delta * delta * n * fb;
  n = nn;
}

// The forward statistics accumulate x - shift_c with shift_c = x[0, c, 0]
// (element c * l) in every split and add shift_c back in float64: the sums
// then lose precision relative to the spread of the channel, not to its
// mean, so |mean| >> std stays accurate.  A non-finite shift makes the
// channel's statistics NaN, as the non-finite value does anyway.
__device__ __forceinline__ int64_t statsShiftIndex(int64_t ch, int64_t l) {
  return ch * l;
}

struct ChannelCoef {
  float mu, a, k, invstd;
  float a_lo = 0.f, k_lo = 0.f, mu_lo = 0.f; // read by the float64 terms only
};

__device__ __forceinline__ ChannelCoef loadCoef(const float* coef, int64_t c, int64_t ch) {
  return {__ldg(coef + kMu * c + ch),     __ldg(coef + kA * c + ch),   __ldg(coef + kK * c + ch),
          __ldg(coef + kInvstd * c + ch), __ldg(coef + kALo * c + ch), __ldg(coef + kKLo * c + ch),
          __ldg(coef + kMuLo * c + ch)};
}

// As PyTorch: 1 / (1 + exp(-t)); NaN and +-Inf propagate as there.  The
// 16-bit types take the fast exp (relative error ~1e-6, far below their
// rounding); float32 keeps the accurate one.
template <typename T>
__device__ __forceinline__ float sigmoidOf(float t) {
  if constexpr (sizeof(T) == 2) {
    return __frcp_rn(1.f + __expf(-t));
  } else {
    return __frcp_rn(1.f + expf(-t));
  }
}

// What g_bn needs beyond the per-channel coefficients: 1 / divisor, and the
// form of the swish's derivative.  silu: silu_backward's one product
// g·s'·(1 + t(1 − s')); else autograd's sum through t * sigmoid(t),
// g·s' + ((g·t)(1 − s'))·s', which is NaN (inf − inf) where an infinite g
// makes the product ±inf.
struct SwishGradArgs {
  double inv_d = 0.0;
  bool silu = true;
};

// For an infinite g: s where eager's sigmoid r (its formula, in its dtype)
// is not 0 or 1, else r.  Eager's sigmoid is float32 (silu_backward's
// opmath) or the input's dtype (the sigmoid tensor of t * sigmoid(t)); where
// it is 1 or 0, an infinite g meets 1 - s = 0 or s = 0 and gives NaN, which
// the more precise s here would turn into +-Inf.  A finite g keeps the
// precise s: eager's rounding there is an error, not a NaN.
template <typename S>
__device__ __forceinline__ S snapSigmoid(float g, S s, float r) {
  return isinf(g) && (r == 0.f || r == 1.f) ? static_cast<S>(r) : s;
}

// g_bn = dout * s' * (1 + t (1 - s')) / d, with t recomputed from x.
template <typename T>
__device__ __forceinline__ float swishGrad(
    float g,
    float x,
    const ChannelCoef& cf,
    SwishGradArgs ga,
    float* xm_out) {
  const float xm = x - cf.mu;
  const float t = fmaf(xm, cf.a, cf.k);
  float s = sigmoidOf<T>(t);
  if (!ga.silu) {
    s = snapSigmoid(g, s, toFloat(fromFloat<T>(s)));
  }
  *xm_out = xm;
  const float gt = ga.silu ? g * s * (1.f + t * (1.f - s)) : g * s + g * t * (1.f - s) * s;
  return gt * static_cast<float>(ga.inv_d);
}

// g_bn in float64 from float32 x and grad: the float32 path's terms.  Its
// gradient of a one-element `other` sums g_bn over every element while gy is
// signed, so the sum cancels by orders of magnitude; float32 terms (t, s,
// 1 - s, the products) then exceeded 2x eager's error on some draws
// (measured 3.2e-6 vs eager's 7.3e-7 on an H200; the same sum from float64
// terms: 2.9e-7).  Float64 leaves the rounding of the saved invstd.
// NB: explicit roundings, never contracted: the reduction and the dx pass
// evaluate it separately and must agree bit for bit, so that where eager's dx
// cancels exactly (a channel of one element: g_bn - sum g_bn / 1) ours does.
__device__ __forceinline__ double swishGradF64(
    float g,
    float x,
    const ChannelCoef& cf,
    SwishGradArgs ga,
    double* xm_out) {
  const double xm = __dsub_rn(__dsub_rn(x, cf.mu), cf.mu_lo);
  const double a = __dadd_rn(cf.a, cf.a_lo);
  const double k = __dadd_rn(cf.k, cf.k_lo);
  const double t = __fma_rn(xm, a, k);
  const double s_exact = __drcp_rn(__dadd_rn(1.0, exp(-t)));
  // NB: eager's float32 sigmoid, 1 / (1 + exp(-t)), is 1 from t > 16.64
  // (1 + e rounds to 1), not from 17.33 where the exact value rounds to 1.
  const double s = snapSigmoid(g, s_exact, __frcp_rn(__fadd_rn(1.f, expf(-__double2float_rn(t)))));
  *xm_out = xm;
  const double gs = __dmul_rn(g, s);
  const double gt = ga.silu
      ? __dmul_rn(gs, __fma_rn(t, __dsub_rn(1.0, s), 1.0))
      : __dadd_rn(gs, __dmul_rn(__dmul_rn(__dmul_rn(g, t), __dsub_rn(1.0, s)), s));
  return __dmul_rn(gt, ga.inv_d);
}

// Type of the reductions' per-element terms and per-chunk sums and means:
// float64 for float32 inputs (swishGradF64), float32 for 16-bit ones, whose
// rounding errors are far larger than float32's.  Chunks merge into float64
// accumulators either way.
template <typename T>
using ChunkAcc = std::conditional_t<std::is_same_v<T, float>, double, float>;

// Adds g_bn and g_bn * xhat to (c0, c1).
template <typename T>
__device__ __forceinline__ void bwdTerms(
    float g,
    float x,
    const ChannelCoef& cf,
    SwishGradArgs ga,
    ChunkAcc<T>& c0,
    ChunkAcc<T>& c1) {
  if constexpr (std::is_same_v<T, float>) {
    double xm;
    const double gb = swishGradF64(g, x, cf, ga, &xm);
    c0 += gb;
    c1 += gb * (xm * static_cast<double>(cf.invstd));
  } else {
    float xm;
    const float gb = swishGrad<T>(g, x, cf, ga, &xm);
    c0 += gb;
    c1 += gb * (xm * cf.invstd);
  }
}

} // namespace torchfuse::kernels::batch_norm
