#include "ops/common/relu_mask.h"

#include <ATen/ATen.h>

namespace torchfuse::ops {

int64_t reluMaskBytes(int64_t numel) {
  return (numel + 31) / 32 * 4;
}

c10::SymInt reluMaskBytes(const c10::SymInt& numel) {
  return (numel + 31) / 32 * 4;
}

// NB: written with ATen ops so that one definition serves every device; the
// CUDA relu kernels write the same layout directly.
at::Tensor packReluMask(const at::Tensor& keep) {
  const int64_t n = keep.numel();
  const int64_t words = (n + 31) / 32;
  const auto long_opts = keep.options().dtype(at::kLong);
  auto bits = at::zeros({words * 32}, long_opts);
  bits.narrow(0, 0, n).copy_(keep.reshape(-1));
  const auto weights =
      at::bitwise_left_shift(at::ones({32}, long_opts), at::arange(32, long_opts));
  // Values up to 2^32 - 1; the narrowing to int32 wraps, keeping the bits.
  return (bits.view({words, 32}) * weights).sum(1).to(at::kInt).view(at::kByte);
}

at::Tensor unpackReluMask(const at::Tensor& mask, at::IntArrayRef sizes) {
  int64_t n = 1;
  for (const auto s : sizes) {
    n *= s;
  }
  TORCH_INTERNAL_ASSERT(
      mask.scalar_type() == at::kByte && mask.numel() == reluMaskBytes(n),
      "relu mask of ", mask.numel(), " bytes for ", n, " elements");
  const auto long_opts = mask.options().dtype(at::kLong);
  const auto words = mask.contiguous().view(at::kInt).to(at::kLong);
  const auto bits =
      at::bitwise_and(at::bitwise_right_shift(words.unsqueeze(1), at::arange(32, long_opts)), 1);
  return bits.reshape(-1).narrow(0, 0, n).to(at::kBool).view(sizes);
}

at::Tensor reluKeep(const at::Tensor& y) {
  return at::le(y, 0).logical_not();
}

} // namespace torchfuse::ops
