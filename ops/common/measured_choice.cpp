#include "ops/common/measured_choice.h"

#include <algorithm>
#include <cmath>

namespace torchfuse::ops {

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
} // namespace

MeasuredChoice::MeasuredChoice(MeasuredChoiceProtocol protocol) : p_(protocol) {
  p_.settle = std::max<int64_t>(p_.settle, 0);
  p_.warm = std::max<int64_t>(p_.warm, 0);
  p_.blocks = std::max<int64_t>(p_.blocks, 1);
  p_.calls_per_block = std::max<int64_t>(p_.calls_per_block, 1);
}

MeasuredChoice::Call MeasuredChoice::next() {
  Call c;
  if (decided_) {
    c.candidate = *decided_;
    ++calls_;
    return c;
  }
  const int64_t k = calls_++;
  if (k < p_.settle) {
    return c;
  }
  const int64_t w = k - p_.settle;
  if (w < p_.warm) {
    c.candidate = w % 2 == 0;
    return c;
  }
  const int64_t m = w - p_.warm;
  const int64_t timed = 2 * p_.blocks * p_.calls_per_block;
  if (m < timed) {
    const int64_t b = m / p_.calls_per_block;
    c.candidate = blockRunsCandidate(b);
    c.stamp = m % p_.calls_per_block == 0;
    return c;
  }
  c.stamp = true;
  c.resolve = true;
  return c;
}

void MeasuredChoice::resolve(const std::vector<double>& block_ms) {
  if (decided_) {
    return;
  }
  const auto n = static_cast<size_t>(2 * p_.blocks);
  std::vector<double> original;
  std::vector<double> candidate;
  for (size_t b = 0; b < std::min(n, block_ms.size()); ++b) {
    (blockRunsCandidate(static_cast<int64_t>(b)) ? candidate : original).push_back(block_ms[b]);
  }
  // NB: a failed timer (too few blocks, a NaN or a time <= 0) keeps the
  // original; checked before sorting, which NaN would leave unordered.
  const bool timed = block_ms.size() >= n &&
      std::all_of(block_ms.begin(), block_ms.end(),
                  [](double t) { return std::isfinite(t) && t > 0; });
  if (!timed) {
    decided_ = false;
    return;
  }
  const double o = median(original);
  const double c = median(candidate);
  medians_ = std::make_pair(o, c);
  decided_ = c <= o * (1.0 - p_.margin);
}

} // namespace torchfuse::ops
