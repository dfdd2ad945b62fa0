// The one table of fusions.  NB: the order is the pipeline's: the chain
// fusions first (the conv chain before linear, so neither takes the other's
// relu), ReplaceRelu last, so it only takes relus no chain claimed.
// ReplaceRelu runs only when named.

#include "torchfuse/registry.h"

#include "torchfuse/passes.h"

namespace torchfuse {

const std::vector<Fusion>& fusions() {
  static const std::vector<Fusion> table = {
      {"conv_relu_add",
       "conv{1,2,3}d → relu → add",
       {"torchfuse::custom_conv_relu_add"},
       &passes::FuseConvReluAdd,
       true},
      {"linear_add_relu",
       "linear → add → relu",
       {"torchfuse::custom_linear_add_relu"},
       &passes::FuseLinearAddRelu,
       true},
      {"batch_norm_add_div_swish",
       "batch_norm → add → div → x*sigmoid(x)",
       {"torchfuse::custom_batch_norm_add_div_swish",
        "torchfuse::custom_batch_norm_add_div_swish_eval"},
       &passes::FuseBatchNormAddDivSwish,
       true},
      // NB: before conv_add_act, which would take its conv -> act link and
      // leave the pool on its own.
      {"conv_act_max_pool",
       "conv{1,2,3}d → [activation] → max_pool2d",
       {"torchfuse::custom_conv_act_max_pool"},
       &passes::FuseConvActMaxPool,
       true},
      // NB: before conv_add_act, which would take the gate's activation into
      // the excitation conv's epilogue and leave the broadcast multiply.
      {"gate_mul",
       "squeeze → conv → act → conv → sigmoid/hardsigmoid → mul (the SE gate)",
       {"torchfuse::custom_gate_mul"},
       &passes::FuseGateMul,
       true},
      // NB: after the seed chains, so that each keeps its own: conv -> relu
      // -> add, and an add of a conv output into batch_norm -> add -> div.
      {"conv_add_act",
       "conv{1,2,3}d → [add] → [activation]",
       {"torchfuse::custom_conv_add_act"},
       &passes::FuseConvAddAct,
       true},
      // NB: after batch_norm_add_div_swish, whose chain starts at the
      // batch_norm.
      {"conv_batch_norm_act",
       "conv{1,2,3}d → batch_norm (unfrozen) → [activation]",
       {"torchfuse::custom_conv_batch_norm_act"},
       &passes::FuseConvBatchNormAct,
       true},
      // NB: after linear_add_relu, which keeps linear -> add -> relu; it
      // leaves add -> layer_norm to add_layer_norm (sumIsLayerNormed).
      {"linear_act",
       "linear → [add] → activation, linear → add (also a constant-weight matmul → activation)",
       {"torchfuse::custom_linear_act"},
       &passes::FuseLinearAct,
       true},
      // NB: last of the chains: it takes only add -> layer_norm, and leaves
      // every chain that ends in an add (conv -> add, conv -> relu -> add)
      // to its own fusion.
      {"add_layer_norm",
       "add → layer_norm (the sum also returned where other ops read it)",
       {"torchfuse::custom_add_layer_norm"},
       &passes::FuseAddLayerNorm,
       true},
      {"relu",
       "a standalone relu",
       {"torchfuse::custom_relu"},
       &passes::ReplaceRelu,
       // NB: one elementwise op for another moves the same bytes, and on
       // CUDA it splits the NNC fusion group the relu would have joined.
       false},
  };
  return table;
}

} // namespace torchfuse
