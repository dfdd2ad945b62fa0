#include "kernels/batch_norm/reduce.cuh"

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"

// Each thread reduces chunks of up to kUnroll loads (in ChunkAcc) and adds
// them to float64 accumulators (see ReduceAcc): the statistics as shifted
// Welford (mean, m2) merges (see statsShiftIndex), the backward as sums.
// - l == 1 ("columns"): x is an (n, c) matrix.  A thread owns V adjacent
//   columns (one 16-byte vector) and walks rows, so a warp reads contiguous
//   memory; 8 row groups per block are merged through shared memory and the
//   grid's y dimension splits the rows.
// - l > 1 ("planes"): block (channel, split) walks its share of the
//   channel's n * l elements in 16-byte vectors that never straddle planes
//   (l % V == 0), then reduces across the block with warp shuffles.

namespace torchfuse::kernels::batch_norm {
namespace {

// Merges a chunk of nb elements with shifted mean mb and m2 m2b into a
// float64 Welford state of n elements (n updated by the caller, once for
// all the columns that share the counts).
template <typename C>
__device__ __forceinline__ void mergeChunk(
    double n,
    double fb,
    double& mean,
    double& m2,
    C mb,
    C m2b) {
  const double delta = double(mb) - mean;
  mean += delta * fb;
  m2 += double(m2b) + delta * delta * n * fb;
}

// The mean and m2 of xs[0..nv), already shifted, in C.
template <int N, typename C>
__device__ __forceinline__ void chunkStats(const C (&xs)[N], int nv, C& mean, C& m2) {
  C sum = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i < nv) {
      sum += xs[i];
    }
  }
  mean = sum / C(nv);
  m2 = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i < nv) {
      const C d = xs[i] - mean;
      m2 += d * d;
    }
  }
}

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
    ReduceAcc* __restrict__ part0,
    ReduceAcc* __restrict__ part1) {
  using Acc = ReduceAcc;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int64_t col = int64_t(blockIdx.x) * kColX + tx; // vector column
  const bool valid = col < c / V;
  const int64_t r0 = int64_t(blockIdx.y) * per;
  const int64_t r1 = r0 + per < n ? r0 + per : n;

  Acc s0[V], s1[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    s0[k] = Acc(0);
    s1[k] = Acc(0);
  }
  double cnt = 0;
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
      if constexpr (!kBwd) {
        int nv = 0; // rows of this chunk: a prefix of the kUnroll
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          nv += r + u * kColY < r1 ? 1 : 0;
        }
        const double n_old = cnt;
        cnt += nv;
        const double fb = nv / cnt;
#pragma unroll
        for (int k = 0; k < V; ++k) {
          ChunkAcc<T> xs[kUnroll] = {};
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            if (u < nv) {
              xs[u] = ChunkAcc<T>(toFloat(xv[u].v[k])) - ChunkAcc<T>(shift[k]);
            }
          }
          ChunkAcc<T> cm, cm2;
          chunkStats(xs, nv, cm, cm2);
          mergeChunk(n_old, fb, s0[k], s1[k], cm, cm2);
        }
      } else {
        ChunkAcc<T> c0[V] = {}, c1[V] = {};
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (r + u * kColY < r1) {
#pragma unroll
            for (int k = 0; k < V; ++k) {
              bwdTerms<T>(toFloat(gv[u].v[k]), toFloat(xv[u].v[k]), cf[k], ga, c0[k], c1[k]);
            }
          }
        }
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
  __shared__ double shn[kColY][kColX];
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
    double na = cnt;
    for (int j = 1; j < kColY; ++j) {
      if constexpr (kBwd) {
        a0 += sh0[j][tx * V + k];
        a1 += sh1[j][tx * V + k];
      } else {
        welfordMerge(na, a0, a1, shn[j][tx], sh0[j][tx * V + k], sh1[j][tx * V + k]);
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
    ReduceAcc* __restrict__ part0,
    ReduceAcc* __restrict__ part1) {
  using Acc = ReduceAcc;
  const int64_t ch = blockIdx.x;
  const int64_t e0 = int64_t(blockIdx.y) * per;
  const int64_t e1 = e0 + per < m ? e0 + per : m;
  Acc a0 = 0, a1 = 0; // (mean, m2) or (sum g_bn, sum g_bn * xhat)
  double cnt = 0;
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
    if constexpr (!kBwd) {
      int nv = 0; // vectors of this chunk: a prefix of the kUnroll
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        nv += e + u * kStep < e1 ? 1 : 0;
      }
      ChunkAcc<T> xs[kUnroll * V] = {};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (u < nv) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            xs[u * V + k] = ChunkAcc<T>(toFloat(xv[u].v[k])) - ChunkAcc<T>(shift);
          }
        }
      }
      ChunkAcc<T> cm, cm2;
      chunkStats(xs, nv * V, cm, cm2);
      const double n_old = cnt;
      cnt += nv * V;
      mergeChunk(n_old, nv * V / cnt, a0, a1, cm, cm2);
    } else {
      ChunkAcc<T> c0 = 0, c1 = 0;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (e + u * kStep < e1) {
#pragma unroll
          for (int k = 0; k < V; ++k) {
            bwdTerms<T>(toFloat(gv[u].v[k]), toFloat(xv[u].v[k]), cf, ga, c0, c1);
          }
        }
      }
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
      const double nb = __shfl_down_sync(0xffffffffu, cnt, offset);
      welfordMerge(cnt, a0, a1, nb, b0, b1);
    }
  }
  __shared__ Acc sh[2][kWarps];
  __shared__ double shn[kWarps];
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

} // namespace

template <typename T, int V, bool kBwd>
void launchReduce(
    const Plan& p,
    BnShape s,
    const T* x,
    const T* g,
    const float* coef,
    SwishGradArgs ga,
    ReduceAcc* part0,
    ReduceAcc* part1,
    cudaStream_t stream) {
  if (p.columns) {
    const dim3 grid(
        static_cast<unsigned>(ceilDiv(s.c / V, kColX)), static_cast<unsigned>(p.splits));
    columnReduceKernel<T, V, kBwd>
        <<<grid, dim3(kColX, kColY), 0, stream>>>(x, g, s.n, s.c, p.per, coef, ga, part0, part1);
  } else {
    const dim3 grid(static_cast<unsigned>(s.c), static_cast<unsigned>(p.splits));
    planeReduceKernel<T, V, kBwd>
        <<<grid, kThreads, 0, stream>>>(x, g, s.c, s.l, s.n * s.l, p.per, coef, ga, part0, part1);
  }
}

#define TORCHFUSE_INSTANTIATE_REDUCE(T, V)                                                     \
  template void launchReduce<T, V, false>(                                                     \
      const Plan&, BnShape, const T*, const T*, const float*, SwishGradArgs, double*, double*, \
      cudaStream_t);                                                                           \
  template void launchReduce<T, V, true>(                                                      \
      const Plan&, BnShape, const T*, const T*, const float*, SwishGradArgs, double*, double*, \
      cudaStream_t);
#define TORCHFUSE_INSTANTIATE_REDUCE_VECS(T) \
  TORCHFUSE_INSTANTIATE_REDUCE(T, 1) TORCHFUSE_INSTANTIATE_REDUCE(T, maxVec<T>())
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE_REDUCE_VECS)
#undef TORCHFUSE_INSTANTIATE_REDUCE_VECS
#undef TORCHFUSE_INSTANTIATE_REDUCE

} // namespace torchfuse::kernels::batch_norm
