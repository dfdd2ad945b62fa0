#include "ops/common/autocast.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/jit/passes/autocast.h>
#include <torch/csrc/jit/python/update_graph_executor_opt.h>
#include <torch/csrc/jit/runtime/interpreter.h>

namespace torchfuse::ops {

ChainAutocast::ChainAutocast(c10::DeviceType device)
    : device_(device),
      // NB: the graph executor reads both switches when it first optimizes a
      // method for an autocast state and keeps that graph; read here at each
      // call, they agree with it as long as they are not flipped in between.
      // NB: and only inside TorchScript's interpreter: called from eager
      // code (an FX GraphModule, Inductor's or AOTInductor's code), the
      // original chain it replaces had eager autocast alone.
      jit_pass_(
          torch::jit::autocastEnabled() && torch::jit::getGraphExecutorOptimize() &&
          !torch::jit::currentCallstack().empty()),
      cuda_enabled_(at::autocast::is_autocast_enabled(c10::DeviceType::CUDA)),
      cpu_enabled_(at::autocast::is_autocast_enabled(c10::DeviceType::CPU)),
      cuda_dtype_(at::autocast::get_autocast_dtype(c10::DeviceType::CUDA)),
      cpu_dtype_(at::autocast::get_autocast_dtype(c10::DeviceType::CPU)) {}

at::Tensor ChainAutocast::reduced(const at::Tensor& t) const {
  const auto lower = at::autocast::get_lower_precision_fp_from_device_type(device_);
  if (!jit_pass_) {
    return at::autocast::cached_cast(lower, t, device_);
  }
  // NB: the pass's cast is not cached; eager autocast then meets an already
  // cast tensor, or casts a float16/bfloat16 one of the other dtype.
  return at::autocast::cached_cast(
      lower,
      t._autocast_to_reduced_precision(
          cuda_enabled_, cpu_enabled_, cuda_dtype_, cpu_dtype_),
      device_);
}

std::optional<at::Tensor> ChainAutocast::reduced(
    const std::optional<at::Tensor>& t) const {
  if (!t.has_value() || !t->defined()) {
    return t;
  }
  return reduced(*t);
}

bool ChainAutocast::fullCasts(const at::Tensor& t) const {
  if (!jit_pass_ || !t.defined()) {
    return false;
  }
  const auto dtype = t.scalar_type();
  return (dtype == at::kHalf || dtype == at::kBFloat16) &&
      ((t.is_cuda() && cuda_enabled_) || (t.is_cpu() && cpu_enabled_));
}

at::Tensor ChainAutocast::full(const at::Tensor& t) const {
  if (!jit_pass_) {
    return t;
  }
  return t._autocast_to_full_precision(cuda_enabled_, cpu_enabled_);
}

} // namespace torchfuse::ops
