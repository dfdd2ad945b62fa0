#pragma once

// The per-channel totals of the partial sums the grad prologues write
// (conv_relu_add.cuh): `parts` rows of C doubles, summed per column in
// double and rounded once to the gradient's dtype, in one launch for both
// the conv bias's and `other`'s gradient.

#include <cuda_runtime.h>

#include <cstdint>

namespace torchfuse::kernels {

// out_a[c] = sum over rows of rows_a[row * channels + c], likewise for b;
// a null rows pointer skips its total.  The order of the additions is
// fixed, so results repeat bit for bit.
template <typename T>
void convGradSumsTotal(
    const double* rows_a,
    const double* rows_b,
    int64_t parts,
    int64_t channels,
    T* out_a,
    T* out_b,
    cudaStream_t stream);

} // namespace torchfuse::kernels
