// custom_conv_relu_add's conversions for the channels-last route (the
// contract is in conv_relu_add.cuh): batched transposes between nchw and
// nhwc, dst[b][j][i] = f(b, i, j, src[b][i][j]), through shared-memory
// tiles, with the epilogue, the relu's gradient or the TF32 rounding as f.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"
#include "kernels/conv/conv_relu_add.cuh"
#include "kernels/conv/tf32.cuh"
#include "kernels/conv/tiles.cuh"

namespace torchfuse::kernels {
namespace {

using namespace conv; // NB: the tiles

// A functor with kRowSums has `sums` and `input_sums` (either may be null)
// and `stored`: per source row i and block of columns, the sum of its values
// goes into sums[(b * column_blocks + block) * rows + i] and the sum of the
// source values into input_sums likewise; dst holds stored(value).
struct Identity {
  static constexpr bool kRowSums = false;
  __device__ __forceinline__ float operator()(int64_t, int64_t, int64_t, float v) const {
    return v;
  }
};

struct RoundTf32 {
  static constexpr bool kRowSums = false;
  __device__ __forceinline__ float operator()(int64_t, int64_t, int64_t, float v) const {
    return roundTf32(v);
  }
};

// t = v + bias[c]; (t <= 0 ? 0 : t) + alpha * other[c], as reluAdd.
template <typename T>
struct BiasReluAdd {
  static constexpr bool kRowSums = false;
  const T* bias;
  const T* other;
  float alpha;
  __device__ __forceinline__ float operator()(int64_t, int64_t, int64_t c, float v) const {
    const float t = v + (bias ? toFloat(bias[c]) : 0.f);
    return (!(t <= 0.f) ? t : 0.f) + (other ? alpha * toFloat(other[c]) : 0.f);
  }
};

// g = dy where the relu passed (mask bit of the element's logical nchw
// index set, as in reluAdd), else 0: a select, so a NaN dy passes as NaN.
// Stored rounded to TF32 when tf32 (the implicit-GEMM data gradient reads
// it); the sums, of g (the bias gradient) and of dy (other's), are unrounded.
struct MaskedGrad {
  static constexpr bool kRowSums = true;
  const uint32_t* mask;
  double* sums;
  double* input_sums;
  int64_t rows, cols;
  bool tf32;
  __device__ __forceinline__ float operator()(int64_t b, int64_t i, int64_t j, float v) const {
    const int64_t e = (b * rows + i) * cols + j;
    return (__ldg(mask + (e >> 5)) >> (e & 31)) & 1u ? v : 0.f;
  }
  __device__ __forceinline__ float stored(float g) const {
    return tf32 ? roundTf32(g) : g;
  }
};

template <typename F>
__device__ __forceinline__ float stored(const F& f, float t) {
  if constexpr (F::kRowSums) {
    return f.stored(t);
  } else {
    return t;
  }
}

// The sum of `width` consecutive lanes' t (width a power of two <= 32),
// stored by the first of them at dst[at] when dst is not null.
__device__ __forceinline__ void storeLaneSum(
    double* dst,
    int64_t at,
    float t,
    int width,
    bool first,
    bool valid) {
  if (dst == nullptr) {
    return;
  }
  for (int d = 1; d < width; d <<= 1) {
    t += __shfl_xor_sync(0xffffffffu, t, d);
  }
  if (first && valid) {
    dst[at] = t;
  }
}

// 32x32 tiles, one element per access, for any extents and alignment.
// Rows beyond gridDim.y tiles and batches beyond gridDim.z loop.
template <typename T, typename F>
__global__ void __launch_bounds__(kTile * kRows) transposeKernel(
    const T* __restrict__ src,
    T* __restrict__ dst,
    int64_t batch,
    int64_t rows,
    int64_t cols,
    F f) {
  __shared__ float tile[kTile][kTile + 1];
  const int lane = threadIdx.x;
  const int64_t j0 = int64_t(blockIdx.x) * kTile;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const T* in = src + b * rows * cols;
    T* o = dst + b * rows * cols;
    for (int64_t i0 = int64_t(blockIdx.y) * kTile; i0 < rows; i0 += int64_t(gridDim.y) * kTile) {
      for (int k = threadIdx.y; k < kTile; k += kRows) {
        const bool inside = i0 + k < rows && j0 + lane < cols;
        float v = 0.f, t = 0.f;
        if (inside) {
          v = toFloat(*(in + (i0 + k) * cols + j0 + lane));
          t = f(b, i0 + k, j0 + lane, v);
          tile[k][lane] = stored(f, t);
        }
        if constexpr (F::kRowSums) { // a warp is one row of the tile
          const int64_t at = (b * gridDim.x + blockIdx.x) * rows + i0 + k;
          storeLaneSum(f.sums, at, t, kTile, lane == 0, i0 + k < rows);
          storeLaneSum(f.input_sums, at, v, kTile, lane == 0, i0 + k < rows);
        }
      }
      __syncthreads();
      for (int k = threadIdx.y; k < kTile; k += kRows) {
        if (j0 + k < cols && i0 + lane < rows) {
          o[(j0 + k) * rows + i0 + lane] = fromFloat<T>(tile[lane][k]);
        }
      }
      __syncthreads();
    }
  }
}

// 64x64 tiles with 16-byte accesses on both sides: rows and cols multiples
// of kUnit, src and dst 16-byte aligned.  NB: the 32x32 scalar tiles move
// only 128 bytes per warp access and ran at about half of copy speed on an
// H200 (docs/kernels/conv_relu_add.md, "Variants tried").
constexpr int kVecTile = 64;

template <typename T, typename F>
__global__ void __launch_bounds__(kThreads) transposeVecKernel(
    const T* __restrict__ src,
    T* __restrict__ dst,
    int64_t batch,
    int64_t rows,
    int64_t cols,
    F f) {
  constexpr int kUnit = 16 / sizeof(T);
  constexpr int kLanesPerLine = kVecTile / kUnit; // threads per tile line
  constexpr int kLinesPerPass = kThreads / kLanesPerLine;
  __shared__ float tile[kVecTile][kVecTile + 1];
  const int part = (threadIdx.x % kLanesPerLine) * kUnit; // offset within a line
  const int line = threadIdx.x / kLanesPerLine;
  const int64_t j0 = int64_t(blockIdx.x) * kVecTile;
  for (int64_t b = blockIdx.z; b < batch; b += gridDim.z) {
    const T* in = src + b * rows * cols;
    T* o = dst + b * rows * cols;
    for (int64_t i0 = int64_t(blockIdx.y) * kVecTile; i0 < rows;
         i0 += int64_t(gridDim.y) * kVecTile) {
      float v[kVecTile / kLinesPerPass][kUnit];
#pragma unroll
      for (int p = 0; p < kVecTile / kLinesPerPass; ++p) {
        const int64_t i = i0 + line + p * kLinesPerPass, j = j0 + part;
        if (i < rows && j < cols) { // units never straddle cols: cols % kUnit == 0
          loadVec<T, kUnit>(in + i * cols + j, v[p]);
        }
      }
#pragma unroll
      for (int p = 0; p < kVecTile / kLinesPerPass; ++p) {
        const int r = line + p * kLinesPerPass;
        float sum = 0.f, input_sum = 0.f;
        // NB: f reads per-column values: only for columns that exist.
        if (i0 + r < rows && j0 + part < cols) {
#pragma unroll
          for (int k = 0; k < kUnit; ++k) {
            const float t = f(b, i0 + r, j0 + part + k, v[p][k]);
            tile[r][part + k] = stored(f, t);
            sum += t;
            input_sum += v[p][k];
          }
        }
        if constexpr (F::kRowSums) { // a line's lanes are consecutive
          const int64_t at = (b * gridDim.x + blockIdx.x) * rows + i0 + r;
          const bool first = threadIdx.x % kLanesPerLine == 0;
          storeLaneSum(f.sums, at, sum, kLanesPerLine, first, i0 + r < rows);
          storeLaneSum(f.input_sums, at, input_sum, kLanesPerLine, first, i0 + r < rows);
        }
      }
      __syncthreads();
#pragma unroll
      for (int p = 0; p < kVecTile / kLinesPerPass; ++p) {
        const int c = line + p * kLinesPerPass;
        const int64_t j = j0 + c, i = i0 + part;
        if (j < cols && i < rows) {
#pragma unroll
          for (int k = 0; k < kUnit; ++k) {
            v[p][k] = tile[part + k][c];
          }
          storeVec<T, kUnit>(o + j * rows + i, v[p]);
        }
      }
      __syncthreads();
    }
  }
}

// Returns the blocks of columns (the row sums' column_blocks).
template <typename T, typename F>
int64_t launchTranspose(const TransposeArgs<T>& a, F f, cudaStream_t stream) {
  const auto [src, dst, batch, rows, cols] = a;
  if (batch == 0 || rows == 0 || cols == 0) {
    return 0;
  }
  constexpr int kUnit = 16 / sizeof(T);
  if (aligned16(src) && aligned16(dst) && rows % kUnit == 0 && cols % kUnit == 0) {
    const auto vec_tiles = [](int64_t e) { return (e + kVecTile - 1) / kVecTile; };
    const dim3 blocks = grid(vec_tiles(cols), vec_tiles(rows), batch);
    transposeVecKernel<T, F><<<blocks, kThreads, 0, stream>>>(src, dst, batch, rows, cols, f);
    return blocks.x;
  }
  const dim3 blocks = grid(tiles(cols), tiles(rows), batch);
  transposeKernel<T, F><<<blocks, dim3(kTile, kRows), 0, stream>>>(src, dst, batch, rows, cols, f);
  return blocks.x;
}

} // namespace

template <typename T>
void transposeBatched(const TransposeArgs<T>& a, cudaStream_t stream) {
  launchTranspose(a, Identity{}, stream);
}

void transposeBatchedTf32(const TransposeArgs<float>& a, cudaStream_t stream) {
  launchTranspose(a, RoundTf32{}, stream);
}

int64_t convReluAddGradNchwToNhwcParts(int64_t n, int64_t c, int64_t s) {
  return n * tiles(s); // at most: the vector tiles make half as many
}

template <typename T>
int64_t convReluAddGradNchwToNhwc(const ConvGradArgs<T>& a, bool tf32, cudaStream_t stream) {
  // per image, the nchw [C][S] gradient into nhwc [S][C], masked
  const MaskedGrad f{a.mask, a.sum_g, a.sum_dy, a.c, a.s, tf32};
  return a.n * launchTranspose(TransposeArgs<T>{a.dy, a.g, a.n, a.c, a.s}, f, stream);
}

template <typename T>
void convReluAddEpilogueNhwcToNchw(const ConvEpilogueArgs<T>& a, cudaStream_t stream) {
  // per image, the nhwc [S][C] conv output into the nchw [C][S] output
  const TransposeArgs<T> t{a.conv, a.out, a.n, a.s, a.c};
  launchTranspose(t, BiasReluAdd<T>{a.bias, a.other, a.alpha}, stream);
}

#define TORCHFUSE_INSTANTIATE(T)                                                             \
  template void transposeBatched<T>(const TransposeArgs<T>&, cudaStream_t);                  \
  template int64_t convReluAddGradNchwToNhwc<T>(const ConvGradArgs<T>&, bool, cudaStream_t); \
  template void convReluAddEpilogueNhwcToNchw<T>(const ConvEpilogueArgs<T>&, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
