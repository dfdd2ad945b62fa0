#pragma once

// The elementwise passes: the forward's output and the backward's dx, from
// the per-channel coefficients in the workspace.  nvec = n * c * l / V
// vectors of V elements (1, or maxVec<T>() where every pointer is aligned).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/batch_norm/math.cuh"

namespace torchfuse::kernels::batch_norm {

// Which dx launchApplyBackward writes.
enum class BwdOut { kTrainDx, kEvalDx };

// out = t * sigmoid(t), t = (x - mu) * a + k.
template <typename T, int V>
void launchApplyForward(
    const T* x,
    T* out,
    int64_t nvec,
    int64_t c,
    int64_t l,
    const float* coef,
    cudaStream_t stream);

// dx = p * (g_bn - q - xhat * r) (training) or p * g_bn (eval).
template <typename T, int V, BwdOut kOut>
void launchApplyBackward(
    const T* g,
    const T* x,
    T* dx,
    int64_t nvec,
    int64_t c,
    int64_t l,
    const float* coef,
    const double* sums,
    SwishGradArgs ga,
    cudaStream_t stream);

} // namespace torchfuse::kernels::batch_norm
