// custom_conv_add_act's epilogue (the contract is in add_act_epilogue.cuh):
// an elementwise pass whose only layout dependence is the bias's channel,
// which each thread tracks along its consecutive elements instead of
// dividing per element.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "kernels/common/activation.cuh"
#include "kernels/common/channel_cursor.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/conv/add_act_epilogue.cuh"

namespace torchfuse::kernels {
namespace {

// How the N elements of each vector of a launch map to channels:
// - kOne: one channel (nchw with s a multiple of N; single elements);
// - kConsecutive: channels c .. c + N - 1, c a multiple of N (nhwc with C a
//   multiple of N and 16-byte aligned operands): the per-channel operands
//   are read as vectors, where a gather per element and operand costs the
//   pass as much as its own loads and stores;
// - kAny: a cursor steps through them.
enum class ChannelSpan { kOne, kConsecutive, kAny };

// Vectors of N elements from element `first` on; `vectors` of them.
// Index: withIndexType's.
template <ActivationKind K, typename T, int N, typename Index>
__global__ void __launch_bounds__(kThreads) epilogueKernel(
    T* out,
    const T* __restrict__ bias,
    const T* __restrict__ other,
    const float* __restrict__ scale,
    const float* __restrict__ shift,
    float alpha,
    Activation act,
    Index first,
    Index vectors,
    ChannelMap<Index> map,
    ChannelSpan span) {
  for (Index v = Index(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
       v += Index(gridDim.x) * blockDim.x) {
    const Index e = first + v * N;
    float x[N];
    loadVec<T, N>(out + e, x);
    if (scale || bias) {
      float sc[N], sh[N], bi[N];
      auto cursor = map.at(e);
      if (span == ChannelSpan::kConsecutive) {
        if (scale) {
          loadVec<float, N>(scale + cursor.channel, sc);
          loadVec<float, N>(shift + cursor.channel, sh);
        }
        if (bias) {
          loadVec<T, N>(bias + cursor.channel, bi);
        }
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {
          if (k == 0 || span == ChannelSpan::kAny) {
            if (scale) {
              sc[k] = scale[cursor.channel];
              sh[k] = shift[cursor.channel];
            }
            if (bias) {
              bi[k] = toFloat(bias[cursor.channel]);
            }
            cursor.next(map.run, map.channels);
          } else {
            if (scale) {
              sc[k] = sc[0];
              sh[k] = sh[0];
            }
            if (bias) {
              bi[k] = bi[0];
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (scale) {
          x[k] = x[k] * sc[k] + sh[k];
        }
        if (bias) {
          // NB: (conv + bias) + alpha * other, eager's order of additions.
          x[k] += bi[k];
        }
      }
    }
    if (other) {
      float o[N];
      loadVec<T, N>(other + e, o);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        x[k] += alpha * o[k];
      }
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      x[k] = activate<K, isSixteenBit<T>()>(x[k], act.a, act.b);
    }
    storeVec<T, N>(out + e, x);
  }
}

template <ActivationKind K, typename T, int N, typename Index>
void launch(
    const ConvAddActEpilogueArgs<T>& a,
    int64_t first,
    int64_t vectors,
    int64_t run,
    ChannelSpan span,
    cudaStream_t stream) {
  if (vectors == 0) {
    return;
  }
  // NB: enough blocks to fill the device several times over; the grid-stride
  // loop takes the rest.
  constexpr int64_t kMaxBlocks = 65535;
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks);
  epilogueKernel<K, T, N, Index><<<unsigned(blocks), kThreads, 0, stream>>>(
      a.out, a.bias, a.other, a.scale, a.shift, a.alpha, a.act, Index(first), Index(vectors),
      ChannelMap<Index>(run, a.c), span);
}

// The span of the vectors of kVec elements from element 0 on (see
// ChannelSpan), `period` elements a channel run.
template <typename T>
ChannelSpan vectorSpan(const ConvAddActEpilogueArgs<T>& a, int64_t period) {
  constexpr int kVec = maxVec<T>();
  if (period % kVec == 0) {
    return ChannelSpan::kOne;
  }
  const bool aligned = aligned16(a.bias) && aligned16(a.scale) && aligned16(a.shift);
  return period == 1 && a.c % kVec == 0 && aligned ? ChannelSpan::kConsecutive : ChannelSpan::kAny;
}

template <ActivationKind K, typename T, typename Index>
void runWith(
    const ConvAddActEpilogueArgs<T>& a,
    int64_t total,
    int64_t period,
    cudaStream_t stream) {
  constexpr int kVec = maxVec<T>();
  if (aligned16(a.out) && aligned16(a.other)) {
    const int64_t vectors = total / kVec;
    launch<K, T, kVec, Index>(a, 0, vectors, period, vectorSpan(a, period), stream);
    launch<K, T, 1, Index>(
        a, vectors * kVec, total - vectors * kVec, period, ChannelSpan::kOne, stream);
  } else {
    launch<K, T, 1, Index>(a, 0, total, period, ChannelSpan::kOne, stream);
  }
}

template <ActivationKind K, typename T>
void run(const ConvAddActEpilogueArgs<T>& a, bool channels_last, cudaStream_t stream) {
  const int64_t total = a.n * a.c * a.s;
  const int64_t period = channels_last ? 1 : a.s;
  withIndexType(
      total, [&](auto index) { runWith<K, T, decltype(index)>(a, total, period, stream); });
}

} // namespace

template <typename T>
void convAddActEpilogue(
    const ConvAddActEpilogueArgs<T>& a,
    bool channels_last,
    cudaStream_t stream) {
  if (a.n * a.c * a.s == 0) {
    return;
  }
  forActivation(
      a.act.kind, [&](auto kind) { run<decltype(kind)::value>(a, channels_last, stream); });
}

#define TORCHFUSE_INSTANTIATE(T) \
  template void convAddActEpilogue<T>(const ConvAddActEpilogueArgs<T>&, bool, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
