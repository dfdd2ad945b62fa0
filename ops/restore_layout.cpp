// custom_restore_layout: gives a value of a channels-last region
// (passes/convert_to_channels_last.cpp) the memory format the original
// graph, with its NCHW weights, gives it.
//
// NB: the original's convolutions return channels-last exactly when their
// input is (ATen: the input or the weight, and the weights were contiguous);
// the region's other ops keep that layout, and with contiguous inputs they
// return canonical contiguous strides.  So the region's dynamic entry alone
// says which: channels-last (returned as is: the rewritten region computed
// it with the original's layouts) or contiguous with canonical strides
// (also for size-1 dims, whose strides suggest_memory_format reads).
//
// In an unfrozen graph the region's entry is instead the first convolution's
// weight, which custom_channels_last_weight converted or not: given that
// result as `converted`, the op restores contiguous strides exactly where it
// converted (the original's region is then all contiguous), else returns
// `self`, which the region computed with the original's layouts.
//
// NB: CompositeImplicitAutograd, as aten::contiguous (whose alias schema
// this shares: the result is self or a copy): it is made of ATen ops, so it
// runs on every backend (Meta included) and autograd differentiates it.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops/channels_last_weight.h"
#include "ops/common/checks.h"
#include "ops/restore_layout.h"

TORCH_LIBRARY_FRAGMENT(torchfuse, m) {
  m.def(
      "custom_restore_layout(Tensor(a) self, Tensor entry, Tensor? converted=None) -> "
      "Tensor(a)");
}

namespace torchfuse::ops {

namespace {
constexpr const char* kOp = "torchfuse::custom_restore_layout";

bool hasContiguousStrides(const at::Tensor& t) {
  const auto sizes = t.sym_sizes();
  const auto strides = t.sym_strides();
  c10::SymInt expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; --d) {
    if (strides[d] != expected) {
      return false;
    }
    expected = expected * sizes[d].max(1);
  }
  return true;
}
} // namespace

bool entryIsChannelsLast(const at::Tensor& entry) {
  // NB: suggest_memory_format, as the convolution decides, not
  // is_contiguous(channels_last): a [N, 1, H, W] or [N, C, 1, 1] tensor is
  // contiguous in both senses.  An unbatched [C, H, W] input is convolved
  // as unsqueeze(0).
  if (entry.dim() == 4) {
    return entry.suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  }
  if (entry.dim() == 3) {
    return entry.unsqueeze(0).suggest_memory_format() == at::MemoryFormat::ChannelsLast;
  }
  return false;
}

at::Tensor restoreLayout(
    const at::Tensor& self,
    const at::Tensor& entry,
    const std::optional<at::Tensor>& converted) {
  checkDefined(kOp, "self", self);
  checkDefined(kOp, "entry", entry);
  const bool keep = converted.has_value() ? !convertsToChannelsLast(entry, *converted)
                                          : entryIsChannelsLast(entry);
  if (keep || hasContiguousStrides(self)) {
    return self;
  }
  return self.clone(at::MemoryFormat::Contiguous);
}

} // namespace torchfuse::ops

TORCH_LIBRARY_IMPL(torchfuse, CompositeImplicitAutograd, m) {
  m.impl(
      TORCH_SELECTIVE_NAME("torchfuse::custom_restore_layout"),
      TORCH_FN(torchfuse::ops::restoreLayout));
}
