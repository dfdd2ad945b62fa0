// torchfuse::backends: the process-wide options' defaults, round trips,
// checks, and reads racing writes (run under TSan to see the atomics).

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "torchfuse/backends.h"

namespace {

using torchfuse::backends::ChannelsLastRoute;
using torchfuse::backends::CudnnFusion;
using torchfuse::backends::NchwConversion;

// Restores the options a test changed.
class BackendsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    auto& conv = torchfuse::backends::conv();
    conv.setChannelsLastRoute(ChannelsLastRoute::kAuto);
    conv.setAllowImplicitGemm(true);
    conv.setAllowDirect(true);
    conv.setNchwConversion(NchwConversion::kAuto);
    conv.setConversionLookahead(0);
    conv.setCudnnFusion(CudnnFusion::kAuto);
    torchfuse::backends::matmul().setAutotune(true);
  }
};

TEST_F(BackendsTest, Defaults) {
  const auto& conv = torchfuse::backends::conv();
  EXPECT_EQ(conv.channelsLastRoute(), ChannelsLastRoute::kAuto);
  EXPECT_TRUE(conv.allowImplicitGemm());
  EXPECT_TRUE(conv.allowDirect());
  EXPECT_EQ(conv.nchwConversion(), NchwConversion::kAuto);
  EXPECT_EQ(conv.conversionLookahead(), 0);
  EXPECT_EQ(conv.cudnnFusion(), CudnnFusion::kAuto);
  EXPECT_TRUE(torchfuse::backends::matmul().autotune());
}

TEST_F(BackendsTest, RoundTrip) {
  auto& conv = torchfuse::backends::conv();
  conv.setChannelsLastRoute(ChannelsLastRoute::kAlways);
  conv.setAllowImplicitGemm(false);
  conv.setNchwConversion(NchwConversion::kSeparate);
  conv.setConversionLookahead(64);
  conv.setCudnnFusion(CudnnFusion::kNever);
  torchfuse::backends::matmul().setAutotune(false);
  EXPECT_EQ(torchfuse::backends::conv().channelsLastRoute(), ChannelsLastRoute::kAlways);
  EXPECT_FALSE(conv.allowImplicitGemm());
  EXPECT_TRUE(conv.allowDirect());
  EXPECT_EQ(conv.nchwConversion(), NchwConversion::kSeparate);
  EXPECT_EQ(conv.conversionLookahead(), 64);
  EXPECT_EQ(conv.cudnnFusion(), CudnnFusion::kNever);
  EXPECT_FALSE(torchfuse::backends::matmul().autotune());
}

TEST_F(BackendsTest, RejectsOutOfRangeValues) {
  auto& conv = torchfuse::backends::conv();
  conv.setConversionLookahead(5);
  for (const int bad : {-1, 65}) {
    try {
      conv.setConversionLookahead(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const c10::Error& e) {
      EXPECT_NE(
          std::string(e.what_without_backtrace())
              .find(
                  "setConversionLookahead: expected images to be 0 (the kernel's choice) or "
                  "from 1 to 64, got " +
                  std::to_string(bad)),
          std::string::npos)
          << e.what_without_backtrace();
    }
  }
  EXPECT_EQ(conv.conversionLookahead(), 5); // unchanged
  EXPECT_THROW(conv.setChannelsLastRoute(static_cast<ChannelsLastRoute>(3)), c10::Error);
  EXPECT_THROW(conv.setNchwConversion(static_cast<NchwConversion>(2)), c10::Error);
  EXPECT_THROW(conv.setCudnnFusion(static_cast<CudnnFusion>(3)), c10::Error);
  EXPECT_EQ(conv.cudnnFusion(), CudnnFusion::kAuto); // unchanged
}

TEST_F(BackendsTest, ReadsRaceWrites) {
  auto& conv = torchfuse::backends::conv();
  std::atomic<bool> stop{false};
  std::atomic<int> bad{0};
  std::vector<std::thread> readers;
  for (int i = 0; i < 4; ++i) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        const int ahead = conv.conversionLookahead();
        if (ahead != 0 && ahead != 7) {
          ++bad;
        }
      }
    });
  }
  for (int i = 0; i < 10000; ++i) {
    conv.setConversionLookahead(i % 2 == 0 ? 7 : 0);
  }
  stop = true;
  for (auto& t : readers) {
    t.join();
  }
  EXPECT_EQ(bad.load(), 0);
}

} // namespace
