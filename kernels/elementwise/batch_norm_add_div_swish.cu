#include "kernels/elementwise/batch_norm_add_div_swish.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

// Layout of the work (see docs/kernels/batch_norm_add_div_swish.md):
//
// * Reductions (training statistics; backward sums) write one partial per
//   (split, channel) to the workspace; a one-thread-per-channel kernel merges
//   the splits in float64 and derives per-channel coefficients.  The
//   statistics are float32 Welford (shifted, see statsShiftIndex) up to the
//   split partials; the backward sums are float64 from each thread's
//   accumulator on (see ReduceAcc).
//   - l == 1 ("columns"): x is an (n, c) matrix.  A thread owns V adjacent
//     columns (one 16-byte vector) and walks rows, so a warp reads contiguous
//     memory; 8 row groups per block are merged through shared memory and the
//     grid's y dimension splits the rows.
//   - l > 1 ("planes"): block (channel, split) walks its share of the
//     channel's n * l elements in 16-byte vectors that never straddle planes
//     (l % V == 0), then reduces across the block with warp shuffles.
// * Elementwise passes read the per-channel coefficients from the workspace.
// * The backward: one reduction pass for the per-channel sums, one
//   elementwise pass for dx.  float32 evaluates every per-element term in
//   float64 and rounds once (swishGradF64); a float32 training backward
//   first recomputes the float64 batch mean the forward centred on, since
//   the saved statistics carry only its float32 rounding.
//
// Workspace: kNumCoefSlots * c float coefficients, kNumSumSlots * c double
// per-channel values, then 2 * splits * c partials (float or double, see
// ReduceAcc).

namespace torchfuse::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kColX = 32;  // column threads per block (x)
constexpr int kColY = 8;   // row groups per block (y)
constexpr int kUnroll = 4; // loads in flight per thread

// Per-channel coefficient arrays, each c floats, at workspace + k * c.
enum Coef : int {
  kMu = 0,     // mean used to centre x (batch or running)
  kA = 1,      // w * invstd / d
  kK = 2,      // (b + s) / d
  kInvstd = 3, // invstd
  kP = 4,      // w * invstd
  kQ = 5,      // sum g_bn / M
  kR = 6,      // sum g_bn * xhat / M
  kMuLo = 7,   // mean - (float)mean: the forward centres on mu + mu_lo
  kALo = 8,    // a - (float)a: a = kA + kALo in float64 (float64 terms)
  kKLo = 9,    // k - (float)k
  kPLo = 10,   // p - (float)p
  // An even count (slot 11 is padding) keeps the float64 regions after the
  // slots 8-byte aligned.
  kNumCoefSlots = 12,
};

// Per-channel float64 values, each c doubles, after the coefficients.
enum Sum : int {
  kSumG = 0,  // sum g_bn (for a one-element `other`)
  kQ64 = 1,   // sum g_bn / M, as kQ unrounded (float32 dx)
  kR64 = 2,   // sum g_bn * xhat / M, as kR unrounded
  kNumSumSlots = 3,
};

// ---------------------------------------------------------------- types ----

__device__ __forceinline__ float toFloat(float v) {
  return v;
}
__device__ __forceinline__ float toFloat(__half v) {
  return __half2float(v);
}
__device__ __forceinline__ float toFloat(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ float fromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// At most 16-byte alignment: sm_90 has no wider vector access, so a vector of
// 8 floats is two 16-byte accesses.
template <typename T, int V>
struct alignas(sizeof(T) * V < 16 ? sizeof(T) * V : 16) Vec {
  T v[V];
};

template <typename T>
constexpr int maxVec() {
  return 16 / static_cast<int>(sizeof(T));
}

__device__ double loadChannel(const BnChannelRef& r, int64_t c, double absent) {
  if (r.data == nullptr) {
    return absent;
  }
  const int64_t i = c * r.stride;
  switch (r.dtype) {
    case BnDtype::kFloat:
      return static_cast<const float*>(r.data)[i];
    case BnDtype::kHalf:
      return __half2float(static_cast<const __half*>(r.data)[i]);
    case BnDtype::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(r.data)[i]);
    case BnDtype::kDouble:
      return static_cast<const double*>(r.data)[i];
  }
  return absent;
}

__device__ double loadMut(const BnChannelMut& r, int64_t c) {
  return loadChannel(BnChannelRef{r.data, r.dtype, 1}, c, 0.0);
}

__device__ void storeMut(const BnChannelMut& r, int64_t c, double v) {
  switch (r.dtype) {
    case BnDtype::kFloat:
      static_cast<float*>(r.data)[c] = static_cast<float>(v);
      break;
    case BnDtype::kHalf:
      static_cast<__half*>(r.data)[c] = __float2half_rn(static_cast<float>(v));
      break;
    case BnDtype::kBFloat16:
      static_cast<__nv_bfloat16*>(r.data)[c] =
          __float2bfloat16_rn(static_cast<float>(v));
      break;
    case BnDtype::kDouble:
      static_cast<double*>(r.data)[c] = v;
      break;
  }
}

// --------------------------------------------------------------- plan ----

struct Plan {
  bool columns = true;
  int vec = 1;          // elements per vector when pointers are aligned
  int64_t splits = 1;   // partials per channel
  int64_t total = 0;    // units split: rows (columns) or elements (planes)
  int64_t per = 0;      // units per split
  int64_t col_blocks = 0;
};

int64_t ceilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Depends on the shape, the element size and the SM count only, so the
// workspace size and the launches agree.
Plan makePlan(BnShape s, int elem_size, int num_sms) {
  Plan p;
  const int vmax = 16 / elem_size;
  // Enough 256-thread blocks to fill every SM.
  const int64_t target = int64_t(std::max(num_sms, 1)) * 8;
  p.columns = s.l == 1;
  if (p.columns) {
    p.vec = s.c % vmax == 0 ? vmax : 1;
    p.col_blocks = ceilDiv(s.c / p.vec, kColX);
    // At least 8 rows per thread.
    const int64_t max_splits =
        std::min<int64_t>(65535, std::max<int64_t>(1, s.n / (kColY * 8)));
    p.splits = std::clamp<int64_t>(ceilDiv(target, p.col_blocks), 1, max_splits);
    p.total = s.n;
    p.per = ceilDiv(s.n, p.splits);
  } else {
    p.vec = s.l % vmax == 0 ? vmax : 1;
    const int64_t m = s.n * s.l;
    // At least kUnroll vectors per thread.
    const int64_t max_splits = std::min<int64_t>(
        65535, std::max<int64_t>(1, m / (int64_t(kThreads) * p.vec * kUnroll)));
    p.splits = std::clamp<int64_t>(ceilDiv(target, s.c), 1, max_splits);
    p.total = m;
    p.per = ceilDiv(ceilDiv(m, p.splits), p.vec) * p.vec;
  }
  return p;
}

__host__ __device__ __forceinline__ int64_t
splitCount(int64_t total, int64_t per, int64_t s) {
  const int64_t left = total - s * per;
  return left <= 0 ? 0 : (left < per ? left : per);
}

bool aligned16(const void* p) {
  return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// ------------------------------------------------------------- math ----

// Chan et al.'s merge of (nb, mb, m2b) into (n, mean, m2).
template <typename F>
__device__ __forceinline__ void
welfordMerge(F& n, F& mean, F& m2, F nb, F mb, F m2b) {
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
// (element c * l) in every split and add shift_c back in float64: the float32
// sums then lose precision relative to the spread of the channel, not to its
// mean, so |mean| >> std stays accurate.  A non-finite shift makes the
// channel's statistics NaN, as the non-finite value does anyway.
__device__ __forceinline__ int64_t statsShiftIndex(int64_t ch, int64_t l) {
  return ch * l;
}

struct ChannelCoef {
  float mu, a, k, invstd;
  float a_lo = 0.f, k_lo = 0.f, mu_lo = 0.f;  // read by the float64 terms only
};

__device__ __forceinline__ ChannelCoef loadCoef(const float* coef, int64_t c, int64_t ch) {
  return {
      __ldg(coef + kMu * c + ch), __ldg(coef + kA * c + ch),
      __ldg(coef + kK * c + ch), __ldg(coef + kInvstd * c + ch),
      __ldg(coef + kALo * c + ch), __ldg(coef + kKLo * c + ch),
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
__device__ __forceinline__ float
swishGrad(float g, float x, const ChannelCoef& cf, SwishGradArgs ga, float* xm_out) {
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
__device__ __forceinline__ double
swishGradF64(float g, float x, const ChannelCoef& cf, SwishGradArgs ga, double* xm_out) {
  const double xm = __dsub_rn(__dsub_rn(x, cf.mu), cf.mu_lo);
  const double a = __dadd_rn(cf.a, cf.a_lo);
  const double k = __dadd_rn(cf.k, cf.k_lo);
  const double t = __fma_rn(xm, a, k);
  const double s_exact = __drcp_rn(__dadd_rn(1.0, exp(-t)));
  // NB: eager's float32 sigmoid, 1 / (1 + exp(-t)), is 1 from t > 16.64
  // (1 + e rounds to 1), not from 17.33 where the exact value rounds to 1.
  const double s =
      snapSigmoid(g, s_exact, __frcp_rn(__fadd_rn(1.f, expf(-__double2float_rn(t)))));
  *xm_out = xm;
  const double gs = __dmul_rn(g, s);
  const double gt = ga.silu
      ? __dmul_rn(gs, __fma_rn(t, __dsub_rn(1.0, s), 1.0))
      : __dadd_rn(gs, __dmul_rn(__dmul_rn(__dmul_rn(g, t), __dsub_rn(1.0, s)), s));
  return __dmul_rn(gt, ga.inv_d);
}

// Type of the backward reductions' per-element terms and chunk sums:
// float64 for float32 inputs (swishGradF64), float32 for 16-bit ones, whose
// rounding errors are far larger than float32's.
template <typename T>
using BwdTerm = std::conditional_t<std::is_same_v<T, float>, double, float>;

// Adds g_bn and g_bn * xhat to (c0, c1).
template <typename T>
__device__ __forceinline__ void bwdTerms(
    float g, float x, const ChannelCoef& cf, SwishGradArgs ga, BwdTerm<T>& c0, BwdTerm<T>& c1) {
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

// ------------------------------------------------------- reductions ----

// NB: the backward's sums accumulate in float64 from the thread level on.
// They cancel heavily (g_bn is signed), and the gradient of a one-element
// `other` sums g_bn over every element: float32 accumulators lost enough
// digits there to exceed eager's error against float64.  Each thread adds
// the sum of its kUnroll-row chunk (BwdTerm) to its double accumulator.  The forward statistics stay float32 (shifted
// Welford), whose error is relative to the spread of a channel.
template <bool kBwd>
using ReduceAcc = std::conditional_t<kBwd, double, float>;

// kBwd == false: Welford (mean, m2) of x per column.
// kBwd == true:  (sum g_bn, sum g_bn * xhat) per column.
template <typename T, int V, bool kBwd>
__global__ void __launch_bounds__(kColX* kColY) columnReduceKernel(
    const T* __restrict__ x,
    const T* __restrict__ g,
    int64_t n,
    int64_t c,
    int64_t per,
    const float* __restrict__ coef,
    SwishGradArgs ga,
    ReduceAcc<kBwd>* __restrict__ part0,
    ReduceAcc<kBwd>* __restrict__ part1) {
  using Acc = ReduceAcc<kBwd>;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int64_t col = int64_t(blockIdx.x) * kColX + tx;  // vector column
  const bool valid = col < c / V;
  const int64_t r0 = int64_t(blockIdx.y) * per;
  const int64_t r1 = r0 + per < n ? r0 + per : n;

  Acc s0[V], s1[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    s0[k] = Acc(0);
    s1[k] = Acc(0);
  }
  int cnt = 0;
  // Forward: Welford of x - shift_c, shift_c = x[0, c] (see statsShift).
  float shift[kBwd ? 1 : V];
  if constexpr (!kBwd) {
    if (valid) {
      // l == 1 here: statsShiftIndex(col * V + k, 1) = col * V + k.
      const Vec<T, V> s = *reinterpret_cast<const Vec<T, V>*>(x + col * V);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        shift[k] = toFloat(s.v[k]);
      }
    }
  }
  ChannelCoef cf[kBwd ? V : 1];
  if constexpr (kBwd) {
    if (valid) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        cf[k] = loadCoef(coef, c, col * V + k);
      }
    }
  }
  if (valid) {
    for (int64_t r = r0 + ty; r < r1; r += kColY * kUnroll) {
      Vec<T, V> xv[kUnroll];
      Vec<T, V> gv[kBwd ? kUnroll : 1];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t rr = r + u * kColY;
        if (rr < r1) {
          xv[u] = *reinterpret_cast<const Vec<T, V>*>(x + rr * c + col * V);
          if constexpr (kBwd) {
            gv[u] = *reinterpret_cast<const Vec<T, V>*>(g + rr * c + col * V);
          }
        }
      }
      BwdTerm<T> c0[kBwd ? V : 1] = {}, c1[kBwd ? V : 1] = {};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (r + u * kColY < r1) {
          if constexpr (!kBwd) {
            ++cnt;
            const float f = 1.f / static_cast<float>(cnt);
#pragma unroll
            for (int k = 0; k < V; ++k) {
              const float xf = toFloat(xv[u].v[k]) - shift[k];
              const float d = xf - s0[k];
              s0[k] += d * f;
              s1[k] += d * (xf - s0[k]);
            }
          } else {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              bwdTerms<T>(toFloat(gv[u].v[k]), toFloat(xv[u].v[k]), cf[k], ga, c0[k], c1[k]);
            }
          }
        }
      }
      if constexpr (kBwd) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          s0[k] += c0[k];
          s1[k] += c1[k];
        }
      }
    }
  }

  __shared__ Acc sh0[kColY][kColX * V];
  __shared__ Acc sh1[kColY][kColX * V];
  __shared__ int shn[kColY][kColX];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    sh0[ty][tx * V + k] = s0[k];
    sh1[ty][tx * V + k] = s1[k];
  }
  shn[ty][tx] = cnt;
  __syncthreads();
  if (ty != 0 || !valid) {
    return;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) {
    Acc a0 = s0[k], a1 = s1[k];
    float na = static_cast<float>(cnt);
    for (int j = 1; j < kColY; ++j) {
      if constexpr (kBwd) {
        a0 += sh0[j][tx * V + k];
        a1 += sh1[j][tx * V + k];
      } else {
        welfordMerge(
            na, a0, a1, static_cast<float>(shn[j][tx]), sh0[j][tx * V + k],
            sh1[j][tx * V + k]);
      }
    }
    const int64_t idx = int64_t(blockIdx.y) * c + col * V + k;
    part0[idx] = a0;
    part1[idx] = a1;
  }
}

template <typename T, int V, bool kBwd>
__global__ void __launch_bounds__(kThreads) planeReduceKernel(
    const T* __restrict__ x,
    const T* __restrict__ g,
    int64_t c,
    int64_t l,
    int64_t m,
    int64_t per,
    const float* __restrict__ coef,
    SwishGradArgs ga,
    ReduceAcc<kBwd>* __restrict__ part0,
    ReduceAcc<kBwd>* __restrict__ part1) {
  using Acc = ReduceAcc<kBwd>;
  const int64_t ch = blockIdx.x;
  const int64_t e0 = int64_t(blockIdx.y) * per;
  const int64_t e1 = e0 + per < m ? e0 + per : m;
  Acc a0 = 0, a1 = 0;  // (mean, m2) or (sum g_bn, sum g_bn * xhat)
  float cnt = 0.f;
  float shift = 0.f;
  if constexpr (!kBwd) {
    shift = toFloat(x[statsShiftIndex(ch, l)]);
  }
  ChannelCoef cf{};
  if constexpr (kBwd) {
    cf = loadCoef(coef, c, ch);
  }
  constexpr int64_t kStep = int64_t(kThreads) * V;
  for (int64_t e = e0 + int64_t(threadIdx.x) * V; e < e1; e += kStep * kUnroll) {
    Vec<T, V> xv[kUnroll];
    Vec<T, V> gv[kBwd ? kUnroll : 1];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t ee = e + u * kStep;
      if (ee < e1) {
        const int64_t plane = ee / l;
        const int64_t off = (plane * c + ch) * l + (ee - plane * l);
        xv[u] = *reinterpret_cast<const Vec<T, V>*>(x + off);
        if constexpr (kBwd) {
          gv[u] = *reinterpret_cast<const Vec<T, V>*>(g + off);
        }
      }
    }
    BwdTerm<T> c0 = 0, c1 = 0;  // this chunk's backward sums
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (e + u * kStep < e1) {
        if constexpr (!kBwd) {
          // Merge the vector's own (mean, m2) into the running state.
          float bm = 0.f;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            bm += toFloat(xv[u].v[k]) - shift;
          }
          bm *= 1.f / V;
          float bm2 = 0.f;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float d = (toFloat(xv[u].v[k]) - shift) - bm;
            bm2 += d * d;
          }
          const float n_old = cnt;
          cnt += V;
          const float f = V / cnt;
          const float delta = bm - a0;
          a0 += delta * f;
          a1 += bm2 + delta * delta * n_old * f;
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            bwdTerms<T>(toFloat(gv[u].v[k]), toFloat(xv[u].v[k]), cf, ga, c0, c1);
          }
        }
      }
    }
    if constexpr (kBwd) {
      a0 += c0;
      a1 += c1;
    }
  }

  // Block reduction: warps by shuffles, then the kWarps warp results.
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Acc b0 = __shfl_down_sync(0xffffffffu, a0, offset);
    const Acc b1 = __shfl_down_sync(0xffffffffu, a1, offset);
    if constexpr (kBwd) {
      a0 += b0;
      a1 += b1;
    } else {
      const float nb = __shfl_down_sync(0xffffffffu, cnt, offset);
      welfordMerge(cnt, a0, a1, nb, b0, b1);
    }
  }
  __shared__ Acc sh[2][kWarps];
  __shared__ float shn[kWarps];
  const int warp = threadIdx.x / 32;
  if ((threadIdx.x & 31) == 0) {
    sh[0][warp] = a0;
    sh[1][warp] = a1;
    shn[warp] = cnt;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      if constexpr (kBwd) {
        a0 += sh[0][w];
        a1 += sh[1][w];
      } else {
        welfordMerge(cnt, a0, a1, shn[w], sh[0][w], sh[1][w]);
      }
    }
    part0[int64_t(blockIdx.y) * c + ch] = a0;
    part1[int64_t(blockIdx.y) * c + ch] = a1;
  }
}

// ------------------------------------------------- per-channel kernels ----

// Writes the coefficients of channel ch.  invstd is the float32 value the
// backward sees again (saved statistics).  The forward centres on the float64
// mean as mu + mu_lo: where |mean| >> std the float32 mean alone is off by up
// to half an ulp of |mean|, times invstd in t (eager's forward does not round
// its mean either).  The backward gets the saved float32 mean (mu_lo = 0)
// and, for float32 in training, recomputes mu_lo (meanLoKernel).
__device__ void writeCoef(
    float* coef,
    int64_t c,
    int64_t ch,
    double mean,
    float invstd,
    const BnAffine& aff) {
  const double w = loadChannel(aff.weight, ch, 1.0);
  const double b = loadChannel(aff.bias, ch, 0.0);
  const double s = loadChannel(aff.other, ch, 0.0);
  const double d = aff.divisor;
  coef[kMu * c + ch] = static_cast<float>(mean);
  coef[kMuLo * c + ch] = static_cast<float>(mean - static_cast<float>(mean));
  const double a = w * invstd / d;
  const double k = (b + s) / d;
  coef[kA * c + ch] = static_cast<float>(a);
  coef[kK * c + ch] = static_cast<float>(k);
  coef[kALo * c + ch] = static_cast<float>(a - static_cast<float>(a));
  coef[kKLo * c + ch] = static_cast<float>(k - static_cast<float>(k));
  coef[kInvstd * c + ch] = invstd;
  const double p = w * invstd;
  coef[kP * c + ch] = static_cast<float>(p);
  coef[kPLo * c + ch] = static_cast<float>(p - static_cast<float>(p));
}

// The statistics reduction's output: per (split, channel) shifted Welford
// (mean, m2) in float32, and the plan's split of each channel's elements.
struct StatsPartials {
  const float* part0;
  const float* part1;
  int64_t splits, total, per;
};

// The channel's float64 batch mean and m2 (sum of squared deviations): the
// splits' partials merged in split order, the shift added back.
template <typename T>
__device__ void batchStats(
    const T* __restrict__ x,
    const StatsPartials& sp,
    int64_t c,
    int64_t l,
    int64_t ch,
    double& mean,
    double& m2) {
  double n = 0;
  mean = 0;
  m2 = 0;
  for (int64_t s = 0; s < sp.splits; ++s) {
    const int64_t nb = splitCount(sp.total, sp.per, s);
    welfordMerge<double>(
        n, mean, m2, static_cast<double>(nb), sp.part0[s * c + ch], sp.part1[s * c + ch]);
  }
  mean += toFloat(x[statsShiftIndex(ch, l)]);
}

template <typename T>
__global__ void trainStatsFinalizeKernel(
    const T* __restrict__ x,
    StatsPartials sp,
    int64_t c,
    int64_t l,
    int64_t m,
    BnAffine aff,
    BnChannelMut running_mean,
    BnChannelMut running_var,
    double momentum,
    double eps,
    float* __restrict__ save_mean,
    float* __restrict__ save_invstd,
    float* __restrict__ coef) {
  const int64_t ch = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) {
    return;
  }
  double mean, m2;
  batchStats(x, sp, c, l, ch, mean, m2);
  // NB: as PyTorch: invstd from the biased variance, the running variance
  // from the unbiased one (m2 / (M - 1): NaN for M == 1, as there).
  const double var = m2 / static_cast<double>(m);
  const float mean_f = static_cast<float>(mean);
  const float invstd_f = static_cast<float>(1.0 / sqrt(var + eps));
  if (save_mean != nullptr) {
    save_mean[ch] = mean_f;
  }
  if (save_invstd != nullptr) {
    save_invstd[ch] = invstd_f;
  }
  if (running_mean.data != nullptr) {
    storeMut(
        running_mean, ch,
        (1.0 - momentum) * loadMut(running_mean, ch) + momentum * mean);
  }
  if (running_var.data != nullptr) {
    const double unbiased = m2 / static_cast<double>(m - 1);
    storeMut(
        running_var, ch,
        (1.0 - momentum) * loadMut(running_var, ch) + momentum * unbiased);
  }
  writeCoef(coef, c, ch, mean, invstd_f, aff);
}

// A float32 training backward's mu_lo: the float64 batch mean, recomputed
// from the same partials as the forward's, less the saved float32 mean that
// coefFromStatsKernel wrote as mu.  NB: only where that mean is the batch
// mean's float32 rounding (the forward's save_mean); any other mean is used
// as given (with its own mu_lo), as native_batch_norm_backward does.
template <typename T>
__global__ void meanLoKernel(
    const T* __restrict__ x,
    StatsPartials sp,
    int64_t c,
    int64_t l,
    float* __restrict__ coef) {
  const int64_t ch = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) {
    return;
  }
  double mean, m2;
  batchStats(x, sp, c, l, ch, mean, m2);
  const float mu = coef[kMu * c + ch];
  if (static_cast<float>(mean) == mu) {
    coef[kMuLo * c + ch] = static_cast<float>(mean - static_cast<double>(mu));
  }
}

// From given statistics: invstd given directly, or 1/sqrt(var + eps).
__global__ void coefFromStatsKernel(
    int64_t c,
    BnChannelRef mean,
    BnChannelRef var_or_invstd,
    bool is_var,
    double eps,
    BnAffine aff,
    float* __restrict__ coef) {
  const int64_t ch = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) {
    return;
  }
  const double v = loadChannel(var_or_invstd, ch, 0.0);
  const float invstd = is_var
      ? static_cast<float>(1.0 / sqrt(v + eps))
      : static_cast<float>(v);
  writeCoef(coef, c, ch, loadChannel(mean, ch, 0.0), invstd, aff);
}

// Merges the splits' partials in split order; writes the parameter
// gradients, each channel's sum of g_bn (for a one-element `other`) and
// q = sum g_bn / M, r = sum g_bn * xhat / M (float coefficients and float64
// sums).
__global__ void backwardSumsFinalizeKernel(
    const double* __restrict__ part0,
    const double* __restrict__ part1,
    int64_t c,
    int64_t splits,
    int64_t m,
    BnParamGrads grads,
    bool other_per_channel,
    double* __restrict__ sums,
    float* __restrict__ coef) {
  const int64_t ch = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ch >= c) {
    return;
  }
  double sum_g = 0, sum_gx = 0;
  for (int64_t s = 0; s < splits; ++s) {
    sum_g += part0[s * c + ch];
    sum_gx += part1[s * c + ch];
  }
  if (grads.weight.data != nullptr) {
    storeMut(grads.weight, ch, sum_gx);
  }
  if (grads.bias.data != nullptr) {
    storeMut(grads.bias, ch, sum_g);
  }
  if (grads.other.data != nullptr && other_per_channel) {
    storeMut(grads.other, ch, sum_g);
  }
  const double q = sum_g / static_cast<double>(m);
  const double r = sum_gx / static_cast<double>(m);
  sums[kSumG * c + ch] = sum_g;
  sums[kQ64 * c + ch] = q;
  sums[kR64 * c + ch] = r;
  coef[kQ * c + ch] = static_cast<float>(q);
  coef[kR * c + ch] = static_cast<float>(r);
}

// The gradient of a one-element `other`: the channels' sums of g_bn added in
// float64 by one block in a fixed order.
__global__ void __launch_bounds__(kThreads) sumChannelsKernel(
    const double* __restrict__ channel_sum,
    int64_t c,
    BnChannelMut out) {
  double a = 0;
  for (int64_t ch = threadIdx.x; ch < c; ch += kThreads) {
    a += channel_sum[ch];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
  }
  __shared__ double sh[kWarps];
  if ((threadIdx.x & 31) == 0) {
    sh[threadIdx.x / 32] = a;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) {
      a += sh[w];
    }
    storeMut(out, 0, a);
  }
}

// ------------------------------------------------------- elementwise ----

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

// Which dx applyBackwardKernel writes.
enum class BwdOut { kTrainDx, kEvalDx };

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
  constexpr int W = kF64 ? V : 1;  // sizes of the float64-only arrays
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
            d.v[k] = static_cast<float>(
                pd * (gb - q64[k] - (xm * static_cast<double>(is[k])) * r64[k]));
          } else {
            d.v[k] = static_cast<float>(pd * gb);
          }
        } else {
          float xm;
          const ChannelCoef cf{mu[k], a[k], kk[k], 0.f};
          const float gb = swishGrad<T>(
              toFloat(gv[u].v[k]), toFloat(xv[u].v[k]), cf, ga, &xm);
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

// ---------------------------------------------------------- launchers ----

// Calls f(std::integral_constant<int, V>) with the plan's vector width when
// every pointer is 16-byte aligned, else with 1.
template <typename T, typename F>
void withVec(const Plan& p, bool aligned, F&& f) {
  if (aligned && p.vec == maxVec<T>()) {
    f(std::integral_constant<int, maxVec<T>()>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

template <typename T, int V, bool kBwd>
void launchReduce(
    const Plan& p,
    BnShape s,
    const T* x,
    const T* g,
    const float* coef,
    SwishGradArgs ga,
    ReduceAcc<kBwd>* part0,
    ReduceAcc<kBwd>* part1,
    cudaStream_t stream) {
  if (p.columns) {
    const dim3 grid(static_cast<unsigned>(ceilDiv(s.c / V, kColX)), static_cast<unsigned>(p.splits));
    columnReduceKernel<T, V, kBwd><<<grid, dim3(kColX, kColY), 0, stream>>>(
        x, g, s.n, s.c, p.per, coef, ga, part0, part1);
  } else {
    const dim3 grid(static_cast<unsigned>(s.c), static_cast<unsigned>(p.splits));
    planeReduceKernel<T, V, kBwd><<<grid, kThreads, 0, stream>>>(
        x, g, s.c, s.l, s.n * s.l, p.per, coef, ga, part0, part1);
  }
}

unsigned applyBlocks(int64_t nvec) {
  return static_cast<unsigned>(ceilDiv(nvec, int64_t(kThreads) * kUnroll));
}

unsigned channelBlocks(int64_t c) {
  return static_cast<unsigned>(ceilDiv(c, kThreads));
}

int64_t numel(BnShape s) {
  return s.n * s.c * s.l;
}

// The workspace's regions (see the top of the file); Acc is the partials'
// type.
template <typename Acc>
struct Workspace {
  float* coef;
  double* sums;  // kNumSumSlots * c
  Acc* part0;
  Acc* part1;
};

template <typename Acc>
Workspace<Acc> carve(void* ws, BnShape s, const Plan& p) {
  Workspace<Acc> w;
  w.coef = static_cast<float*>(ws);
  w.sums = reinterpret_cast<double*>(w.coef + kNumCoefSlots * s.c);
  w.part0 = reinterpret_cast<Acc*>(w.sums + kNumSumSlots * s.c);
  w.part1 = w.part0 + p.splits * s.c;
  return w;
}

} // namespace

int64_t batchNormSwishWorkspaceBytes(BnShape shape, int elem_size, int num_sms) {
  if (numel(shape) == 0) {
    return 0;
  }
  const Plan p = makePlan(shape, elem_size, num_sms);
  return int64_t(sizeof(float)) * kNumCoefSlots * shape.c +
      int64_t(sizeof(double)) * (kNumSumSlots * shape.c + 2 * p.splits * shape.c);
}

template <typename T>
void batchNormSwishTrainForward(
    const T* x,
    T* out,
    BnShape shape,
    const BnAffine& affine,
    BnChannelMut running_mean,
    BnChannelMut running_var,
    double momentum,
    double eps,
    float* save_mean,
    float* save_invstd,
    void* workspace,
    int num_sms,
    cudaStream_t stream) {
  if (numel(shape) == 0) {
    return;
  }
  const Plan p = makePlan(shape, sizeof(T), num_sms);
  const auto ws = carve<float>(workspace, shape, p);
  withVec<T>(p, aligned16(x) && aligned16(out), [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    launchReduce<T, V, false>(
        p, shape, x, nullptr, nullptr, SwishGradArgs{}, ws.part0, ws.part1, stream);
    trainStatsFinalizeKernel<T><<<channelBlocks(shape.c), kThreads, 0, stream>>>(
        x, StatsPartials{ws.part0, ws.part1, p.splits, p.total, p.per}, shape.c, shape.l,
        shape.n * shape.l, affine, running_mean, running_var, momentum, eps,
        save_mean, save_invstd, ws.coef);
    const int64_t nvec = numel(shape) / V;
    applyForwardKernel<T, V><<<applyBlocks(nvec), kThreads, 0, stream>>>(
        x, out, nvec, shape.c, shape.l, ws.coef);
  });
}

template <typename T>
void batchNormSwishEvalForward(
    const T* x,
    T* out,
    BnShape shape,
    const BnAffine& affine,
    BnChannelRef running_mean,
    BnChannelRef running_var,
    double eps,
    void* workspace,
    int num_sms,
    cudaStream_t stream) {
  if (numel(shape) == 0) {
    return;
  }
  const Plan p = makePlan(shape, sizeof(T), num_sms);
  float* coef = static_cast<float*>(workspace);
  coefFromStatsKernel<<<channelBlocks(shape.c), kThreads, 0, stream>>>(
      shape.c, running_mean, running_var, /*is_var=*/true, eps, affine, coef);
  withVec<T>(p, aligned16(x) && aligned16(out), [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    const int64_t nvec = numel(shape) / V;
    applyForwardKernel<T, V><<<applyBlocks(nvec), kThreads, 0, stream>>>(
        x, out, nvec, shape.c, shape.l, coef);
  });
}

template <typename T>
void batchNormSwishBackward(
    const T* grad_output,
    const T* x,
    BnShape shape,
    const BnAffine& affine,
    BnChannelRef mean,
    BnChannelRef invstd,
    bool training,
    bool silu,
    T* grad_input,
    const BnParamGrads& grads,
    void* workspace,
    int num_sms,
    cudaStream_t stream) {
  if (numel(shape) == 0) {
    return;
  }
  const Plan p = makePlan(shape, sizeof(T), num_sms);
  const auto ws = carve<double>(workspace, shape, p);
  const SwishGradArgs ga{1.0 / affine.divisor, silu};
  coefFromStatsKernel<<<channelBlocks(shape.c), kThreads, 0, stream>>>(
      shape.c, mean, invstd, /*is_var=*/false, 0.0, affine, ws.coef);
  const bool need_sums = (training && grad_input != nullptr) ||
      grads.weight.data != nullptr || grads.bias.data != nullptr ||
      grads.other.data != nullptr;
  const bool other_per_channel = affine.other.stride != 0;
  const bool aligned =
      aligned16(grad_output) && aligned16(x) && aligned16(grad_input);
  withVec<T>(p, aligned, [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    if constexpr (std::is_same_v<T, float>) {
      if (training) {
        // The forward's statistics pass again (its float partials), for mu_lo.
        const auto stats = carve<float>(workspace, shape, p);
        launchReduce<T, V, false>(
            p, shape, x, nullptr, nullptr, SwishGradArgs{}, stats.part0, stats.part1, stream);
        meanLoKernel<T><<<channelBlocks(shape.c), kThreads, 0, stream>>>(
            x, StatsPartials{stats.part0, stats.part1, p.splits, p.total, p.per}, shape.c,
            shape.l, ws.coef);
      }
    }
    if (need_sums) {
      launchReduce<T, V, true>(
          p, shape, x, grad_output, ws.coef, ga, ws.part0, ws.part1, stream);
      backwardSumsFinalizeKernel<<<channelBlocks(shape.c), kThreads, 0, stream>>>(
          ws.part0, ws.part1, shape.c, p.splits, shape.n * shape.l, grads,
          other_per_channel, ws.sums, ws.coef);
      if (grads.other.data != nullptr && !other_per_channel) {
        sumChannelsKernel<<<1, kThreads, 0, stream>>>(
            ws.sums + kSumG * shape.c, shape.c, grads.other);
      }
    }
    if (grad_input == nullptr) {
      return;
    }
    const int64_t nvec = numel(shape) / V;
    const auto blocks = applyBlocks(nvec);
    if (training) {
      applyBackwardKernel<T, V, BwdOut::kTrainDx><<<blocks, kThreads, 0, stream>>>(
          grad_output, x, grad_input, nvec, shape.c, shape.l, ws.coef, ws.sums, ga);
    } else {
      applyBackwardKernel<T, V, BwdOut::kEvalDx><<<blocks, kThreads, 0, stream>>>(
          grad_output, x, grad_input, nvec, shape.c, shape.l, ws.coef, ws.sums, ga);
    }
  });
}

#define TORCHFUSE_INSTANTIATE_BN_SWISH_FORWARD(T)                              \
  template void batchNormSwishTrainForward<T>(                                 \
      const T*, T*, BnShape, const BnAffine&, BnChannelMut, BnChannelMut,      \
      double, double, float*, float*, void*, int, cudaStream_t);               \
  template void batchNormSwishEvalForward<T>(                                  \
      const T*, T*, BnShape, const BnAffine&, BnChannelRef, BnChannelRef,      \
      double, void*, int, cudaStream_t);
#define TORCHFUSE_INSTANTIATE_BN_SWISH_BACKWARD(T)                             \
  template void batchNormSwishBackward<T>(                                     \
      const T*, const T*, BnShape, const BnAffine&, BnChannelRef,              \
      BnChannelRef, bool, bool, T*, const BnParamGrads&, void*, int, cudaStream_t);
TORCHFUSE_INSTANTIATE_BN_SWISH_FORWARD(float)
TORCHFUSE_INSTANTIATE_BN_SWISH_FORWARD(__half)
TORCHFUSE_INSTANTIATE_BN_SWISH_FORWARD(__nv_bfloat16)
TORCHFUSE_INSTANTIATE_BN_SWISH_BACKWARD(float)
TORCHFUSE_INSTANTIATE_BN_SWISH_BACKWARD(__half)
TORCHFUSE_INSTANTIATE_BN_SWISH_BACKWARD(__nv_bfloat16)
#undef TORCHFUSE_INSTANTIATE_BN_SWISH_FORWARD
#undef TORCHFUSE_INSTANTIATE_BN_SWISH_BACKWARD

} // namespace torchfuse::kernels
