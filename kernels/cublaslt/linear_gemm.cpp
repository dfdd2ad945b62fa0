#include "kernels/cublaslt/linear_gemm.h"

namespace torchfuse::kernels {
namespace {

LtMatmulArgs baseArgs(const LinearGemmContext& ctx) {
  LtMatmulArgs a;
  a.dtype = ctx.dtype;
  a.allow_tf32 = ctx.allow_tf32;
  a.workspace = ctx.workspace;
  a.workspace_size = ctx.workspace_size;
  a.autotune = ctx.autotune;
  a.reduction_schemes = ctx.reduction_schemes;
  return a;
}

} // namespace

bool linearForward(const LinearGemmContext& ctx, const LinearForwardArgs& f) {
  auto a = baseArgs(ctx);
  a.trans_a = true;
  a.m = f.n;
  a.n = f.m;
  a.k = f.k;
  a.a = f.w;
  a.lda = f.ldw;
  a.b = f.x;
  a.ldb = f.ldx;
  a.c = f.c;
  a.ldc = f.ldc;
  a.beta = f.c != nullptr ? f.beta : 0.0f;
  a.d = f.y;
  a.ldd = f.ldy;
  if (f.bias != nullptr) {
    a.epilogue = LtEpilogue::kBias;
    a.bias = const_cast<void*>(f.bias);  // read only with kBias
    a.bias_fp32 = f.bias_fp32;
  }
  return ltMatmul(ctx.handle, a, ctx.stream);
}

bool linearGradInput(
    const LinearGemmContext& ctx, int64_t m, int64_t n, int64_t k, const void* g,
    int64_t ldg, const void* w, int64_t ldw, void* dx, int64_t lddx) {
  auto a = baseArgs(ctx);
  a.m = k;
  a.n = m;
  a.k = n;
  a.a = w;
  a.lda = ldw;
  a.b = g;
  a.ldb = ldg;
  a.d = dx;
  a.ldd = lddx;
  return ltMatmul(ctx.handle, a, ctx.stream);
}

bool linearGradWeight(const LinearGemmContext& ctx, const LinearGradWeightArgs& wg) {
  auto a = baseArgs(ctx);
  // D[K, N] = op(A)[K, M] · op(B)[M, N]: A is x (or xt), B is g (or gt).
  a.trans_a = wg.transposed;
  a.trans_b = !wg.transposed;
  a.m = wg.k;
  a.n = wg.n;
  a.k = wg.m;
  a.a = wg.x;
  a.lda = wg.ldx;
  a.b = wg.g;
  a.ldb = wg.ldg;
  a.d = wg.dw;
  a.ldd = wg.lddw;
  if (wg.db != nullptr) {
    a.epilogue = LtEpilogue::kBGradB;  // Σ over the GEMM's k (= rows of g)
    a.bias = wg.db;
  }
  return ltMatmul(ctx.handle, a, ctx.stream);
}

} // namespace torchfuse::kernels
