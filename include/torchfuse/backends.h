#pragma once

// Process-wide choices of the torchfuse kernels that users may override, in
// the style of at::globalContext()'s cuDNN flags (Python:
// torchfuse.backends.conv / torchfuse.backends.matmul, docs/options.md).
// Thread-safe: each option is one atomic; a kernel call reads each option it
// needs once, when it picks its plan, so a change applies to later calls.
// NB: options, not environment variables: a program states its choices in
// code, and tests set and restore them in-process.

#include <atomic>

#include "torchfuse/export.h"

namespace torchfuse::backends {

// Whether custom_conv_relu_add on CUDA converts a large float32 NCHW
// convolution to channels-last (cuDNN's channels-last convolution or the
// sm_90 implicit-GEMM kernel, then one pass back to NCHW with the epilogue).
enum class ChannelsLastRoute {
  kAuto,   // where eager's own convolution is TF32 and the output has >= 2^24 elements
  kNever,  // never: eager's convolution and one epilogue pass
  kAlways, // wherever the route's kernels apply, whatever the size or
           // precision: forces the strategy, for tests and measurements
};

// How the implicit-GEMM kernel gets x in NHWC.
enum class NchwConversion {
  kAuto,     // inside the kernel, on its idle warps, where TMA can read x
  kSeparate, // a pass of its own before the kernel: forces the strategy,
             // for tests and measurements
};

// Whether custom_conv_add_act on CUDA runs its convolution and epilogue as
// one cuDNN graph (runtime fusion) instead of eager's convolution and one
// epilogue pass.
enum class CudnnFusion {
  kAuto,   // the first call of each problem times cuDNN's fused plans against
           // the convolution and epilogue, and keeps the fastest
  kNever,  // never
  kAlways, // wherever cuDNN has a plan, untimed: forces the strategy, for
           // tests and measurements
};

class TORCHFUSE_API ConvOptions {
 public:
  ChannelsLastRoute channelsLastRoute() const noexcept;
  void setChannelsLastRoute(ChannelsLastRoute route);

  // The sm_90 implicit-GEMM kernel may run the channels-last route's
  // convolution, its training forward and its input gradient (default
  // true; false: cuDNN's).
  bool allowImplicitGemm() const noexcept;
  void setAllowImplicitGemm(bool allow) noexcept;

  // The direct convolution may run the inference forward of small float32
  // convolutions with few channels (default true; false: cuDNN's).
  bool allowDirect() const noexcept;
  void setAllowDirect(bool allow) noexcept;

  NchwConversion nchwConversion() const noexcept;
  void setNchwConversion(NchwConversion conversion);

  // How many images ahead of the convolution the in-kernel conversion may
  // run: 0 (the default) lets the kernel choose; 1 to 64 force a lookahead,
  // for tests and measurements.  Raises for any other value.
  int conversionLookahead() const noexcept;
  void setConversionLookahead(int images);

  CudnnFusion cudnnFusion() const noexcept;
  void setCudnnFusion(CudnnFusion fusion);

 private:
  std::atomic<int> channels_last_route_{static_cast<int>(ChannelsLastRoute::kAuto)};
  std::atomic<bool> allow_implicit_gemm_{true};
  std::atomic<bool> allow_direct_{true};
  std::atomic<int> nchw_conversion_{static_cast<int>(NchwConversion::kAuto)};
  std::atomic<int> conversion_lookahead_{0};
  std::atomic<int> cudnn_fusion_{static_cast<int>(CudnnFusion::kAuto)};
};

class TORCHFUSE_API MatmulOptions {
 public:
  // The first call of each cuBLASLt problem times the heuristic's candidate
  // algorithms and keeps the fastest (default true; false: the heuristic's
  // first choice, no timing).  Plans are kept per problem and setting, so
  // one problem under one setting always runs one algorithm.
  bool autotune() const noexcept;
  void setAutotune(bool autotune) noexcept;

 private:
  std::atomic<bool> autotune_{true};
};

// The process-wide instances.
TORCHFUSE_API ConvOptions& conv();
TORCHFUSE_API MatmulOptions& matmul();

} // namespace torchfuse::backends
