#pragma once

// Shared helpers of the op tests: signed random inputs, one dtype-keyed
// tolerance table, a forward + backward comparison against an unfused ATen
// composition, and error-message checks.

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace torchfuse::test {

struct Tolerance {
  double rtol;
  double atol;
};

// The one tolerance table of the op tests.  The CPU kernels are ATen
// compositions, so only reassociation in the backward (sums over broadcast
// dims, recomputed batch-norm statistics) separates them from the reference.
inline Tolerance toleranceFor(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return {1e-10, 1e-12};
    case at::kFloat:
      return {1e-4, 1e-5};
    case at::kHalf:
    case at::kBFloat16:
      return {1e-2, 1e-2};
    default:
      ADD_FAILURE() << "no tolerance for dtype " << dtype;
      return {0.0, 0.0};
  }
}

inline const std::vector<at::ScalarType>& testDtypes() {
  static const std::vector<at::ScalarType> dtypes{at::kFloat, at::kDouble};
  return dtypes;
}

// Standard-normal values pushed away from zero: signed, never 0, so the ReLU
// kinks and the batch-norm statistics are not hit by accident.
inline at::Tensor randSigned(at::IntArrayRef sizes, at::ScalarType dtype) {
  auto t = at::randn(sizes, at::TensorOptions().dtype(dtype));
  return at::where(t.abs() < 0.05, at::full_like(t, 0.5), t);
}

inline at::Tensor randPositive(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::rand(sizes, at::TensorOptions().dtype(dtype)) + 0.5;
}

inline std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  if (!t.defined()) {
    s << "undefined";
  } else {
    s << t.scalar_type() << t.sizes();
  }
  return s.str();
}

// Same shape and dtype, and allclose under the table's tolerance.
inline void expectClose(
    const at::Tensor& actual,
    const at::Tensor& expected,
    const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << ": actual is undefined";
  ASSERT_TRUE(expected.defined()) << what << ": expected is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type()) << what;
  const auto tol = toleranceFor(expected.scalar_type());
  const bool close = at::allclose(
      actual, expected, tol.rtol, tol.atol, /*equal_nan=*/true);
  EXPECT_TRUE(close) << what << ": max abs difference "
                     << (actual.numel() == 0
                             ? 0.0
                             : (actual - expected).abs().max().item<double>())
                     << " (rtol " << tol.rtol << ", atol " << tol.atol << ")";
}

inline std::vector<at::Tensor> freshLeaves(const std::vector<at::Tensor>& bases) {
  std::vector<at::Tensor> leaves;
  leaves.reserve(bases.size());
  for (const auto& b : bases) {
    leaves.push_back(b.detach().clone().set_requires_grad(true));
  }
  return leaves;
}

using OpFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// Runs `fused` and `reference` on separate leaf copies of `bases` (each
// function builds its views, e.g. transposes, from the leaves), compares the
// outputs, then back-propagates one random gradient through both and compares
// the gradient of every leaf.
inline void expectMatchesReference(
    const std::vector<at::Tensor>& bases,
    const OpFn& fused,
    const OpFn& reference) {
  const auto fused_leaves = freshLeaves(bases);
  const auto ref_leaves = freshLeaves(bases);
  const auto out = fused(fused_leaves);
  const auto expected = reference(ref_leaves);
  expectClose(out, expected, "output");
  ASSERT_TRUE(out.requires_grad()) << "the output records no graph";

  const auto grad_out = randSigned(expected.sizes(), expected.scalar_type());
  out.backward(grad_out);
  expected.backward(grad_out);
  for (size_t i = 0; i < bases.size(); ++i) {
    const auto& g = fused_leaves[i].grad();
    const auto& g_ref = ref_leaves[i].grad();
    const std::string what = "gradient of leaf " + std::to_string(i);
    if (!g_ref.defined()) {
      // autograd gives none where the leaf does not reach the output.
      EXPECT_TRUE(!g.defined() || g.eq(0).all().item<bool>()) << what;
      continue;
    }
    expectClose(g, g_ref, what);
  }
}

// `fn` throws a c10::Error whose message (without backtrace) contains
// `expected`.
inline void expectThrowsWith(
    const std::function<void()>& fn,
    const std::string& expected) {
  EXPECT_THROW(
      {
        try {
          fn();
        } catch (const c10::Error& e) {
          const std::string message = e.what_without_backtrace();
          EXPECT_NE(message.find(expected), std::string::npos)
              << "message: " << message << "\nexpected to contain: " << expected;
          throw;
        }
      },
      c10::Error);
}

// Backward with create_graph, which needs the gradient of the backward op.
inline void expectDoubleBackwardRefused(
    const at::Tensor& out,
    const std::string& op) {
  const auto grad_out = at::ones_like(out).set_requires_grad(true);
  EXPECT_THROW(
      {
        try {
          out.backward(grad_out, /*retain_graph=*/true, /*create_graph=*/true);
        } catch (const c10::Error& e) {
          const std::string message = e.what_without_backtrace();
          EXPECT_NE(
              message.find(op + ": double backward is not supported"),
              std::string::npos)
              << message;
          throw;
        }
      },
      c10::Error);
}

// Double backward: the gradients of every leaf, taken with create_graph,
// dotted with one random tensor each, then differentiated again; `fused` and
// `reference` (each run once) must agree at both orders.
inline void expectDoubleBackwardMatchesReference(
    const std::vector<at::Tensor>& bases,
    const OpFn& fused,
    const OpFn& reference) {
  std::vector<at::Tensor> dirs;
  for (const auto& b : bases) {
    dirs.push_back(randSigned(b.sizes(), b.scalar_type()));
  }
  at::Tensor grad_out;
  const auto grads = [&](const OpFn& fn) {
    const auto leaves = freshLeaves(bases);
    const auto out = fn(leaves);
    if (!grad_out.defined()) {
      grad_out = randSigned(out.sizes(), out.scalar_type());
    }
    const auto first = torch::autograd::grad(
        {out}, leaves, {grad_out}, /*retain_graph=*/true, /*create_graph=*/true,
        /*allow_unused=*/true);
    auto dot = at::zeros({}, out.options());
    for (size_t i = 0; i < first.size(); ++i) {
      if (first[i].defined()) {
        dot = dot + (first[i] * dirs[i]).sum();
      }
    }
    auto second = torch::autograd::grad(
        {dot}, leaves, {}, /*retain_graph=*/false, /*create_graph=*/false,
        /*allow_unused=*/true);
    second.insert(second.begin(), first.begin(), first.end());
    return second;
  };
  const auto got = grads(fused);
  const auto want = grads(reference);
  for (size_t i = 0; i < want.size(); ++i) {
    const std::string what =
        (i < bases.size() ? "gradient of leaf " : "double gradient of leaf ") +
        std::to_string(i % bases.size());
    // autograd gives none, or zeros, where a leaf does not reach the result
    if (!want[i].defined() || !got[i].defined()) {
      const auto& g = want[i].defined() ? want[i] : got[i];
      EXPECT_TRUE(!g.defined() || g.eq(0).all().item<bool>()) << what;
      continue;
    }
    expectClose(got[i], want[i], what);
  }
}

// The activations custom_conv_add_act, custom_conv_act_max_pool and
// custom_linear_act take, with their arguments and eager's op.
struct Act {
  const char* name;
  std::vector<double> args;
  std::function<at::Tensor(const at::Tensor&)> eager;
};

inline const std::vector<Act>& activations() {
  static const std::vector<Act> acts = {
      {"none", {}, [](const at::Tensor& t) { return t; }},
      {"relu", {}, [](const at::Tensor& t) { return at::relu(t); }},
      {"relu_", {}, [](const at::Tensor& t) { return at::relu(t); }},
      {"hardtanh", {-0.5, 1.5}, [](const at::Tensor& t) { return at::hardtanh(t, -0.5, 1.5); }},
      {"silu", {}, [](const at::Tensor& t) { return at::silu(t); }},
      {"hardswish", {}, [](const at::Tensor& t) { return at::hardswish(t); }},
      {"hardsigmoid", {}, [](const at::Tensor& t) { return at::hardsigmoid(t); }},
      {"sigmoid", {}, [](const at::Tensor& t) { return at::sigmoid(t); }},
      {"gelu", {}, [](const at::Tensor& t) { return at::gelu(t, "none"); }},
      {"gelu_tanh", {}, [](const at::Tensor& t) { return at::gelu(t, "tanh"); }},
      {"leaky_relu", {0.2}, [](const at::Tensor& t) { return at::leaky_relu(t, 0.2); }},
  };
  return acts;
}

} // namespace torchfuse::test
