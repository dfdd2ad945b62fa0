#pragma once

// First-use autotuning: the fastest of a few ways to run one problem, timed on
// the caller's own buffers (cuBLASLt's algorithms, cuDNN's fused plans against
// the unfused convolution).

#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

namespace torchfuse::kernels {

// The index of the fastest of `count` candidates, or -1 where every one
// refused.  `launch(i)` enqueues candidate i on `stream` and returns false
// where it refuses (it is skipped from then on); each candidate's outputs
// are overwritten and its inputs only read.
// NB: the candidates take turns, kRounds times, and each is judged by its
// median round.  A GPU that was idle raises its clocks during the first
// launches; timing each candidate's runs back to back charged that ramp
// (and any drift) to the candidates timed first, so the pick varied from
// process to process.  Each candidate also runs once untimed first (lazy
// kernel loading).  Ties go to the lower index.  Synchronizes with the
// stream: never call it while the stream captures a CUDA graph.
int fastestCandidate(int count, const std::function<bool(int)>& launch, cudaStream_t stream);

// Each candidate's median round in milliseconds, timed as fastestCandidate
// times them; infinity for one that refused.
std::vector<float> medianTimes(
    int count,
    const std::function<bool(int)>& launch,
    cudaStream_t stream);

} // namespace torchfuse::kernels
