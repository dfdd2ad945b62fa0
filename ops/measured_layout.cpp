// The call sites of custom_channels_last_weight(measured=true) and their
// measured choices (torchfuse.measured_layouts()).
//
// NB: a site's time stamps are events on the current stream, so a block's
// time is the GPU timeline between two calls' starts: the kernels of the
// step, and the gaps where the GPU waited for the host (launches, weight
// conversions).  One host synchronization per site, on its last stamp.

#include "ops/measured_layout.h"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/runtime/graph_executor.h>

#ifdef TORCHFUSE_WITH_CUDA
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "ops/common/measured_choice.h"
#include "torchfuse/ops.h"

namespace torchfuse {
namespace ops {
namespace {

// Sites kept at most (the oldest go first): one per model, input shape and
// mode in a program; a freed model's entries age out.
constexpr size_t kMaxSites = 64;

// A site's calls: its input and mode (what measuredLayouts() reports
// besides the choice's own state), the choice, and the trial's stamps.
struct Site {
  Site(MeasuredChoiceProtocol p, const at::Tensor& input, bool grad, std::string autocast)
      : choice(p),
        input_sizes(input.sizes().vec()),
        dtype(c10::toString(input.scalar_type())),
        grad(grad),
        autocast(std::move(autocast)) {}
  MeasuredChoice choice;
  std::vector<c10::Event> stamps;
  std::vector<int64_t> input_sizes;
  std::string dtype;
  bool grad;
  std::string autocast;
};

struct Sites {
  std::mutex mutex;
  std::map<std::vector<int64_t>, std::unique_ptr<Site>> sites;
  std::deque<std::vector<int64_t>> order;
};

// NB: never destroyed: a site mid-trial holds CUDA events, which must not
// be destroyed after the CUDA runtime at exit.
Sites& sites() {
  static auto* s = new Sites();
  return *s;
}

bool capturing() {
#ifdef TORCHFUSE_WITH_CUDA
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

Site& siteFor(Sites& s, const at::Tensor& weight, const at::Tensor& input, bool grad) {
  const bool autocast = at::autocast::is_autocast_enabled(at::kCUDA);
  const auto autocast_dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  std::vector<int64_t> key = {
      static_cast<int64_t>(reinterpret_cast<intptr_t>(weight.unsafeGetTensorImpl())),
      input.get_device(), static_cast<int64_t>(input.scalar_type()), grad,
      autocast ? static_cast<int64_t>(autocast_dtype) : -1};
  key.insert(key.end(), input.sizes().begin(), input.sizes().end());
  auto it = s.sites.find(key);
  if (it != s.sites.end()) {
    return *it->second;
  }
  if (s.sites.size() >= kMaxSites) {
    s.sites.erase(s.order.front());
    s.order.pop_front();
  }
  MeasuredChoiceProtocol p;
  // NB: the executor's profiling runs and its optimizing run.
  p.settle = static_cast<int64_t>(torch::jit::getNumProfiledRuns().load()) + 1;
  auto site = std::make_unique<Site>(
      p, input, grad, autocast ? std::string(c10::toString(autocast_dtype)) : std::string());
  s.order.push_back(key);
  return *(s.sites[std::move(key)] = std::move(site));
}

std::vector<double> blockTimes(const std::vector<c10::Event>& stamps) {
  std::vector<double> ms;
  for (size_t i = 0; i + 1 < stamps.size(); ++i) {
    ms.push_back(stamps[i].elapsedTime(stamps[i + 1]));
  }
  return ms;
}

} // namespace

bool measuredChannelsLast(const at::Tensor& weight, const at::Tensor& input) {
  if (!input.is_cuda() || at::globalContext().deterministicAlgorithms() ||
      at::globalContext().deterministicCuDNN()) {
    return false;
  }
  const bool grad = c10::GradMode::is_enabled();
  auto& s = sites();
  std::lock_guard<std::mutex> lock(s.mutex);
  Site& site = siteFor(s, weight, input, grad);
  if (capturing()) {
    return site.choice.decided().value_or(false);
  }
  const auto call = site.choice.next();
  if (call.stamp) {
    const c10::impl::VirtualGuardImpl impl(input.device().type());
    site.stamps.emplace_back(input.device().type(), c10::EventFlag::BACKEND_DEFAULT);
    site.stamps.back().record(impl.getStream(input.device()));
  }
  if (!call.resolve) {
    return call.candidate;
  }
  // NB: a timer that fails (events the backend cannot time) keeps the
  // original, rather than failing the user's call.
  std::vector<double> block_ms;
  try {
    site.stamps.back().synchronize();
    block_ms = blockTimes(site.stamps);
  } catch (const c10::Error&) {
    block_ms.clear();
  }
  site.choice.resolve(block_ms);
  site.stamps.clear();
  return *site.choice.decided();
}

} // namespace ops

std::vector<MeasuredLayout> measuredLayouts() {
  auto& s = ops::sites();
  std::lock_guard<std::mutex> lock(s.mutex);
  std::vector<MeasuredLayout> out;
  for (const auto& key : s.order) {
    const auto& site = *s.sites.at(key);
    MeasuredLayout l;
    l.input_sizes = site.input_sizes;
    l.dtype = site.dtype;
    l.grad = site.grad;
    l.autocast = site.autocast;
    l.calls = site.choice.calls();
    l.channels_last = site.choice.decided();
    if (const auto m = site.choice.medians()) {
      l.nchw_ms = m->first;
      l.channels_last_ms = m->second;
    }
    out.push_back(std::move(l));
  }
  return out;
}

} // namespace torchfuse
