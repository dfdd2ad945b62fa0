// custom_conv_relu_add's passes with the positions-inner mask (the contract
// is in conv_relu_add.cuh): unstaged streaming passes over nchw tensors,
// whose flat index is also the mask's bit index.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/divider.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/conv/conv_relu_add.cuh"

namespace torchfuse::kernels {
namespace {

// t = conv + b; the mask bit !(t <= 0) (NB: NaN compares false, stays NaN
// and passes its gradient, as in PyTorch's relu); (keep ? t : 0) + o.
__device__ __forceinline__ void reluAdd(float& v, float b, float o, uint32_t& bits, int k) {
  const float t = v + b;
  const bool keep = !(t <= 0.f);
  bits |= uint32_t(keep) << k;
  v = (keep ? t : 0.f) + o;
}

// Lane l holds the kUnit bits of elements warp_first + l * kUnit + k; one
// mask word is 32 / kUnit lanes' bits.  Every lane of the warp must call.
template <int kUnit, typename Index>
__device__ __forceinline__ void storeMaskBits(
    uint32_t* mask,
    Index i,
    Index total,
    uint32_t bits,
    int lane) {
  uint32_t word;
  constexpr int kLanes = 32 / kUnit;
  if constexpr (kUnit == 1) {
    word = __ballot_sync(0xffffffffu, bits != 0);
  } else {
    word = bits << ((lane % kLanes) * kUnit);
#pragma unroll
    for (int d = 1; d < kLanes; d <<= 1) {
      word |= __shfl_xor_sync(0xffffffffu, word, d);
    }
  }
  if (lane % kLanes == 0 && i < total) {
    mask[i / 32] = word; // i is the word's first element
  }
}

// Each thread takes kUnroll units of kUnit consecutive elements, a block's
// units interleaved so that each warp access is one contiguous run; all loads
// are issued before any use.  The flat index i of the nchw tensor is also the
// mask's bit index.  In place (out == conv) is allowed.
template <typename T, int kUnit, int kUnroll, typename Index>
__global__ void __launch_bounds__(kThreads) epiloguePositionsInnerKernel(
    const T* conv,
    const T* __restrict__ bias,
    const T* __restrict__ other,
    float alpha,
    T* out,
    uint32_t* __restrict__ mask,
    Index total,
    Index channels,
    Index positions,
    Divider<Index> by_channels,
    Divider<Index> by_positions) {
  const int lane = threadIdx.x % 32;
  const Index first =
      Index(blockIdx.x) * Index(kThreads * kUnroll * kUnit) + Index(threadIdx.x) * kUnit;
  float v[kUnroll][kUnit];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const Index i = first + Index(u * kThreads * kUnit);
    if (i + kUnit <= total) {
      loadVec<T, kUnit>(conv + i, v[u]);
    } else {
#pragma unroll
      for (int k = 0; k < kUnit; ++k) {
        v[u][k] = i + k < total ? static_cast<float>(conv[i + k]) : 0.f;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const Index i = first + Index(u * kThreads * kUnit);
    uint32_t bits = 0;
    if (i < total) {
      const Index row = by_positions.div(i); // image * channels + channel
      if (i - row * positions + kUnit <= positions) {
        // the unit lies in one channel (always, where positions % kUnit == 0)
        const Index c = row - by_channels.div(row) * channels;
        const float b = bias ? static_cast<float>(bias[c]) : 0.f;
        const float o = other ? alpha * static_cast<float>(other[c]) : 0.f;
#pragma unroll
        for (int k = 0; k < kUnit; ++k) {
          reluAdd(v[u][k], b, o, bits, k);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kUnit; ++k) {
          const Index r = by_positions.div(i + k);
          const Index c = r - by_channels.div(r) * channels;
          const float b = bias ? static_cast<float>(bias[c]) : 0.f;
          const float o = other ? alpha * static_cast<float>(other[c]) : 0.f;
          reluAdd(v[u][k], b, o, bits, k);
        }
      }
      if (i + kUnit <= total) {
        storeVec<T, kUnit>(out + i, v[u]);
      } else {
        bits &= (1u << (total - i)) - 1; // < kUnit elements left
#pragma unroll
        for (int k = 0; k < kUnit; ++k) {
          if (i + k < total) {
            out[i + k] = fromFloat<T>(v[u][k]);
          }
        }
      }
    }
    if (mask) {
      storeMaskBits<kUnit>(mask, i, total, bits, lane);
    }
  }
}

template <typename T, int kUnit, typename Index>
void launchEpiloguePositionsInner(const ConvEpilogueArgs<T>& a, cudaStream_t stream) {
  constexpr int kUnroll = kUnit == 1 ? 8 : 4;
  constexpr int64_t kPerBlock = int64_t(kThreads) * kUnroll * kUnit;
  const int64_t total = a.n * a.c * a.s;
  const auto blocks = static_cast<unsigned>((total + kPerBlock - 1) / kPerBlock);
  epiloguePositionsInnerKernel<T, kUnit, kUnroll, Index><<<blocks, kThreads, 0, stream>>>(
      a.conv, a.bias, a.other, a.alpha, a.out, a.mask, Index(total), Index(a.c), Index(a.s),
      Divider<Index>(a.c), Divider<Index>(a.s));
}

template <typename T, int kUnit>
void launchEpiloguePositionsInner(const ConvEpilogueArgs<T>& a, cudaStream_t stream) {
  // NB: 32-bit indices while every index a thread forms (< total + one
  // block's elements) fits.
  if (a.n * a.c * a.s <= (int64_t(1) << 31)) {
    launchEpiloguePositionsInner<T, kUnit, uint32_t>(a, stream);
  } else {
    launchEpiloguePositionsInner<T, kUnit, uint64_t>(a, stream);
  }
}

// The grad prologue's blocks: groups of `1 << member_log2` threads each
// stream one channel row of one image (or a chunk of it, where few rows
// would leave the GPU idle) and reduce it in shared memory, so every row
// leaves a block once, as one partial sum per (image, chunk, channel), in a
// fixed order: the sums are deterministic.  Short rows take small groups, so
// a warp still reads consecutive rows.
struct GradPlan {
  int member_log2;    // log2 of the threads per row
  int64_t row_groups; // blocks across the channels
  int64_t chunks;     // blocks along one row
  int64_t chunk_len;  // positions per chunk, a multiple of 32
};

GradPlan gradPlanPositionsInner(int64_t n, int64_t c, int64_t s) {
  constexpr int64_t kPerThread = 16; // elements per thread at least, where rows allow
  constexpr int64_t kTargetBlocks = 8192;
  int member_log2 = 0;
  while ((int64_t(1) << member_log2) < kThreads && (int64_t(1) << member_log2) * kPerThread < s) {
    ++member_log2;
  }
  const int64_t members = int64_t(1) << member_log2;
  const int64_t rows_per_block = kThreads / members;
  const int64_t row_groups = (c + rows_per_block - 1) / rows_per_block;
  const int64_t max_chunks = std::max<int64_t>(1, s / (members * kPerThread));
  const int64_t chunks =
      std::clamp<int64_t>(kTargetBlocks / std::max<int64_t>(1, n * row_groups), 1, max_chunks);
  const int64_t chunk_len = ((s + chunks - 1) / chunks + 31) / 32 * 32;
  return {member_log2, row_groups, (s + chunk_len - 1) / chunk_len, chunk_len};
}

template <typename T, int kUnit, int kUnroll>
__global__ void __launch_bounds__(kThreads, 4)
        gradProloguePositionsInnerKernel(
            const T* __restrict__ dy,
            const uint32_t* __restrict__ mask,
            T* __restrict__ g,
            double* __restrict__ sum_g,
            double* __restrict__ sum_dy,
            int64_t channels,
            int64_t positions,
            int member_log2,
            int64_t chunks,
            int64_t chunk_len) {
  __shared__ double red[2][kThreads];
  const int members = 1 << member_log2;
  const int member = threadIdx.x & (members - 1);
  const int64_t chunk = blockIdx.x % chunks;
  const int64_t c =
      int64_t(blockIdx.x / chunks) * (kThreads >> member_log2) + (threadIdx.x >> member_log2);
  const int64_t img = blockIdx.y;
  double acc_g = 0., acc_dy = 0.;
  if (c < channels) {
    const int64_t row = (img * channels + c) * positions;
    const int64_t end = (chunk + 1) * chunk_len < positions ? (chunk + 1) * chunk_len : positions;
    const int64_t step = int64_t(members) * kUnit;
    // NB: units never straddle `end`: it is positions, a multiple of kUnit,
    // or a chunk boundary, a multiple of 32.
    for (int64_t s0 = chunk * chunk_len + int64_t(member) * kUnit; s0 < end; s0 += step * kUnroll) {
      float d[kUnroll][kUnit];
      uint32_t bits[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t i = row + s0 + u * step;
        if (s0 + u * step < end) {
          loadVec<T, kUnit>(dy + i, d[u]);
          bits[u] = mask[i / 32] >> (i % 32); // one word: i % kUnit == 0
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (s0 + u * step < end) {
          float v[kUnit];
#pragma unroll
          for (int k = 0; k < kUnit; ++k) {
            // NB: a select, not a product: a masked NaN or Inf gradient gives 0.
            v[k] = (bits[u] >> k) & 1u ? d[u][k] : 0.f;
            acc_g += v[k];
            acc_dy += d[u][k];
          }
          storeVec<T, kUnit>(g + row + s0 + u * step, v);
        }
      }
    }
  }
  if (!sum_g && !sum_dy) {
    return; // uniform across the block
  }
  red[0][threadIdx.x] = acc_g;
  red[1][threadIdx.x] = acc_dy;
  __syncthreads();
  for (int half = members / 2; half > 0; half /= 2) {
    if (member < half) {
      red[0][threadIdx.x] += red[0][threadIdx.x + half];
      red[1][threadIdx.x] += red[1][threadIdx.x + half];
    }
    __syncthreads();
  }
  if (member == 0 && c < channels) {
    const int64_t at = (img * chunks + chunk) * channels + c;
    if (sum_g) {
      sum_g[at] = red[0][threadIdx.x];
    }
    if (sum_dy) {
      sum_dy[at] = red[1][threadIdx.x];
    }
  }
}

} // namespace

template <typename T>
void convReluAddEpiloguePositionsInner(const ConvEpilogueArgs<T>& a, cudaStream_t stream) {
  if (a.n == 0 || a.c == 0 || a.s == 0) {
    return;
  }
  constexpr int kVec = 16 / sizeof(T);
  if (aligned16(a.conv) && aligned16(a.out)) {
    launchEpiloguePositionsInner<T, kVec>(a, stream);
  } else {
    launchEpiloguePositionsInner<T, 1>(a, stream);
  }
}

int64_t convReluAddGradPartsPositionsInner(int64_t n, int64_t c, int64_t s) {
  return n == 0 || c == 0 || s == 0 ? 0 : n * gradPlanPositionsInner(n, c, s).chunks;
}

template <typename T, int kUnit, int kUnroll>
void launchGradProloguePositionsInner(const ConvGradArgs<T>& a, cudaStream_t stream) {
  const auto plan = gradPlanPositionsInner(a.n, a.c, a.s);
  // NB: one image per grid y index: the partial-sum rows are indexed by it.
  const dim3 blocks(
      static_cast<unsigned>(plan.row_groups * plan.chunks), static_cast<unsigned>(a.n));
  gradProloguePositionsInnerKernel<T, kUnit, kUnroll><<<blocks, kThreads, 0, stream>>>(
      a.dy, a.mask, a.g, a.sum_g, a.sum_dy, a.c, a.s, plan.member_log2, plan.chunks,
      plan.chunk_len);
}

template <typename T>
void convReluAddGradProloguePositionsInner(const ConvGradArgs<T>& a, cudaStream_t stream) {
  if (a.n == 0 || a.c == 0 || a.s == 0) {
    return;
  }
  constexpr int kVec = 16 / sizeof(T);
  if (aligned16(a.dy) && aligned16(a.g) && a.s % kVec == 0) {
    launchGradProloguePositionsInner<T, kVec, 4>(a, stream);
  } else {
    launchGradProloguePositionsInner<T, 1, 8>(a, stream);
  }
}

#define TORCHFUSE_INSTANTIATE(T)                                                                \
  template void convReluAddEpiloguePositionsInner<T>(const ConvEpilogueArgs<T>&, cudaStream_t); \
  template void convReluAddGradProloguePositionsInner<T>(const ConvGradArgs<T>&, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
