// torchfuse._C: the thin Python layer over libtorchfuse_ops.  Importing it
// loads the ops library, which registers torch.ops.torchfuse.

#include <dlfcn.h>
#include <torch/extension.h>

#include "torchfuse/ops.h"

namespace {

std::string opsLibraryPath() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&torchfuse::version), &info) == 0 ||
      info.dli_fname == nullptr) {
    return "";
  }
  return info.dli_fname;
}

} // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchfuse native bindings";
  m.def("version", &torchfuse::version);
  m.def("ops_library_path", &opsLibraryPath,
        "Path of libtorchfuse_ops, for torch.ops.load_library in other processes");
  m.attr("built_with_torch") = TORCHFUSE_TORCH_VERSION;
  m.attr("built_with_cuda") = TORCHFUSE_TORCH_CUDA;
}
