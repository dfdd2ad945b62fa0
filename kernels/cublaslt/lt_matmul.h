#pragma once

// One column-major cuBLASLt matmul with an epilogue,
//   D[m, n] = alpha · op(A)[m, k] · op(B)[k, n] + beta · C[m, n]  (+ epilogue),
// with the descriptors, layouts and the chosen algorithm cached per problem.
// Raw pointers only; the caller picks the handle, workspace and stream.
//
// Plan cache: a key holds everything an algorithm depends on (device, types,
// compute type incl. TF32, transposes, sizes, leading dimensions, epilogue,
// pointer alignments, workspace size, autotuning).  On a key's first use the
// heuristic is asked for up to kMaxCandidates algorithms and each is timed on
// the call's own buffers (CUDA events on the call's stream); the fastest is
// kept for the life of the process, so one key always runs one algorithm.
// No timing (the heuristic's first choice) when args.autotune is false (part
// of the key) or when the stream is being captured into a CUDA graph.
// Thread-safe.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace torchfuse::kernels {

enum class GemmDtype { kFloat32, kFloat16, kBFloat16 };

enum class LtEpilogue {
  kDefault,  // no epilogue
  kBias,     // + bias[i] on row i of D
  kBGradB,   // bias_grad[j] = Σ_k op(B)[k, j] (a gradient output)
};

struct LtMatmulArgs {
  GemmDtype dtype;  // of A, B, C and D
  // float32 only: CUBLAS_COMPUTE_32F_FAST_TF32 instead of CUBLAS_COMPUTE_32F.
  bool allow_tf32 = false;
  bool trans_a = false;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;  // column-major, ld >= rows as stored
  int64_t lda = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  const void* c = nullptr;  // null: beta = 0 and C is not read
  int64_t ldc = 0;
  void* d = nullptr;  // must not alias a, b or c
  int64_t ldd = 0;
  float alpha = 1.0f;
  float beta = 0.0f;
  LtEpilogue epilogue = LtEpilogue::kDefault;
  // kBias: the bias vector (m entries), read; kBGradB: the gradient (n
  // entries), written.  Stored in float32 when bias_fp32, else in dtype.
  void* bias = nullptr;
  bool bias_fp32 = false;
  void* workspace = nullptr;
  size_t workspace_size = 0;
  // Time the heuristic's candidates on a key's first use (the caller's
  // torchfuse::backends::matmul().autotune()).
  bool autotune = true;
  // The split-K reduction schemes allowed (CUBLASLT_MATMUL_PREF_REDUCTION_
  // SCHEME_MASK, cublasLtReductionScheme_t bits; cuBLASLt's default: all).
  // NB: ATen narrows it for float16/bfloat16 when torch's reduced-precision
  // reduction flags forbid reductions in the 16-bit output type.
  uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_MASK;
};

// Returns false, having launched nothing, when cuBLASLt offers no algorithm
// for the problem (remembered per key); the caller must then fall back.
// Throws on any other cuBLASLt or CUDA error.
bool ltMatmul(cublasLtHandle_t handle, const LtMatmulArgs& args, cudaStream_t stream);

} // namespace torchfuse::kernels
