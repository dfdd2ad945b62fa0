#include "kernels/cudnn/conv_fusion.h"

#include <cudnn_frontend.h>

#include <exception>
#include <unordered_map>
#include <utility>

namespace torchfuse::kernels::cudnn {
namespace {

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

enum Uid : int64_t { kX = 1, kW, kBias, kOther, kY };

fe::DataType_t ioType(FusionDtype d) {
  switch (d) {
    case FusionDtype::kFloat32:
      return fe::DataType_t::FLOAT;
    case FusionDtype::kFloat16:
      return fe::DataType_t::HALF;
    case FusionDtype::kBFloat16:
      return fe::DataType_t::BFLOAT16;
  }
  return fe::DataType_t::NOT_SET;
}

// Sizes in NCHW order, strides of the NHWC (channels-last) packing.
std::vector<int64_t> nhwcStrides(int64_t c, int64_t h, int64_t w) {
  return {c * h * w, 1, w * c, c};
}

TensorPtr input(
    fe::graph::Graph& g,
    const char* name,
    Uid uid,
    std::vector<int64_t> dim,
    std::vector<int64_t> stride,
    fe::DataType_t type) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(std::move(dim))
                      .set_stride(std::move(stride))
                      .set_data_type(type));
}

TensorPtr pointwise(
    fe::graph::Graph& g,
    fe::PointwiseMode_t mode,
    TensorPtr a,
    TensorPtr b = nullptr) {
  auto attributes =
      fe::graph::Pointwise_attributes().set_mode(mode).set_compute_data_type(fe::DataType_t::FLOAT);
  return b ? g.pointwise(std::move(a), std::move(b), attributes)
           : g.pointwise(std::move(a), attributes);
}

// RELU_FWD clamped to [lo, hi]: cuDNN's clipped relu keeps NaN, as
// hardtanh does.
TensorPtr clamp(fe::graph::Graph& g, TensorPtr z, float lo, float hi) {
  return g.pointwise(
      std::move(z),
      fe::graph::Pointwise_attributes()
          .set_mode(fe::PointwiseMode_t::RELU_FWD)
          .set_compute_data_type(fe::DataType_t::FLOAT)
          .set_relu_lower_clip(lo)
          .set_relu_upper_clip(hi));
}

// act(z) in the order eager computes it (ATen's CUDA formulas).
TensorPtr activate(fe::graph::Graph& g, TensorPtr z, const Activation& act) {
  using M = fe::PointwiseMode_t;
  switch (act.kind) {
    case ActivationKind::kNone:
      return z;
    case ActivationKind::kRelu:
      return pointwise(g, M::RELU_FWD, std::move(z));
    case ActivationKind::kHardtanh:
      return clamp(g, std::move(z), act.a, act.b);
    case ActivationKind::kLeakyRelu:
      return g.pointwise(
          std::move(z),
          fe::graph::Pointwise_attributes()
              .set_mode(M::RELU_FWD)
              .set_compute_data_type(fe::DataType_t::FLOAT)
              .set_relu_lower_clip_slope(act.a));
    case ActivationKind::kSilu:
      return pointwise(g, M::SWISH_FWD, std::move(z));
    case ActivationKind::kSigmoid:
      return pointwise(g, M::SIGMOID_FWD, std::move(z));
    case ActivationKind::kGelu:
      return pointwise(g, M::GELU_FWD, std::move(z));
    case ActivationKind::kGeluTanh:
      return nullptr; // not expressible
    case ActivationKind::kHardsigmoid: {
      // min(max(z + 3, 0), 6) / 6
      auto gate = clamp(g, pointwise(g, M::ADD, std::move(z), g.tensor(3.f)), 0.f, 6.f);
      return pointwise(g, M::DIV, std::move(gate), g.tensor(6.f));
    }
    case ActivationKind::kHardswish: {
      // z * min(max(z + 3, 0), 6) / 6
      auto gate = clamp(g, pointwise(g, M::ADD, z, g.tensor(3.f)), 0.f, 6.f);
      return pointwise(
          g, M::DIV, pointwise(g, M::MUL, std::move(z), std::move(gate)), g.tensor(6.f));
    }
  }
  return nullptr;
}

} // namespace

bool expressible(const Activation& act) {
  switch (act.kind) {
    case ActivationKind::kNone:
    case ActivationKind::kRelu:
    case ActivationKind::kLeakyRelu:
    case ActivationKind::kSilu:
    case ActivationKind::kSigmoid:
    case ActivationKind::kGelu:
    case ActivationKind::kHardsigmoid:
    case ActivationKind::kHardswish:
      return true;
    case ActivationKind::kHardtanh:
      return act.a <= act.b; // hardtanh's own check, else eager raises
    case ActivationKind::kGeluTanh:
      // NB: cuDNN's tanh GELU is 4x less accurate than ATen's in float32
      // (1.0e-6 against 2.3e-7 of the output's range, H200).
      return false;
  }
  return false;
}

struct ConvFusion::Impl {
  fe::graph::Graph graph;
  std::vector<int64_t> plans; // indices into the graph's candidate list
  std::vector<int64_t> workspace;
  std::vector<std::string> names;
  bool has_bias = false;
  bool has_other = false;
};

ConvFusion::ConvFusion(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ConvFusion::~ConvFusion() = default;

std::unique_ptr<ConvFusion> ConvFusion::create(
    const ConvFusionProblem& p,
    cudnnHandle_t handle,
    int max_plans,
    int64_t max_workspace) {
  if (!expressible(p.act) || p.groups < 1 || p.c % p.groups != 0 || p.k % p.groups != 0) {
    return nullptr;
  }
  auto impl = std::make_unique<Impl>();
  impl->has_bias = p.has_bias;
  impl->has_other = p.has_other;
  auto& g = impl->graph;
  const auto io = ioType(p.dtype);
  g.set_io_data_type(io)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  const int64_t cg = p.c / p.groups;
  auto x = input(g, "x", kX, {p.n, p.c, p.h, p.w}, nhwcStrides(p.c, p.h, p.w), io);
  auto w = input(g, "w", kW, {p.k, cg, p.r, p.s}, nhwcStrides(cg, p.r, p.s), io);
  auto z = g.conv_fprop(
      x, w,
      fe::graph::Conv_fprop_attributes()
          .set_compute_data_type(fe::DataType_t::FLOAT)
          .set_padding({p.padding[0], p.padding[1]})
          .set_stride({p.stride[0], p.stride[1]})
          .set_dilation({p.dilation[0], p.dilation[1]}));
  if (p.has_bias) {
    auto b = input(g, "bias", kBias, {1, p.k, 1, 1}, {p.k, 1, p.k, p.k}, io);
    z = pointwise(g, fe::PointwiseMode_t::ADD, std::move(z), std::move(b));
  }
  if (p.has_other) {
    auto o = input(g, "other", kOther, {p.n, p.k, p.p, p.q}, nhwcStrides(p.k, p.p, p.q), io);
    if (p.alpha != 1.f) {
      o = pointwise(g, fe::PointwiseMode_t::MUL, std::move(o), g.tensor(p.alpha));
    }
    z = pointwise(g, fe::PointwiseMode_t::ADD, std::move(z), std::move(o));
  }
  auto y = activate(g, std::move(z), p.act);
  y->set_output(true)
      .set_uid(kY)
      .set_data_type(io)
      .set_dim({p.n, p.k, p.p, p.q})
      .set_stride(nhwcStrides(p.k, p.p, p.q));

  // NB: cuDNN reports an unsupported graph, engine or shape through these
  // error objects; the frontend may also throw.  Either means: no fusion.
  try {
    if (g.validate().is_bad() || g.build_operation_graph(handle).is_bad() ||
        g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}).is_bad()) {
      return nullptr;
    }
    // As ATen's cuDNN convolutions, never engines that down-convert their
    // inputs; for float32 no tensor-core (TF32) engine (see create's note).
    std::vector<fe::NumericalNote_t> excluded{fe::NumericalNote_t::DOWN_CONVERT_INPUTS};
    if (p.dtype == FusionDtype::kFloat32) {
      excluded.push_back(fe::NumericalNote_t::TENSOR_CORE);
    }
    g.deselect_numeric_notes(excluded);
    g.deselect_workspace_greater_than(max_workspace);
    if (g.check_support(handle).is_bad()) {
      return nullptr;
    }
    const int64_t count = g.get_execution_plan_count();
    for (int64_t i = 0; i < count && static_cast<int>(impl->plans.size()) < max_plans; ++i) {
      if (g.build_plan_at_index(i).is_bad()) {
        continue;
      }
      int64_t bytes = 0;
      std::string name;
      if (g.get_workspace_size_plan_at_index(i, bytes).is_bad() || bytes > max_workspace) {
        continue;
      }
      (void)g.get_plan_name_at_index(i, name);
      impl->plans.push_back(i);
      impl->workspace.push_back(bytes);
      impl->names.push_back(std::move(name));
    }
  } catch (const std::exception&) {
    return nullptr;
  }
  if (impl->plans.empty()) {
    return nullptr;
  }
  return std::unique_ptr<ConvFusion>(new ConvFusion(std::move(impl)));
}

int ConvFusion::plans() const {
  return static_cast<int>(impl_->plans.size());
}

int64_t ConvFusion::workspaceBytes(int plan) const {
  return impl_->workspace.at(plan);
}

const std::string& ConvFusion::planName(int plan) const {
  return impl_->names.at(plan);
}

bool ConvFusion::run(
    int plan,
    const ConvFusionPointers& ptrs,
    void* workspace,
    cudnnHandle_t handle) const {
  std::unordered_map<int64_t, void*> pack{
      {kX, const_cast<void*>(ptrs.x)}, {kW, const_cast<void*>(ptrs.w)}, {kY, ptrs.y}};
  if (impl_->has_bias) {
    pack.emplace(kBias, const_cast<void*>(ptrs.bias));
  }
  if (impl_->has_other) {
    pack.emplace(kOther, const_cast<void*>(ptrs.other));
  }
  return impl_->graph.execute_plan_at_index(handle, pack, workspace, impl_->plans.at(plan))
      .is_good();
}

} // namespace torchfuse::kernels::cudnn
