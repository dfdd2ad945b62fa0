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
    ChannelMap<Index> map) {
  for (Index v = Index(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
       v += Index(gridDim.x) * blockDim.x) {
    const Index e = first + v * N;
    float x[N];
    loadVec<T, N>(out + e, x);
    if (scale || bias) {
      auto cursor = map.at(e);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        if (scale) {
          x[k] = x[k] * scale[cursor.channel] + shift[cursor.channel];
        }
        if (bias) {
          // NB: (conv + bias) + alpha * other, eager's order of additions.
          x[k] += toFloat(bias[cursor.channel]);
        }
        cursor.next(map.run, map.channels);
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
      x[k] = activate<K>(x[k], act.a, act.b);
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
      ChannelMap<Index>(run, a.c));
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
    launch<K, T, kVec, Index>(a, 0, vectors, period, stream);
    launch<K, T, 1, Index>(a, vectors * kVec, total - vectors * kVec, period, stream);
  } else {
    launch<K, T, 1, Index>(a, 0, total, period, stream);
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
