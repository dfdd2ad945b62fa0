#include "kernels/batch_norm/channels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/batch_norm/math.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"

namespace torchfuse::kernels::batch_norm {
namespace {

// Element c of a per-channel vector in float64; `absent` where there is none.
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
      static_cast<__nv_bfloat16*>(r.data)[c] = __float2bfloat16_rn(static_cast<float>(v));
      break;
    case BnDtype::kDouble:
      static_cast<double*>(r.data)[c] = v;
      break;
  }
}

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
    storeMut(running_mean, ch, (1.0 - momentum) * loadMut(running_mean, ch) + momentum * mean);
  }
  if (running_var.data != nullptr) {
    const double unbiased = m2 / static_cast<double>(m - 1);
    storeMut(running_var, ch, (1.0 - momentum) * loadMut(running_var, ch) + momentum * unbiased);
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
  const float invstd = is_var ? static_cast<float>(1.0 / sqrt(v + eps)) : static_cast<float>(v);
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
__global__ void __launch_bounds__(kThreads)
    sumChannelsKernel(const double* __restrict__ channel_sum, int64_t c, BnChannelMut out) {
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

// Each channel's splits' partials merged into split 0's slot by one block
// per kMergeX channels: thread row y merges splits y, y + kMergeY, ... in
// order (loads kMergeBatch at a time, since the partials are read once),
// then row 0 merges the kMergeY results in row order.  kStats: Welford
// (mean, m2) with the plan's split counts; else sums.
constexpr int kMergeX = 32;
constexpr int kMergeY = 16;
constexpr int kMergeBatch = 4;

template <bool kStats>
__global__ void __launch_bounds__(kMergeX* kMergeY) mergeSplitsKernel(
    double* __restrict__ part0,
    double* __restrict__ part1,
    int64_t c,
    int64_t splits,
    int64_t total,
    int64_t per) {
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int64_t ch = int64_t(blockIdx.x) * kMergeX + tx;
  double n = 0, a0 = 0, a1 = 0;
  if (ch < c) {
    for (int64_t s0 = ty; s0 < splits; s0 += int64_t(kMergeY) * kMergeBatch) {
      double b0[kMergeBatch], b1[kMergeBatch];
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) {
        const int64_t s = s0 + int64_t(u) * kMergeY;
        if (s < splits) {
          b0[u] = part0[s * c + ch];
          b1[u] = part1[s * c + ch];
        }
      }
#pragma unroll
      for (int u = 0; u < kMergeBatch; ++u) {
        const int64_t s = s0 + int64_t(u) * kMergeY;
        if (s < splits) {
          if constexpr (kStats) {
            welfordMerge<double>(
                n, a0, a1, static_cast<double>(splitCount(total, per, s)), b0[u], b1[u]);
          } else {
            a0 += b0[u];
            a1 += b1[u];
          }
        }
      }
    }
  }
  __shared__ double sh0[kMergeY][kMergeX];
  __shared__ double sh1[kMergeY][kMergeX];
  __shared__ double shn[kMergeY][kMergeX];
  sh0[ty][tx] = a0;
  sh1[ty][tx] = a1;
  shn[ty][tx] = n;
  __syncthreads();
  if (ty != 0 || ch >= c) {
    return;
  }
  for (int j = 1; j < kMergeY; ++j) {
    if constexpr (kStats) {
      welfordMerge<double>(n, a0, a1, shn[j][tx], sh0[j][tx], sh1[j][tx]);
    } else {
      a0 += sh0[j][tx];
      a1 += sh1[j][tx];
    }
  }
  part0[ch] = a0;
  part1[ch] = a1;
}

// Launches the merge where there are more splits than a per-channel kernel
// merges quickly one at a time; returns the splits left.
template <bool kStats>
int64_t mergeSplits(const Workspace& w, const Plan& p, int64_t c, cudaStream_t stream) {
  if (p.splits <= kMergeY) {
    return p.splits;
  }
  mergeSplitsKernel<kStats>
      <<<static_cast<unsigned>(ceilDiv(c, kMergeX)), dim3(kMergeX, kMergeY), 0, stream>>>(
          w.part0, w.part1, c, p.splits, p.total, p.per);
  return 1;
}

unsigned channelBlocks(int64_t c) {
  return static_cast<unsigned>(ceilDiv(c, kThreads));
}

} // namespace

template <typename T>
void launchTrainStatsFinalize(
    const BnForward<T>& f,
    const BnTrainStats& s,
    StatsPartials sp,
    float* coef,
    cudaStream_t stream) {
  const int64_t c = f.shape.c;
  trainStatsFinalizeKernel<T><<<channelBlocks(c), kThreads, 0, stream>>>(
      f.x, sp, c, f.shape.l, f.shape.n * f.shape.l, f.affine, s.running_mean, s.running_var,
      s.momentum, s.eps, s.save_mean, s.save_invstd, coef);
}

StatsPartials mergeStatsPartials(
    const Workspace& w,
    const Plan& p,
    int64_t c,
    cudaStream_t stream) {
  const int64_t splits = mergeSplits<true>(w, p, c, stream);
  // One split left: all of the total.
  return splits == 1 ? StatsPartials{w.part0, w.part1, 1, p.total, p.total} : statsPartials(w, p);
}

int64_t mergeSumPartials(const Workspace& w, const Plan& p, int64_t c, cudaStream_t stream) {
  return mergeSplits<false>(w, p, c, stream);
}

void launchMeanLo(
    const float* x,
    StatsPartials sp,
    int64_t c,
    int64_t l,
    float* coef,
    cudaStream_t stream) {
  meanLoKernel<float><<<channelBlocks(c), kThreads, 0, stream>>>(x, sp, c, l, coef);
}

void launchCoefFromStats(
    int64_t c,
    BnChannelRef mean,
    BnChannelRef var_or_invstd,
    bool is_var,
    double eps,
    const BnAffine& aff,
    float* coef,
    cudaStream_t stream) {
  coefFromStatsKernel<<<channelBlocks(c), kThreads, 0, stream>>>(
      c, mean, var_or_invstd, is_var, eps, aff, coef);
}

void launchBackwardSumsFinalize(
    const double* part0,
    const double* part1,
    int64_t c,
    int64_t splits,
    int64_t m,
    const BnParamGrads& grads,
    bool other_per_channel,
    double* sums,
    float* coef,
    cudaStream_t stream) {
  backwardSumsFinalizeKernel<<<channelBlocks(c), kThreads, 0, stream>>>(
      part0, part1, c, splits, m, grads, other_per_channel, sums, coef);
}

void launchSumChannels(
    const double* channel_sum,
    int64_t c,
    BnChannelMut out,
    cudaStream_t stream) {
  sumChannelsKernel<<<1, kThreads, 0, stream>>>(channel_sum, c, out);
}

#define TORCHFUSE_INSTANTIATE_CHANNELS(T)    \
  template void launchTrainStatsFinalize<T>( \
      const BnForward<T>&, const BnTrainStats&, StatsPartials, float*, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE_CHANNELS)
#undef TORCHFUSE_INSTANTIATE_CHANNELS

} // namespace torchfuse::kernels::batch_norm
