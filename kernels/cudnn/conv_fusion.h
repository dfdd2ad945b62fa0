#pragma once

// One 2-d convolution and its pointwise epilogue as one cuDNN graph (the
// graph API's runtime fusion, built with cudnn-frontend):
//
//   y = act(conv(x, w) + bias[k] + alpha * other)
//
// x, w, other and y channels-last (NHWC, KRSC), fully packed; float32,
// float16 or bfloat16 in and out, float32 inside, rounded once.  Raw device
// pointers, a cuDNN handle already bound to the stream; no torch types, so
// the frontend's headers stay in this file's .cpp.

#include <cudnn.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/common/activation.h"

namespace torchfuse::kernels::cudnn {

enum class FusionDtype { kFloat32, kFloat16, kBFloat16 };

struct ConvFusionProblem {
  FusionDtype dtype = FusionDtype::kFloat32;
  int64_t n = 0, c = 0, h = 0, w = 0; // x
  int64_t k = 0, r = 0, s = 0;        // w: [k, c / groups, r, s]
  int64_t p = 0, q = 0;               // y: [n, k, p, q]
  std::array<int64_t, 2> stride{1, 1}, padding{0, 0}, dilation{1, 1};
  int64_t groups = 1;
  bool has_bias = false;
  bool has_other = false;
  float alpha = 1.f; // other's factor
  Activation act;
};

struct ConvFusionPointers {
  const void* x = nullptr;
  const void* w = nullptr;
  const void* bias = nullptr;  // has_bias
  const void* other = nullptr; // has_other
  void* y = nullptr;
};

// Whether the graph can express `act` with eager's values: NaN stays NaN
// (cuDNN's RELU_FWD and its clipped form keep it; its MAX and MIN would not,
// so nothing here uses them).
bool expressible(const Activation& act);

// The graph of one problem and the plans built for it.  Not thread-safe:
// the caller serializes calls on one instance.
class ConvFusion {
 public:
  // Builds the graph and up to `max_plans` of cuDNN's heuristic plans whose
  // workspace is at most `max_workspace` bytes: never one that
  // down-converts its inputs and, for float32, none that uses tensor cores.
  // NB: float32 plans are IEEE even where cuDNN's TF32 flag is on: the
  // fused TF32 engines round differently from eager's (resnet50's stem on
  // an H200: 3.2x eager's TF32 error against float64), which the accuracy
  // rule does not allow.
  // nullptr where cuDNN supports no plan for it or the activation is not
  // expressible; never throws for an unsupported problem.
  static std::unique_ptr<ConvFusion> create(
      const ConvFusionProblem& problem,
      cudnnHandle_t handle,
      int max_plans,
      int64_t max_workspace);
  ~ConvFusion();
  ConvFusion(const ConvFusion&) = delete;
  ConvFusion& operator=(const ConvFusion&) = delete;

  int plans() const;
  int64_t workspaceBytes(int plan) const;
  const std::string& planName(int plan) const;
  // Enqueues plan `plan` on the handle's stream; false where cuDNN refused
  // to launch it.
  bool run(int plan, const ConvFusionPointers& ptrs, void* workspace, cudnnHandle_t handle) const;

 private:
  struct Impl;
  explicit ConvFusion(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

} // namespace torchfuse::kernels::cudnn
