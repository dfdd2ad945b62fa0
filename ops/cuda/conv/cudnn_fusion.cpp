#include "ops/cuda/conv/cudnn_fusion.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cudnn/Handle.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/common/fastest.h"
#include "kernels/common/problem_cache.h"
#include "kernels/cudnn/conv_fusion.h"
#include "torchfuse/backends.h"

namespace torchfuse::ops::conv_cuda {
namespace {

namespace kc = kernels::cudnn;
using backends::CudnnFusion;

// Fused plans timed against the unfused path on a problem's first call.
constexpr int kMaxPlans = 3;
// NB: a fused plan must beat the unfused path by this fraction: one
// problem timed alone (L2-warm, 5 rounds) is not its cost inside a network,
// and near-ties taken fused ran mobilenet_v3_large fp16 at 0.97x (H200).
constexpr double kMargin = 0.03;

std::optional<kc::FusionDtype> fusionDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return kc::FusionDtype::kFloat32;
    case at::kHalf:
      return kc::FusionDtype::kFloat16;
    case at::kBFloat16:
      return kc::FusionDtype::kBFloat16;
    default:
      return std::nullopt;
  }
}

// Channels-last and not also contiguous: more than one channel and position.
bool unambiguouslyChannelsLast(const at::Tensor& t) {
  return t.dim() == 4 && t.size(1) > 1 && t.size(2) * t.size(3) > 1 &&
      t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// A 2-d convolution's stride, padding or dilation: one value for both
// dimensions, or two.
bool pairable(at::IntArrayRef v) {
  return v.size() == 1 || v.size() == 2;
}

std::array<int64_t, 2> pair(at::IntArrayRef v) {
  return {v[0], v[v.size() - 1]};
}

int64_t bits(float f) {
  int32_t i = 0;
  std::memcpy(&i, &f, sizeof(i));
  return i;
}

// Whether a fused plan's output is the unfused path's up to rounding: NaN
// and Inf in the same places, the finite values within a few units of the
// dtype's (for float32, TF32's: eager's convolution may round to it) last
// place, relative to the largest magnitude.
bool agrees(const at::Tensor& fused, const at::Tensor& unfused) {
  const auto a = fused.to(at::kFloat);
  const auto b = unfused.to(at::kFloat);
  if (!at::equal(at::isnan(a), at::isnan(b)) || !at::equal(at::isinf(a), at::isinf(b))) {
    return false;
  }
  const auto finite = at::isfinite(b);
  const double scale = at::where(finite, b.abs(), 0).max().item<double>();
  const double err = at::where(finite, (a - b).abs(), 0).max().item<double>();
  const double ulp = fused.scalar_type() == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
  return err <= 8 * ulp * scale;
}

// One problem's decision: `plan` of `fusion`, or -1 for the unfused path.
struct Entry {
  std::mutex mutex;
  bool decided = false;
  int plan = -1;
  std::unique_ptr<kc::ConvFusion> fusion;
};

} // namespace

bool autoLeavesTf32ConvUnfused(at::ScalarType dtype) {
  return dtype == at::kFloat && at::globalContext().allowTF32CuDNN(at::Float32Op::CONV);
}

bool cudnnFusionApplies(
    const ConvAddActArgs& a,
    const kernels::Activation& act,
    const at::Tensor& other,
    at::IntArrayRef sizes) {
  const auto& ctx = at::globalContext();
  const auto dtype = a.input.scalar_type();
  const bool bias_ok = !a.bias || !a.bias->defined() ||
      (a.bias->scalar_type() == dtype && a.bias->is_cuda() && a.bias->dim() == 1);
  // NB: alpha 1 only (the residual of real networks): a graph scaling
  // `other` by a pass-by-value alpha gave NaN in float32 (H200, cuDNN 9.19).
  const bool other_ok = !other.defined() ||
      (other.scalar_type() == dtype && other.device() == a.input.device() &&
       other.sizes() == sizes && unambiguouslyChannelsLast(other) && a.alpha.toDouble() == 1.0);
  return ctx.userEnabledCuDNN() && !ctx.deterministicCuDNN() && !ctx.deterministicAlgorithms() &&
      a.input.is_cuda() && a.weight.device() == a.input.device() && fusionDtype(dtype) &&
      a.weight.scalar_type() == dtype && a.weight.dim() == 4 && sizes.size() == 4 &&
      unambiguouslyChannelsLast(a.input) &&
      a.weight.is_contiguous(at::MemoryFormat::ChannelsLast) && sizes[1] > 1 &&
      sizes[2] * sizes[3] > 1 && bias_ok && other_ok && pairable(a.stride) && pairable(a.padding) &&
      pairable(a.dilation) && kc::expressible(act);
}

at::Tensor convAddActCudnnFused(
    const ConvAddActArgs& a,
    const kernels::Activation& act,
    const at::Tensor& other,
    at::IntArrayRef sizes,
    const std::function<at::Tensor()>& unfused) {
  const auto mode = backends::conv().cudnnFusion();
  if (mode == CudnnFusion::kNever || !cudnnFusionApplies(a, act, other, sizes) ||
      (mode == CudnnFusion::kAuto && autoLeavesTf32ConvUnfused(a.input.scalar_type()))) {
    return {};
  }
  const auto& x = a.input;
  const bool has_bias = a.bias && a.bias->defined();
  const auto bias = has_bias ? a.bias->contiguous() : at::Tensor();
  kc::ConvFusionProblem p;
  p.dtype = *fusionDtype(x.scalar_type());
  p.n = x.size(0), p.c = x.size(1), p.h = x.size(2), p.w = x.size(3);
  p.k = a.weight.size(0), p.r = a.weight.size(2), p.s = a.weight.size(3);
  p.p = sizes[2], p.q = sizes[3];
  p.stride = pair(a.stride);
  p.padding = pair(a.padding);
  p.dilation = pair(a.dilation);
  p.groups = a.groups;
  p.has_bias = has_bias;
  p.has_other = other.defined();
  p.alpha = a.alpha.toFloat();
  p.act = act;

  c10::cuda::CUDAGuard guard(x.device());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const kc::ConvFusionPointers ptrs0{
      x.const_data_ptr(), a.weight.const_data_ptr(), has_bias ? bias.const_data_ptr() : nullptr,
      p.has_other ? other.const_data_ptr() : nullptr, nullptr};
  const std::vector<int64_t> key{
      x.get_device(),
      static_cast<int64_t>(p.dtype),
      p.n,
      p.c,
      p.h,
      p.w,
      p.k,
      p.r,
      p.s,
      p.p,
      p.q,
      p.stride[0],
      p.stride[1],
      p.padding[0],
      p.padding[1],
      p.dilation[0],
      p.dilation[1],
      p.groups,
      p.has_bias,
      p.has_other,
      bits(p.alpha),
      static_cast<int64_t>(act.kind),
      bits(act.a),
      bits(act.b),
      kernels::pointerAlignment(ptrs0.x),
      kernels::pointerAlignment(ptrs0.w),
      p.has_bias ? kernels::pointerAlignment(ptrs0.bias) : 0,
      p.has_other ? kernels::pointerAlignment(ptrs0.other) : 0,
      static_cast<int64_t>(mode)};
  const auto entry = kernels::problemEntry<std::vector<int64_t>, Entry>(key);
  std::lock_guard<std::mutex> lock(entry->mutex);
  if (entry->decided && entry->plan < 0) {
    return {}; // decided unfused: no output, handle or workspace to set up
  }

  auto out = at::empty(sizes, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  auto ptrs = ptrs0;
  ptrs.y = out.data_ptr();
  cudnnHandle_t handle = at::native::getCudnnHandle();
  TORCH_CHECK(
      cudnnSetStream(handle, stream) == CUDNN_STATUS_SUCCESS,
      "torchfuse::custom_conv_add_act: cudnnSetStream failed");
  // NB: none for a plan without workspace (the allocator would round a
  // placeholder byte up to a 512-byte block: more than the unfused path).
  const auto workspace = [&](int plan) {
    const int64_t bytes = entry->fusion->workspaceBytes(plan);
    return bytes > 0 ? at::empty({bytes}, x.options().dtype(at::kByte)) : at::Tensor();
  };
  const auto address = [](const at::Tensor& space) {
    return space.defined() ? space.data_ptr() : nullptr;
  };

  if (!entry->decided) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      return {};
    }
    // NB: plans' workspaces are bounded by the output's size, a bound on
    // what the fused call may add (eager's convolution on the unfused path
    // takes a cuDNN workspace of its own).
    const int64_t max_workspace = out.nbytes();
    entry->fusion = kc::ConvFusion::create(
        p, handle, mode == CudnnFusion::kAlways ? 1 : kMaxPlans, max_workspace);
    if (!entry->fusion) {
      entry->plan = -1;
    } else if (mode == CudnnFusion::kAlways) {
      entry->plan = 0;
    } else {
      // NB: a plan runs only where it reproduces the unfused result: in
      // whole networks, a plan other than the heuristic's first gave wrong
      // outputs for some problems (resnet50, bfloat16, H200, cuDNN 9.19).
      // NB: the output is poisoned before each plan, so that a plan which
      // leaves some of it unwritten cannot pass on an earlier plan's values
      // (resnet50 in float16 ran at 1.4e-1 against float64, eager 2.8e-2).
      const auto reference = unfused();
      std::vector<int> candidates;
      std::vector<at::Tensor> spaces;
      for (int i = 0; i < entry->fusion->plans(); ++i) {
        auto space = workspace(i);
        out.fill_(std::numeric_limits<double>::quiet_NaN());
        if (entry->fusion->run(i, ptrs, address(space), handle) && agrees(out, reference)) {
          candidates.push_back(i);
          spaces.push_back(std::move(space));
        }
      }
      const int n = static_cast<int>(candidates.size());
      if (n > 0) {
        const auto ms = kernels::medianTimes(
            n + 1,
            [&](int i) {
              if (i == n) {
                unfused();
                return true;
              }
              return entry->fusion->run(candidates[i], ptrs, address(spaces[i]), handle);
            },
            stream);
        const int best = static_cast<int>(std::min_element(ms.begin(), ms.end() - 1) - ms.begin());
        entry->plan = ms[best] < ms[n] * (1.0 - kMargin) ? candidates[best] : -1;
      }
    }
    if (entry->plan < 0) {
      entry->fusion.reset();
    }
    entry->decided = true;
  }
  if (entry->plan < 0) {
    return {};
  }
  auto space = workspace(entry->plan);
  if (!entry->fusion->run(entry->plan, ptrs, address(space), handle)) {
    return {};
  }
  return out;
}

} // namespace torchfuse::ops::conv_cuda
