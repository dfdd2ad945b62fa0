#pragma once

// The per-channel kernels, one thread per channel: they merge the
// reductions' split partials in float64 (in a fixed order, so the results
// are deterministic), update the running statistics, write the parameter
// gradients and derive the coefficients the elementwise passes read.  Many
// splits (narrow channels: up to one per block of the reduction) are first
// merged by a kernel with more threads per channel: one thread walking a
// thousand splits took longer than the reduction itself.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/batch_norm/batch_norm_add_div_swish.cuh"
#include "kernels/batch_norm/plan.cuh"

namespace torchfuse::kernels::batch_norm {

// The statistics reduction's partials in w, merged into fewer splits where
// there are many (see the top of this file).
StatsPartials mergeStatsPartials(const Workspace& w, const Plan& p, int64_t c, cudaStream_t stream);

// The same for the backward sums' partials; returns the splits left.
int64_t mergeSumPartials(const Workspace& w, const Plan& p, int64_t c, cudaStream_t stream);

// Training forward: the batch statistics from the statistics reduction's
// partials sp, the running-statistics update, save_mean / save_invstd (each
// may be null) and the coefficients into coef.
template <typename T>
void launchTrainStatsFinalize(
    const BnForward<T>& f,
    const BnTrainStats& s,
    StatsPartials sp,
    float* coef,
    cudaStream_t stream);

// A float32 training backward's mu_lo (the low part of the float64 batch
// mean) from the statistics reduction's partials.
void launchMeanLo(
    const float* x,
    StatsPartials sp,
    int64_t c,
    int64_t l,
    float* coef,
    cudaStream_t stream);

// The coefficients from given statistics: invstd given, or 1/sqrt(var + eps)
// where is_var.
void launchCoefFromStats(
    int64_t c,
    BnChannelRef mean,
    BnChannelRef var_or_invstd,
    bool is_var,
    double eps,
    const BnAffine& aff,
    float* coef,
    cudaStream_t stream);

// The backward sums' partials merged: the parameter gradients, the sums
// (kSumG, kQ64, kR64) and the coefficients kQ, kR.  m = n * l.
void launchBackwardSumsFinalize(
    const double* part0,
    const double* part1,
    int64_t c,
    int64_t splits,
    int64_t m,
    const BnParamGrads& grads,
    bool other_per_channel,
    double* sums,
    float* coef,
    cudaStream_t stream);

// out[0] = the sum of channel_sum[0, c), by one block in a fixed order.
void launchSumChannels(const double* channel_sum, int64_t c, BnChannelMut out, cudaStream_t stream);

} // namespace torchfuse::kernels::batch_norm
