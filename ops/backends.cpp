#include "torchfuse/backends.h"

#include <c10/util/Exception.h>

namespace torchfuse::backends {

ChannelsLastRoute ConvOptions::channelsLastRoute() const noexcept {
  return static_cast<ChannelsLastRoute>(channels_last_route_.load());
}

void ConvOptions::setChannelsLastRoute(ChannelsLastRoute route) {
  const int value = static_cast<int>(route);
  TORCH_CHECK(
      value >= 0 && value <= static_cast<int>(ChannelsLastRoute::kAlways),
      "torchfuse::backends::ConvOptions::setChannelsLastRoute: expected kAuto, kNever or "
      "kAlways, got ",
      value);
  channels_last_route_.store(value);
}

bool ConvOptions::allowImplicitGemm() const noexcept {
  return allow_implicit_gemm_.load();
}

void ConvOptions::setAllowImplicitGemm(bool allow) noexcept {
  allow_implicit_gemm_.store(allow);
}

bool ConvOptions::allowDirect() const noexcept {
  return allow_direct_.load();
}

void ConvOptions::setAllowDirect(bool allow) noexcept {
  allow_direct_.store(allow);
}

NchwConversion ConvOptions::nchwConversion() const noexcept {
  return static_cast<NchwConversion>(nchw_conversion_.load());
}

void ConvOptions::setNchwConversion(NchwConversion conversion) {
  const int value = static_cast<int>(conversion);
  TORCH_CHECK(
      value >= 0 && value <= static_cast<int>(NchwConversion::kSeparate),
      "torchfuse::backends::ConvOptions::setNchwConversion: expected kAuto or kSeparate, got ",
      value);
  nchw_conversion_.store(value);
}

int ConvOptions::conversionLookahead() const noexcept {
  return conversion_lookahead_.load();
}

void ConvOptions::setConversionLookahead(int images) {
  TORCH_CHECK(
      images >= 0 && images <= 64,
      "torchfuse::backends::ConvOptions::setConversionLookahead: expected images to be 0 (the "
      "kernel's choice) or from 1 to 64, got ",
      images);
  conversion_lookahead_.store(images);
}

CudnnFusion ConvOptions::cudnnFusion() const noexcept {
  return static_cast<CudnnFusion>(cudnn_fusion_.load());
}

void ConvOptions::setCudnnFusion(CudnnFusion fusion) {
  const int value = static_cast<int>(fusion);
  TORCH_CHECK(
      value >= 0 && value <= static_cast<int>(CudnnFusion::kAlways),
      "torchfuse::backends::ConvOptions::setCudnnFusion: expected kAuto, kNever or kAlways, got ",
      value);
  cudnn_fusion_.store(value);
}

bool MatmulOptions::autotune() const noexcept {
  return autotune_.load();
}

void MatmulOptions::setAutotune(bool autotune) noexcept {
  autotune_.store(autotune);
}

ConvOptions& conv() {
  static ConvOptions options;
  return options;
}

MatmulOptions& matmul() {
  static MatmulOptions options;
  return options;
}

} // namespace torchfuse::backends
