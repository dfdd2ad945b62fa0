#pragma once

// custom_conv_add_act on CUDA as one cuDNN graph (kernels/cudnn/conv_fusion.h):
// the convolution with its bias, residual and activation in the conv kernel's
// epilogue, where torchfuse::backends::conv().cudnnFusion() allows it and, by
// default, where it was the faster on the problem's first call.

#include <ATen/core/Tensor.h>

#include <functional>

#include "kernels/common/activation.h"
#include "ops/conv_add_act.h"

namespace torchfuse::ops::conv_cuda {

// Whether the graph can compute this call as eager would: a batched 2-d
// convolution of float32/float16/bfloat16 CUDA tensors, x and w
// channels-last (so that eager's output is channels-last too), output and
// input unambiguous in layout (more than one channel and position), `other`
// absent or of the output's sizes, strides and dtype with alpha 1, an activation the
// graph expresses with eager's NaN behaviour; cuDNN enabled, and no
// deterministic-algorithm request (the fused engines do not promise it).
bool cudnnFusionApplies(
    const ConvAddActArgs& a,
    const kernels::Activation& act,
    const at::Tensor& other,
    at::IntArrayRef sizes);

// Whether kAuto leaves a problem of `dtype` unfused, untimed: float32 where
// cuDNN may use TF32.  The graph takes IEEE plans only (TF32 plans rounded
// differently from eager's convolution).  Against eager's TF32 convolution
// and one epilogue pass, plans that won alone did not reliably win in whole
// networks: resnet50, vgg16, mobilenet_v3_large and efficientnet_b0 ran at
// 0.98, 1.00, 0.96 and 0.99x in one run, 1.00, 1.00, 1.03 and 1.08x in an
// earlier one on another H200 (bench/cudnn_fusion_ab.py).
bool autoLeavesTf32ConvUnfused(at::ScalarType dtype);

// The call's result by the fused graph, or an undefined tensor where the
// caller is to run `unfused` (its convolution and epilogue): where
// cudnnFusionApplies is false, the option is kNever, kAuto with
// autoLeavesTf32ConvUnfused, cuDNN has no plan, or
// `unfused` was the faster when the problem was first timed.  That first
// call (kAuto) drops the plans whose output differs from `unfused`'s beyond
// rounding, then times the others against `unfused` on the call's own
// tensors and keeps the fastest where it beats `unfused` by more than 3 %; not while the stream
// captures a CUDA graph: then `unfused` runs, and the problem is decided at a later call.  kAlways
// takes cuDNN's first plan, unchecked and untimed.
at::Tensor convAddActCudnnFused(
    const ConvAddActArgs& a,
    const kernels::Activation& act,
    const at::Tensor& other,
    at::IntArrayRef sizes,
    const std::function<at::Tensor()>& unfused);

} // namespace torchfuse::ops::conv_cuda
