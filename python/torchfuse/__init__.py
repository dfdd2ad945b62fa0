"""torchfuse: fused TorchScript ops and the passes that insert them.

Importing this package loads the ops library, which registers
``torch.ops.torchfuse.custom_*``.
"""

import pkgutil
from typing import Any, Dict, Iterable, List, Optional

import torch

# NB: a development build keeps _C in its own tree (build/python/torchfuse),
# so that several build trees can share one source tree: env.sh puts the
# source's python/ and then the build's python/ on PYTHONPATH, and this
# package spans both, as a package split across sys.path entries does.  An
# installed package (pip install ., cmake --install) has _C beside this file.
__path__ = pkgutil.extend_path(__path__, __name__)

from . import _C  # noqa: E402  (loads libtorchfuse_ops)
from . import backends  # noqa: E402
from . import utils  # noqa: E402

__version__ = _C.version()


def _check_build() -> None:
    # NB: the JIT and dispatcher headers have no stable ABI; a library built
    # against another torch fails later with undefined symbols or worse.
    built = _C.built_with_torch
    running = torch.__version__.split("+")[0]
    if running != built:
        raise ImportError(
            f"torchfuse was built against torch {built}, but torch {torch.__version__} "
            f"is installed; install torch=={built} (the JIT has no stable ABI)"
        )
    built_cuda = _C.built_with_cuda or None
    if built_cuda and torch.version.cuda and built_cuda != torch.version.cuda:
        raise ImportError(
            f"torchfuse was built against CUDA {built_cuda}, but torch uses CUDA "
            f"{torch.version.cuda}; rebuild torchfuse with the matching torch"
        )


_check_build()


def _tag_compile_caches() -> None:
    # NB: torch.compile's caches (FX graph, AOTAutograd, remote) key a
    # compiled graph by the custom ops' schemas, not by their kernels: a
    # graph compiled against one build of the ops would be reused with
    # another whose Meta kernels give other dtypes or shapes, and its code
    # would then read their results as the old ones (wrong values, no
    # error).  The ops library's identity joins the caches' key tag, which
    # keeps any tag the user set.
    import os

    import torch.compiler.config as compiler_config

    st = os.stat(_C.ops_library_path())
    ident = f"torchfuse-{__version__}-{st.st_size}-{st.st_mtime_ns}"
    tag = compiler_config.cache_key_tag
    if ident not in tag.split(";"):
        compiler_config.cache_key_tag = f"{tag};{ident}" if tag else ident


_tag_compile_caches()


def library_path() -> str:
    """Path of libtorchfuse_ops, for ``torch.ops.load_library`` in processes
    that load optimized models without importing torchfuse."""
    return _C.ops_library_path()


def pass_names() -> list:
    """Names accepted by ``optimize(..., passes=[...])``, in pipeline order."""
    return list(_C.pass_names())


def fusions() -> list:
    """The fusion registry, in pipeline order: one dict per fusion with its
    pass ``name``, the ``chain`` it matches, the ``ops`` it inserts and
    whether it runs when no passes are named (``by_default``)."""
    return list(_C.fusions())


def _script_module_c(module, what: str):
    if isinstance(module, torch.jit.ScriptModule):
        return module._c
    if isinstance(module, torch._C.ScriptModule):
        return module
    raise TypeError(
        f"torchfuse.{what}: expected a scripted or traced module "
        f"(torch.jit.ScriptModule), got {type(module).__name__}; "
        "call torch.jit.script or torch.jit.trace first"
    )


def _names(value, argument: str, what: str) -> list:
    # NB: a bare string is iterable too: passes="relu" would run the passes
    # "r", "e", "l", "u".
    if value is None:
        return []
    if isinstance(value, (str, bytes)):
        hint = f"; write {argument}=[{value!r}]" if isinstance(value, str) else ""
        raise TypeError(
            f"torchfuse.optimize: expected {argument} to be a list of {what}, "
            f"got the {type(value).__name__} {value!r}{hint}"
        )
    try:
        names = list(value)
    except TypeError:
        raise TypeError(
            f"torchfuse.optimize: expected {argument} to be a list of {what}, "
            f"got {type(value).__name__}"
        ) from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(
                f"torchfuse.optimize: expected {argument} to be a list of {what}, "
                f"got an element of type {type(name).__name__}: {name!r}"
            )
    return names


_LAYOUTS = ("auto", "channels_last", "keep")


def optimize(
    module,
    *,
    freeze: bool = False,
    passes: Optional[Iterable[str]] = None,
    preserved_attrs: Optional[Iterable[str]] = None,
    layout: str = "auto",
) -> torch.jit.ScriptModule:
    """Returns a new module whose ``forward`` uses the torchfuse ops.

    The input module's methods, and other instances of its class, are left
    unchanged.  The result shares the input's parameters and buffers (the
    same tensors, as ``torch.compile`` does): tied weights stay tied, an
    optimizer built on the input's parameters trains the result, and
    training the result updates the input's tensors.

    With ``freeze=True`` the module (in eval mode, or frozen already) is
    frozen first, and what ``torch.jit.freeze`` folds (a BatchNorm into the
    conv or linear before it, constant scales and shifts into a conv) is
    folded where that keeps the module's meaning (docs/passes.md);
    ``preserved_attrs`` names the attributes and methods
    (e.g. ``@torch.jit.export`` ones; ``"sub.name"`` for a submodule's)
    that freezing keeps, as in ``torch.jit.freeze``.
    ``passes`` selects among :func:`pass_names` (default: the fusions whose
    ``by_default`` is true, see :func:`fusions`).

    ``layout`` chooses the 2-d convolutions' layout.  With ``freeze=True``:
    ``"auto"`` stores CUDA weights channels-last where the cost model says
    it is faster, ``"channels_last"`` does so on any device, ``"keep"``
    leaves them.  Without freeze, the first convolution's weight is
    converted on each call where the input and the weights are NCHW, so the
    convolutions run NHWC (training included): with ``"channels_last"`` on
    every call, with ``"auto"`` where the cost model says so for CUDA
    weights and then as each call site's measured choice decides (its first
    calls alternate the two layouts and time them; see
    :func:`measured_layouts`); ``"keep"`` leaves the graph NCHW.
    Outputs keep the memory format the original returns.
    """
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(
            f"torchfuse.optimize: expected layout to be one of "
            f"{', '.join(repr(x) for x in _LAYOUTS)}, got {layout!r}"
        )
    c = _script_module_c(module, "optimize")
    names = _names(passes, "passes", "pass names")
    preserved = _names(preserved_attrs, "preserved_attrs", "names")
    result, _ = _C.optimize(c, freeze, names, preserved, layout)
    return torch.jit._recursive.wrap_cpp_module(result)


def fuse_graph(graph: torch._C.Graph, passes: Optional[Iterable[str]] = None) -> Dict[str, int]:
    """Runs the pipeline's graph stage on ``graph`` in place: the
    canonicalization, the dropouts that are their input (constant probability
    0, or a constant train=False) removed, the
    attention masks proven true everywhere dropped, then the fusions
    (``passes``, default those on by default) in the registry's order, then
    the in-place relus no fusion took restored.  Returns how many chains
    each fused, with ``nodes_before``, ``nodes_after``,
    ``zero_dropouts_removed`` and ``attention_masks_dropped``.  The graph
    should be inlined and constant-propagated, and must not have been
    executed yet."""
    if not isinstance(graph, torch._C.Graph):
        raise TypeError(
            f"torchfuse.fuse_graph: expected a torch._C.Graph, got {type(graph).__name__}"
        )
    return dict(_C.fuse_graph(graph, list(passes) if passes is not None else []))


def report(module) -> Dict[str, int]:
    """Counts, per pass name, the torchfuse ops in ``module.forward``
    (sub-blocks included)."""
    return dict(_C.report(_script_module_c(module, "report")))


def measured_layouts() -> List[Dict[str, Any]]:
    """The layout choices that CUDA calls of unfrozen modules optimized with
    ``layout="auto"`` have measured, oldest first: one per call site (the
    module's first converted weight), input sizes, dtype, grad mode and
    autocast dtype.  Each has ``calls`` so far and, once decided,
    ``channels_last`` (else None) with the median times in ms of the
    blocks of calls it was decided by (``nchw_ms``, ``channels_last_ms``).
    See docs/passes.md, "Unfrozen graphs"."""
    return list(_C.measured_layouts())


__all__ = [
    "backends",
    "utils",
    "library_path",
    "optimize",
    "fuse_graph",
    "report",
    "measured_layouts",
    "pass_names",
    "fusions",
    "__version__",
]


def __getattr__(name: str):
    # NB: torchfuse.fx (torch.compile and torch.export) is imported on first
    # use: TorchScript users need not pay for torch.export's import.
    if name == "fx":
        import importlib

        return importlib.import_module(".fx", __name__)
    raise AttributeError(f"module 'torchfuse' has no attribute {name!r}")
