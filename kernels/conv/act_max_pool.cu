// custom_conv_act_max_pool's pooling pass (the contract is in
// act_max_pool.cuh).  One thread per output element (nchw) or per vector of
// channels at one output position (nhwc, so that a warp reads contiguous
// channels); the window's rows and columns outside the input are skipped,
// as ATen's max_pool2d skips its padding.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/common/activation.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/conv/act_max_pool.cuh"

namespace torchfuse::kernels {
namespace {

// ATen's max_pool2d update: a NaN, once taken, stays.
__device__ __forceinline__ float poolMax(float m, float v) {
  return (v > m || isnan(v)) ? v : m;
}

// One output position's vector of V channels from channel c0 on; `row` is
// the distance between elements of one channel at consecutive w (c for
// nhwc), `plane` between consecutive h.
template <ActivationKind K, typename T, int V>
__device__ __forceinline__ void poolWindow(
    const ActMaxPoolArgs<T>& a,
    const T* base,
    int64_t c0,
    int64_t y,
    int64_t x,
    int64_t row,
    int64_t plane,
    float (&m)[V]) {
  float b[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    b[k] = a.bias ? toFloat(a.bias[c0 + k]) : 0.f;
    m[k] = -INFINITY;
  }
  const int64_t h0 = y * a.sh - a.ph;
  const int64_t w0 = x * a.sw - a.pw;
  for (int64_t i = 0; i < a.kh; ++i) {
    const int64_t h = h0 + i * a.dh;
    if (h < 0 || h >= a.h) {
      continue;
    }
    for (int64_t j = 0; j < a.kw; ++j) {
      const int64_t w = w0 + j * a.dw;
      if (w < 0 || w >= a.w) {
        continue;
      }
      float v[V];
      loadVec<T, V>(base + h * plane + w * row, v);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        // NB: no bias, no add: -0.0 stays -0.0, as in eager's act(conv).
        m[k] = poolMax(
            m[k], activate<K, isSixteenBit<T>()>(a.bias ? v[k] + b[k] : v[k], a.act.a, a.act.b));
      }
    }
  }
}

template <ActivationKind K, typename T, int V>
__global__ void __launch_bounds__(kThreads) nhwcKernel(ActMaxPoolArgs<T> a, int64_t total) {
  const int64_t groups = a.c / V;
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    int64_t q = t;
    const int64_t c0 = (q % groups) * V;
    q /= groups;
    const int64_t x = q % a.wo;
    q /= a.wo;
    const int64_t y = q % a.ho;
    const int64_t img = q / a.ho;
    float m[V];
    poolWindow<K, T, V>(a, a.in + img * a.h * a.w * a.c + c0, c0, y, x, a.c, a.w * a.c, m);
    storeVec<T, V>(a.out + ((img * a.ho + y) * a.wo + x) * a.c + c0, m);
  }
}

template <ActivationKind K, typename T>
__global__ void __launch_bounds__(kThreads) nchwKernel(ActMaxPoolArgs<T> a, int64_t total) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    int64_t q = t;
    const int64_t x = q % a.wo;
    q /= a.wo;
    const int64_t y = q % a.ho;
    q /= a.ho; // image * c + channel
    const int64_t c = q % a.c;
    float m[1];
    poolWindow<K, T, 1>(a, a.in + q * a.h * a.w, c, y, x, 1, a.w, m);
    a.out[t] = fromFloat<T>(m[0]);
  }
}

unsigned blocksFor(int64_t threads) {
  // NB: enough blocks to fill the device several times over; the
  // grid-stride loop takes the rest.
  constexpr int64_t kMaxBlocks = 65535;
  return unsigned(std::min<int64_t>((threads + kThreads - 1) / kThreads, kMaxBlocks));
}

template <ActivationKind K, typename T>
void run(const ActMaxPoolArgs<T>& a, bool channels_last, cudaStream_t stream) {
  const int64_t outputs = a.n * a.c * a.ho * a.wo;
  if (!channels_last) {
    nchwKernel<K, T><<<blocksFor(outputs), kThreads, 0, stream>>>(a, outputs);
    return;
  }
  constexpr int kVec = maxVec<T>();
  if (a.c % kVec == 0 && aligned16(a.in) && aligned16(a.out)) {
    nhwcKernel<K, T, kVec><<<blocksFor(outputs / kVec), kThreads, 0, stream>>>(a, outputs / kVec);
  } else {
    nhwcKernel<K, T, 1><<<blocksFor(outputs), kThreads, 0, stream>>>(a, outputs);
  }
}

} // namespace

template <typename T>
void actMaxPool(const ActMaxPoolArgs<T>& a, bool channels_last, cudaStream_t stream) {
  if (a.n * a.c * a.ho * a.wo == 0) {
    return;
  }
  forActivation(
      a.act.kind, [&](auto kind) { run<decltype(kind)::value>(a, channels_last, stream); });
}

#define TORCHFUSE_INSTANTIATE(T) \
  template void actMaxPool<T>(const ActMaxPoolArgs<T>&, bool, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
