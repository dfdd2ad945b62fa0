#pragma once

// The cost model of ConvertToChannelsLast, for tests.

#include <torch/csrc/jit/ir/ir.h>

#include <memory>
#include <optional>

namespace torchfuse::passes {

// The ratio of the region's estimated convolution time channels-last to
// NCHW (Inductor's decide_layout_opt multipliers; <= 1: channels-last
// wins), whatever the weights' device; nullopt when nothing would convert.
std::optional<double> channelsLastFlopRatio(std::shared_ptr<torch::jit::Graph>& graph);

} // namespace torchfuse::passes
