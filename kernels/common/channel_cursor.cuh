#pragma once

// The channel of an element of an [n][c][s] (nchw) or [n][s][c] (nhwc)
// tensor in a streaming pass: found once per vector without 64-bit
// division, then tracked along the vector's consecutive elements.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/divider.cuh"

namespace torchfuse::kernels {

// The channel of consecutive elements: element e has channel
// (e / run) % channels, with run = s for nchw, 1 for nhwc.  Found once per
// vector by Divider, then tracked along the vector's elements.
template <typename Index>
struct ChannelCursor {
  Index channel, offset; // offset within the current run

  __device__ ChannelCursor(
      Index e,
      const Divider<Index>& by_run,
      Index run,
      const Divider<Index>& by_channels,
      Index channels) {
    const Index q = by_run.div(e);
    offset = e - q * run;
    channel = q - by_channels.div(q) * channels;
  }
  __device__ void next(Index run, Index channels) {
    if (++offset == run) {
      offset = 0;
      channel = channel + 1 == channels ? 0 : channel + 1;
    }
  }
};

// Where element e's channel comes from: its run (s for nchw, 1 for nhwc),
// the channel count, and their dividers.
template <typename Index>
struct ChannelMap {
  Index run, channels;
  Divider<Index> by_run, by_channels;

  ChannelMap(int64_t run, int64_t channels)
      : run(Index(run)),
        channels(Index(channels)),
        by_run(Index(run)),
        by_channels(Index(channels)) {}
  __device__ ChannelCursor<Index> at(Index e) const {
    return ChannelCursor<Index>(e, by_run, run, by_channels, channels);
  }
};

// Calls f(Index{}) with the index type of a streaming pass over `total`
// elements: uint32_t (the dividers' multiply-shift) below 2^31, which leaves
// the grid-stride loop room to pass total by a grid's threads before it
// stops; else uint64_t.
template <typename F>
void withIndexType(int64_t total, F&& f) {
  if (total < (int64_t(1) << 31)) {
    f(uint32_t{});
  } else {
    f(uint64_t{});
  }
}

} // namespace torchfuse::kernels
