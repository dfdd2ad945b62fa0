#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "ops/common/measured_choice.h"

namespace torchfuse {
namespace {

using ops::MeasuredChoice;
using ops::MeasuredChoiceProtocol;

MeasuredChoiceProtocol protocol() {
  MeasuredChoiceProtocol p;
  p.settle = 2;
  p.warm = 4;
  p.blocks = 5;
  p.calls_per_block = 2;
  p.margin = 0.03;
  return p;
}

// Runs the protocol's calls up to the resolving one, whose block times are
// `ms(candidate)` per block; returns the calls' plans.
std::vector<MeasuredChoice::Call> runTrial(
    MeasuredChoice& c,
    double original_ms,
    double candidate_ms) {
  std::vector<MeasuredChoice::Call> calls;
  std::vector<double> blocks;
  while (true) {
    const auto call = c.next();
    calls.push_back(call);
    if (call.stamp && calls.size() > 1) {
      // the block that this stamp ends: the one the previous stamp started
      for (auto it = calls.rbegin() + 1; it != calls.rend(); ++it) {
        if (it->stamp) {
          blocks.push_back(it->candidate ? candidate_ms : original_ms);
          break;
        }
      }
    }
    if (call.resolve) {
      c.resolve(blocks);
      return calls;
    }
  }
}

TEST(MeasuredChoice, FollowsTheProtocol) {
  MeasuredChoice c(protocol());
  const auto calls = runTrial(c, 10.0, 8.0);
  // settle: the original, untimed; warm: alternating, candidate first
  ASSERT_EQ(calls.size(), 2u + 4u + 20u + 1u);
  for (int k = 0; k < 2; ++k) {
    EXPECT_FALSE(calls[k].candidate);
    EXPECT_FALSE(calls[k].stamp);
  }
  for (int k = 0; k < 4; ++k) {
    EXPECT_EQ(calls[2 + k].candidate, k % 2 == 0);
    EXPECT_FALSE(calls[2 + k].stamp);
  }
  // blocks of two calls in ABBA order, a stamp at each block's first call
  const std::vector<bool> order = {true, false, false, true, true, false, false, true, true, false};
  for (int b = 0; b < 10; ++b) {
    for (int i = 0; i < 2; ++i) {
      const auto& call = calls[6 + 2 * b + i];
      EXPECT_EQ(call.candidate, order[b]) << b;
      EXPECT_EQ(call.stamp, i == 0) << b;
      EXPECT_FALSE(call.resolve);
    }
  }
  EXPECT_TRUE(calls.back().stamp && calls.back().resolve);
  ASSERT_TRUE(c.decided().has_value());
  EXPECT_TRUE(*c.decided());
  ASSERT_TRUE(c.medians().has_value());
  EXPECT_DOUBLE_EQ(c.medians()->first, 10.0);
  EXPECT_DOUBLE_EQ(c.medians()->second, 8.0);
  // decided: every later call runs it, untimed
  for (int k = 0; k < 5; ++k) {
    const auto call = c.next();
    EXPECT_TRUE(call.candidate);
    EXPECT_FALSE(call.stamp || call.resolve);
  }
}

TEST(MeasuredChoice, KeepsTheOriginalUnlessTheCandidateWinsByTheMargin) {
  for (const auto& [candidate_ms, want] : std::vector<std::pair<double, bool>>{
           {9.0, true}, {9.69, true}, {9.75, false}, {10.0, false}, {12.0, false}}) {
    MeasuredChoice c(protocol());
    runTrial(c, 10.0, candidate_ms);
    ASSERT_TRUE(c.decided().has_value());
    EXPECT_EQ(*c.decided(), want) << candidate_ms;
  }
}

TEST(MeasuredChoice, MediansIgnoreAnOutlierBlock) {
  MeasuredChoice c(protocol());
  std::vector<double> blocks = {8, 10, 10, 8, 8, 10, 10, 8, 8, 10};
  blocks[0] = 500; // a candidate block with a pause in it
  blocks[1] = 1;   // an original block cut short
  while (!c.next().resolve) {
  }
  c.resolve(blocks);
  ASSERT_TRUE(c.decided().has_value());
  EXPECT_TRUE(*c.decided());
  EXPECT_DOUBLE_EQ(c.medians()->first, 10.0);
  EXPECT_DOUBLE_EQ(c.medians()->second, 8.0);
}

TEST(MeasuredChoice, AFailedTimerKeepsTheOriginal) {
  std::vector<double> one_nan = {8, 10, 10, 8, 8, 10, 10, 8, 8, 10};
  one_nan[3] = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> one_zero = {8, 10, 10, 8, 8, 10, 10, 8, 8, 10};
  one_zero[0] = 0;
  for (const auto& blocks : std::vector<std::vector<double>>{
           {},
           {8, 10, 10},
           std::vector<double>(10, std::numeric_limits<double>::quiet_NaN()),
           one_nan,
           one_zero}) {
    MeasuredChoice c(protocol());
    while (!c.next().resolve) {
    }
    c.resolve(blocks);
    ASSERT_TRUE(c.decided().has_value());
    EXPECT_FALSE(*c.decided()) << blocks.size();
  }
}

} // namespace
} // namespace torchfuse
