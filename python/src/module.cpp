// torchfuse._C: the thin Python layer over libtorchfuse_ops and
// libtorchfuse_passes.  Importing it loads both libraries, which registers
// torch.ops.torchfuse.
//
// NB: torch::jit::Module (torch._C.ScriptModule) and
// std::shared_ptr<torch::jit::Graph> (torch._C.Graph) cross the boundary
// through torch's own pybind11 type registrations, which this module shares.

#include <dlfcn.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/extension.h>

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
  return d;
}

py::tuple optimizeModule(
    const torch::jit::Module& module,
    bool freeze,
    const std::vector<std::string>& passes,
    const std::vector<std::string>& preserved_attrs) {
  torchfuse::OptimizeOptions options;
  options.freeze = freeze;
  options.passes = passes;
  options.preserved_attrs = preserved_attrs;
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

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchfuse native bindings";
  m.def("version", &torchfuse::version);
  m.def("ops_library_path", &opsLibraryPath,
        "Path of libtorchfuse_ops, for torch.ops.load_library in other processes");
  m.attr("built_with_torch") = TORCHFUSE_TORCH_VERSION;
  m.attr("built_with_cuda") = TORCHFUSE_TORCH_CUDA;
  m.def("pass_names", &torchfuse::passNames);
  m.def("optimize", &optimizeModule, py::arg("module"), py::arg("freeze") = false,
        py::arg("passes") = std::vector<std::string>{},
        py::arg("preserved_attrs") = std::vector<std::string>{},
        "optimize(torch._C.ScriptModule, freeze, passes, preserved_attrs) -> "
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
}
