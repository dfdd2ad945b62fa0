"""torchfuse: fused TorchScript ops and the passes that insert them.

Importing this package loads the ops library, which registers
``torch.ops.torchfuse.custom_*``.
"""

import os

import torch

# NB: a development build keeps _C under $TORCHFUSE_BUILD_DIR (set by env.sh),
# so that several build trees can share one source tree; an installed package
# has it beside this file.
_build_dir = os.environ.get("TORCHFUSE_BUILD_DIR")
if _build_dir:
    __path__.append(os.path.join(_build_dir, "python", "torchfuse"))

from . import _C  # noqa: E402  (loads libtorchfuse_ops)

__version__ = _C.version()


def _check_build() -> None:
    # NB: the JIT and dispatcher headers have no stable ABI; a library built
    # against another torch fails later with undefined symbols or worse.
    built = _C.built_with_torch
    running = torch.__version__.split("+")[0]
    if running != built:
        raise ImportError(
            f"torchfuse was built against torch {built}, but torch {torch.__version__} "
            "is installed; rebuild torchfuse (make build) with the matching torch"
        )
    built_cuda = _C.built_with_cuda or None
    if built_cuda and torch.version.cuda and built_cuda != torch.version.cuda:
        raise ImportError(
            f"torchfuse was built against CUDA {built_cuda}, but torch uses CUDA "
            f"{torch.version.cuda}; rebuild torchfuse with the matching torch"
        )


_check_build()


def library_path() -> str:
    """Path of libtorchfuse_ops, for ``torch.ops.load_library`` in processes
    that load optimized models without importing torchfuse."""
    return _C.ops_library_path()


__all__ = ["library_path", "__version__"]
