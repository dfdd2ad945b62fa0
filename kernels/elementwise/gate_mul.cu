// custom_gate_mul's pass (the contract is in gate_mul.cuh): one read of x,
// one write of out, the gate from L1/L2.  A vector lies in one image, so
// its image is found once; its channels are tracked by ChannelCursor.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common/activation.cuh"
#include "kernels/common/channel_cursor.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/elementwise/gate_mul.cuh"

namespace torchfuse::kernels {
namespace {

template <ActivationKind K, typename T, int N, typename Index>
__global__ void __launch_bounds__(kThreads) gateMulKernel(
    const T* __restrict__ x,
    const T* __restrict__ gate,
    T* __restrict__ out,
    Activation act,
    Index vectors,
    ChannelMap<Index> map,
    Divider<Index> by_image,
    int64_t gate_image_stride,
    int64_t gate_channel_stride) {
  for (Index v = Index(blockIdx.x) * blockDim.x + threadIdx.x; v < vectors;
       v += Index(gridDim.x) * blockDim.x) {
    const Index e = v * N;
    const T* image_gate = gate + int64_t(by_image.div(e)) * gate_image_stride;
    auto cursor = map.at(e);
    float y[N];
    loadVec<T, N>(x + e, y);
    // NB: in nchw a vector's elements mostly share one channel: its gate
    // is activated once.
    Index last = map.channels;
    float g = 0.f;
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (cursor.channel != last) {
        last = cursor.channel;
        const float pre = toFloat(image_gate[int64_t(last) * gate_channel_stride]);
        g = toFloat(fromFloat<T>(activate<K, isSixteenBit<T>()>(pre, act.a, act.b)));
      }
      y[k] *= g;
      cursor.next(map.run, map.channels);
    }
    storeVec<T, N>(out + e, y);
  }
}

template <ActivationKind K, typename T, int N, typename Index>
void launch(const GateMulArgs<T>& a, int64_t run, cudaStream_t stream) {
  const int64_t vectors = a.n * a.c * a.s / N;
  // NB: enough blocks to fill the device several times over; the grid-stride
  // loop takes the rest.
  constexpr int64_t kMaxBlocks = 65535;
  const int64_t blocks = std::min<int64_t>((vectors + kThreads - 1) / kThreads, kMaxBlocks);
  gateMulKernel<K, T, N, Index><<<unsigned(blocks), kThreads, 0, stream>>>(
      a.x, a.gate, a.out, a.act, Index(vectors), ChannelMap<Index>(run, a.c),
      Divider<Index>(Index(a.c * a.s)), a.gate_image_stride, a.gate_channel_stride);
}

template <ActivationKind K, typename T, typename Index>
void runWith(const GateMulArgs<T>& a, int64_t run, cudaStream_t stream) {
  constexpr int kVec = maxVec<T>();
  if (aligned16(a.x) && aligned16(a.out) && (a.c * a.s) % kVec == 0) {
    launch<K, T, kVec, Index>(a, run, stream);
  } else {
    launch<K, T, 1, Index>(a, run, stream);
  }
}

} // namespace

template <typename T>
bool gateMul(const GateMulArgs<T>& a, bool channels_last, cudaStream_t stream) {
  using Kind = ActivationKind;
  const auto go = [&](auto kind) {
    constexpr Kind K = decltype(kind)::value;
    const int64_t total = a.n * a.c * a.s;
    const int64_t run = channels_last ? 1 : a.s;
    if (total == 0) {
      return;
    }
    withIndexType(total, [&](auto index) { runWith<K, T, decltype(index)>(a, run, stream); });
  };
  switch (a.act.kind) {
    case Kind::kSigmoid:
      go(std::integral_constant<Kind, Kind::kSigmoid>{});
      return true;
    case Kind::kHardsigmoid:
      go(std::integral_constant<Kind, Kind::kHardsigmoid>{});
      return true;
    default:
      return false;
  }
}

#define TORCHFUSE_INSTANTIATE(T) \
  template bool gateMul<T>(const GateMulArgs<T>&, bool, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
