#pragma once

// The reductions over each channel's elements: the training statistics and
// the backward's sums.  Each writes one partial per (split, channel) to the
// workspace, which a per-channel kernel (channels.cuh) merges.

#include <cuda_runtime_api.h>

#include "kernels/batch_norm/math.cuh"
#include "kernels/batch_norm/plan.cuh"

namespace torchfuse::kernels::batch_norm {

// NB: both reductions accumulate in float64 from the thread level on.
// - The backward's sums cancel heavily (g_bn is signed), and the gradient of
//   a one-element `other` sums g_bn over every element: float32
//   accumulators lost enough digits there to exceed eager's error against
//   float64.  Each thread adds the sum of its kUnroll-row chunk (ChunkAcc).
// - The statistics merge each thread's chunks (shifted mean and m2, see
//   ChunkAcc) into a float64 Welford state.  A float32 state and float32
//   partials left the running mean several float32 roundings off, more than
//   2x eager's error on some small batches.
using ReduceAcc = double;

// kBwd == false: shifted Welford (mean, m2) of x per (split, channel) into
// (part0, part1).  kBwd == true: (sum g_bn, sum g_bn * xhat) from g and x,
// with the coefficients the per-channel kernels wrote to coef.  V: elements
// per vector access (1, or maxVec<T>() where every pointer is aligned).
template <typename T, int V, bool kBwd>
void launchReduce(
    const Plan& p,
    BnShape s,
    const T* x,
    const T* g,
    const float* coef,
    SwishGradArgs ga,
    ReduceAcc* part0,
    ReduceAcc* part1,
    cudaStream_t stream);

} // namespace torchfuse::kernels::batch_norm
