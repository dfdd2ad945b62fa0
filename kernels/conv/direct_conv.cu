// custom_conv_relu_add's direct convolution for few channels
// (docs/kernels/conv_relu_add.md; the contract is in the header).
//
// A block takes 256 consecutive output positions of one image, all output
// channels, a thread one position.  The block first copies the input rows
// its positions read (all channels, whole rows, zero past the top and
// bottom borders) into shared memory with coalesced loads; then each thread
// walks the c * r * s taps: per tap one input and the tap's weights for all
// channels, which every thread of the warp reads at the same address (a
// broadcast).  Stores are nchw, consecutive threads writing consecutive
// positions.

#include "kernels/conv/direct_conv.cuh"

#include <algorithm>

namespace torchfuse::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxMacs = 2048;  // multiply-adds per output position
constexpr size_t kMaxShared = 48 * 1024;  // without opting in to more

// Channels the kernel computes: k rounded up to 8, 16 or 32.
int64_t channelBlock(int64_t k) {
  return k <= 8 ? 8 : k <= 16 ? 16 : 32;
}

// Rows of input a block reads at most: its positions span at most
// ceil((positions - 1) / q) + 1 output rows.
int64_t inputRows(const DirectConv& g) {
  const int64_t span = std::min(g.p, (kThreads - 1 + g.q - 1) / g.q + 1);
  return (span - 1) * g.stride_h + (g.r - 1) * g.dilation_h + 1;
}

size_t sharedBytes(const DirectConv& g, int64_t kb) {
  return size_t(g.c * g.r * g.s * kb + 2 * kb + g.c * inputRows(g) * g.w) * sizeof(float);
}

// Shared memory: weights [tap][KB] (zero past k), bias[KB], alpha *
// other[KB], then the input rows [c][rows][w].
template <int KB>
__global__ void __launch_bounds__(kThreads) directConvKernel(
    const float* __restrict__ x,
    const float* __restrict__ weight,
    const float* __restrict__ bias,
    const float* __restrict__ other,
    float alpha,
    float* __restrict__ out,
    DirectConv g,
    int rows) {
  extern __shared__ float4 smem4[];
  float* const weights = reinterpret_cast<float*>(smem4);
  const int taps = int(g.c * g.r * g.s), k_out = int(g.k);
  float* const adds = weights + taps * KB;
  float* const extras = adds + KB;
  float* const patch = extras + KB;
  const int h = int(g.h), w = int(g.w), q_out = int(g.q);
  const int positions = int(g.p * g.q), n = blockIdx.y;
  const int pos0 = blockIdx.x * kThreads;
  const int ih0 = (pos0 / q_out) * int(g.stride_h) - int(g.pad_h);
  const float* const xn = x + int64_t(n) * g.c * h * w;
  const int plane = rows * w;
#pragma unroll 4
  for (int i = threadIdx.x; i < int(g.c) * plane; i += kThreads) {
    const int c = i / plane, ih = ih0 + (i % plane) / w;
    patch[i] = ih >= 0 && ih < h ? __ldg(xn + (int64_t(c) * h + ih) * w + i % w) : 0.f;
  }
  for (int i = threadIdx.x; i < taps * KB; i += kThreads) {
    const int tap = i / KB, k = i % KB;
    weights[i] = k < k_out ? weight[int64_t(k) * taps + tap] : 0.f;
  }
  for (int k = threadIdx.x; k < KB; k += kThreads) {
    adds[k] = k < k_out && bias ? bias[k] : 0.f;
    extras[k] = k < k_out && other ? alpha * other[k] : 0.f;
  }
  __syncthreads();

  const int pos = pos0 + threadIdx.x;
  if (pos >= positions) {
    return;
  }
  const int p = pos / q_out, q = pos % q_out;
  const int first = (p * int(g.stride_h) - int(g.pad_h) - ih0) * w;
  const int w0 = q * int(g.stride_w) - int(g.pad_w);
  float acc[KB];
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    acc[k] = 0.f;
  }
  const float4* tap_weights = smem4;
  for (int c = 0; c < int(g.c); ++c) {
    for (int r = 0; r < int(g.r); ++r) {
      const float* const row = patch + c * plane + first + r * int(g.dilation_h) * w;
      for (int s = 0; s < int(g.s); ++s, tap_weights += KB / 4) {
        const int iw = w0 + s * int(g.dilation_w);
        // Padding contributes 0 * weight, as an explicit zero input would.
        const float v = iw >= 0 && iw < w ? row[iw] : 0.f;
#pragma unroll
        for (int k4 = 0; k4 < KB / 4; ++k4) {
          const float4 wk = tap_weights[k4];
          acc[4 * k4] = fmaf(v, wk.x, acc[4 * k4]);
          acc[4 * k4 + 1] = fmaf(v, wk.y, acc[4 * k4 + 1]);
          acc[4 * k4 + 2] = fmaf(v, wk.z, acc[4 * k4 + 2]);
          acc[4 * k4 + 3] = fmaf(v, wk.w, acc[4 * k4 + 3]);
        }
      }
    }
  }
  float* const o = out + int64_t(n) * k_out * positions + pos;
#pragma unroll
  for (int k = 0; k < KB; ++k) {
    if (k < k_out) {
      const float t = acc[k] + adds[k];
      o[int64_t(k) * positions] = (!(t <= 0.f) ? t : 0.f) + extras[k];  // relu(NaN) is NaN
    }
  }
}

template <int KB>
void launch(const ConvReluAddOperands& o, const DirectConv& g, cudaStream_t stream) {
  const dim3 grid(unsigned((g.p * g.q + kThreads - 1) / kThreads), unsigned(g.n));
  directConvKernel<KB><<<grid, kThreads, sharedBytes(g, KB), stream>>>(
      o.x, o.weight, o.bias, o.other, o.alpha, o.out, g, int(inputRows(g)));
}

}  // namespace

bool directConvTakes(const DirectConv& g) {
  const auto positive = [](int64_t v) { return v > 0; };
  if (!(positive(g.n) && positive(g.c) && positive(g.h) && positive(g.w) && positive(g.k) &&
        positive(g.r) && positive(g.s) && positive(g.stride_h) && positive(g.stride_w) &&
        positive(g.dilation_h) && positive(g.dilation_w) && positive(g.p) && positive(g.q)) ||
      g.pad_h < 0 || g.pad_w < 0 || g.k > 32) {
    return false;
  }
  constexpr int64_t kMax32 = (int64_t(1) << 31) - 1;
  return g.c * g.r * g.s * channelBlock(g.k) <= kMaxMacs && g.n <= 65535 &&
      sharedBytes(g, channelBlock(g.k)) <= kMaxShared &&
      g.n * g.c * g.h * g.w <= kMax32 && g.n * g.k * g.p * g.q <= kMax32 &&
      g.h + g.pad_h <= kMax32 / 2 && g.w + g.pad_w <= kMax32 / 2;
}

void directConvReluAdd(const ConvReluAddOperands& o, const DirectConv& g, cudaStream_t stream) {
  switch (channelBlock(g.k)) {
    case 8:
      launch<8>(o, g, stream);
      break;
    case 16:
      launch<16>(o, g, stream);
      break;
    default:
      launch<32>(o, g, stream);
  }
}

}  // namespace torchfuse::kernels
