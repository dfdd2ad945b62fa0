#include "kernels/common/fastest.h"

#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <array>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace torchfuse::kernels {
namespace {

constexpr int kRounds = 5;

struct EventDeleter {
  void operator()(cudaEvent_t e) const noexcept {
    if (e != nullptr) {
      cudaEventDestroy(e);
    }
  }
};
using Event = std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, EventDeleter>;

Event makeEvent() {
  cudaEvent_t e = nullptr;
  C10_CUDA_CHECK(cudaEventCreate(&e));
  return Event(e);
}

} // namespace

std::vector<float> medianTimes(
    int count,
    const std::function<bool(int)>& launch,
    cudaStream_t stream) {
  std::vector<bool> refused(count, false);
  for (int i = 0; i < count; ++i) {
    refused[i] = !launch(i);
  }
  std::vector<Event> events(static_cast<size_t>(count) * kRounds + 1);
  for (auto& e : events) {
    e = makeEvent();
  }
  C10_CUDA_CHECK(cudaEventRecord(events[0].get(), stream));
  size_t next = 1;
  for (int r = 0; r < kRounds; ++r) {
    for (int i = 0; i < count; ++i) {
      if (!refused[i]) {
        refused[i] = !launch(i);
      }
      C10_CUDA_CHECK(cudaEventRecord(events[next++].get(), stream));
    }
  }
  C10_CUDA_CHECK(cudaEventSynchronize(events.back().get()));
  std::vector<float> medians(count, std::numeric_limits<float>::infinity());
  for (int i = 0; i < count; ++i) {
    if (refused[i]) {
      continue;
    }
    std::array<float, kRounds> ms{};
    for (int r = 0; r < kRounds; ++r) {
      const size_t j = static_cast<size_t>(r) * count + i + 1;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms[r], events[j - 1].get(), events[j].get()));
    }
    std::nth_element(ms.begin(), ms.begin() + kRounds / 2, ms.end());
    medians[i] = ms[kRounds / 2];
  }
  return medians;
}

int fastestCandidate(int count, const std::function<bool(int)>& launch, cudaStream_t stream) {
  const auto medians = medianTimes(count, launch, stream);
  int best = -1;
  for (int i = 0; i < count; ++i) {
    if (medians[i] < std::numeric_limits<float>::infinity() &&
        (best < 0 || medians[i] < medians[best])) {
      best = i;
    }
  }
  return best;
}

} // namespace torchfuse::kernels
