"""The package version for scikit-build-core ([[tool.dynamic-metadata]] in
pyproject.toml): CMakeLists.txt's project version and, for a wheel, a local
label naming the torch it is built against, as in
torchfuse-0.1.0+torch2.11.0.cu130-cp311-cp311-linux_x86_64.whl.

NB: the JIT has no stable ABI, so a wheel runs only with the exact torch it
was built against (2.11.0, and the same CUDA); the label says which.  An
sdist is built into a wheel later, against whatever torch is there then, so
it carries the bare version.
"""

import re
from pathlib import Path

_state = "metadata_wheel"


def build_state(state):
    global _state
    _state = state


def _project_version() -> str:
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    match = re.search(r"^project\(torchfuse\s+VERSION\s+([0-9.]+)", cmake, re.M)
    if not match:
        raise RuntimeError("tools/packaging/wheel_version.py: no project(torchfuse VERSION x.y.z) in CMakeLists.txt")
    return match.group(1)


def torch_label() -> str:
    """``torch2.11.0.cu130`` (``.cpu`` for a torch without CUDA)."""
    import torch

    version = torch.__version__.split("+")[0]
    cuda = torch.version.cuda
    return f"torch{version}." + (f"cu{cuda.replace('.', '')}" if cuda else "cpu")


def dynamic_metadata(settings, project):
    if settings:
        raise RuntimeError(f"tools/packaging/wheel_version.py takes no settings, got {dict(settings)}")
    version = _project_version()
    if _state != "sdist":
        version += "+" + torch_label()
    return {"version": version}
