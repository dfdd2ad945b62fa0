#include "ops/cuda/conv/tf32_probe.h"

#include <map>
#include <mutex>
#include <vector>

#include "ops/common/conv_composites.h"

namespace torchfuse::ops::conv_cuda {

// NB: asked of eager itself, once per problem and pass: ATen caches one plan
// per problem (sizes, strides, dtype, device, flags), so the pass run on
// constants runs the engine eager runs.  One operand is 1 + d, the other 1;
// d = 3 * 2^-13 needs 13 mantissa bits: TF32 (10) rounds it away under any
// rounding mode, float32 keeps it, so the result's sum grows by the factor
// 1 + d against 1 exactly when the engine computes in float32.
bool eagerConvIsTf32(const ConvProblem& p, ConvPass pass) {
  const auto& input = p.input;
  const auto& weight = p.weight;
  const auto& ctx = at::globalContext();
  std::vector<int64_t> key = {
      static_cast<int64_t>(pass),
      input.get_device(),
      static_cast<int64_t>(input.scalar_type()),
      p.groups,
      ctx.userEnabledCuDNN(),
      ctx.benchmarkCuDNN(),
      ctx.deterministicCuDNN(),
      ctx.deterministicAlgorithms(),
      ctx.allowTF32CuDNN(at::Float32Op::CONV)};
  for (const auto list :
       {input.sizes(), input.strides(), weight.sizes(), weight.strides(), p.stride, p.padding,
        p.dilation}) {
    key.push_back(static_cast<int64_t>(list.size()));
    key.insert(key.end(), list.begin(), list.end());
  }
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(key); it != known.end()) {
    return it->second;
  }
  constexpr double kDelta = 3.0 / 8192;
  auto x = at::empty_strided(input.sizes(), input.strides(), input.options()).fill_(1);
  auto w = at::empty_strided(weight.sizes(), weight.strides(), weight.options()).fill_(1);
  at::Tensor g;
  if (pass != ConvPass::kForward) { // in the layout eager's relu backward gives
    g = at::empty_like(convolve(x, w, std::nullopt, p.stride, p.padding, p.dilation, p.groups))
            .fill_(1);
  }
  // the pass with one operand filled with `value`, the other with 1
  const auto result = [&](double value) {
    const bool data = pass == ConvPass::kDataGradient;
    (data ? g : x).fill_(value);
    if (pass == ConvPass::kForward) {
      return convolve(x, w, std::nullopt, p.stride, p.padding, p.dilation, p.groups);
    }
    const auto grads =
        convolveBackward(g, x, w, p.stride, p.padding, p.dilation, p.groups, {data, !data, false});
    return data ? std::get<0>(grads) : std::get<1>(grads);
  };
  const auto sum = [&](double value) { return result(value).sum(at::kDouble).item<double>(); };
  const double grown = sum(1 + kDelta) / sum(1);
  const bool tf32 = grown < 1 + kDelta / 2;
  known.emplace(std::move(key), tf32);
  return tf32;
}

} // namespace torchfuse::ops::conv_cuda
