#include "kernels/batch_norm/apply.cuh"

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"

namespace torchfuse::kernels::batch_norm {
namespace {

// Coefficient `slot` for the V elements of the vector starting at element e.
// l == 1: V adjacent channels starting at e % c (c % V == 0, so they do not
// wrap and the load is 16-byte aligned when V >= 4); l > 1: one channel
// (e / l) % c for all V (l % V == 0).
template <int V>
__device__ __forceinline__ void fetchCoef(
    const float* __restrict__ coef,
    int64_t c,
    int slot,
    int64_t ch0,
    bool cols,
    float (&out)[V]) {
  const float* p = coef + slot * c + ch0;
  if (cols) {
    if constexpr (V % 4 == 0) {
#pragma unroll
      for (int j = 0; j < V / 4; ++j) {
        const float4 f = __ldg(reinterpret_cast<const float4*>(p) + j);
        out[4 * j] = f.x;
        out[4 * j + 1] = f.y;
        out[4 * j + 2] = f.z;
        out[4 * j + 3] = f.w;
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        out[k] = __ldg(p + k);
      }
    }
  } else {
    const float v = __ldg(p);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      out[k] = v;
    }
  }
}

__device__ __forceinline__ int64_t firstChannel(int64_t e, int64_t c, int64_t l) {
  return l == 1 ? e % c : (e / l) % c;
}

template <typename T, int V>
__global__ void __launch_bounds__(kThreads) applyForwardKernel(
    const T* __restrict__ x,
    T* __restrict__ out,
    int64_t nvec,
    int64_t c,
    int64_t l,
    const float* __restrict__ coef) {
  const int64_t base = int64_t(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
  const bool cols = l == 1;
  Vec<T, V> xv[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (v < nvec) {
      xv[u] = reinterpret_cast<const Vec<T, V>*>(x)[v];
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (v < nvec) {
      const int64_t ch0 = firstChannel(v * V, c, l);
      float mu[V], mu_lo[V], a[V], kk[V];
      fetchCoef<V>(coef, c, kMu, ch0, cols, mu);
      fetchCoef<V>(coef, c, kMuLo, ch0, cols, mu_lo);
      fetchCoef<V>(coef, c, kA, ch0, cols, a);
      fetchCoef<V>(coef, c, kK, ch0, cols, kk);
      Vec<T, V> o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float t = fmaf((toFloat(xv[u].v[k]) - mu[k]) - mu_lo[k], a[k], kk[k]);
        o.v[k] = fromFloat<T>(t * sigmoidOf<T>(t));
      }
      reinterpret_cast<Vec<T, V>*>(out)[v] = o;
    }
  }
}

// Per-channel float64 values for the V elements of a vector, as fetchCoef.
template <int V>
__device__ __forceinline__ void fetchSum(
    const double* __restrict__ sums,
    int64_t c,
    int slot,
    int64_t ch0,
    bool cols,
    double (&out)[V]) {
#pragma unroll
  for (int k = 0; k < V; ++k) {
    out[k] = __ldg(sums + slot * c + ch0 + (cols ? k : 0));
  }
}

// dx = p * (g_bn - q - xhat * r) in training, p * g_bn in eval.  float32
// evaluates it in float64 from the unrounded coefficients (the *_lo slots and
// the float64 q, r) and rounds once; 16-bit in float32.
template <typename T, int V, BwdOut kOut>
__global__ void __launch_bounds__(kThreads) applyBackwardKernel(
    const T* __restrict__ g,
    const T* __restrict__ x,
    T* __restrict__ dx,
    int64_t nvec,
    int64_t c,
    int64_t l,
    const float* __restrict__ coef,
    const double* __restrict__ sums,
    SwishGradArgs ga) {
  constexpr bool kF64 = std::is_same_v<T, float>;
  constexpr int W = kF64 ? V : 1; // sizes of the float64-only arrays
  const int64_t base = int64_t(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
  const bool cols = l == 1;
  Vec<T, V> xv[kUnroll], gv[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (v < nvec) {
      xv[u] = reinterpret_cast<const Vec<T, V>*>(x)[v];
      gv[u] = reinterpret_cast<const Vec<T, V>*>(g)[v];
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = base + u * kThreads;
    if (v < nvec) {
      const int64_t ch0 = firstChannel(v * V, c, l);
      float mu[V], a[V], kk[V], is[V], p[V], q[V], r[V];
      float mu_lo[W], a_lo[W], k_lo[W], p_lo[W];
      double q64[W], r64[W];
      fetchCoef<V>(coef, c, kMu, ch0, cols, mu);
      fetchCoef<V>(coef, c, kA, ch0, cols, a);
      fetchCoef<V>(coef, c, kK, ch0, cols, kk);
      fetchCoef<V>(coef, c, kP, ch0, cols, p);
      if constexpr (kF64) {
        fetchCoef<V>(coef, c, kMuLo, ch0, cols, mu_lo);
        fetchCoef<V>(coef, c, kALo, ch0, cols, a_lo);
        fetchCoef<V>(coef, c, kKLo, ch0, cols, k_lo);
        fetchCoef<V>(coef, c, kPLo, ch0, cols, p_lo);
      }
      if constexpr (kOut == BwdOut::kTrainDx) {
        fetchCoef<V>(coef, c, kInvstd, ch0, cols, is);
        if constexpr (kF64) {
          fetchSum<V>(sums, c, kQ64, ch0, cols, q64);
          fetchSum<V>(sums, c, kR64, ch0, cols, r64);
        } else {
          fetchCoef<V>(coef, c, kQ, ch0, cols, q);
          fetchCoef<V>(coef, c, kR, ch0, cols, r);
        }
      }
      Vec<T, V> d;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if constexpr (kF64) {
          double xm;
          const ChannelCoef cf{mu[k], a[k], kk[k], 0.f, a_lo[k], k_lo[k], mu_lo[k]};
          const double gb = swishGradF64(gv[u].v[k], xv[u].v[k], cf, ga, &xm);
          const double pd = static_cast<double>(p[k]) + static_cast<double>(p_lo[k]);
          if constexpr (kOut == BwdOut::kTrainDx) {
            d.v[k] =
                static_cast<float>(pd * (gb - q64[k] - (xm * static_cast<double>(is[k])) * r64[k]));
          } else {
            d.v[k] = static_cast<float>(pd * gb);
          }
        } else {
          float xm;
          const ChannelCoef cf{mu[k], a[k], kk[k], 0.f};
          const float gb = swishGrad<T>(toFloat(gv[u].v[k]), toFloat(xv[u].v[k]), cf, ga, &xm);
          if constexpr (kOut == BwdOut::kTrainDx) {
            d.v[k] = fromFloat<T>(p[k] * (gb - q[k] - (xm * is[k]) * r[k]));
          } else {
            d.v[k] = fromFloat<T>(p[k] * gb);
          }
        }
      }
      reinterpret_cast<Vec<T, V>*>(dx)[v] = d;
    }
  }
}

unsigned applyBlocks(int64_t nvec) {
  return static_cast<unsigned>(ceilDiv(nvec, int64_t(kThreads) * kUnroll));
}

} // namespace

template <typename T, int V>
void launchApplyForward(
    const T* x,
    T* out,
    int64_t nvec,
    int64_t c,
    int64_t l,
    const float* coef,
    cudaStream_t stream) {
  applyForwardKernel<T, V><<<applyBlocks(nvec), kThreads, 0, stream>>>(x, out, nvec, c, l, coef);
}

template <typename T, int V, BwdOut kOut>
void launchApplyBackward(
    const T* g,
    const T* x,
    T* dx,
    int64_t nvec,
    int64_t c,
    int64_t l,
    const float* coef,
    const double* sums,
    SwishGradArgs ga,
    cudaStream_t stream) {
  applyBackwardKernel<T, V, kOut>
      <<<applyBlocks(nvec), kThreads, 0, stream>>>(g, x, dx, nvec, c, l, coef, sums, ga);
}

#define TORCHFUSE_INSTANTIATE_APPLY(T, V)                                             \
  template void launchApplyForward<T, V>(                                             \
      const T*, T*, int64_t, int64_t, int64_t, const float*, cudaStream_t);           \
  template void launchApplyBackward<T, V, BwdOut::kTrainDx>(                          \
      const T*, const T*, T*, int64_t, int64_t, int64_t, const float*, const double*, \
      SwishGradArgs, cudaStream_t);                                                   \
  template void launchApplyBackward<T, V, BwdOut::kEvalDx>(                           \
      const T*, const T*, T*, int64_t, int64_t, int64_t, const float*, const double*, \
      SwishGradArgs, cudaStream_t);
#define TORCHFUSE_INSTANTIATE_APPLY_VECS(T) \
  TORCHFUSE_INSTANTIATE_APPLY(T, 1) TORCHFUSE_INSTANTIATE_APPLY(T, maxVec<T>())
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE_APPLY_VECS)
#undef TORCHFUSE_INSTANTIATE_APPLY_VECS
#undef TORCHFUSE_INSTANTIATE_APPLY

} // namespace torchfuse::kernels::batch_norm
