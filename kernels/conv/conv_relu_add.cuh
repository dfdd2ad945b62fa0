#pragma once

// The elementwise passes around eager's convolution for
// custom_conv_relu_add, on raw device pointers.  No dispatcher headers here:
// ops/cuda/conv_relu_add_kernel.cpp checks arguments, picks the stream and
// maps dtypes.
//
// Shapes: N images, C channels, S spatial positions (the product of the
// spatial sizes).  "nchw" is [N][C][S] (contiguous), "nhwc" is [N][S][C]
// (channels-last).
//
// Mask orders (defined, and chosen per convolution, in ops/conv_relu_add.h):
//   positions-inner: bit i % 32 of word i / 32 is !(t <= 0) for element
//     i = (n * C + c) * S + s, no padding: nchw memory order;
//   channels-inner: bit c % 32 of word (n * S + s) * ceil(C / 32) + c / 32,
//     each position's channels padded to whole words: nhwc memory order.
// The positions-inner passes stream nchw tensors with their mask unstaged;
// the channels-inner ones stage nchw tensors through shared-memory tiles.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels {

// The epilogue's operands, from the conv output `conv` (n x c x s):
//   t = conv + bias[c];  out = (t <= 0 ? 0 : t) + alpha * other[c]
// and the relu mask of t.  bias, other (C values each) and mask may be null.
template <typename T>
struct ConvEpilogueArgs {
  const T* conv;
  const T* bias;
  const T* other;
  float alpha;
  T* out;
  uint32_t* mask;
  int64_t n, c, s;
};

// The grad prologue's operands, from grad_output `dy` (n x c x s) and the
// relu mask: g = mask ? dy : 0, and per-channel partial sums of g and of dy
// into sum_g and sum_dy (either may be null).
template <typename T>
struct ConvGradArgs {
  const T* dy;
  const uint32_t* mask;
  T* g;
  double* sum_g;
  double* sum_dy;
  int64_t n, c, s;
};

// ---- positions-inner mask, nchw tensors: unstaged streaming passes
// (positions_inner.cu).

// The epilogue in one pass over nchw conv and out, with the positions-inner
// mask.  out may be conv; mask must be 4-byte aligned.  16-byte loads and
// stores where conv and out are 16-byte aligned, else scalar ones.
template <typename T>
void convReluAddEpiloguePositionsInner(const ConvEpilogueArgs<T>& a, cudaStream_t stream);

// Partial sums convReluAddGradProloguePositionsInner writes: `parts` rows of
// C doubles each.  n <= 65535.
int64_t convReluAddGradPartsPositionsInner(int64_t n, int64_t c, int64_t s);

// The grad prologue in one pass over nchw dy and g, with the positions-inner
// mask; convReluAddGradPartsPositionsInner rows of C partial sums each.
// n <= 65535; mask 4-byte aligned.  16-byte loads and stores where dy and g
// are 16-byte aligned and S is a multiple of 16 bytes' worth of elements,
// else scalar ones.
template <typename T>
void convReluAddGradProloguePositionsInner(const ConvGradArgs<T>& a, cudaStream_t stream);

// ---- channels-inner mask: one warp ballot per word, nchw tensors staged
// through shared-memory tiles (channels_inner.cu).

// As convReluAddEpiloguePositionsInner, with the channels-inner mask and
// `conv`/`out` nchw when nchw, else nhwc.
template <typename T>
void convReluAddEpilogueChannelsInner(const ConvEpilogueArgs<T>& a, bool nchw, cudaStream_t stream);

// Partial sums convReluAddGradPrologueChannelsInner writes: `parts` rows of
// C doubles each.
int64_t convReluAddGradPartsChannelsInner(int64_t n, int64_t c, int64_t s);

// As convReluAddGradProloguePositionsInner, with the channels-inner mask, dy
// nchw when dy_nchw, else nhwc, and g nchw when g_nchw, else nhwc.
template <typename T>
void convReluAddGradPrologueChannelsInner(
    const ConvGradArgs<T>& a,
    bool dy_nchw,
    bool g_nchw,
    cudaStream_t stream);

// ---- the channels-last route for nchw inputs (transposes.cu;
// docs/kernels/conv_relu_add.md): the convolution and its gradients run
// channels-last; these passes convert around them through shared-memory
// tiles, with 16-byte accesses on both sides where extents and alignment
// allow.

// dst[b][j][i] = src[b][i][j] for b < batch, i < rows, j < cols: nchw to
// nhwc with rows = C and cols = S, nhwc to nchw with rows = S and cols = C.
template <typename T>
struct TransposeArgs {
  const T* src;
  T* dst;
  int64_t batch, rows, cols;
};

template <typename T>
void transposeBatched(const TransposeArgs<T>& a, cudaStream_t stream);

// transposeBatched for float32, each value rounded to TF32 on the way
// (nearest, ties away from zero): the inputs of the implicit-GEMM
// convolution (implicit_gemm_sm90.cuh), whose MMAs would truncate them.
void transposeBatchedTf32(const TransposeArgs<float>& a, cudaStream_t stream);

// The relu's gradient of an nchw conv output for a channels-last
// convolution backward, in one pass: the grad prologue with dy nchw
// [n][c][s], mask in the output's logical (nchw) order, g written nhwc
// [n][s][c], rounded to TF32 (as transposeBatchedTf32) when tf32.  g must
// not overlap dy.  The partial sums (at least
// convReluAddGradNchwToNhwcParts(n, c, s) rows of c each) are of the
// unrounded g (the bias gradient) and of dy, one row of c per block of
// positions; returns the rows written.
int64_t convReluAddGradNchwToNhwcParts(int64_t n, int64_t c, int64_t s);

template <typename T>
int64_t convReluAddGradNchwToNhwc(const ConvGradArgs<T>& a, bool tf32, cudaStream_t stream);

// The epilogue in one pass from the nhwc conv output, out written nchw; no
// mask (a.mask is not read).  out must not overlap conv.
template <typename T>
void convReluAddEpilogueNhwcToNchw(const ConvEpilogueArgs<T>& a, cudaStream_t stream);

} // namespace torchfuse::kernels
