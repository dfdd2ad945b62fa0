// custom_gate_mul's pass (the contract is in gate_mul.cuh): one read of x,
// one write of out.  A block works on one image: it activates the image's
// c gate values once into shared memory (in nhwc every element has its own
// channel, so activating per element would cost an exp per element), then
// streams the image's vectors, each vector's channels found once by
// ChannelCursor.

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

// Grid: x splits an image's vectors, y strides over the images.
template <ActivationKind K, typename T, int N, typename Index>
__global__ void __launch_bounds__(kThreads) gateMulKernel(
    const T* __restrict__ x,
    const T* __restrict__ gate,
    T* __restrict__ out,
    Activation act,
    int64_t images,
    Index image_vectors,
    ChannelMap<Index> map,
    int64_t gate_image_stride,
    int64_t gate_channel_stride) {
  extern __shared__ float gates[];
  const Index image_elements = image_vectors * N;
  for (int64_t image = blockIdx.y; image < images; image += gridDim.y) {
    __syncthreads(); // the previous image's gates are read
    const T* image_gate = gate + image * gate_image_stride;
    for (Index ch = threadIdx.x; ch < map.channels; ch += blockDim.x) {
      const float pre = toFloat(image_gate[int64_t(ch) * gate_channel_stride]);
      // NB: rounded to T, as eager's activation returns it.
      gates[ch] = toFloat(fromFloat<T>(activate<K>(pre, act.a, act.b)));
    }
    __syncthreads();
    const T* image_x = x + image * int64_t(image_elements);
    T* image_out = out + image * int64_t(image_elements);
    for (Index v = Index(blockIdx.x) * blockDim.x + threadIdx.x; v < image_vectors;
         v += Index(gridDim.x) * blockDim.x) {
      const Index e = v * N;
      auto cursor = map.at(e);
      float y[N];
      loadVec<T, N>(image_x + e, y);
#pragma unroll
      for (int k = 0; k < N; ++k) {
        y[k] *= gates[cursor.channel];
        cursor.next(map.run, map.channels);
      }
      storeVec<T, N>(image_out + e, y);
    }
  }
}

template <ActivationKind K, typename T, int N, typename Index>
void launch(const GateMulArgs<T>& a, int64_t run, cudaStream_t stream) {
  const int64_t image_vectors = a.c * a.s / N;
  // NB: about eight blocks per multiprocessor in all, split evenly among
  // the images, none without a vector to take.
  const int64_t per_image = std::clamp<int64_t>(
      (8 * int64_t(a.sms) + a.n - 1) / a.n, 1, (image_vectors + kThreads - 1) / kThreads);
  const dim3 grid(
      unsigned(std::min<int64_t>(per_image, 65535)), unsigned(std::min<int64_t>(a.n, 65535)));
  gateMulKernel<K, T, N, Index><<<grid, kThreads, a.c * sizeof(float), stream>>>(
      a.x, a.gate, a.out, a.act, a.n, Index(image_vectors), ChannelMap<Index>(run, a.c),
      a.gate_image_stride, a.gate_channel_stride);
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
    const int64_t image = a.c * a.s;
    const int64_t run = channels_last ? 1 : a.s;
    if (a.n * image == 0) {
      return;
    }
    // NB: indices within an image; the grid-stride loop's may pass its
    // size by a grid's threads before it stops, which 2^31 leaves room for.
    if (image < (int64_t(1) << 31)) {
      runWith<K, T, uint32_t>(a, run, stream);
    } else {
      runWith<K, T, uint64_t>(a, run, stream);
    }
  };
  if (a.c > kGateMulMaxChannels) {
    return false;
  }
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
