#pragma once

// The block shape of the streaming kernels (elementwise passes, reductions,
// transposes).  Kernels whose block shape is part of their algorithm keep
// their own (kernels/conv/direct_conv.cu, kernels/conv/implicit_gemm_sm90.cu).

namespace torchfuse::kernels {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

} // namespace torchfuse::kernels
