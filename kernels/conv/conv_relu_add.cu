#include "kernels/conv/conv_relu_add.cuh"
#include "kernels/conv/tf32.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

namespace torchfuse::kernels {
namespace {

// 32x32 tiles moved by 32x8 threads: each warp reads and writes 32
// consecutive elements (128 bytes in float32) on both sides of the transpose.
constexpr int kTile = 32;
constexpr int kRows = 8;
// CUDA caps gridDim.y and gridDim.z; larger extents loop.
constexpr int64_t kMaxGridYZ = 65535;

template <typename T>
__device__ __forceinline__ float load(const T* p) {
  return static_cast<float>(*p);
}
template <typename T>
__device__ __forceinline__ T store(float v) {
  return static_cast<T>(v);
}

int64_t tiles(int64_t extent) {
  return (extent + kTile - 1) / kTile;
}

dim3 grid(int64_t x, int64_t y, int64_t z) {
  return dim3(
      static_cast<unsigned>(x), static_cast<unsigned>(std::min(y, kMaxGridYZ)),
      static_cast<unsigned>(std::min(z, kMaxGridYZ)));
}

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
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts across the transpose
  const int lane = threadIdx.x;
  const int64_t c = int64_t(blockIdx.x) * kTile + lane;
  const bool live = c < channels;
  const float b = live && bias ? load(bias + c) : 0.f;
  const float o = live && other ? alpha * load(other + c) : 0.f;
  const int64_t words = (channels + 31) / 32;
  for (int64_t img = blockIdx.z; img < n; img += gridDim.z) {
    const int64_t base = img * channels * positions;
    for (int64_t s0 = int64_t(blockIdx.y) * kTile; s0 < positions; s0 += int64_t(gridDim.y) * kTile) {
      if (kNchw) {
        for (int i = threadIdx.y; i < kTile; i += kRows) {
          const int64_t ch = int64_t(blockIdx.x) * kTile + i, s = s0 + lane;
          if (ch < channels && s < positions) {
            tile[i][lane] = load(conv + base + ch * positions + s);
          }
        }
        __syncthreads();
      }
      for (int i = threadIdx.y; i < kTile; i += kRows) {
        const int64_t s = s0 + i;
        if (s >= positions) {
          break;  // uniform across the warp
        }
        float t = 0.f;
        if (live) {
          t = (kNchw ? tile[lane][i] : load(conv + base + s * channels + c)) + b;
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
          tile[lane][i] = v;  // read and written by this thread only
        } else if (live) {
          out[base + s * channels + c] = store<T>(v);
        }
      }
      if (kNchw) {
        __syncthreads();
        for (int i = threadIdx.y; i < kTile; i += kRows) {
          const int64_t ch = int64_t(blockIdx.x) * kTile + i, s = s0 + lane;
          if (ch < channels && s < positions) {
            out[base + ch * positions + s] = store<T>(tile[i][lane]);
          }
        }
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
      for (int i = threadIdx.y; i < kTile; i += kRows) {
        const int64_t ch = int64_t(blockIdx.x) * kTile + i, s = s0 + lane;
        if (ch < channels && s < positions) {
          tile[i][lane] = load(dy + nchw_base + ch * positions + s);
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
      const float d = kDyNchw ? tile[lane][i] : load(dy + pos * channels + c);
      const bool keep = (mask[pos * words + blockIdx.x] >> lane) & 1u;
      // NB: a select, not a product: a masked NaN or Inf gradient gives 0.
      const float v = keep ? d : 0.f;
      if (kGNchw) {
        tile[lane][i] = v;  // read and written by this thread only
      } else {
        g[pos * channels + c] = store<T>(v);
      }
      acc_g += v;
      acc_dy += d;
    }
    if (kGNchw) {
      __syncthreads();
      for (int i = threadIdx.y; i < kTile; i += kRows) {
        const int64_t ch = int64_t(blockIdx.x) * kTile + i, s = s0 + lane;
        if (ch < channels && s < positions) {
          g[nchw_base + ch * positions + s] = store<T>(tile[i][lane]);
        }
      }
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

// ---- positions-inner mask: unstaged streaming passes over nchw tensors.

constexpr int kThreads = 256;

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// x / d by a multiply-high, an add and a shift, exact for every x < 2^32
// (Granlund and Montgomery, "Division by invariant integers using
// multiplication", PLDI 1994, figure 4.1), so that finding an element's
// channel costs no 64-bit division.
template <typename Index>
struct Divider;

template <>
struct Divider<uint32_t> {
  uint32_t magic;
  uint32_t shift;
  explicit Divider(uint32_t d) : magic(1), shift(0) {  // d >= 1
    while (shift < 32 && (uint64_t(1) << shift) < d) {
      ++shift;
    }
    // < 2^32: 2^shift - d < d
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t x) const {
    const uint32_t t = __umulhi(x, magic);
    return static_cast<uint32_t>((uint64_t(t) + x) >> shift);
  }
};

template <>
struct Divider<uint64_t> {
  uint64_t d;
  explicit Divider(uint64_t d) : d(d) {}
  __device__ __forceinline__ uint64_t div(uint64_t x) const {
    return x / d;
  }
};

// kUnit consecutive elements: one 16-byte access when kUnit * sizeof(T) is 16.
template <typename T, int kUnit>
struct alignas(sizeof(T) * kUnit) Pack {
  T v[kUnit];
};

template <typename T, int kUnit>
__device__ __forceinline__ void loadPack(const T* p, float (&v)[kUnit]) {
  const auto pack = *reinterpret_cast<const Pack<T, kUnit>*>(p);
#pragma unroll
  for (int k = 0; k < kUnit; ++k) {
    v[k] = static_cast<float>(pack.v[k]);
  }
}

template <typename T, int kUnit>
__device__ __forceinline__ void storePack(T* p, const float (&v)[kUnit]) {
  Pack<T, kUnit> pack;
#pragma unroll
  for (int k = 0; k < kUnit; ++k) {
    pack.v[k] = store<T>(v[k]);
  }
  *reinterpret_cast<Pack<T, kUnit>*>(p) = pack;
}

// ---- the channels-last route's conversions:
// dst[b][j][i] = f(b, i, j, src[b][i][j])

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
    const float t = v + (bias ? load(bias + c) : 0.f);
    return (!(t <= 0.f) ? t : 0.f) + (other ? alpha * load(other + c) : 0.f);
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
    double* dst, int64_t at, float t, int width, bool first, bool valid) {
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
          v = load(in + (i0 + k) * cols + j0 + lane);
          t = f(b, i0 + k, j0 + lane, v);
          tile[k][lane] = stored(f, t);
        }
        if constexpr (F::kRowSums) {  // a warp is one row of the tile
          const int64_t at = (b * gridDim.x + blockIdx.x) * rows + i0 + k;
          storeLaneSum(f.sums, at, t, kTile, lane == 0, i0 + k < rows);
          storeLaneSum(f.input_sums, at, v, kTile, lane == 0, i0 + k < rows);
        }
      }
      __syncthreads();
      for (int k = threadIdx.y; k < kTile; k += kRows) {
        if (j0 + k < cols && i0 + lane < rows) {
          o[(j0 + k) * rows + i0 + lane] = store<T>(tile[lane][k]);
        }
      }
      __syncthreads();
    }
  }
}

// 64x64 tiles with 16-byte accesses on both sides: rows and cols multiples
// of kUnit, src and dst 16-byte aligned.  NB: the 32x32 scalar tiles move
// only 128 bytes per warp access and ran at about half of copy speed on an
// H200 (kernels/conv/README.md, variant E).
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
  constexpr int kLanesPerLine = kVecTile / kUnit;       // threads per tile line
  constexpr int kLinesPerPass = kThreads / kLanesPerLine;
  __shared__ float tile[kVecTile][kVecTile + 1];
  const int part = (threadIdx.x % kLanesPerLine) * kUnit;  // offset within a line
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
        if (i < rows && j < cols) {  // units never straddle cols: cols % kUnit == 0
          loadPack<T, kUnit>(in + i * cols + j, v[p]);
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
        if constexpr (F::kRowSums) {  // a line's lanes are consecutive
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
          storePack<T, kUnit>(o + j * rows + i, v[p]);
        }
      }
      __syncthreads();
    }
  }
}

// Returns the blocks of columns (the row sums' column_blocks).
template <typename T, typename F>
int64_t launchTranspose(
    const T* src, T* dst, int64_t batch, int64_t rows, int64_t cols, F f, cudaStream_t stream) {
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
    uint32_t* mask, Index i, Index total, uint32_t bits, int lane) {
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
    mask[i / 32] = word;  // i is the word's first element
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
      loadPack<T, kUnit>(conv + i, v[u]);
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
      const Index row = by_positions.div(i);  // image * channels + channel
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
        storePack<T, kUnit>(out + i, v[u]);
      } else {
        bits &= (1u << (total - i)) - 1;  // < kUnit elements left
#pragma unroll
        for (int k = 0; k < kUnit; ++k) {
          if (i + k < total) {
            out[i + k] = store<T>(v[u][k]);
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
void launchEpiloguePositionsInner(
    const T* conv, const T* bias, const T* other, float alpha, T* out, uint32_t* mask,
    int64_t total, int64_t c, int64_t s, cudaStream_t stream) {
  constexpr int kUnroll = kUnit == 1 ? 8 : 4;
  constexpr int64_t kPerBlock = int64_t(kThreads) * kUnroll * kUnit;
  const auto blocks = static_cast<unsigned>((total + kPerBlock - 1) / kPerBlock);
  epiloguePositionsInnerKernel<T, kUnit, kUnroll, Index><<<blocks, kThreads, 0, stream>>>(
      conv, bias, other, alpha, out, mask, Index(total), Index(c), Index(s), Divider<Index>(c),
      Divider<Index>(s));
}

template <typename T, int kUnit>
void launchEpiloguePositionsInner(
    const T* conv, const T* bias, const T* other, float alpha, T* out, uint32_t* mask,
    int64_t total, int64_t c, int64_t s, cudaStream_t stream) {
  // NB: 32-bit indices while every index a thread forms (< total + one
  // block's elements) fits.
  if (total <= (int64_t(1) << 31)) {
    launchEpiloguePositionsInner<T, kUnit, uint32_t>(
        conv, bias, other, alpha, out, mask, total, c, s, stream);
  } else {
    launchEpiloguePositionsInner<T, kUnit, uint64_t>(
        conv, bias, other, alpha, out, mask, total, c, s, stream);
  }
}

// The grad prologue's blocks: groups of `1 << member_log2` threads each
// stream one channel row of one image (or a chunk of it, where few rows
// would leave the GPU idle) and reduce it in shared memory, so every row
// leaves a block once, as one partial sum per (image, chunk, channel), in a
// fixed order: the sums are deterministic.  Short rows take small groups, so
// a warp still reads consecutive rows.
struct GradPlan {
  int member_log2;     // log2 of the threads per row
  int64_t row_groups;  // blocks across the channels
  int64_t chunks;      // blocks along one row
  int64_t chunk_len;   // positions per chunk, a multiple of 32
};

GradPlan gradPlanPositionsInner(int64_t n, int64_t c, int64_t s) {
  constexpr int64_t kPerThread = 16;  // elements per thread at least, where rows allow
  constexpr int64_t kTargetBlocks = 8192;
  int member_log2 = 0;
  while ((int64_t(1) << member_log2) < kThreads && (int64_t(1) << member_log2) * kPerThread < s) {
    ++member_log2;
  }
  const int64_t members = int64_t(1) << member_log2;
  const int64_t rows_per_block = kThreads / members;
  const int64_t row_groups = (c + rows_per_block - 1) / rows_per_block;
  const int64_t max_chunks = std::max<int64_t>(1, s / (members * kPerThread));
  const int64_t chunks = std::clamp<int64_t>(
      kTargetBlocks / std::max<int64_t>(1, n * row_groups), 1, max_chunks);
  const int64_t chunk_len = ((s + chunks - 1) / chunks + 31) / 32 * 32;
  return {member_log2, row_groups, (s + chunk_len - 1) / chunk_len, chunk_len};
}

template <typename T, int kUnit, int kUnroll>
__global__ void __launch_bounds__(kThreads, 4) gradProloguePositionsInnerKernel(
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
  const int64_t c = int64_t(blockIdx.x / chunks) * (kThreads >> member_log2) +
      (threadIdx.x >> member_log2);
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
          loadPack<T, kUnit>(dy + i, d[u]);
          bits[u] = mask[i / 32] >> (i % 32);  // one word: i % kUnit == 0
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
          storePack<T, kUnit>(g + row + s0 + u * step, v);
        }
      }
    }
  }
  if (!sum_g && !sum_dy) {
    return;  // uniform across the block
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
void convReluAddEpilogueChannelsInner(
    const T* conv, const T* bias, const T* other, float alpha, T* out, bool nchw,
    uint32_t* mask, int64_t n, int64_t c, int64_t s, cudaStream_t stream) {
  if (n == 0 || c == 0 || s == 0) {
    return;
  }
  const dim3 g = grid(tiles(c), tiles(s), n);
  const dim3 b(kTile, kRows);
  if (nchw) {
    epilogueKernel<T, true><<<g, b, 0, stream>>>(conv, bias, other, alpha, out, mask, n, c, s);
  } else {
    epilogueKernel<T, false><<<g, b, 0, stream>>>(conv, bias, other, alpha, out, mask, n, c, s);
  }
}

int64_t convReluAddGradPartsChannelsInner(int64_t n, int64_t c, int64_t s) {
  return n * gradBlocksPerImage(n, c, s);
}

template <typename T>
void convReluAddGradPrologueChannelsInner(
    const T* dy, bool dy_nchw, const uint32_t* mask, T* g, bool g_nchw, double* sum_g,
    double* sum_dy, int64_t n, int64_t c, int64_t s, cudaStream_t stream) {
  if (n == 0 || c == 0 || s == 0) {
    return;
  }
  // NB: one image per grid z index: the partial-sum rows are indexed by it.
  const dim3 g3(
      static_cast<unsigned>(tiles(c)), static_cast<unsigned>(gradBlocksPerImage(n, c, s)),
      static_cast<unsigned>(n));
  const dim3 b(kTile, kRows);
  if (dy_nchw && g_nchw) {
    gradPrologueKernel<T, true, true><<<g3, b, 0, stream>>>(dy, mask, g, sum_g, sum_dy, c, s);
  } else if (dy_nchw) {
    gradPrologueKernel<T, true, false><<<g3, b, 0, stream>>>(dy, mask, g, sum_g, sum_dy, c, s);
  } else if (g_nchw) {
    gradPrologueKernel<T, false, true><<<g3, b, 0, stream>>>(dy, mask, g, sum_g, sum_dy, c, s);
  } else {
    gradPrologueKernel<T, false, false><<<g3, b, 0, stream>>>(dy, mask, g, sum_g, sum_dy, c, s);
  }
}

template <typename T>
void convReluAddEpiloguePositionsInner(
    const T* conv, const T* bias, const T* other, float alpha, T* out, uint32_t* mask,
    int64_t n, int64_t c, int64_t s, cudaStream_t stream) {
  if (n == 0 || c == 0 || s == 0) {
    return;
  }
  constexpr int kVec = 16 / sizeof(T);
  if (aligned16(conv) && aligned16(out)) {
    launchEpiloguePositionsInner<T, kVec>(conv, bias, other, alpha, out, mask, n * c * s, c, s, stream);
  } else {
    launchEpiloguePositionsInner<T, 1>(conv, bias, other, alpha, out, mask, n * c * s, c, s, stream);
  }
}

int64_t convReluAddGradPartsPositionsInner(int64_t n, int64_t c, int64_t s) {
  return n == 0 || c == 0 || s == 0 ? 0 : n * gradPlanPositionsInner(n, c, s).chunks;
}

template <typename T>
void convReluAddGradProloguePositionsInner(
    const T* dy, const uint32_t* mask, T* g, double* sum_g, double* sum_dy, int64_t n,
    int64_t c, int64_t s, cudaStream_t stream) {
  if (n == 0 || c == 0 || s == 0) {
    return;
  }
  const auto plan = gradPlanPositionsInner(n, c, s);
  // NB: one image per grid y index: the partial-sum rows are indexed by it.
  const dim3 blocks(static_cast<unsigned>(plan.row_groups * plan.chunks), static_cast<unsigned>(n));
  constexpr int kVec = 16 / sizeof(T);
  if (aligned16(dy) && aligned16(g) && s % kVec == 0) {
    gradProloguePositionsInnerKernel<T, kVec, 4><<<blocks, kThreads, 0, stream>>>(
        dy, mask, g, sum_g, sum_dy, c, s, plan.member_log2, plan.chunks, plan.chunk_len);
  } else {
    gradProloguePositionsInnerKernel<T, 1, 8><<<blocks, kThreads, 0, stream>>>(
        dy, mask, g, sum_g, sum_dy, c, s, plan.member_log2, plan.chunks, plan.chunk_len);
  }
}

template <typename T>
void transposeBatched(
    const T* src, T* dst, int64_t batch, int64_t rows, int64_t cols, cudaStream_t stream) {
  launchTranspose(src, dst, batch, rows, cols, Identity{}, stream);
}

void transposeBatchedTf32(
    const float* src, float* dst, int64_t batch, int64_t rows, int64_t cols, cudaStream_t stream) {
  launchTranspose(src, dst, batch, rows, cols, RoundTf32{}, stream);
}

int64_t convReluAddGradNchwToNhwcParts(int64_t n, int64_t c, int64_t s) {
  return n * tiles(s);  // at most: the vector tiles make half as many
}

template <typename T>
int64_t convReluAddGradNchwToNhwc(
    const T* dy, const uint32_t* mask, T* g, bool tf32, double* sum_g, double* sum_dy, int64_t n,
    int64_t c, int64_t s, cudaStream_t stream) {
  // per image, the nchw [C][S] gradient into nhwc [S][C], masked
  return n *
      launchTranspose(dy, g, n, c, s, MaskedGrad{mask, sum_g, sum_dy, c, s, tf32}, stream);
}

template <typename T>
void convReluAddEpilogueNhwcToNchw(
    const T* conv, const T* bias, const T* other, float alpha, T* out, int64_t n, int64_t c,
    int64_t s, cudaStream_t stream) {
  // per image, the nhwc [S][C] conv output into the nchw [C][S] output
  launchTranspose(conv, out, n, s, c, BiasReluAdd<T>{bias, other, alpha}, stream);
}

#define TORCHFUSE_INSTANTIATE(T)                                                         \
  template void convReluAddEpiloguePositionsInner<T>(                                    \
      const T*, const T*, const T*, float, T*, uint32_t*, int64_t, int64_t, int64_t,     \
      cudaStream_t);                                                                     \
  template void convReluAddGradProloguePositionsInner<T>(                                \
      const T*, const uint32_t*, T*, double*, double*, int64_t, int64_t, int64_t,        \
      cudaStream_t);                                                                     \
  template void convReluAddEpilogueChannelsInner<T>(                                     \
      const T*, const T*, const T*, float, T*, bool, uint32_t*, int64_t, int64_t, int64_t, \
      cudaStream_t);                                                                     \
  template void convReluAddGradPrologueChannelsInner<T>(                                 \
      const T*, bool, const uint32_t*, T*, bool, double*, double*, int64_t, int64_t,     \
      int64_t, cudaStream_t);                                                            \
  template void transposeBatched<T>(const T*, T*, int64_t, int64_t, int64_t, cudaStream_t); \
  template int64_t convReluAddGradNchwToNhwc<T>(                                         \
      const T*, const uint32_t*, T*, bool, double*, double*, int64_t, int64_t, int64_t,  \
      cudaStream_t);                                                                     \
  template void convReluAddEpilogueNhwcToNchw<T>(                                        \
      const T*, const T*, const T*, float, T*, int64_t, int64_t, int64_t, cudaStream_t);
TORCHFUSE_INSTANTIATE(float)
TORCHFUSE_INSTANTIATE(__half)
TORCHFUSE_INSTANTIATE(__nv_bfloat16)
#undef TORCHFUSE_INSTANTIATE

} // namespace torchfuse::kernels
