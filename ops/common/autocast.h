#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace torchfuse::ops {

// The casts a scripted chain gets under autocast, for the Autocast kernels.
//
// NB: two mechanisms cast the original chain.  Eager (dispatcher) autocast
// casts the inputs of linear and conv to the lower-precision dtype (every
// floating tensor of the device but float64) and leaves batch_norm, add, div,
// mul, sigmoid, silu and relu alone, on CPU and CUDA alike.  TorchScript's
// autocast pass (torch/csrc/jit/passes/autocast.cpp) also rewrites the graph
// when it is optimized under autocast: aten::_autocast_to_reduced_precision
// before linear and conv, and aten::_autocast_to_full_precision before every
// tensor input of add, sub, mul and div when one of them has no static dtype
// or float32 -- always the case in our chains, whose intermediate values are
// untyped.  The pass runs only where GraphFunction preoptimizes the graph:
// with the JIT autocast mode on (torch._C._jit_set_autocast_mode, the default)
// and optimized execution on (torch.jit.optimized_execution), and only for a
// call from TorchScript's interpreter: the torchfuse.fx rewrite's ops run from
// eager code, where the chain had eager autocast alone.
class ChainAutocast {
 public:
  // Reads the thread's autocast state: construct it before excluding the
  // autocast keys, which turns is_autocast_enabled off.
  explicit ChainAutocast(c10::DeviceType device);

  // True when the scripted chain runs through TorchScript's autocast pass.
  bool jitPass() const {
    return jit_pass_;
  }

  // An input of linear or conv as the chain casts it: the pass's cast of
  // float32 (when it runs), then eager autocast's cast of the rest.
  at::Tensor reduced(const at::Tensor& t) const;
  std::optional<at::Tensor> reduced(const std::optional<at::Tensor>& t) const;

  // An input of add, div or mul: float16 and bfloat16 tensors of an
  // autocast-enabled device go to float32 when the pass runs; t otherwise.
  at::Tensor full(const at::Tensor& t) const;

  // Whether full() changes t's dtype.
  bool fullCasts(const at::Tensor& t) const;

 private:
  c10::DeviceType device_;
  bool jit_pass_;
  bool cuda_enabled_;
  bool cpu_enabled_;
  c10::ScalarType cuda_dtype_;
  c10::ScalarType cpu_dtype_;
};

} // namespace torchfuse::ops
