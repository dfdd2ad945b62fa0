#pragma once

// batch_norm -> add -> div -> swish kernels on raw device pointers.  No
// dispatcher headers here: ops/cuda/batch_norm_add_div_swish_kernel.cpp checks
// the arguments, picks the stream, allocates the workspace and maps dtypes.
//
// The input is dense and viewed as (n, c, l) in memory order: a contiguous
// (N, C) input is l = 1, a contiguous (N, C, *) one has l = prod(*), a
// channels-last one is (N * prod(*), C, 1).  Elementwise arithmetic and the
// forward statistics are float32 whatever T is; the backward's sums
// accumulate in float64, and per-channel finishing steps run in float64.
//
//   t   = (x - mu_c) * a_c + k_c,   a_c = w_c * invstd_c / d,
//                                   k_c = (b_c + s_c) / d
//   out = t * sigmoid(t)
//
// Backward (s' = sigmoid(t), xhat = (x - mu_c) * invstd_c):
//   g_bn  = dout * s' * (1 + t * (1 - s')) / d        (= d out / d (bn + s);
//           silu == false: (dout * s' + dout * t * (1 - s') * s') / d)
//   dw_c  = sum g_bn * xhat,  db_c = sum g_bn
//   dx    = w_c * invstd_c * (g_bn - db_c / M - xhat * dw_c / M)   (training)
//   dx    = w_c * invstd_c * g_bn                                  (eval)
// with M = n * l.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels {

enum class BnDtype : int { kFloat = 0, kHalf = 1, kBFloat16 = 2, kDouble = 3 };

// A per-channel vector on the device: element c is data[c * stride].  A
// stride of 0 broadcasts one value; data == nullptr means absent (weight: 1,
// bias and other: 0).
struct BnChannelRef {
  const void* data = nullptr;
  BnDtype dtype = BnDtype::kFloat;
  int64_t stride = 1;
};

// A contiguous per-channel vector updated in place (running statistics).
struct BnChannelMut {
  void* data = nullptr;
  BnDtype dtype = BnDtype::kFloat;
};

struct BnShape {
  int64_t n = 0;
  int64_t c = 0;
  int64_t l = 0;
};

struct BnAffine {
  BnChannelRef weight;
  BnChannelRef bias;
  BnChannelRef other; // s_c: one value (stride 0) or one per channel
  double divisor = 1.0;
};

// Gradients of the per-channel parameters; data == nullptr means not wanted.
struct BnParamGrads {
  BnChannelMut weight; // sum g_bn * xhat per channel
  BnChannelMut bias;   // sum g_bn per channel
  // sum_to_size(g_bn, other.shape): per channel as bias when affine.other
  // has a non-zero stride, else one value, the sum over all channels.
  BnChannelMut other;
};

// Bytes of device workspace (16-byte aligned) the calls below need for this
// shape, element size and SM count (the same values must be passed to the
// call).
int64_t batchNormSwishWorkspaceBytes(BnShape shape, int elem_size, int num_sms);

// A forward's tensors and workspace: out has x's layout; workspace holds
// batchNormSwishWorkspaceBytes(shape, sizeof(T), num_sms) bytes.
template <typename T>
struct BnForward {
  const T* x;
  T* out;
  BnShape shape;
  BnAffine affine;
  void* workspace;
  int num_sms;
};

// The training forward's statistics: the running statistics updated in
// place (each may be absent), save_mean / save_invstd (float32, each may be
// null).
struct BnTrainStats {
  BnChannelMut running_mean;
  BnChannelMut running_var;
  double momentum;
  double eps;
  float* save_mean;
  float* save_invstd;
};

// Training forward: batch statistics (Welford, float32, merged in float64),
// the running-statistics update
//   rm <- (1 - m) rm + m mu,   rv <- (1 - m) rv + m var * M / (M - 1),
// save_mean / save_invstd and out.
template <typename T>
void batchNormSwishTrainForward(const BnForward<T>& f, const BnTrainStats& s, cudaStream_t stream);

// The eval forward's statistics: the running mean and variance.
struct BnEvalStats {
  BnChannelRef running_mean;
  BnChannelRef running_var;
  double eps;
};

// Eval forward with the running statistics: invstd = 1 / sqrt(rv + eps).
template <typename T>
void batchNormSwishEvalForward(const BnForward<T>& f, const BnEvalStats& s, cudaStream_t stream);

// Backward.  mean / invstd are the saved batch statistics (training) or the
// running mean and 1/sqrt(rv + eps) (eval).  silu: the swish's derivative as
// silu_backward's product (true) or as autograd's sum through
// t * sigmoid(t) (false); they differ where grad_output is infinite.  grad_output has x's layout.
// grad_input (x's layout) is written where not null, the parameter gradients
// where wanted; the sums behind them accumulate in float64 and are reduced in
// a fixed order, so they are deterministic.  float32 (T = float) evaluates
// the per-element terms in float64 and rounds dx once; in training it centres
// x on the float64 batch mean, recomputed as the forward computed it, where
// mean is that mean's float32 rounding.
template <typename T>
struct BnBackward {
  const T* grad_output;
  const T* x;
  BnShape shape;
  BnAffine affine;
  BnChannelRef mean;
  BnChannelRef invstd;
  bool training;
  bool silu;
  T* grad_input;
  BnParamGrads grads;
  void* workspace; // as BnForward's
  int num_sms;
};

template <typename T>
void batchNormSwishBackward(const BnBackward<T>& b, cudaStream_t stream);

} // namespace torchfuse::kernels
