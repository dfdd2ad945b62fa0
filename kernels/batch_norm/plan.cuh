#pragma once

// The launch plan and the workspace layout that the stages share.
//
// Workspace: kNumCoefSlots * c float coefficients, kNumSumSlots * c double
// per-channel values, then 2 * splits * c double partials (see ReduceAcc in
// reduce.cuh).

#include <algorithm>
#include <cstdint>

#include "kernels/batch_norm/batch_norm_add_div_swish.cuh"
#include "kernels/common/launch.cuh"

namespace torchfuse::kernels::batch_norm {

constexpr int kColX = 32;  // column threads per block (x)
constexpr int kColY = 8;   // row groups per block (y)
constexpr int kUnroll = 4; // loads in flight per thread

// Per-channel coefficient arrays, each c floats, at workspace + k * c.
enum Coef : int {
  kMu = 0,     // mean used to centre x (batch or running)
  kA = 1,      // w * invstd / d
  kK = 2,      // (b + s) / d
  kInvstd = 3, // invstd
  kP = 4,      // w * invstd
  kQ = 5,      // sum g_bn / M
  kR = 6,      // sum g_bn * xhat / M
  kMuLo = 7,   // mean - (float)mean: the forward centres on mu + mu_lo
  kALo = 8,    // a - (float)a: a = kA + kALo in float64 (float64 terms)
  kKLo = 9,    // k - (float)k
  kPLo = 10,   // p - (float)p
  // An even count (slot 11 is padding) keeps the float64 regions after the
  // slots 8-byte aligned.
  kNumCoefSlots = 12,
};

// Per-channel float64 values, each c doubles, after the coefficients.
enum Sum : int {
  kSumG = 0, // sum g_bn (for a one-element `other`)
  kQ64 = 1,  // sum g_bn / M, as kQ unrounded (float32 dx)
  kR64 = 2,  // sum g_bn * xhat / M, as kR unrounded
  kNumSumSlots = 3,
};

struct Plan {
  bool columns = true;
  int vec = 1;        // elements per vector when pointers are aligned
  int64_t splits = 1; // partials per channel
  int64_t total = 0;  // units split: rows (columns) or elements (planes)
  int64_t per = 0;    // units per split
  int64_t col_blocks = 0;
};

inline int64_t ceilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Depends on the shape, the element size and the SM count only, so the
// workspace size and the launches agree.
inline Plan makePlan(BnShape s, int elem_size, int num_sms) {
  Plan p;
  const int vmax = 16 / elem_size;
  // Enough 256-thread blocks to fill every SM.
  const int64_t target = int64_t(std::max(num_sms, 1)) * 8;
  p.columns = s.l == 1;
  if (p.columns) {
    p.vec = s.c % vmax == 0 ? vmax : 1;
    p.col_blocks = ceilDiv(s.c / p.vec, kColX);
    // At least 8 rows per thread.
    const int64_t max_splits = std::min<int64_t>(65535, std::max<int64_t>(1, s.n / (kColY * 8)));
    p.splits = std::clamp<int64_t>(ceilDiv(target, p.col_blocks), 1, max_splits);
    p.total = s.n;
    p.per = ceilDiv(s.n, p.splits);
  } else {
    p.vec = s.l % vmax == 0 ? vmax : 1;
    const int64_t m = s.n * s.l;
    // At least kUnroll vectors per thread.
    const int64_t max_splits =
        std::min<int64_t>(65535, std::max<int64_t>(1, m / (int64_t(kThreads) * p.vec * kUnroll)));
    p.splits = std::clamp<int64_t>(ceilDiv(target, s.c), 1, max_splits);
    p.total = m;
    p.per = ceilDiv(ceilDiv(m, p.splits), p.vec) * p.vec;
  }
  return p;
}

__host__ __device__ __forceinline__ int64_t splitCount(int64_t total, int64_t per, int64_t s) {
  const int64_t left = total - s * per;
  return left <= 0 ? 0 : (left < per ? left : per);
}

// The statistics reduction's output: per (split, channel) shifted Welford
// (mean, m2) in float64, and the plan's split of each channel's elements.
struct StatsPartials {
  const double* part0;
  const double* part1;
  int64_t splits, total, per;
};

// The workspace's regions (see the top of this file).
struct Workspace {
  float* coef;
  double* sums; // kNumSumSlots * c
  double* part0;
  double* part1;
};

inline Workspace carve(void* ws, BnShape s, const Plan& p) {
  Workspace w;
  w.coef = static_cast<float*>(ws);
  w.sums = reinterpret_cast<double*>(w.coef + kNumCoefSlots * s.c);
  w.part0 = w.sums + kNumSumSlots * s.c;
  w.part1 = w.part0 + p.splits * s.c;
  return w;
}

// The statistics reduction's partials in the workspace carved as w.
inline StatsPartials statsPartials(const Workspace& w, const Plan& p) {
  return StatsPartials{w.part0, w.part1, p.splits, p.total, p.per};
}

} // namespace torchfuse::kernels::batch_norm
