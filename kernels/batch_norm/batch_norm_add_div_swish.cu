#include "kernels/batch_norm/batch_norm_add_div_swish.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/batch_norm/apply.cuh"
#include "kernels/batch_norm/channels.cuh"
#include "kernels/batch_norm/plan.cuh"
#include "kernels/batch_norm/reduce.cuh"
#include "kernels/common/dtype.cuh"
#include "kernels/common/vec.cuh"

// The order of the stages (see docs/kernels/batch_norm_add_div_swish.md):
//
// * Reductions (training statistics; backward sums, reduce.cu) write one
//   partial per (split, channel) to the workspace (plan.cuh); a
//   one-thread-per-channel kernel (channels.cu) merges the splits in float64
//   and derives per-channel coefficients.
// * Elementwise passes (apply.cu) read the per-channel coefficients from the
//   workspace.
// * The backward: one reduction pass for the per-channel sums, one
//   elementwise pass for dx.  float32 evaluates every per-element term in
//   float64 and rounds once (swishGradF64); a float32 training backward
//   first recomputes the float64 batch mean the forward centred on, since
//   the saved statistics carry only its float32 rounding.

namespace torchfuse::kernels {
namespace {

using namespace batch_norm; // NB: the stages above

// Calls f(std::integral_constant<int, V>) with the plan's vector width when
// every pointer is 16-byte aligned, else with 1.
template <typename T, typename F>
void withVec(const Plan& p, bool aligned, F&& f) {
  if (aligned && p.vec == maxVec<T>()) {
    f(std::integral_constant<int, maxVec<T>()>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

int64_t numel(BnShape s) {
  return s.n * s.c * s.l;
}

} // namespace

int64_t batchNormSwishWorkspaceBytes(BnShape shape, int elem_size, int num_sms) {
  if (numel(shape) == 0) {
    return 0;
  }
  const Plan p = makePlan(shape, elem_size, num_sms);
  return int64_t(sizeof(float)) * kNumCoefSlots * shape.c +
      int64_t(sizeof(double)) * (kNumSumSlots * shape.c + 2 * p.splits * shape.c);
}

template <typename T>
void batchNormSwishTrainForward(const BnForward<T>& f, const BnTrainStats& s, cudaStream_t stream) {
  const BnShape shape = f.shape;
  if (numel(shape) == 0) {
    return;
  }
  const Plan p = makePlan(shape, sizeof(T), f.num_sms);
  const auto ws = carve(f.workspace, shape, p);
  withVec<T>(p, aligned16(f.x) && aligned16(f.out), [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    launchReduce<T, V, false>(
        p, shape, f.x, nullptr, nullptr, SwishGradArgs{}, ws.part0, ws.part1, stream);
    launchTrainStatsFinalize<T>(f, s, mergeStatsPartials(ws, p, shape.c, stream), ws.coef, stream);
    const int64_t nvec = numel(shape) / V;
    launchApplyForward<T, V>(f.x, f.out, nvec, shape.c, shape.l, ws.coef, stream);
  });
}

template <typename T>
void batchNormSwishEvalForward(const BnForward<T>& f, const BnEvalStats& s, cudaStream_t stream) {
  const BnShape shape = f.shape;
  if (numel(shape) == 0) {
    return;
  }
  const Plan p = makePlan(shape, sizeof(T), f.num_sms);
  float* coef = static_cast<float*>(f.workspace);
  launchCoefFromStats(
      shape.c, s.running_mean, s.running_var, /*is_var=*/true, s.eps, f.affine, coef, stream);
  withVec<T>(p, aligned16(f.x) && aligned16(f.out), [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    const int64_t nvec = numel(shape) / V;
    launchApplyForward<T, V>(f.x, f.out, nvec, shape.c, shape.l, coef, stream);
  });
}

template <typename T>
void batchNormSwishBackward(const BnBackward<T>& b, cudaStream_t stream) {
  // NB: lambdas capture no structured bindings in C++17.
  const T *grad_output = b.grad_output, *x = b.x;
  T* const grad_input = b.grad_input;
  const BnShape shape = b.shape;
  const BnAffine& affine = b.affine;
  const BnParamGrads& grads = b.grads;
  const bool training = b.training;
  if (numel(shape) == 0) {
    return;
  }
  const Plan p = makePlan(shape, sizeof(T), b.num_sms);
  const auto ws = carve(b.workspace, shape, p);
  const SwishGradArgs ga{1.0 / affine.divisor, b.silu};
  launchCoefFromStats(shape.c, b.mean, b.invstd, /*is_var=*/false, 0.0, affine, ws.coef, stream);
  const bool need_sums = (training && grad_input != nullptr) || grads.weight.data != nullptr ||
      grads.bias.data != nullptr || grads.other.data != nullptr;
  const bool other_per_channel = affine.other.stride != 0;
  const bool aligned = aligned16(grad_output) && aligned16(x) && aligned16(grad_input);
  withVec<T>(p, aligned, [&](auto vc) {
    constexpr int V = decltype(vc)::value;
    if constexpr (std::is_same_v<T, float>) {
      if (training) {
        // The forward's statistics pass again, for mu_lo; the backward's
        // sums reuse the partials' region afterwards.
        launchReduce<T, V, false>(
            p, shape, x, nullptr, nullptr, SwishGradArgs{}, ws.part0, ws.part1, stream);
        launchMeanLo(
            x, mergeStatsPartials(ws, p, shape.c, stream), shape.c, shape.l, ws.coef, stream);
      }
    }
    if (need_sums) {
      launchReduce<T, V, true>(p, shape, x, grad_output, ws.coef, ga, ws.part0, ws.part1, stream);
      launchBackwardSumsFinalize(
          ws.part0, ws.part1, shape.c, mergeSumPartials(ws, p, shape.c, stream), shape.n * shape.l,
          grads, other_per_channel, ws.sums, ws.coef, stream);
      if (grads.other.data != nullptr && !other_per_channel) {
        launchSumChannels(ws.sums + kSumG * shape.c, shape.c, grads.other, stream);
      }
    }
    if (grad_input == nullptr) {
      return;
    }
    const int64_t nvec = numel(shape) / V;
    if (training) {
      launchApplyBackward<T, V, BwdOut::kTrainDx>(
          grad_output, x, grad_input, nvec, shape.c, shape.l, ws.coef, ws.sums, ga, stream);
    } else {
      launchApplyBackward<T, V, BwdOut::kEvalDx>(
          grad_output, x, grad_input, nvec, shape.c, shape.l, ws.coef, ws.sums, ga, stream);
    }
  });
}

#define TORCHFUSE_INSTANTIATE_BN_SWISH(T)                      \
  template void batchNormSwishTrainForward<T>(                 \
      const BnForward<T>&, const BnTrainStats&, cudaStream_t); \
  template void batchNormSwishEvalForward<T>(                  \
      const BnForward<T>&, const BnEvalStats&, cudaStream_t);  \
  template void batchNormSwishBackward<T>(const BnBackward<T>&, cudaStream_t);
TORCHFUSE_FOR_EACH_FLOAT_TYPE(TORCHFUSE_INSTANTIATE_BN_SWISH)
#undef TORCHFUSE_INSTANTIATE_BN_SWISH

} // namespace torchfuse::kernels
