// torchfuse._C: the thin Python layer over libtorchfuse_ops and
// libtorchfuse_passes.  Importing it loads both libraries, which registers
// torch.ops.torchfuse.
//
// NB: torch::jit::Module (torch._C.ScriptModule) and
// std::shared_ptr<torch::jit::Graph> (torch._C.Graph) cross the boundary
// through torch's own pybind11 type registrations, which this module shares.

#include <c10/util/StringUtil.h>
#include <dlfcn.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>

#include "ops/common/measured_choice.h"
#include "torchfuse/backends.h"
#include "torchfuse/ops.h"
#include "torchfuse/optimize.h"
#include "torchfuse/registry.h"

namespace py = pybind11;

namespace {

std::string opsLibraryPath() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&torchfuse::version), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  return info.dli_fname;
}

py::dict reportToDict(const torchfuse::FusionReport& r) {
  py::dict d;
  for (const auto& [name, count] : r.fused) {
    d[py::str(name)] = count;
  }
  d["nodes_before"] = r.nodes_before;
  d["nodes_after"] = r.nodes_after;
  d["attention_masks_dropped"] = r.attention_masks_dropped;
  d["zero_dropouts_removed"] = r.zero_dropouts_removed;
  return d;
}

// NB: in torchfuse::Layout's order.
constexpr std::array<const char*, 3> kLayouts = {"auto", "channels_last", "keep"};

template <typename Enum, size_t N>
Enum parse(const std::string& text, const std::array<const char*, N>& names, const char* what);

py::tuple optimizeModule(
    const torch::jit::Module& module,
    bool freeze,
    const std::vector<std::string>& passes,
    const std::vector<std::string>& preserved_attrs,
    const std::string& layout) {
  torchfuse::OptimizeOptions options;
  options.freeze = freeze;
  options.passes = passes;
  options.preserved_attrs = preserved_attrs;
  // NB: torchfuse.optimize validates the spelling first, naming its argument.
  options.layout = parse<torchfuse::Layout>(layout, kLayouts, "layout");
  torchfuse::FusionReport report;
  torch::jit::Module result;
  {
    py::gil_scoped_release no_gil;
    result = torchfuse::optimize(module, options, &report);
  }
  return py::make_tuple(result, reportToDict(report));
}

py::list fusionsList() {
  py::list l;
  for (const auto& f : torchfuse::fusions()) {
    py::dict d;
    d["name"] = f.name;
    d["chain"] = f.chain;
    d["ops"] = f.ops;
    d["by_default"] = f.by_default;
    l.append(d);
  }
  return l;
}

template <typename T>
py::object orNone(const std::optional<T>& v) {
  return v ? py::cast(*v) : py::none();
}

py::list measuredLayoutsList() {
  py::list l;
  for (const auto& site : torchfuse::measuredLayouts()) {
    py::dict d;
    d["input_sizes"] = site.input_sizes;
    d["dtype"] = site.dtype;
    d["grad"] = site.grad;
    d["autocast"] = site.autocast.empty() ? py::none() : py::cast(site.autocast);
    d["calls"] = site.calls;
    d["channels_last"] = orNone(site.channels_last);
    d["nchw_ms"] = orNone(site.nchw_ms);
    d["channels_last_ms"] = orNone(site.channels_last_ms);
    l.append(d);
  }
  return l;
}

// NB: the enums cross as their Python spellings; torchfuse/backends/
// validates first, with the Python argument's name in its errors.
template <typename Enum, size_t N>
const char* spelling(Enum value, const std::array<const char*, N>& names) {
  return names.at(static_cast<size_t>(value));
}

template <typename Enum, size_t N>
Enum parse(const std::string& text, const std::array<const char*, N>& names, const char* what) {
  const auto it = std::find(names.begin(), names.end(), text);
  TORCH_CHECK(
      it != names.end(), "torchfuse.backends: expected ", what, " to be one of ",
      c10::Join(", ", names), ", got \"", text, "\"");
  return static_cast<Enum>(it - names.begin());
}

constexpr std::array<const char*, 3> kRoutes = {"auto", "never", "always"};
constexpr std::array<const char*, 2> kConversions = {"auto", "separate"};

void bindBackends(py::module& m) {
  using torchfuse::backends::ChannelsLastRoute;
  using torchfuse::backends::CudnnFusion;
  using torchfuse::backends::NchwConversion;
  namespace b = torchfuse::backends;
  m.def("_get_conv_channels_last_route", [] {
    return spelling(b::conv().channelsLastRoute(), kRoutes);
  });
  m.def("_set_conv_channels_last_route", [](const std::string& v) {
    b::conv().setChannelsLastRoute(parse<ChannelsLastRoute>(v, kRoutes, "channels_last_route"));
  });
  m.def("_get_conv_allow_implicit_gemm", [] { return b::conv().allowImplicitGemm(); });
  m.def("_set_conv_allow_implicit_gemm", [](bool v) { b::conv().setAllowImplicitGemm(v); });
  m.def("_get_conv_allow_direct", [] { return b::conv().allowDirect(); });
  m.def("_set_conv_allow_direct", [](bool v) { b::conv().setAllowDirect(v); });
  m.def("_get_conv_nchw_conversion", [] {
    return spelling(b::conv().nchwConversion(), kConversions);
  });
  m.def("_set_conv_nchw_conversion", [](const std::string& v) {
    b::conv().setNchwConversion(parse<NchwConversion>(v, kConversions, "nchw_conversion"));
  });
  m.def("_get_conv_conversion_lookahead", [] { return b::conv().conversionLookahead(); });
  m.def("_set_conv_conversion_lookahead", [](int v) { b::conv().setConversionLookahead(v); });
  m.def("_get_conv_cudnn_fusion", [] { return spelling(b::conv().cudnnFusion(), kRoutes); });
  m.def("_set_conv_cudnn_fusion", [](const std::string& v) {
    b::conv().setCudnnFusion(parse<CudnnFusion>(v, kRoutes, "cudnn_fusion"));
  });
  m.def("_get_matmul_autotune", [] { return b::matmul().autotune(); });
  m.def("_set_matmul_autotune", [](bool v) { b::matmul().setAutotune(v); });
}

// torchfuse.fx's choice between a compiled graph with the fusions and one
// without: the protocol of the TorchScript layout trial, on the caller's
// timer.
void bindMeasuredChoice(py::module& m) {
  using torchfuse::ops::MeasuredChoice;
  using torchfuse::ops::MeasuredChoiceProtocol;
  const MeasuredChoiceProtocol d;
  py::class_<MeasuredChoice>(m, "MeasuredChoice")
      .def(
          py::init([](int64_t settle, int64_t warm, int64_t blocks, int64_t calls_per_block,
                      double margin) {
            return MeasuredChoice(
                MeasuredChoiceProtocol{settle, warm, blocks, calls_per_block, margin});
          }),
          py::arg("settle") = d.settle, py::arg("warm") = d.warm, py::arg("blocks") = d.blocks,
          py::arg("calls_per_block") = d.calls_per_block, py::arg("margin") = d.margin)
      .def(
          "next",
          [](MeasuredChoice& c) {
            const auto call = c.next();
            return py::make_tuple(call.candidate, call.stamp, call.resolve);
          },
          "(candidate, stamp, resolve) of the next call")
      .def("resolve", &MeasuredChoice::resolve, py::arg("block_ms"))
      .def_property_readonly("decided", [](const MeasuredChoice& c) { return orNone(c.decided()); })
      .def_property_readonly("calls", &MeasuredChoice::calls)
      .def_property_readonly("medians", [](const MeasuredChoice& c) -> py::object {
        const auto m = c.medians();
        return m ? py::make_tuple(m->first, m->second) : py::object(py::none());
      });
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchfuse native bindings";
  m.def("version", &torchfuse::version);
  m.def("ops_library_path", &opsLibraryPath,
        "Path of libtorchfuse_ops, for torch.ops.load_library in other processes");
  m.attr("built_with_torch") = TORCHFUSE_TORCH_VERSION;
  m.attr("built_with_cuda") = TORCHFUSE_TORCH_CUDA;
  m.def("pass_names", &torchfuse::passNames);
  m.def(
      "optimize", &optimizeModule, py::arg("module"), py::arg("freeze") = false,
      py::arg("passes") = std::vector<std::string>{},
      py::arg("preserved_attrs") = std::vector<std::string>{},
      py::arg("layout") = std::string("auto"),
      "optimize(torch._C.ScriptModule, freeze, passes, preserved_attrs, layout) -> "
      "(ScriptModule, dict)");
  m.def("fusions", &fusionsList,
        "The fusion registry in pipeline order: [{name, chain, ops, by_default}]");
  m.def("fuse_graph",
        [](std::shared_ptr<torch::jit::Graph> graph,
           const std::vector<std::string>& passes) {
          return reportToDict(torchfuse::fuseGraph(graph, passes));
        },
        py::arg("graph"), py::arg("passes") = std::vector<std::string>{},
        "Runs Canonicalize and the fusions on a torch._C.Graph in place");
  m.def("report", &torchfuse::report, py::arg("module"));
  m.def(
      "measured_layouts", &measuredLayoutsList,
      "The measured layout choices of layout=auto's unfrozen graphs: [{input_sizes, dtype, "
      "grad, autocast, calls, channels_last, nchw_ms, channels_last_ms}]");
  bindBackends(m);
  bindMeasuredChoice(m);
}
