// The Autocast kernels: called from TorchScript's interpreter, the dtypes and
// values of the scripted chains under CPU autocast, with TorchScript's
// autocast pass on (the default) and off; called from C++ directly (eager
// code: torchfuse.fx's rewrite, AOTInductor), eager autocast's.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/jit/ir/irparser.h>
#include <torch/csrc/jit/passes/autocast.h>
#include <torch/csrc/jit/runtime/interpreter.h>

#include <memory>
#include <string>
#include <vector>

#include "test/cpp/util/op_test_utils.h"
#include "torchfuse/ops.h"

namespace {

using torchfuse::test::randSigned;

// CPU autocast on for the scope, the JIT autocast mode as given.
class CpuAutocast {
 public:
  CpuAutocast(at::ScalarType dtype, bool jit_pass)
      : old_enabled_(at::autocast::is_autocast_enabled(at::kCPU)),
        old_dtype_(at::autocast::get_autocast_dtype(at::kCPU)),
        old_jit_(torch::jit::setAutocastMode(jit_pass)) {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, dtype);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(at::kCPU, old_enabled_);
    at::autocast::set_autocast_dtype(at::kCPU, old_dtype_);
    torch::jit::setAutocastMode(old_jit_);
    at::autocast::clear_cache();
  }

 private:
  bool old_enabled_;
  at::ScalarType old_dtype_;
  bool old_jit_;
};

// The graph `ir` run by TorchScript's interpreter.
at::Tensor fromTorchScript(const std::string& ir, std::vector<c10::IValue> args) {
  auto graph = std::make_shared<torch::jit::Graph>();
  torch::jit::parseIR(ir, graph.get());
  torch::jit::Code code(graph, "f");
  torch::jit::InterpreterState state(code);
  torch::jit::Stack stack(args.begin(), args.end());
  state.run(stack);
  return stack.at(0).toTensor();
}

constexpr const char* kLinearAddRelu = R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor?, %o : Tensor):
  %one : int = prim::Constant[value=1]()
  %y : Tensor = torchfuse::custom_linear_add_relu(%x, %w, %b, %o, %one)
  return (%y))IR";

TEST(AutocastKernels, LinearAddReluIsFloat32AfterTheReducedLinear) {
  const auto x = randSigned({5, 8}, at::kFloat);
  const auto w = randSigned({6, 8}, at::kFloat);
  const auto b = randSigned({6}, at::kFloat);
  const auto other = randSigned({5, 6}, at::kBFloat16);
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    CpuAutocast scope(dtype, /*jit_pass=*/true);
    const auto out = fromTorchScript(kLinearAddRelu, {x, w, b, other});
    ASSERT_EQ(out.scalar_type(), at::kFloat);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    const auto expected = at::relu(
        at::linear(x.to(dtype), w.to(dtype), b.to(dtype)).to(at::kFloat) +
        other.to(at::kFloat));
    EXPECT_TRUE(at::equal(out, expected));
  }
}

TEST(AutocastKernels, LinearAddReluFollowsEagerAutocastWithTheJitPassOffOrOutsideTorchScript) {
  const auto x = randSigned({5, 8}, at::kHalf);  // cast to bfloat16 too
  const auto w = randSigned({6, 8}, at::kFloat);
  const auto other = randSigned({5, 6}, at::kBFloat16);
  for (const bool jit_pass : {false, true}) {
    CpuAutocast scope(at::kBFloat16, jit_pass);
    // NB: with the pass on, only a direct call: from the interpreter the
    // pass's casts apply (the test above)
    const auto out = jit_pass ? torchfuse::custom_linear_add_relu(x, w, std::nullopt, other)
                              : fromTorchScript(kLinearAddRelu, {x, w, c10::IValue(), other});
    ASSERT_EQ(out.scalar_type(), at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    const auto expected = at::relu(at::linear(x.to(at::kBFloat16), w.to(at::kBFloat16)) + other);
    EXPECT_TRUE(at::equal(out, expected));
  }
}

TEST(AutocastKernels, ConvReluAddAddsInFloat32) {
  const auto x = randSigned({2, 3, 6, 6}, at::kFloat);
  const auto w = randSigned({4, 3, 3, 3}, at::kFloat);
  const auto other = randSigned({2, 4, 4, 4}, at::kBFloat16);
  CpuAutocast scope(at::kBFloat16, /*jit_pass=*/true);
  const auto out = fromTorchScript(
      R"IR(
graph(%x : Tensor, %w : Tensor, %o : Tensor):
  %none : NoneType = prim::Constant()
  %zero : int = prim::Constant[value=0]()
  %one : int = prim::Constant[value=1]()
  %two : int = prim::Constant[value=2]()
  %ones : int[] = prim::ListConstruct(%one, %one)
  %zeros : int[] = prim::ListConstruct(%zero, %zero)
  %y : Tensor = torchfuse::custom_conv_relu_add(%x, %w, %none, %ones, %zeros, %ones, %one, %o, %two)
  return (%y))IR",
      {x, w, other});
  ASSERT_EQ(out.scalar_type(), at::kFloat);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  const auto conv = at::conv2d(x.to(at::kBFloat16), w.to(at::kBFloat16));
  EXPECT_TRUE(at::equal(out, at::add(at::relu(conv).to(at::kFloat), other.to(at::kFloat), 2)));
}

TEST(AutocastKernels, BatchNormAddDivSwishOfA16BitInputIsFloat32) {
  const auto x = randSigned({4, 3, 5}, at::kBFloat16);
  const auto other = randSigned({4, 3, 5}, at::kBFloat16);
  auto weight = randSigned({3}, at::kFloat);
  auto bias = randSigned({3}, at::kFloat);
  auto mean = at::zeros({3});
  auto var = at::ones({3});
  auto mean_ref = mean.clone();
  auto var_ref = var.clone();
  CpuAutocast scope(at::kBFloat16, /*jit_pass=*/true);
  const auto out = fromTorchScript(
      R"IR(
graph(%x : Tensor, %w : Tensor, %b : Tensor, %m : Tensor, %v : Tensor, %o : Tensor):
  %true : bool = prim::Constant[value=1]()
  %momentum : float = prim::Constant[value=0.1]()
  %eps : float = prim::Constant[value=1.0000000000000001e-05]()
  %divisor : float = prim::Constant[value=2.5]()
  %y : Tensor = torchfuse::custom_batch_norm_add_div_swish(%x, %w, %b, %m, %v, %true, %momentum, %eps, %o, %divisor, %true)
  return (%y))IR",
      {x, weight, bias, mean, var, other});
  ASSERT_EQ(out.scalar_type(), at::kFloat);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  const auto bn = at::batch_norm(x, weight, bias, mean_ref, var_ref, true, 0.1, 1e-5, true);
  const auto t = (bn.to(at::kFloat) + other.to(at::kFloat)) / 2.5;
  EXPECT_TRUE(at::equal(out, at::silu(t)));
  EXPECT_TRUE(at::equal(mean, mean_ref));
  EXPECT_TRUE(at::equal(var, var_ref));
}

} // namespace
