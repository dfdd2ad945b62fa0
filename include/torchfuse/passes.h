#pragma once

// The fusion passes.  Each rewrites one chain in a graph and every sub-block
// of it, returns how many chains it fused, and leaves anything it does not
// fully understand unchanged (it never throws on a foreign graph).

#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/ir/ir.h>

#include <cstdint>
#include <memory>

#include "torchfuse/export.h"

namespace torchfuse::passes {

// Normalizes graphs for the fusions: traced aten::_convolution -> conv{1,2,3}d,
// relu_ on fresh unaliased tensors -> relu.
TORCHFUSE_API void Canonicalize(std::shared_ptr<torch::jit::Graph>& graph);
// After the fusions: turns the relus Canonicalize made from relu_ and no
// fusion took back into relu_.  Returns how many.
TORCHFUSE_API int64_t RestoreInPlace(std::shared_ptr<torch::jit::Graph>& graph);
// Replaces aten::scaled_dot_product_attention calls (not causal, no
// dropout) whose attn_mask the graph proves a boolean mask true everywhere
// (transformers traces such masks) by torchfuse::custom_unmasked_attention:
// ATen's fused attention kernels take no such mask.  Returns how many.
TORCHFUSE_API int64_t DropAllTrueAttentionMasks(std::shared_ptr<torch::jit::Graph>& graph);
// Replaces dropouts (aten::dropout, feature_, alpha_ and feature_alpha_
// dropout, in-place forms too) of constant probability 0 by their input, as
// ATen computes them; TorchScript's autodiff would run them as
// native_dropout, whose CUDA kernel drops some elements even at p = 0.
// A dropout of run-time p or train whose result is written in place becomes
// prim::If(p == 0 or not train) of its input or itself, so that the write,
// one to the input where ATen returns it, is not taken for a dead one.
// Returns how many were removed.
TORCHFUSE_API int64_t RemoveZeroDropouts(std::shared_ptr<torch::jit::Graph>& graph);

// linear -> add -> relu  =>  torchfuse::custom_linear_add_relu
TORCHFUSE_API int64_t FuseLinearAddRelu(std::shared_ptr<torch::jit::Graph>& graph);
// conv{1,2,3}d -> relu -> add  =>  torchfuse::custom_conv_relu_add
TORCHFUSE_API int64_t FuseConvReluAdd(std::shared_ptr<torch::jit::Graph>& graph);
// conv{1,2,3}d -> [activation] -> max_pool2d
//   =>  torchfuse::custom_conv_act_max_pool
TORCHFUSE_API int64_t FuseConvActMaxPool(std::shared_ptr<torch::jit::Graph>& graph);
// squeeze -> conv -> act -> conv -> sigmoid/hardsigmoid -> mul (the SE gate)
//   =>  torchfuse::custom_gate_mul
TORCHFUSE_API int64_t FuseGateMul(std::shared_ptr<torch::jit::Graph>& graph);
// conv{1,2,3}d -> [add] -> [activation] (at least one of them)
//   =>  torchfuse::custom_conv_add_act
TORCHFUSE_API int64_t FuseConvAddAct(std::shared_ptr<torch::jit::Graph>& graph);
// conv{1,2,3}d -> batch_norm (not constant training) -> [activation]
//   =>  torchfuse::custom_conv_batch_norm_act
TORCHFUSE_API int64_t FuseConvBatchNormAct(std::shared_ptr<torch::jit::Graph>& graph);
// linear -> activation (and optimize_for_inference's matmul of a linear
// without bias -> activation)  =>  torchfuse::custom_linear_act
TORCHFUSE_API int64_t FuseLinearAct(std::shared_ptr<torch::jit::Graph>& graph);
// add / add_ (into a fresh tensor) -> layer_norm, the sum used by the norm
// only or also later  =>  torchfuse::custom_add_layer_norm
TORCHFUSE_API int64_t FuseAddLayerNorm(std::shared_ptr<torch::jit::Graph>& graph);
// batch_norm -> add -> div -> x*sigmoid(x) | silu
//   =>  torchfuse::custom_batch_norm_add_div_swish (or its _eval form)
TORCHFUSE_API int64_t FuseBatchNormAddDivSwish(std::shared_ptr<torch::jit::Graph>& graph);
// a standalone relu / relu_  =>  torchfuse::custom_relu; runs last.
TORCHFUSE_API int64_t ReplaceRelu(std::shared_ptr<torch::jit::Graph>& graph);

// Frozen graphs, after the fusions: where custom_conv_add_act's `other` is
// a convolution with a constant bias that only it reads, moves that bias
// into the op's constant bias (b1 + alpha * b2) and drops it from the
// convolution (docs/passes.md).  Returns how many it folded.
TORCHFUSE_API int64_t FoldResidualConvBias(std::shared_ptr<torch::jit::Graph>& graph);

// Frozen graphs: stores the constant weights of 2-d convolutions
// channels-last, so that the convolutions and the layout-agnostic ops after
// them run NHWC, and gives every value leaving that region the memory format
// the original gives it (torchfuse::custom_restore_layout).  Without
// `force`, only where the cost model (docs/passes.md) says channels-last is
// faster, and only for CUDA weights.  Returns how many weights it converted;
// 0 leaves the graph unchanged.
TORCHFUSE_API int64_t
ConvertToChannelsLast(std::shared_ptr<torch::jit::Graph>& graph, bool force = false);

// Unfrozen graphs of `module`'s forward, whose weights are its attributes:
// the region's first convolution reads its weight through
// torchfuse::custom_channels_last_weight, which converts it on each call
// where the input and every region weight suggest NCHW, so that the region
// runs NHWC; its values leave it through custom_restore_layout(v, weight,
// converted).  With `force` (optimize's layout=ChannelsLast) on any device
// and every call; without (layout=Auto) only where the cost model says
// channels-last is faster for CUDA weights, and then on each CUDA call site
// as its measured choice decides: the per-call conversions cost host time
// the cost model does not see (docs/passes.md).  Returns how many
// convolutions the region holds; 0 leaves the graph unchanged.
TORCHFUSE_API int64_t ConvertToChannelsLastUnfrozen(
    std::shared_ptr<torch::jit::Graph>& graph,
    const torch::jit::Module& module,
    bool force = true);

} // namespace torchfuse::passes
