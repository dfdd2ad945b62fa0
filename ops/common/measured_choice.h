#pragma once

// A choice between two ways of running a module's calls, made by timing the
// calls themselves: the original way and a candidate (the channels-last
// layout of an unfrozen graph, custom_channels_last_weight).  Only the
// calls can tell: what is timed is everything from one call's start to the
// next one's, so a training step's backward and optimizer step, and the
// host work of each way (launches, weight conversions), are in it.
//
// NB: the protocol.  The first `settle` calls run the original (the
// TorchScript executor profiles and optimizes the graph on them, on the
// original's layout).  The next `warm` calls alternate, candidate first,
// untimed (the executor's path for the other layout, cuDNN's heuristics,
// lazy kernel loading).  Then `blocks` blocks of `calls_per_block` calls per
// way, in the order candidate, original, original, candidate, ... (a linear
// drift of the machine falls on both alike); a block is timed from its
// first call's start to the next block's.  The call after the last block
// resolves: the candidate wins when its median block is at least `margin`
// faster than the original's, else the original stays (a smaller gain is
// within these medians' run-to-run noise).

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace torchfuse::ops {

struct MeasuredChoiceProtocol {
  int64_t settle = 2;
  int64_t warm = 4;
  int64_t blocks = 5; // per way
  int64_t calls_per_block = 2;
  double margin = 0.03;
};

class MeasuredChoice {
 public:
  explicit MeasuredChoice(MeasuredChoiceProtocol protocol);

  // How the next call runs: the candidate or the original; whether a block
  // starts at it (the caller stamps the time at its start); whether it is
  // the resolving call (the caller stamps, then passes every block's time
  // to resolve() before choosing, and the call runs decided()).
  struct Call {
    bool candidate = false;
    bool stamp = false;
    bool resolve = false;
  };
  Call next();

  // The blocks' times in order (the time between consecutive stamps); an
  // empty or short list (a timer that failed) keeps the original.
  void resolve(const std::vector<double>& block_ms);

  // The decision once made: true for the candidate.
  std::optional<bool> decided() const {
    return decided_;
  }
  int64_t calls() const {
    return calls_;
  }
  // Median block times of the original and the candidate, once resolved.
  std::optional<std::pair<double, double>> medians() const {
    return medians_;
  }

 private:
  // Whether block b (0-based) runs the candidate: ABBA order.
  static bool blockRunsCandidate(int64_t b) {
    return b % 4 == 0 || b % 4 == 3;
  }

  MeasuredChoiceProtocol p_;
  int64_t calls_ = 0;
  std::optional<bool> decided_;
  std::optional<std::pair<double, double>> medians_;
};

} // namespace torchfuse::ops
