// custom_conv_relu_add's implicit-GEMM convolution for sm_90
// (docs/kernels/conv_relu_add.md; the contract is in the header).
//
// One CTA per SM loops over tiles of 4 x 64 output positions (2 rows of up
// to 128 columns, or 4 rows of up to 64) of one image, all k <= 128 output
// channels (n = 64 MMAs where k <= 64, which halves their work there).
// Warpgroup 0's first thread is the producer: per 32-channel chunk, one
// TMA load of the input patch the tile reads (zero-filled past the
// borders, so padding costs nothing); per (chunk, tap), one of the
// weights.  The two consumer warpgroups run m64n128k8 TF32 wgmma with both
// operands in shared memory, K-major and 128-byte swizzled: a tap is only
// an offset into the patch, so each input element is loaded once per tile
// rather than once per tap.  The epilogue stages 8-channel slices of the
// nchw output, bias, relu and `other` applied, and writes them with TMA
// stores, so the output costs one write and no extra pass.  The epilogue
// runs while the tensor cores idle, so it is kept short: the per-channel
// bias and `other` wait in shared memory, and each slice costs one barrier.
// The relu mask, where asked for, is gathered per tile in registers, moved
// across lanes by warp shuffles into 16-position runs of each channel, ORed
// into a shared-memory bitmap laid out on the global mask's word grid, then
// written out as whole words;
// the two words at each end of a channel's run may be shared with the
// neighbouring tile, so those two are ORed into the zeroed global mask.
// Where x comes nchw, warps 1..3 of the producer warpgroup
// convert it to nhwc ahead of the convolution, and the producer waits for
// each image's conversion before loading from it.

#include "kernels/conv/implicit_gemm_sm90.cuh"
#include "kernels/conv/tf32.cuh"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>

namespace torchfuse::kernels {
namespace {

constexpr int kStages = 4;               // weight tiles in flight
constexpr int kChunkBytes = 32 * 4;      // one output channel's 32 k per chunk
constexpr int kSlice = 8;                // output channels per staged slice
constexpr int kSlices = 3;               // slice buffers: two stores in flight
constexpr int kThreads = 384;            // producer + 2 consumer warpgroups
constexpr int kMaxSmem = 227 * 1024;

// A tile's bits of one channel: at most 256 positions at any bit offset.
constexpr int kMaskWords = 9;

// x given nchw: boxes of x (32 channels x 32 positions of one image) a
// converter warp takes per grab, and the images of x the converters may run
// ahead of the furthest image a producer has reached.
constexpr int kGrab = 2;
constexpr int kLookahead = 2;

// x's boxes per image (x given nchw): 32 positions by 32 channels each.
__host__ __device__ __forceinline__ int64_t boxesPerImage(const ImplicitGemmConv& g) {
  return (g.h * g.w + 31) / 32 * (g.c / 32);
}

enum class Epilogue { kNone, kRelu, kReluMask };  // the convolution alone; with relu; and its mask

struct Tiling {
  int qb, tr, pw, pr, plane_tx, plane_bytes, stage_bytes;
  size_t smem;
};

// The MMAs' n: the output channels a tile computes.
int tileChannels(const ImplicitGemmConv& g) {
  return g.k <= 64 ? 64 : 128;
}

Tiling tiling(const ImplicitGemmConv& g, bool with_mask) {
  Tiling t{};
  t.qb = g.q <= 64 ? 1 : 2;  // 64-column blocks per output row
  t.tr = 4 / t.qb;           // output rows per tile
  t.pw = int(t.qb * 64 + g.s - 1);
  t.pr = int(t.tr + g.r - 1);
  t.plane_tx = t.pr * t.pw * 128;
  t.plane_bytes = (t.plane_tx + 1023) / 1024 * 1024;  // swizzle atoms stay aligned
  t.stage_bytes = kSlice * t.tr * int(g.q) * 4;
  t.smem = 1024 + 2 * size_t(t.plane_bytes) + kStages * tileChannels(g) * kChunkBytes +
      kSlices * size_t(t.stage_bytes) + 8 * (2 * kStages + 4) + 2 * 128 * 4 +
      (with_mask ? 128 * kMaskWords * 4 : 0);
  return t;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TORCHFUSE_SM90A 1
#endif

#ifdef TORCHFUSE_SM90A
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups
// 1024 bytes apart.  The swizzle follows address bits, so a tile may start
// at any 128-byte row (a tap's offset into the patch).
__device__ __forceinline__ uint64_t descriptor(uint32_t address) {
  return uint64_t((address & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
      (uint64_t(1) << 62);
}

// d[64 x kN] (+)= a[64 x 8] * b[8 x kN], TF32 inputs, float32 accumulators.
template <int kN>
__device__ __forceinline__ void mma(float* d, uint64_t a, uint64_t b, int accumulate);

template <>
__device__ __forceinline__ void mma<128>(float* d, uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
      "%30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, "
      "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, "
      "%58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
        "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void mma<64>(float* d, uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
      "%30, %31"
      "}, %32, %33, p, 1, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
        "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
        "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
        "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void barrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void barrierExpect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void barrierArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrierWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity)
      : "memory");
}

// In-kernel conversion: warps 1..3 of every CTA's producer warpgroup, idle
// otherwise, convert x from nchw into x_nhwc, rounded to TF32 to nearest
// (cvt.rna, as transposeBatchedTf32).  An atomic counter hands out boxes of
// 32 channels x 32 positions in image order, so whichever CTAs are resident
// convert them all; a warp waits before an image more than `lookahead`
// past the furthest a producer has reached, which spreads the conversion's
// traffic over the kernel and keeps the images it wrote in L2 until read.
// Per image, the boxes are counted in done[image] (released after a proxy
// fence: the producer reads x_nhwc by TMA, the async proxy).
// workspace: [0] the next box, [1] the furthest image a producer reached,
// then done[n].
__device__ __forceinline__ void convertNchw(
    const float* __restrict__ src, float* __restrict__ dst, uint32_t* workspace, int lookahead,
    const ImplicitGemmConv& g) {
  const int lane = threadIdx.x % 32;
  const int64_t hw = g.h * g.w;
  const int cblocks = int(g.c / 32), per_image = int(boxesPerImage(g));
  const int total = int(g.n) * per_image;
  const uint32_t* reached = workspace + 1;
  uint32_t* done = workspace + 2;
  int counted = 0;
  uint32_t boxes = 0;
  // counts the warp's boxes of image `counted`, once all its lanes stored
  const auto release = [&] {
    __syncwarp();
    if (lane == 0 && boxes > 0) {
      asm volatile(
          "fence.proxy.async.global;\n"
          "red.release.gpu.global.add.u32 [%0], %1;\n" ::"l"(done + counted), "r"(boxes)
          : "memory");
    }
  };
  while (true) {
    int first = 0;
    if (lane == 0) {
      first = int(atomicAdd(workspace, uint32_t(kGrab)));
    }
    first = __shfl_sync(0xffffffffu, first, 0);
    if (first >= total) {
      break;
    }
    const int last = min(first + kGrab, total) - 1;
    while (true) {
      uint32_t furthest;
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(furthest) : "l"(reached) : "memory");
      if (last / per_image <= int(furthest) + lookahead) {
        break;
      }
      __nanosleep(256);
    }
    // Lane (a, e) = (lane / 4, lane % 4) moves 4 x 4 blocks: channels
    // 4a..4a+3 by positions 16 h + 4 e..+3 of the box, h = 0, 1.  Its loads
    // read 64 bytes of a channel, its stores write 16 of a position's 128,
    // so a warp's access spans 8 and 4 segments: few L1 wavefronts next to
    // the MMAs' operand reads.
    const int a = lane / 4, e = lane % 4;
    float4 v[kGrab][8];
#pragma unroll
    for (int q = 0; q < kGrab; ++q) {
      const int b = first + q, n = b / per_image, r = b % per_image;
      const int p0 = r / cblocks * 32 + 4 * e;
      const float* from = src + (int64_t(n) * g.c + r % cblocks * 32 + 4 * a) * hw + p0;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          v[q][4 * h + k] = b < total && p0 + 16 * h < hw
              ? __ldg(reinterpret_cast<const float4*>(from + k * hw + 16 * h))
              : make_float4(0.f, 0.f, 0.f, 0.f);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < kGrab; ++q) {
      const int b = first + q, n = b / per_image, r = b % per_image;
      if (b >= total) {
        break;
      }
      if (n != counted) {
        release();
        counted = n;
        boxes = 0;
      }
      const int p0 = r / cblocks * 32 + 4 * e;
      float* to = dst + (n * hw + p0) * g.c + r % cblocks * 32 + 4 * a;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (p0 + 16 * h < hw) {
          const float* t = reinterpret_cast<const float*>(&v[q][4 * h]);  // [channel][position]
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            *reinterpret_cast<float4*>(to + (16 * h + i) * g.c) =
                make_float4(roundTf32(t[i]), roundTf32(t[4 + i]), roundTf32(t[8 + i]), roundTf32(t[12 + i]));
          }
        }
      }
      ++boxes;
    }
  }
  release();
}

// Waits until the converters have counted all `per_image` boxes of image n
// into done[n]; then the producer's TMA loads of it see their writes.
__device__ __forceinline__ void waitConverted(const uint32_t* done, uint32_t per_image) {
  uint32_t count;
  while (true) {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(count) : "l"(done) : "memory");
    if (count >= per_image) {
      break;
    }
    __nanosleep(64);
  }
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
#endif

// Shared memory: two patch buffers (alternating chunks), kStages weight
// tiles, kSlices output slices, the barriers, the bias and alpha * other of
// each of the 128 output channels, then (kReluMask) the mask bitmap,
// kMaskWords words per channel.  kN: the MMAs' n (tileChannels).
template <int kN, Epilogue kE>
__global__ void __launch_bounds__(kThreads, 1) implicitGemmKernel(
    const __grid_constant__ CUtensorMap x_map,
    const __grid_constant__ CUtensorMap w_map,
    const __grid_constant__ CUtensorMap out_map,
    const float* __restrict__ bias,
    const float* __restrict__ other,
    float alpha,
    uint32_t* __restrict__ mask,
    const float* x_nchw,
    float* x_nhwc,
    uint32_t* workspace,
    int lookahead,
    ImplicitGemmConv g,
    Tiling t) {
#ifdef TORCHFUSE_SM90A
  constexpr int kWeightTile = kN * kChunkBytes;
  constexpr bool kRelu = kE != Epilogue::kNone, kMask = kE == Epilogue::kReluMask;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t base = (uint32_t(__cvta_generic_to_shared(smem_raw)) + 1023) & ~1023u;
  const uint32_t planes = base;
  const uint32_t weights = planes + 2 * t.plane_bytes;
  const uint32_t slices = weights + kStages * kWeightTile;
  const uint32_t bars = slices + kSlices * t.stage_bytes;
  const auto weight_full = [&](int s) { return bars + 8 * s; };
  const auto weight_free = [&](int s) { return bars + 8 * (kStages + s); };
  const auto plane_full = [&](int b) { return bars + 8 * (2 * kStages + b); };
  const auto plane_free = [&](int b) { return bars + 8 * (2 * kStages + 2 + b); };

  const int tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      barrierInit(weight_full(s), 1);
      barrierInit(weight_free(s), 2);  // one arrival per consumer warpgroup
    }
    for (int b = 0; b < 2; ++b) {
      barrierInit(plane_full(b), 1);
      barrierInit(plane_free(b), 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const int q = int(g.q), taps = int(g.r * g.s), chunks = int(g.c / 32);
  const int tiles_per_image = int((g.p + t.tr - 1) / t.tr);
  const int tiles = int(g.n) * tiles_per_image;

  if (tid < 128) {
    if (x_nchw != nullptr && tid >= 32) {
      convertNchw(x_nchw, x_nhwc, workspace, lookahead, g);
    }
    if (tid == 0) {
      // Waiting on a fresh barrier's previous phase returns at once, so the
      // first pass through each buffer does not wait.
      int w_it = 0, p_it = 0, converted = -1;
      const uint32_t per_image = uint32_t(boxesPerImage(g));
      for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int n = tile / tiles_per_image, p0 = (tile % tiles_per_image) * t.tr;
        if (x_nchw != nullptr && n != converted) {
          // the converters may now run up to image n + lookahead
          atomicMax(workspace + 1, uint32_t(n));
          waitConverted(workspace + 2 + n, per_image);
          converted = n;
        }
        for (int chunk = 0; chunk < chunks; ++chunk, ++p_it) {
          const int b = p_it & 1;
          barrierWait(plane_free(b), ((p_it >> 1) & 1) ^ 1);
          barrierExpect(plane_full(b), t.plane_tx);
          asm volatile(
              "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
              " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(planes + b * t.plane_bytes),
              "l"(&x_map), "r"(chunk * 32), "r"(int(-g.pad_w)), "r"(int(p0 - g.pad_h)), "r"(n),
              "r"(plane_full(b))
              : "memory");
          for (int tap = 0; tap < taps; ++tap, ++w_it) {
            const int s = w_it % kStages;
            barrierWait(weight_free(s), ((w_it / kStages) & 1) ^ 1);
            barrierExpect(weight_full(s), kWeightTile);
            asm volatile(
                "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(weights + s * kWeightTile),
                "l"(&w_map), "r"(int(tap * g.c + chunk * 32)), "r"(0), "r"(weight_full(s))
                : "memory");
          }
        }
      }
    }
    return;
  }

  const int ctid = tid - 128, group = ctid / 128;
  const bool leader = ctid % 128 == 0;
  const int warp = (ctid % 128) / 32, lane = ctid % 32;
  const uint32_t adds = bars + 8 * (2 * kStages + 4), extras = adds + 128 * 4;
  const uint32_t bitmap = extras + 128 * 4;
  if constexpr (kMask) {
    for (int i = ctid; i < kN * kMaskWords; i += 256) {
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(bitmap + i * 4), "r"(0u) : "memory");
    }
  }
  const int64_t plane = g.p * g.q;
  if (ctid < 128) {
    const bool real = ctid < g.k;
    const float add = real && bias ? bias[ctid] : 0.f;
    const float extra = real && other ? alpha * other[ctid] : 0.f;
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(adds + ctid * 4), "f"(add) : "memory");
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(extras + ctid * 4), "f"(extra) : "memory");
  }
  asm volatile("bar.sync 1, 256;\n" ::: "memory");
  int w_it = 0, p_it = 0, slice_it = 0;
  float acc[2][kN / 2];
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int n = tile / tiles_per_image, p0 = (tile % tiles_per_image) * t.tr;
    // A stage is released once the MMAs after it have waited for it.
    int last_weight = -1, last_plane = -1;
    bool first = true;
    for (int chunk = 0; chunk < chunks; ++chunk, ++p_it) {
      const int b = p_it & 1;
      barrierWait(plane_full(b), (p_it >> 1) & 1);
      const uint32_t plane = planes + b * t.plane_bytes;
      for (int tap = 0; tap < taps; ++tap, ++w_it) {
        const int s = w_it % kStages;
        barrierWait(weight_full(s), (w_it / kStages) & 1);
        const int dr = tap / int(g.s), ds = tap % int(g.s);
        const uint64_t wd = descriptor(weights + s * kWeightTile);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int block = group * 2 + m, row = block / t.qb, col = block % t.qb;
          const uint64_t xd = descriptor(plane + ((row + dr) * t.pw + col * 64 + ds) * 128);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            mma<kN>(acc[m], xd + 2 * k, wd + 2 * k, !(first && k == 0));  // +32 bytes per k step
          }
        }
        first = false;
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        if (leader && last_weight >= 0) {
          barrierArrive(weight_free(last_weight));
        }
        if (leader && last_plane >= 0) {
          barrierArrive(plane_free(last_plane));
        }
        last_weight = s;
        last_plane = -1;
      }
      last_plane = b;
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    if (leader) {
      barrierArrive(weight_free(last_weight));
      barrierArrive(plane_free(last_plane));
    }

    // Accumulator (row 16 * warp + lane / 4 + 8 * hi, column 8 * j + 2 * (lane % 4) + e)
    // of block m: output position, output channel.
    const int row_len = t.tr * q;
    // the bit offset of channel c's run in its first mask word:
    // (mask_base + c * plane_bits) % 32
    const int mask_base = int((int64_t(n) * g.k * plane + int64_t(p0) * q) & 31);
    const int plane_bits = int(plane & 31);
    // The relu decisions of block m, slice j, column e, row hi: bit
    // (j % 8) + 8 hi + 16 e of keep[m][j / 8].
    uint32_t keep[2][kN / 64] = {};
#pragma unroll
    for (int j = 0; j < kN / kSlice && j * kSlice < g.k; ++j, ++slice_it) {
      // The store that last read this buffer finished before the previous
      // slice's barrier.
      const uint32_t slice = slices + (slice_it % kSlices) * t.stage_bytes;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int lc = 2 * (lane % 4) + e, channel = j * kSlice + lc;
        float add = 0.f, extra = 0.f;
        if constexpr (kRelu) {
          asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(add) : "r"(adds + channel * 4));
          asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(extra) : "r"(extras + channel * 4));
        }
#pragma unroll
        for (int m = 0; m < 2; ++m) {
          const int block = group * 2 + m, row = block / t.qb, col = block % t.qb;
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int qq = col * 64 + warp * 16 + lane / 4 + 8 * hi;
            const float v = acc[m][j * 4 + hi * 2 + e] + add;
            if constexpr (kMask) {  // !(t <= 0), as the streaming epilogue's mask
              keep[m][j / 8] |= uint32_t(!(v <= 0.f)) << (j % 8 + 8 * hi + 16 * e);
            }
            if (qq < q) {
              float y = v;
              if constexpr (kRelu) {
                // max.NaN keeps a NaN: relu(NaN) is NaN.
                asm("{\n.reg .f32 r;\nmax.NaN.f32 r, %1, 0f00000000;\nadd.f32 %0, r, %2;\n}\n"
                    : "=f"(y)
                    : "f"(v), "f"(extra));
              }
              asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(slice + (lc * row_len + row * q + qq) * 4),
                           "f"(y)
                           : "memory");
            }
          }
        }
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      if (ctid == 0) {  // frees the buffer the next slice writes
        asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kSlices - 2) : "memory");
      }
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
      if (ctid == 0) {
        // Rows past p and channels past k fall outside the map: not written.
        asm volatile(
            "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
            "cp.async.bulk.commit_group;\n" ::"l"(&out_map),
            "r"(p0 * q), "r"(j * kSlice), "r"(n), "r"(slice)
            : "memory");
      }
    }
    if constexpr (kMask) {
      // Lane a + 4 i held rows i and i + 8 of its warp's 16 positions; three
      // butterfly stages swap lane bits 2..4 (i) with register bits 0..2
      // (j % 8), so that lane a + 4 (j % 8) holds, per block m and word
      // j / 8, the 16 position bits of channels 8 j + 2 a + e in its
      // halves e.  Each goes into the bitmap at the channel's bit offset in
      // the global word grid, the positions past q dropped.
      const int a = lane % 4;
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const int block = group * 2 + m, row = block / t.qb, col = block % t.qb;
        const int run = col * 64 + warp * 16;
#pragma unroll
        for (int w = 0; w < kN / 64; ++w) {
          uint32_t v = keep[m][w];
#pragma unroll
          for (int k = 0; k < 3; ++k) {
            const uint32_t high = k == 0 ? 0xAAAAAAAAu : k == 1 ? 0xCCCCCCCCu : 0xF0F0F0F0u;
            const uint32_t x = __shfl_xor_sync(0xffffffffu, v, 4 << k);
            v = lane & (4 << k) ? (v & high) | ((x >> (1 << k)) & ~high)
                                : (v & ~high) | ((x << (1 << k)) & high);
          }
          if (run >= q || p0 + row >= g.p) {
            continue;
          }
          const uint32_t valid = q - run < 16 ? (1u << (q - run)) - 1 : 0xFFFFu;
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int channel = 8 * (lane / 4 + 8 * w) + 2 * a + e;
            if (channel < g.k) {
              const uint32_t bits = (v >> (16 * e)) & valid;
              const int first = ((mask_base + channel * plane_bits) & 31) + row * q + run;
              const uint32_t word = bitmap + (channel * kMaskWords + first / 32) * 4;
              asm volatile("red.shared.or.b32 [%0], %1;\n" ::"r"(word), "r"(bits << (first % 32))
                           : "memory");
              if (first % 32 > 16) {
                asm volatile("red.shared.or.b32 [%0], %1;\n" ::"r"(word + 4),
                             "r"(bits >> (32 - first % 32))
                             : "memory");
              }
            }
          }
        }
      }
      // Every bit is in before these reads; the bitmap is zeroed behind
      // them, and the barrier after keeps the next tile's bits out until all
      // have read.
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
      const int len = min(t.tr, int(g.p) - p0) * q;
      for (int i = ctid; i < kN * kMaskWords; i += 256) {
        const int channel = i / kMaskWords, wi = i % kMaskWords;
        uint32_t bits;
        asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(bits) : "r"(bitmap + i * 4) : "memory");
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(bitmap + i * 4), "r"(0u) : "memory");
        const int64_t start = (int64_t(n) * g.k + channel) * plane + int64_t(p0) * q;
        const int words = (int(start & 31) + len + 31) / 32;
        if (channel < g.k && wi < words) {
          uint32_t* dst = mask + (start >> 5) + wi;
          if (wi == 0 || wi == words - 1) {
            atomicOr(dst, bits);
          } else {
            *dst = bits;
          }
        }
      }
      asm volatile("bar.sync 1, 256;\n" ::: "memory");
    }
  }
  if (ctid == 0) {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
  }
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      f = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

bool encode(CUtensorMap* map, const float* data, int rank, const cuuint64_t* dims,
            const cuuint64_t* strides, const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  return encoder()(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, rank, const_cast<float*>(data), dims,
                   strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool sm90Device() {
  int device = 0, major = 0, minor = 0;
  return cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) == cudaSuccess &&
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) == cudaSuccess &&
      major == 9 && minor == 0;
}

}  // namespace

bool implicitGemmConvTakes(const ImplicitGemmConv& g, bool with_mask) {
  if (g.n <= 0 || g.c <= 0 || g.c % 32 != 0 || g.k <= 0 || g.k > 128 || g.p <= 0 || g.q <= 0 ||
      g.q > 128 || (g.p * g.q) % 4 != 0 || g.h >= (int64_t(1) << 30) ||
      g.w >= (int64_t(1) << 30) || g.n >= (int64_t(1) << 30) || g.pad_h < 0 || g.pad_w < 0 ||
      g.pad_h > 64 || g.pad_w > 64) {
    return false;
  }
  const Tiling t = tiling(g, with_mask);
  // tile and position indices are 32-bit in the kernel
  const int64_t tiles = g.n * ((g.p + t.tr - 1) / t.tr);
  if ((t.tr * g.q) % 4 != 0 || t.pw > 256 || t.pr > 256 || t.smem > size_t(kMaxSmem) ||
      tiles >= (int64_t(1) << 31) || g.p * g.q >= (int64_t(1) << 31)) {
    return false;
  }
  return sm90Device() && encoder() != nullptr;
}

bool implicitGemmConvConvertsNchw(const ImplicitGemmConv& g) {
  // rows of whole 16-byte loads; 32-bit box indices
  return (g.h * g.w) % 4 == 0 && g.n * boxesPerImage(g) < (int64_t(1) << 31);
}

int64_t implicitGemmConvWorkspaceWords(const ImplicitGemmConv& g) {
  return g.n + 2;  // the next box, the furthest image reached, a count per image
}

namespace {

// source: x nchw, converted by the kernel into o.x (lookahead resolved), or
// null.
template <int kN, Epilogue kE>
bool launch(
    const ConvReluAddOperands& o,
    const ImplicitGemmConv& g,
    cudaStream_t stream,
    const ImplicitGemmNchwInput* source) {
  const float *x = o.x, *weight = o.weight;
  float* const out = o.out;
  const Tiling t = tiling(g, kE == Epilogue::kReluMask);
  CUtensorMap x_map, w_map, out_map;
  const cuuint64_t x_dims[4] = {cuuint64_t(g.c), cuuint64_t(g.w), cuuint64_t(g.h), cuuint64_t(g.n)};
  const cuuint64_t x_strides[3] = {cuuint64_t(g.c) * 4, cuuint64_t(g.w * g.c) * 4,
                                   cuuint64_t(g.h * g.w * g.c) * 4};
  const cuuint32_t x_box[4] = {32, cuuint32_t(t.pw), cuuint32_t(t.pr), 1};
  const int64_t k_total = g.r * g.s * g.c;
  const cuuint64_t w_dims[2] = {cuuint64_t(k_total), cuuint64_t(g.k)};
  const cuuint64_t w_strides[1] = {cuuint64_t(k_total) * 4};
  const cuuint32_t w_box[2] = {32, kN};
  const int64_t positions = g.p * g.q;
  const cuuint64_t out_dims[3] = {cuuint64_t(positions), cuuint64_t(g.k), cuuint64_t(g.n)};
  const cuuint64_t out_strides[2] = {cuuint64_t(positions) * 4, cuuint64_t(positions * g.k) * 4};
  const cuuint32_t out_box[3] = {cuuint32_t(t.tr * g.q), kSlice, 1};
  if (!encode(&x_map, x, 4, x_dims, x_strides, x_box, CU_TENSOR_MAP_SWIZZLE_128B) ||
      !encode(&w_map, weight, 2, w_dims, w_strides, w_box, CU_TENSOR_MAP_SWIZZLE_128B) ||
      !encode(&out_map, out, 3, out_dims, out_strides, out_box, CU_TENSOR_MAP_SWIZZLE_NONE)) {
    return false;
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const auto kernel = implicitGemmKernel<kN, kE>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem) !=
      cudaSuccess) {
    return false;
  }
  const int64_t tiles = g.n * ((g.p + t.tr - 1) / t.tr);
  uint32_t* workspace = nullptr;
  if (source != nullptr) {
    workspace = source->workspace;
    cudaMemsetAsync(workspace, 0, implicitGemmConvWorkspaceWords(g) * 4, stream);
  }
  const int blocks = int(std::min<int64_t>(tiles, std::max(sms, 1)));
  kernel<<<blocks, kThreads, t.smem, stream>>>(
      x_map, w_map, out_map, o.bias, o.other, o.alpha, o.mask,
      source != nullptr ? source->x : nullptr, const_cast<float*>(x), workspace,
      source != nullptr ? source->lookahead : 0, g, t);
  return true;
}

// The tile width for g: the kernel's instances with epilogue kE.
template <Epilogue kE>
bool launchTiled(
    const ConvReluAddOperands& o,
    const ImplicitGemmConv& g,
    cudaStream_t stream,
    const ImplicitGemmNchwInput* source) {
  return tileChannels(g) == 64 ? launch<64, kE>(o, g, stream, source)
                               : launch<128, kE>(o, g, stream, source);
}

// The epilogue: with the mask where o.mask is not null.
bool launchReluAdd(
    const ConvReluAddOperands& o,
    const ImplicitGemmConv& g,
    cudaStream_t stream,
    const ImplicitGemmNchwInput* source) {
  return o.mask != nullptr ? launchTiled<Epilogue::kReluMask>(o, g, stream, source)
                           : launchTiled<Epilogue::kRelu>(o, g, stream, source);
}

}  // namespace

bool implicitGemmConvReluAdd(
    const ConvReluAddOperands& o,
    const ImplicitGemmConv& g,
    cudaStream_t stream) {
  return launchReluAdd(o, g, stream, nullptr);
}

bool implicitGemmConvReluAddFromNchw(
    const ImplicitGemmNchwInput& nchw,
    const ConvReluAddOperands& o,
    const ImplicitGemmConv& g,
    cudaStream_t stream) {
  const ImplicitGemmNchwInput source{
      nchw.x, nchw.workspace, nchw.lookahead > 0 ? nchw.lookahead : kLookahead};
  return launchReluAdd(o, g, stream, &source);
}

bool implicitGemmConv(
    const float* x, const float* weight, float* out, const ImplicitGemmConv& g, cudaStream_t stream) {
  const ConvReluAddOperands o{x, weight, nullptr, nullptr, 0.f, out, nullptr};
  return launchTiled<Epilogue::kNone>(o, g, stream, nullptr);
}

}  // namespace torchfuse::kernels
