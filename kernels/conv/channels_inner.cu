// custom_conv_relu_add's passes with the channels-inner mask (the contract
// is in conv_relu_add.cuh): one warp ballot per mask word, nchw tensors
// staged through shared-memory tiles so that every global access is a
// warp-wide run of 32 consecutive elements.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/conv/conv_relu_add.cuh"
#include "kernels/conv/tiles.cuh"

namespace torchfuse::kernels {
namespace {

using namespace conv; // NB: the tiles

// Lane = channel within the tile, so one warp ballot is one mask word.  An
// nchw tensor goes through the shared tile both ways, so that every global
// access is a warp-wide run of 32 consecutive elements.  In place (out ==
// conv) is allowed: a block writes only the tile it has read.
template <typename T, bool kNchw>
__global__ void __launch_bounds__(kTile * kRows) epilogueKernel(
    const T* conv,
    const T* __restrict__ bias,
    const T* __restrict__ other,
    float alpha,
    T* out,
    uint32_t* __restrict__ mask,
    int64_t n,
    int64_t channels,
    int64_t positions) {
  __shared__ float tile[kTile][kTile + 1]; // +1: no bank conflicts across the transpose
  const int lane = threadIdx.x;
  const int64_t c = int64_t(blockIdx.x) * kTile + lane;
  const bool live = c < channels;
  const float b = live && bias ? toFloat(bias[c]) : 0.f;
  const float o = live && other ? alpha * toFloat(other[c]) : 0.f;
  const int64_t words = (channels + 31) / 32;
  for (int64_t img = blockIdx.z; img < n; img += gridDim.z) {
    const int64_t base = img * channels * positions;
    for (int64_t s0 = int64_t(blockIdx.y) * kTile; s0 < positions;
         s0 += int64_t(gridDim.y) * kTile) {
      if (kNchw) {
        moveNchwTile<true>(tile, conv, base, channels, positions, s0, lane);
        __syncthreads();
      }
      for (int i = threadIdx.y; i < kTile; i += kRows) {
        const int64_t s = s0 + i;
        if (s >= positions) {
          break; // uniform across the warp
        }
        float t = 0.f;
        if (live) {
          t = (kNchw ? tile[lane][i] : toFloat(conv[base + s * channels + c])) + b;
        }
        // NB: `t <= 0`, as PyTorch's relu: NaN compares false, stays NaN and
        // passes its gradient.
        const bool keep = live && !(t <= 0.f);
        const uint32_t bits = __ballot_sync(0xffffffffu, keep);
        if (mask && lane == 0) {
          mask[(img * positions + s) * words + blockIdx.x] = bits;
        }
        const float v = (keep ? t : 0.f) + o;
        if (kNchw) {
          tile[lane][i] = v; // read and written by this thread only
        } else if (live) {
          out[base + s * channels + c] = fromFloat<T>(v);
        }
      }
      if (kNchw) {
        __syncthreads();
        moveNchwTile<false>(tile, out, base, channels, positions, s0, lane);
        __syncthreads();
      }
    }
  }
}

// Each block walks a strided set of position tiles of one image, so the
// per-channel sums leave the block once, as one row of partial sums.  An nchw
// dy or g goes through the shared tile, so that every global access is a
// warp-wide run of 32 consecutive elements.
template <typename T, bool kDyNchw, bool kGNchw>
__global__ void __launch_bounds__(kTile * kRows) gradPrologueKernel(
    const T* __restrict__ dy,
    const uint32_t* __restrict__ mask,
    T* __restrict__ g,
    double* __restrict__ sum_g,
    double* __restrict__ sum_dy,
    int64_t channels,
    int64_t positions) {
  __shared__ float tile[kTile][kTile + 1];
  __shared__ double red[2][kRows][kTile];
  const int lane = threadIdx.x;
  const int64_t c = int64_t(blockIdx.x) * kTile + lane;
  const bool live = c < channels;
  const int64_t img = blockIdx.z;
  const int64_t words = (channels + 31) / 32;
  const int64_t nchw_base = img * channels * positions;
  double acc_g = 0., acc_dy = 0.;
  for (int64_t s0 = int64_t(blockIdx.y) * kTile; s0 < positions; s0 += int64_t(gridDim.y) * kTile) {
    if (kDyNchw) {
      // NB: not moveNchwTile: through it, the restrict dy's loads scheduled
      // differently (this kernel's code is kept as measured).
      for (int i = threadIdx.y; i < kTile; i += kRows) {
        const int64_t ch = int64_t(blockIdx.x) * kTile + i, s = s0 + lane;
        if (ch < channels && s < positions) {
          tile[i][lane] = toFloat(dy[nchw_base + ch * positions + s]);
        }
      }
      __syncthreads();
    }
    for (int i = threadIdx.y; i < kTile; i += kRows) {
      const int64_t s = s0 + i;
      if (s >= positions || !live) {
        continue;
      }
      const int64_t pos = img * positions + s;
      const float d = kDyNchw ? tile[lane][i] : toFloat(dy[pos * channels + c]);
      const bool keep = (mask[pos * words + blockIdx.x] >> lane) & 1u;
      // NB: a select, not a product: a masked NaN or Inf gradient gives 0.
      const float v = keep ? d : 0.f;
      if (kGNchw) {
        tile[lane][i] = v; // read and written by this thread only
      } else {
        g[pos * channels + c] = fromFloat<T>(v);
      }
      acc_g += v;
      acc_dy += d;
    }
    if (kGNchw) {
      __syncthreads();
      moveNchwTile<false>(tile, g, nchw_base, channels, positions, s0, lane);
    }
    if (kDyNchw || kGNchw) {
      __syncthreads();
    }
  }
  red[0][threadIdx.y][lane] = acc_g;
  red[1][threadIdx.y][lane] = acc_dy;
  __syncthreads();
  if (threadIdx.y < 2 && live) {
    double total = 0.;
    for (int r = 0; r < kRows; ++r) {
      total += red[threadIdx.y][r][lane];
    }
    double* dst = threadIdx.y == 0 ? sum_g : sum_dy;
    if (dst) {
      dst[(img * gridDim.y + blockIdx.y) * channels + c] = total;
    }
  }
}

// Position tiles per prologue block: enough blocks to fill the GPU, few
// enough partial rows to keep the final reduction small.
int64_t gradBlocksPerImage(int64_t n, int64_t c, int64_t s) {
  constexpr int64_t kTargetBlocks = 8192;
  const int64_t per_image = kTargetBlocks / std::max<int64_t>(1, n * tiles(c));
  return std::clamp<int64_t>(per_image, 1, std::min(tiles(s), kMaxGridYZ));
}

} // namespace

template <typename T, bool kNchw>
void launchEpilogue(const ConvEpilogueArgs<T>& a, cudaStream_t stream) {
  const dim3 g = grid(tiles(a.c), tiles(a.s), a.n);
  epilogueKernel<T, kNchw><<<g, dim3(kTile, kRows), 0, stream>>>(
      a.conv, a.bias, a.other, a.alpha, a.out, a.mask, a.n, a.c, a.s);
}

template <typename T>
void convReluAddEpilogueChannelsInner(
    const ConvEpilogueArgs<T>& a,
    bool nchw,
    cudaStream_t stream) {
  if (a.n == 0 || a.c == 0 || a.s == 0) {
    return;
  }
  if (nchw) {
    launchEpilogue<T, true>(a, stream);
  } else {
    launchEpilogue<T, false>(a, stream);
  }
}

int64_t convReluAddGradPartsChannelsInner(int64_t n, int64_t c, int64_t s) {
  return n * gradBlocksPerImage(n, c, s);
}

template <typename T, bool kDyNchw, bool kGNchw>
void launchGradPrologue(const ConvGradArgs<T>& a, cudaStream_t stream) {
  // NB: one image per grid z index: the partial-sum rows are indexed by it.
  const dim3 g(
      static_cast<unsigned>(tiles(a.c)), static_cast<unsigned>(gradBlocksPerImage(a.n, a.c, a.s)),
      static_cast<unsigned>(a.n));
  gradPrologueKernel<T, kDyNchw, kGNchw>
      <<<g, dim3(kTile, kRows), 0, stream>>>(a.dy, a.mask, a.g, a.sum_g, a.sum_dy, a.c, a.s);
}

template <typename T>
void convReluAddGradPrologueChannelsInner(
    const ConvGradArgs<T>& a,
    bool dy_nchw,
    bool g_nchw,
    cudaStream_t stream) {
  if (a.n == 0 || a.c == 0 || a.s == 0) {
    return;
  }
  if (dy_nchw && g_nchw) {
    launchGradPrologue<T, true, true>(a, stream);
  } else if (dy_nchw) {
    launchGradPrologue<T, true, false>(a, stream);
  } else if (g_nchw) {
    launchGradPrologue<T, false, true>(a, stream);
  } else {
    launchGradPrologue<T, false, false>(a, stream);
  }
}

#define TORCHFUSE_INSTANTIATE(T)                         \
  template void convReluAddEpilogueChannelsInner<T>(     \
      const ConvEpilogueArgs<T>&, bool, cudaStream_t);   \
  template void convReluAddGradPrologueChannelsInner<T>( \
      const ConvGradArgs<T>&, bool, bool, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
