#pragma once

// Division by a divisor fixed for a whole launch.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace torchfuse::kernels {

// x / d by a multiply-high, an add and a shift, exact for every x < 2^32
// (Granlund and Montgomery, "Division by invariant integers using
// multiplication", PLDI 1994, figure 4.1), so that finding an element's
// channel costs no 64-bit division.
template <typename Index>
struct Divider;

template <>
struct Divider<uint32_t> {
  uint32_t magic;
  uint32_t shift;
  explicit Divider(uint32_t d) : magic(1), shift(0) { // d >= 1
    while (shift < 32 && (uint64_t(1) << shift) < d) {
      ++shift;
    }
    // < 2^32: 2^shift - d < d
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t x) const {
    const uint32_t t = __umulhi(x, magic);
    return static_cast<uint32_t>((uint64_t(t) + x) >> shift);
  }
};

template <>
struct Divider<uint64_t> {
  uint64_t d;
  explicit Divider(uint64_t d) : d(d) {}
  __device__ __forceinline__ uint64_t div(uint64_t x) const {
    return x / d;
  }
};

} // namespace torchfuse::kernels
