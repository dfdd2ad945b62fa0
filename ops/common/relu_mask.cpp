#include "ops/common/relu_mask.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace torchfuse::ops {

int64_t reluMaskBytes(int64_t numel) {
  return (numel + 31) / 32 * 4;
}

c10::SymInt reluMaskBytes(const c10::SymInt& numel) {
  return (numel + 31) / 32 * 4;
}

namespace {

// NB: the words are stored in the host's byte order, as the CUDA kernels
// store them; the uint8 view of the mask is then little-endian on every
// platform PyTorch builds for.
static_assert(
    __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
    "relu masks assume a little-endian host");

// Mask words per parallel_for task: 64K elements.
constexpr int64_t kGrainWords = 2048;

// The data offsets of consecutive logical (row-major) indices of a strided
// tensor, from `start` on; numel > 0.
class Walker {
 public:
  Walker(at::IntArrayRef sizes, at::IntArrayRef strides, int64_t start)
      : sizes_(sizes), strides_(strides), index_(sizes.size(), 0) {
    for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
      index_[d] = start % sizes[d];
      start /= sizes[d];
      offset_ += index_[d] * strides[d];
    }
  }
  int64_t offset() const {
    return offset_;
  }
  void next() {
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      offset_ += strides_[d];
      if (++index_[d] < sizes_[d]) {
        return;
      }
      offset_ -= strides_[d] * sizes_[d];
      index_[d] = 0;
    }
  }

 private:
  at::IntArrayRef sizes_;
  at::IntArrayRef strides_;
  std::vector<int64_t> index_;
  int64_t offset_ = 0;
};

template <typename T>
bool keeps(T v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v;
  } else {
    // NB: !(v <= 0), so NaN keeps.
    return !(static_cast<at::opmath_type<T>>(v) <= 0);
  }
}

template <typename T>
void packCpu(const at::Tensor& t, uint8_t* mask) {
  const int64_t n = t.numel();
  const T* data = t.const_data_ptr<T>();
  const bool contiguous = t.is_contiguous();
  at::parallel_for(0, (n + 31) / 32, kGrainWords, [&](int64_t begin, int64_t end) {
    std::optional<Walker> walk;
    if (!contiguous) {
      walk.emplace(t.sizes(), t.strides(), begin * 32);
    }
    for (int64_t w = begin; w < end; ++w) {
      const int64_t first = w * 32;
      const int64_t count = std::min<int64_t>(32, n - first);
      uint32_t bits = 0;
      for (int64_t k = 0; k < count; ++k) {
        int64_t offset = first + k;
        if (walk) {
          offset = walk->offset();
          walk->next();
        }
        bits |= uint32_t(keeps(data[offset])) << k;
      }
      std::memcpy(mask + w * 4, &bits, 4);
    }
  });
}

template <typename T>
void applyCpu(const at::Tensor& grad, const uint8_t* mask, const at::Tensor& out) {
  const int64_t n = grad.numel();
  const T* dy = grad.const_data_ptr<T>();
  T* dx = out.mutable_data_ptr<T>();
  const bool contiguous = grad.is_contiguous() && out.is_contiguous();
  at::parallel_for(0, (n + 31) / 32, kGrainWords, [&](int64_t begin, int64_t end) {
    std::optional<Walker> walk_dy, walk_dx;
    if (!contiguous) {
      walk_dy.emplace(grad.sizes(), grad.strides(), begin * 32);
      walk_dx.emplace(out.sizes(), out.strides(), begin * 32);
    }
    for (int64_t w = begin; w < end; ++w) {
      const int64_t first = w * 32;
      const int64_t count = std::min<int64_t>(32, n - first);
      uint32_t bits = 0;
      std::memcpy(&bits, mask + w * 4, 4);
      for (int64_t k = 0; k < count; ++k) {
        int64_t src = first + k;
        int64_t dst = first + k;
        if (walk_dy) {
          src = walk_dy->offset();
          dst = walk_dx->offset();
          walk_dy->next();
          walk_dx->next();
        }
        dx[dst] = ((bits >> k) & 1u) ? dy[src] : T(0);
      }
    }
  });
}

bool packsOnCpu(at::ScalarType s) {
  return at::isIntegralType(s, /*includeBool=*/true) || s == at::kFloat ||
      s == at::kDouble || s == at::kHalf || s == at::kBFloat16;
}

bool appliesOnCpu(at::ScalarType s) {
  return s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16 ||
      s == at::kComplexFloat || s == at::kComplexDouble;
}

// NB: one bool per element, padded to whole words, then 8 bits to a byte in
// place: 1 byte per element of temporaries (the int64 form took 16).
at::Tensor packReluMaskAten(const at::Tensor& t) {
  const int64_t n = t.numel();
  const int64_t bytes = reluMaskBytes(n);
  auto flags = at::zeros({bytes * 8}, t.options().dtype(at::kBool));
  if (n > 0) {
    auto view = flags.narrow(0, 0, n).view(t.sizes());
    at::le_out(view, t, 0);
    view.logical_not_();
  }
  const auto u8 = t.options().dtype(at::kByte);
  const auto weights = at::bitwise_left_shift(at::ones({8}, u8), at::arange(8, u8));
  return at::sum(flags.view(at::kByte).view({bytes, 8}).mul_(weights), {1}, false, at::kByte);
}

} // namespace

at::Tensor packReluMask(const at::Tensor& t) {
  if (!t.is_cpu() || t.layout() != at::kStrided || !packsOnCpu(t.scalar_type())) {
    return packReluMaskAten(t);
  }
  auto mask = at::empty({reluMaskBytes(t.numel())}, t.options().dtype(at::kByte));
  if (t.numel() > 0) {
    AT_DISPATCH_V2(
        t.scalar_type(), "packReluMask",
        AT_WRAP([&] { packCpu<scalar_t>(t, mask.mutable_data_ptr<uint8_t>()); }),
        AT_EXPAND(AT_INTEGRAL_TYPES_V2), at::kBool, at::kFloat, at::kDouble, at::kHalf,
        at::kBFloat16);
  }
  return mask;
}

at::Tensor unpackReluMask(const at::Tensor& mask, c10::SymIntArrayRef sizes) {
  c10::SymInt n = 1;
  for (const auto& s : sizes) {
    n = n * s;
  }
  TORCH_INTERNAL_ASSERT(mask.scalar_type() == at::kByte, "relu mask of dtype ", mask.scalar_type());
  TORCH_SYM_INTERNAL_ASSERT(
      mask.sym_numel().sym_eq(reluMaskBytes(n)), "relu mask of ", mask.sym_numel(), " bytes for ",
      n, " elements");
  const auto shifts = at::arange(8, mask.options().dtype(at::kByte));
  auto bits = at::bitwise_right_shift(mask.reshape({-1, 1}), shifts);
  bits.bitwise_and_(1);
  return bits.view(-1).narrow_symint(0, 0, n).view(at::kBool).view_symint(sizes);
}

at::Tensor unpackReluMask(const at::Tensor& mask, at::IntArrayRef sizes) {
  return unpackReluMask(mask, c10::fromIntArrayRefSlow(sizes));
}

at::Tensor applyReluMask(const at::Tensor& grad, const at::Tensor& mask, at::Tensor out) {
  if (!grad.is_cpu() || grad.layout() != at::kStrided || !mask.is_cpu() ||
      !appliesOnCpu(grad.scalar_type())) {
    // masked_fill, not a product: a NaN gradient where the output was
    // clamped must give 0, as threshold_backward does.
    return out.copy_(grad.masked_fill(unpackReluMask(mask, grad.sizes()).logical_not(), 0));
  }
  TORCH_INTERNAL_ASSERT(
      mask.scalar_type() == at::kByte && mask.numel() == reluMaskBytes(grad.numel()),
      "relu mask of ", mask.numel(), " bytes for ", grad.numel(), " elements");
  if (grad.numel() > 0) {
    const auto bytes = mask.contiguous();
    AT_DISPATCH_V2(
        grad.scalar_type(), "applyReluMask",
        AT_WRAP([&] { applyCpu<scalar_t>(grad, bytes.const_data_ptr<uint8_t>(), out); }),
        at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kComplexFloat,
        at::kComplexDouble);
  }
  return out;
}

at::Tensor reluKeep(const at::Tensor& y) {
  return at::le(y, 0).logical_not();
}

} // namespace torchfuse::ops
