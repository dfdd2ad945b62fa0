// mathAttentionF32: a block of 8 warps per (32 query rows, b1, b0).  Each
// warp owns 4 query rows; its lanes own columns lane + 32 * x, so the rows'
// operands are shared-memory broadcasts and the columns' are read by
// consecutive lanes (K's rows padded to an odd stride: no bank conflicts).

#include <cmath>

#include "kernels/attention/math_attention.cuh"

namespace torchfuse::kernels {
namespace {

constexpr int kRows = 32;     // query rows a block takes
constexpr int kThreads = 256; // 8 warps
constexpr int kWarpRows = 4;  // rows a warp takes (kRows / 8)
constexpr int kCols = 4;      // columns a lane takes per pass
constexpr int kPass = 32 * kCols;

// K's row stride in shared memory: odd, so that 32 lanes reading one
// column of 32 rows hit 32 banks.
__host__ __device__ inline int64_t keyStride(int64_t e) {
  return e % 2 == 0 ? e + 1 : e;
}

__host__ __device__ inline int64_t kvFloats(int64_t s, int64_t e, int64_t ev) {
  const int64_t k = s * keyStride(e);
  const int64_t v = s * ev;
  return k > v ? k : v;
}

__device__ inline float warpMax(float x) {
  for (int o = 16; o > 0; o >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  }
  return x;
}

__device__ inline float warpSum(float x) {
  for (int o = 16; o > 0; o >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, o);
  }
  return x;
}

__global__ void __launch_bounds__(kThreads) mathAttentionKernel(MathAttentionArgs a) {
  extern __shared__ float smem[];
  const int64_t e = a.e, s = a.s, ev = a.ev;
  const int64_t ks = keyStride(e);
  float* qs = smem;           // [kRows][e], scaled
  float* ps = qs + kRows * e; // [kRows][s]: scores, then probabilities
  float* kv = ps + kRows * s; // [s][ks] K scaled, then [s][ev] V
  const int64_t row0 = int64_t(blockIdx.x) * kRows;
  const int64_t b1 = blockIdx.y, b0 = blockIdx.z;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const auto base = [&](const AttentionOperand& o) {
    return o.data + b0 * o.stride_b0 + b1 * o.stride_b1;
  };

  // NB: q * qs and k * ks rounded as ATen's two elementwise products.
  const float* q = base(a.query);
  for (int64_t i = t; i < kRows * e; i += kThreads) {
    const int64_t r = i / e, c = i - r * e;
    qs[i] = row0 + r < a.l
        ? q[(row0 + r) * a.query.stride_row + c * a.query.stride_col] * a.query_scale
        : 0.0f;
  }
  const float* k = base(a.key);
  for (int64_t i = t; i < s * e; i += kThreads) {
    const int64_t j = i / e, c = i - j * e;
    kv[j * ks + c] = k[j * a.key.stride_row + c * a.key.stride_col] * a.key_scale;
  }
  __syncthreads();

  const float* qrow = qs + warp * kWarpRows * e;
  for (int64_t j0 = 0; j0 < s; j0 += kPass) {
    float acc[kWarpRows][kCols] = {};
    const float* kcol[kCols];
    bool in[kCols];
#pragma unroll
    for (int x = 0; x < kCols; ++x) {
      const int64_t j = j0 + lane + 32 * x;
      in[x] = j < s;
      kcol[x] = kv + (in[x] ? j : 0) * ks;
    }
    for (int64_t c = 0; c < e; ++c) {
      float kx[kCols];
#pragma unroll
      for (int x = 0; x < kCols; ++x) {
        kx[x] = kcol[x][c];
      }
#pragma unroll
      for (int r = 0; r < kWarpRows; ++r) {
        const float qr = qrow[r * e + c];
#pragma unroll
        for (int x = 0; x < kCols; ++x) {
          acc[r][x] = fmaf(qr, kx[x], acc[r][x]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kWarpRows; ++r) {
#pragma unroll
      for (int x = 0; x < kCols; ++x) {
        if (in[x]) {
          ps[(warp * kWarpRows + r) * s + j0 + lane + 32 * x] = acc[r][x];
        }
      }
    }
  }
  __syncthreads();

  // V over K, while the warps finish the softmax of their own rows.
  const float* v = base(a.value);
  for (int64_t i = t; i < s * ev; i += kThreads) {
    const int64_t j = i / ev, c = i - j * ev;
    kv[i] = v[j * a.value.stride_row + c * a.value.stride_col];
  }
  // _safe_softmax: exp(x - max) / sum, and 0 in a row of -inf.  NB: fmaxf
  // skips NaN, but a NaN score makes the sum, so the whole row, NaN, as in
  // ATen; +inf gives inf - inf = NaN likewise.
  for (int r = 0; r < kWarpRows; ++r) {
    float* p = ps + (warp * kWarpRows + r) * s;
    float m = -INFINITY;
    bool all_neg_inf = true;
    for (int64_t j = lane; j < s; j += 32) {
      m = fmaxf(m, p[j]);
      all_neg_inf = all_neg_inf && p[j] == -INFINITY;
    }
    m = warpMax(m);
    all_neg_inf = __all_sync(0xffffffffu, all_neg_inf);
    float sum = 0.0f;
    for (int64_t j = lane; j < s; j += 32) {
      const float x = expf(p[j] - m);
      p[j] = x;
      sum += x;
    }
    sum = warpSum(sum);
    for (int64_t j = lane; j < s; j += 32) {
      p[j] = all_neg_inf ? 0.0f : p[j] / sum;
    }
  }
  __syncthreads();

  const float* prow = ps + warp * kWarpRows * s;
  for (int64_t d0 = 0; d0 < ev; d0 += kPass) {
    float acc[kWarpRows][kCols] = {};
    int64_t col[kCols];
    bool in[kCols];
#pragma unroll
    for (int x = 0; x < kCols; ++x) {
      col[x] = d0 + lane + 32 * x;
      in[x] = col[x] < ev;
      col[x] = in[x] ? col[x] : 0;
    }
    for (int64_t j = 0; j < s; ++j) {
      float vx[kCols];
#pragma unroll
      for (int x = 0; x < kCols; ++x) {
        vx[x] = kv[j * ev + col[x]];
      }
#pragma unroll
      for (int r = 0; r < kWarpRows; ++r) {
        const float pr = prow[r * s + j];
#pragma unroll
        for (int x = 0; x < kCols; ++x) {
          acc[r][x] = fmaf(pr, vx[x], acc[r][x]);
        }
      }
    }
    float* out = a.out + (b0 * a.b1 + b1) * a.l * ev;
#pragma unroll
    for (int r = 0; r < kWarpRows; ++r) {
      const int64_t row = row0 + warp * kWarpRows + r;
#pragma unroll
      for (int x = 0; x < kCols; ++x) {
        if (in[x] && row < a.l) {
          out[row * ev + col[x]] = acc[r][x];
        }
      }
    }
  }
}

} // namespace

size_t mathAttentionSharedBytes(int64_t s, int64_t e, int64_t ev) {
  return sizeof(float) * static_cast<size_t>(kRows * e + kRows * s + kvFloats(s, e, ev));
}

void mathAttentionF32(const MathAttentionArgs& a, cudaStream_t stream) {
  const size_t bytes = mathAttentionSharedBytes(a.s, a.e, a.ev);
  // NB: above the default 48 KiB a kernel must opt in; the caller checked
  // the device's limit.
  cudaFuncSetAttribute(
      mathAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  const dim3 grid(
      static_cast<unsigned>((a.l + kRows - 1) / kRows), static_cast<unsigned>(a.b1),
      static_cast<unsigned>(a.b0));
  mathAttentionKernel<<<grid, kThreads, bytes, stream>>>(a);
}

} // namespace torchfuse::kernels
