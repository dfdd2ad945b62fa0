"""The torchfuse fusions on torch.fx graphs: torch.compile and torch.export.

The TorchScript passes (docs/passes.md) rewrite TorchScript IR; this module
rewrites the same chains in FX graphs into the same ``torch.ops.torchfuse``
ops, with the same conditions where they apply:

- :func:`fuse_graph` rewrites a ``torch.fx.Graph`` in place;
- :func:`optimize` returns a new ``GraphModule`` (sharing the parameters);
- :func:`backend` (or :func:`make_backend`) is a ``torch.compile`` backend:
  the rewrite, then Inductor;
- :func:`optimize_exported` rewrites a ``torch.export.ExportedProgram``,
  e.g. before ``torch._inductor.aoti_compile_and_package``.

Two graph levels are understood: Dynamo's (torch functions, Tensor methods,
``operator`` calls: what a ``torch.compile`` backend receives) and the ATen
graphs of ``torch.export`` (``aten.conv2d``, ``aten.batch_norm``, ...; after
``run_decompositions`` also ``aten.convolution``).  Both come before
autograd: the custom ops' own Autograd kernels then give the backward (their
``custom_*_backward`` ops), so training works.  NB: not Inductor's
post-grad passes, whose forward graph is already split from its backward: a
forward rewritten there keeps the unfused chain's backward, with other saved
tensors.

The registry (``torchfuse.fusions()``, the C++ table the TorchScript pipeline
reads) gives the fusions' names, order, ops and which run by default; this
module adds, per registry entry, the matcher for FX (the TorchScript matchers
work on TorchScript IR and AliasDb, so they cannot serve FX graphs).
"""

import dataclasses
import functools
import inspect
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.export
import torch.fx
import torch.nn as nn

__all__ = ["fuse_graph", "optimize", "optimize_exported", "backend", "make_backend", "backend_passes",
           "measured_choices", "report", "pass_names"]

_ops = torch.ops.torchfuse
_aten = torch.ops.aten

# ----------------------------------------------------------------- normalize


@dataclass
class _Call:
    """A node seen as one of the chains' operations: its kind, whether it is
    in place, and its arguments by name (defaults filled in)."""

    kind: str
    inplace: bool
    args: Dict[str, Any] = field(default_factory=dict)


_CONV = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]
_CONV_DEFAULTS = dict(bias=None, stride=1, padding=0, dilation=1, groups=1)
_BN_TORCH = ["input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps",
             "cudnn_enabled"]
_BN_FUNCTIONAL = ["input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"]
_BN_DEFAULTS = dict(weight=None, bias=None, training=False, momentum=0.1, eps=1e-5)

_LN = ["input", "normalized_shape", "weight", "bias", "eps"]
_LN_DEFAULTS = dict(weight=None, bias=None, eps=1e-5)

_POOL = ["input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices"]
_POOL_DEFAULTS = dict(stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False)

# Dynamo's targets: (kind, in place, parameter names, defaults).  Tensor
# methods are keyed by name; their first parameter is the tensor.
_F = torch.nn.functional
_TORCH_TARGETS: Dict[Any, tuple] = {}
for _fn in (torch.conv1d, torch.conv2d, torch.conv3d):
    _TORCH_TARGETS[_fn] = ("conv", False, _CONV, _CONV_DEFAULTS)
_TORCH_TARGETS.update({
    torch.relu: ("relu", False, ["input"], {}),
    torch.relu_: ("relu", True, ["input"], {}),
    _F.relu: ("relu", None, ["input", "inplace"], dict(inplace=False)),
    operator.add: ("add", False, ["input", "other"], dict(alpha=1)),
    torch.add: ("add", False, ["input", "other", "alpha"], dict(alpha=1)),
    operator.iadd: ("add", True, ["input", "other"], dict(alpha=1)),
    torch._C._nn.linear: ("linear", False, ["input", "weight", "bias"], dict(bias=None)),
    _F.batch_norm: ("batch_norm", False, _BN_FUNCTIONAL, _BN_DEFAULTS),
    torch.batch_norm: ("batch_norm", False, _BN_TORCH, _BN_DEFAULTS),
    operator.truediv: ("div", False, ["input", "other"], dict(rounding_mode=None)),
    torch.div: ("div", False, ["input", "other", "rounding_mode"], dict(rounding_mode=None)),
    torch.true_divide: ("div", False, ["input", "other"], dict(rounding_mode=None)),
    operator.itruediv: ("div", True, ["input", "other"], dict(rounding_mode=None)),
    torch.sigmoid: ("sigmoid", False, ["input"], {}),
    _F.sigmoid: ("sigmoid", False, ["input"], {}),
    operator.mul: ("mul", False, ["input", "other"], {}),
    torch.mul: ("mul", False, ["input", "other"], {}),
    operator.imul: ("mul", True, ["input", "other"], {}),
    _F.silu: ("silu", None, ["input", "inplace"], dict(inplace=False)),
    _F.hardsigmoid: ("hardsigmoid", None, ["input", "inplace"], dict(inplace=False)),
    _F.hardswish: ("hardswish", None, ["input", "inplace"], dict(inplace=False)),
    _F.relu6: ("relu6", None, ["input", "inplace"], dict(inplace=False)),
    _F.hardtanh: ("hardtanh", None, ["input", "min_val", "max_val", "inplace"],
                  dict(min_val=-1.0, max_val=1.0, inplace=False)),
    _F.hardtanh_: ("hardtanh", True, ["input", "min_val", "max_val"], dict(min_val=-1.0, max_val=1.0)),
    _F.gelu: ("gelu", False, ["input", "approximate"], dict(approximate="none")),
    _F.leaky_relu: ("leaky_relu", None, ["input", "negative_slope", "inplace"],
                    dict(negative_slope=0.01, inplace=False)),
    _F.leaky_relu_: ("leaky_relu", True, ["input", "negative_slope"], dict(negative_slope=0.01)),
    _F.adaptive_avg_pool2d: ("adaptive_avg_pool", False, ["input", "output_size"], {}),
    torch._C._nn.adaptive_avg_pool2d: ("adaptive_avg_pool", False, ["input", "output_size"], {}),
    torch.mean: ("mean", False, ["input", "dim", "keepdim", "dtype"], dict(keepdim=False, dtype=None)),
    torch.max_pool2d: ("max_pool", False, _POOL[:-1], _POOL_DEFAULTS),
    _F.max_pool2d: ("max_pool", False, _POOL, _POOL_DEFAULTS),
    _F.layer_norm: ("layer_norm", False, _LN, _LN_DEFAULTS),
    torch.layer_norm: ("layer_norm", False, _LN + ["cudnn_enable"], dict(_LN_DEFAULTS, cudnn_enable=True)),
})
# The fusable activations (isFusableActivation): the arguments the op takes
# from the call's, in the op's order (relu6 and gelu: see _activation).
_ACTIVATION_ARGS = {"relu": (), "relu6": (), "hardtanh": ("min_val", "max_val"), "silu": (), "hardswish": (),
                    "hardsigmoid": (), "sigmoid": (), "gelu": (), "leaky_relu": ("negative_slope",)}
_METHOD_TARGETS = {
    "relu": ("relu", False, ["input"], {}),
    "relu_": ("relu", True, ["input"], {}),
    "add": ("add", False, ["input", "other", "alpha"], dict(alpha=1)),
    "add_": ("add", True, ["input", "other", "alpha"], dict(alpha=1)),
    "div": ("div", False, ["input", "other", "rounding_mode"], dict(rounding_mode=None)),
    "true_divide": ("div", False, ["input", "other"], dict(rounding_mode=None)),
    "div_": ("div", True, ["input", "other", "rounding_mode"], dict(rounding_mode=None)),
    "sigmoid": ("sigmoid", False, ["input"], {}),
    "mul": ("mul", False, ["input", "other"], {}),
    "mul_": ("mul", True, ["input", "other"], {}),
    "mean": ("mean", False, ["input", "dim", "keepdim", "dtype"], dict(keepdim=False, dtype=None)),
}
# ATen overloads (torch.export): their schemas give the parameter names.
_ATEN_TARGETS = {
    _aten.conv1d.default: ("conv", False),
    _aten.conv2d.default: ("conv", False),
    _aten.conv3d.default: ("conv", False),
    _aten.convolution.default: ("convolution", False),
    _aten.relu.default: ("relu", False),
    _aten.relu_.default: ("relu", True),
    _aten.add.Tensor: ("add", False),
    _aten.add_.Tensor: ("add", True),
    _aten.linear.default: ("linear", False),
    _aten.batch_norm.default: ("batch_norm", False),
    _aten.div.Tensor: ("div", False),
    _aten.div.Scalar: ("div", False),
    _aten.div_.Tensor: ("div", True),
    _aten.sigmoid.default: ("sigmoid", False),
    _aten.mul.Tensor: ("mul", False),
    _aten.mul_.Tensor: ("mul", True),
    _aten.silu.default: ("silu", False),
    _aten.silu_.default: ("silu", True),
    _aten.hardsigmoid.default: ("hardsigmoid", False),
    _aten.hardsigmoid_.default: ("hardsigmoid", True),
    _aten.hardswish.default: ("hardswish", False),
    _aten.hardswish_.default: ("hardswish", True),
    _aten.relu6.default: ("relu6", False),
    _aten.relu6_.default: ("relu6", True),
    _aten.hardtanh.default: ("hardtanh", False),
    _aten.hardtanh_.default: ("hardtanh", True),
    _aten.gelu.default: ("gelu", False),
    _aten.gelu_.default: ("gelu", True),
    _aten.leaky_relu.default: ("leaky_relu", False),
    _aten.leaky_relu_.default: ("leaky_relu", True),
    _aten.adaptive_avg_pool2d.default: ("adaptive_avg_pool", False),
    _aten.mean.dim: ("mean", False),
    _aten.max_pool2d.default: ("max_pool", False),
    _aten.layer_norm.default: ("layer_norm", False),
}


@dataclass(frozen=True)
class _Attr:
    """A submodule's parameter or buffer (of a call_module node), read with a
    get_attr node where a fused op takes it."""

    path: str


def _target(node: torch.fx.Node) -> Any:
    """What a get_attr or call_module node names in the graph's module (a
    tensor, a submodule), or None where the graph has no module or it has
    no such attribute."""
    return _attribute(node.graph, str(node.target))


def _attribute(graph: torch.fx.Graph, path: str) -> Any:
    obj: Any = graph.owning_module
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _has_hooks(mod: nn.Module) -> bool:
    """Whether calling mod runs hooks (its own or the global ones), which a
    fused op would drop."""
    own = (mod._forward_hooks, mod._forward_pre_hooks, mod._backward_hooks, mod._backward_pre_hooks)
    g = torch.nn.modules.module
    glob = (g._global_forward_hooks, g._global_forward_pre_hooks, g._global_backward_hooks,
            g._global_backward_pre_hooks)
    return any(len(h) > 0 for h in own + glob)


def _module_call(node: torch.fx.Node) -> Optional[_Call]:
    """call_module nodes of torch.fx.symbolic_trace: convolutions, linears,
    activations and adaptive average pools.  NB: not BatchNorm modules: their mode and
    num_batches_tracked update live in the module, not in the graph."""
    mod = _target(node)
    if not isinstance(mod, nn.Module) or not node.args or _has_hooks(mod):
        return None
    x, t = node.args[0], node.target
    if type(mod) in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        if mod.padding_mode != "zeros" or isinstance(mod.padding, str):
            return None
        bias = _Attr(f"{t}.bias") if mod.bias is not None else None
        return _Call("conv", False, dict(input=x, weight=_Attr(f"{t}.weight"), bias=bias, stride=mod.stride,
                                          padding=mod.padding, dilation=mod.dilation, groups=mod.groups))
    if type(mod) is nn.Linear:
        bias = _Attr(f"{t}.bias") if mod.bias is not None else None
        return _Call("linear", False, dict(input=x, weight=_Attr(f"{t}.weight"), bias=bias))
    if type(mod) is nn.ReLU:
        return _Call("relu", mod.inplace, dict(input=x))
    if type(mod) is nn.SiLU:
        return _Call("silu", mod.inplace, dict(input=x))
    if type(mod) is nn.Sigmoid:
        return _Call("sigmoid", False, dict(input=x))
    if type(mod) is nn.Hardsigmoid:
        return _Call("hardsigmoid", mod.inplace, dict(input=x))
    if type(mod) is nn.Hardswish:
        return _Call("hardswish", mod.inplace, dict(input=x))
    if type(mod) in (nn.Hardtanh, nn.ReLU6):
        return _Call("hardtanh", mod.inplace, dict(input=x, min_val=mod.min_val, max_val=mod.max_val))
    if type(mod) is nn.GELU:
        return _Call("gelu", False, dict(input=x, approximate=mod.approximate))
    if type(mod) is nn.LeakyReLU:
        return _Call("leaky_relu", mod.inplace, dict(input=x, negative_slope=mod.negative_slope))
    if type(mod) is nn.AdaptiveAvgPool2d:
        return _Call("adaptive_avg_pool", False, dict(input=x, output_size=mod.output_size))
    if type(mod) is nn.LayerNorm:
        w = _Attr(f"{t}.weight") if mod.weight is not None else None
        b = _Attr(f"{t}.bias") if mod.bias is not None else None
        return _Call("layer_norm", False, dict(input=x, normalized_shape=mod.normalized_shape, weight=w, bias=b,
                                               eps=mod.eps))
    if type(mod) is nn.MaxPool2d:
        return _Call("max_pool", False, dict(input=x, kernel_size=mod.kernel_size, stride=mod.stride,
                                             padding=mod.padding, dilation=mod.dilation, ceil_mode=mod.ceil_mode,
                                             return_indices=mod.return_indices))
    return None


def _bind(names: Sequence[str], defaults: Dict[str, Any], args, kwargs) -> Optional[Dict[str, Any]]:
    if len(args) > len(names):
        return None
    bound = dict(defaults)
    bound.update(zip(names, args))
    bound.update(kwargs)
    return bound


def _aten_names(op) -> tuple:
    schema = op._schema
    names = ["input" if a.name == "self" else a.name for a in schema.arguments]
    defaults = {("input" if a.name == "self" else a.name): a.default_value
                for a in schema.arguments if a.has_default_value()}
    return names, defaults


def _normalize(node: torch.fx.Node) -> Optional[_Call]:
    if node.op == "call_module":
        return _module_call(node)
    if node.op == "call_method":
        entry = _METHOD_TARGETS.get(node.target)
    elif node.op == "call_function" and node.target in _ATEN_TARGETS:
        kind, inplace = _ATEN_TARGETS[node.target]
        names, defaults = _aten_names(node.target)
        entry = (kind, inplace, names, defaults)
    elif node.op == "call_function":
        try:
            entry = _TORCH_TARGETS.get(node.target)
        except TypeError:  # an unhashable target
            entry = None
    else:
        entry = None
    if entry is None:
        return None
    kind, inplace, names, defaults = entry
    bound = _bind(names, defaults, node.args, node.kwargs)
    if bound is None or bound.get("out") is not None:  # an out= call writes and returns its out
        return None
    if inplace is None:  # F.relu(x, inplace=...)
        if not isinstance(bound.get("inplace"), bool):
            return None  # a flag known only at run time: either spelling
        inplace = bound["inplace"]
    if kind == "convolution":  # aten.convolution: a conv{1,2,3}d when not transposed
        if bound.get("transposed") is not False or not _all_zero(bound.get("output_padding")):
            return None
        kind = "conv"
    return _Call(kind, inplace, bound)


def _all_zero(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, int) and x == 0 for x in v)


# ------------------------------------------------------- values and aliasing


def _meta(node) -> Any:
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def _is_tensor_value(v) -> bool:
    """A graph value that is a tensor, as far as the graph tells: by its
    metadata (Dynamo and torch.export give every value some), else by its
    annotation (symbolic_trace: an input annotated as another type is not
    one; an unannotated one is, as TorchScript takes it)."""
    if isinstance(v, _Attr):
        return True
    if not isinstance(v, torch.fx.Node):
        return False
    m = _meta(v)
    if m is not None:
        return isinstance(m, torch.Tensor)
    return v.type is None or (isinstance(v.type, type) and issubclass(v.type, torch.Tensor))


def _same_layout(a, b) -> bool:
    """Whether a and b are tensors of the same static sizes and strides (by
    their metadata).  NB: eager's other + chain takes other's strides where
    the layouts differ, the fused op the chain's (chainIsAddSelf): the chain
    may be add's second operand only where they cannot differ."""
    ma, mb = _meta(a), _meta(b)
    if not (isinstance(ma, torch.Tensor) and isinstance(mb, torch.Tensor)):
        return False
    dims = list(ma.shape) + list(ma.stride()) + list(mb.shape) + list(mb.stride())
    if not all(isinstance(d, int) for d in dims):
        return False
    return list(ma.shape) == list(mb.shape) and list(ma.stride()) == list(mb.stride())


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_list(v) -> Optional[List[int]]:
    """An int or a list of ints (Python values, not symbolic) as a list."""
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    return None


_VIEW_METHODS = {
    "view", "view_as", "reshape", "reshape_as", "transpose", "permute", "expand", "expand_as", "unsqueeze",
    "squeeze", "flatten", "unflatten", "t", "narrow", "select", "__getitem__", "contiguous", "split", "chunk",
    "unbind", "detach", "as_strided", "to", "type_as", "movedim", "swapaxes", "diagonal", "unfold", "real",
    "imag", "view_as_real", "view_as_complex", "float", "double", "half", "bfloat16",
}


# Ops whose schema says fresh but which return their input itself (in
# eval, or with p == 0): the TorchScript passes special-case them too.
_RETURNS_INPUT = {"dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"}


@functools.lru_cache(maxsize=None)
def _may_return_view(name: str) -> bool:
    """Whether a Tensor method or torch function of this name may return a
    view of (or the same tensor as) its first argument: by ATen's schemas
    of that name (a return with alias information in any overload); a name
    with no ATen op (``cpu``, ``type``, ``getattr`` for ``.T``, a user's
    function) may."""
    if name in _VIEW_METHODS or name in _RETURNS_INPUT:
        return True
    try:
        schemas = torch._C._jit_get_schemas_for_operator(f"aten::{name}")
    except RuntimeError:
        schemas = []
    if not schemas:
        return True
    return any(r.alias_info is not None for sch in schemas for r in sch.returns)


def _view_source(v: torch.fx.Node):
    """The argument v may be a view of, or None where v is fresh."""
    if v.op == "call_module":
        c = _module_call(v)
        fresh = c is not None and not c.inplace
        return None if fresh or not v.args else v.args[0]
    if v.op == "call_method":
        return v.args[0] if v.args and _may_return_view(v.target) else None
    if v.op != "call_function" or not v.args:
        return None
    t = v.target
    if isinstance(t, torch._ops.OpOverload):
        ret = t._schema.returns
        view = bool(ret) and ret[0].alias_info is not None
        return v.args[0] if view or t._schema.name.split("::")[-1] in _RETURNS_INPUT else None
    if t in _INPLACE_OPERATORS or t is operator.getitem:
        return v.args[0]
    name = getattr(t, "__name__", "")
    if name.endswith("_") or _writes_by_flag(v):
        return v.args[0]  # an in-place call returns its input
    try:
        known = t in _TORCH_TARGETS
    except TypeError:  # an unhashable target
        known = False
    if getattr(t, "__module__", None) in ("_operator", "operator") or known:
        return None  # a + b, torch.conv2d, F.relu(x): fresh
    return v.args[0] if _may_return_view(name) else None


def _root(v):
    """What v may be a view of, as far as the graph shows: followed through
    every op that may return a view of its first argument or the argument
    itself (_view_source; where unknown, it is taken to).  Fresh results,
    placeholders and attributes are roots."""
    seen = 0
    while isinstance(v, torch.fx.Node) and seen < 10000:
        seen += 1
        nxt = _view_source(v)
        if not isinstance(nxt, torch.fx.Node):
            return v
        v = nxt
    return v


def _identity(v) -> Any:
    """What aliasing compares: an attribute's tensor by its storage (two
    attributes may hold one tensor: a buffer registered under a second
    name, tied parameters), a module's own tensor (what a call_module node
    writes) likewise, else the graph value v is a view of (_root)."""
    if isinstance(v, torch.Tensor):
        t = v
    elif isinstance(v, torch.fx.Node):
        r = _root(v)
        if r.op == "placeholder" and not isinstance(_meta(r), nn.Parameter):
            # NB: the caller may pass one tensor, or views of one, as two
            # inputs (a buffer of Dynamo's graph too): as TorchScript's alias
            # analysis takes them, graph inputs may alias each other
            return ("graph input",)
        t = _target(r) if r.op == "get_attr" else None
        if not isinstance(t, torch.Tensor):
            return r
    else:
        return None
    try:
        return ("storage", t.untyped_storage().data_ptr())
    except Exception:  # noqa: BLE001  (no storage: a fake or meta tensor)
        return ("tensor", id(t))


def _may_alias(a, b) -> bool:
    """Whether a and b (graph values, or a module's tensors that a
    call_module node writes) may share memory.  NB: as the TorchScript
    passes take them: graph inputs (placeholders other than Dynamo's
    parameters) may alias each other, distinct fresh results are distinct;
    attributes are compared by their tensors' storage."""
    ia, ib = _identity(a), _identity(b)
    return ia is not None and ia == ib


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul, operator.setitem}


@functools.lru_cache(maxsize=None)
def _signature(fn) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one
        return None


def _writes_by_flag(node: torch.fx.Node) -> bool:
    """Whether a torch function call passes its ``inplace`` parameter True,
    by keyword or by position (Dynamo inlines nn.Hardswish, nn.Hardtanh,
    nn.LeakyReLU, ... as F.hardswish(x, True)); a call that cannot be bound
    to its signature is taken to write."""
    if node.kwargs.get("inplace") is True:
        return True
    try:
        sig = _signature(node.target) if callable(node.target) else None
    except TypeError:  # an unhashable target
        sig = None
    if sig is None or "inplace" not in sig.parameters:
        return False
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return True
    return bound.arguments.get("inplace", False) is not False


def _is_library_function(t) -> bool:
    """A function of torch, or of Python's operator, builtins or math
    modules, whose writes its name or flags tell; anything else is a
    user's."""
    module = getattr(t, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "operator", "_operator", "builtins", "math")


def _flat_nodes(v) -> List[torch.fx.Node]:
    if isinstance(v, (list, tuple)):
        return [n for x in v for n in _flat_nodes(x)]
    return [v] if isinstance(v, torch.fx.Node) else []


def _tensor_args(node: torch.fx.Node) -> List[torch.fx.Node]:
    return _flat_nodes(list(node.args) + list(node.kwargs.values()))


def _writes(node: torch.fx.Node) -> List[Any]:
    """The values node writes in place (graph values; for a call_module
    node in training mode also the module's buffers, which BatchNorm's
    running statistics are)."""
    out = []
    if "out" in node.kwargs:
        out.append(node.kwargs["out"])
    if node.op == "call_module":
        call = _normalize(node)
        if call is None or call.inplace:  # an unknown module may write its input
            out += [a for a in node.args if isinstance(a, torch.fx.Node)]
        mod = _target(node)
        if isinstance(mod, nn.Module) and mod.training:
            out += [b for b in mod.buffers() if b is not None]
    elif node.op == "call_method":
        name = node.target
        if name.endswith("_") and not name.startswith("_") and node.args:
            out.append(node.args[0])
    elif node.op == "call_function":
        t = node.target
        if t in _INPLACE_OPERATORS and node.args:
            out.append(node.args[0])
        elif isinstance(t, torch._ops.OpOverload):
            for i, a in enumerate(t._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    out.append(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
        elif node.args and _writes_by_flag(node):
            out.append(node.args[0])
        elif not _is_library_function(t):
            out += _tensor_args(node)  # a user's function (torch.fx.wrap) may write any argument
        else:
            name = getattr(t, "__name__", "")
            if name.endswith("_") and not (name.startswith("__") and name.endswith("__")) and node.args:
                out += _flat_nodes(node.args[0])  # torch.relu_(x), torch._foreach_mul_([a, b], 2)
        call = _normalize(node)
        # NB: batch_norm writes its running statistics in training, though
        # aten::batch_norm's schema does not say so.
        if call is not None and call.kind == "batch_norm" and call.args.get("training") is not False:
            out += [call.args.get("running_mean"), call.args.get("running_var")]
    return [v for v in out if isinstance(v, (torch.fx.Node, torch.Tensor))]


def _between(head: torch.fx.Node, tail: torch.fx.Node) -> List[torch.fx.Node]:
    """The nodes strictly between head and tail, in graph order."""
    out, n = [], head.next
    while n is not tail and n.op != "root":
        out.append(n)
        n = n.next
    return out


def _after(node: torch.fx.Node) -> List[torch.fx.Node]:
    out, n = [], node.next
    while n.op != "root":
        out.append(n)
        n = n.next
    return out


_MODE_SWITCHES = {"_set_grad_enabled", "_enter_autocast", "_exit_autocast", "_enter_inference_mode",
                  "_exit_inference_mode"}


def _switches_mode(node: torch.fx.Node) -> bool:
    """A Dynamo node that changes grad or autocast mode (torch.no_grad() and
    autocast regions inside a compiled function)."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    return name in _MODE_SWITCHES or name.startswith("_set_")


def _no_intervening_writes(head, tail, chain: set, inputs: Iterable) -> bool:
    """noInterveningWrites: nothing between head and tail writes a value
    that may alias the chain's inputs (the fused op, inserted at the tail,
    reads them later than head did), or switches grad or autocast mode (a
    conv under no_grad, its relu and add with grad, must not become one op
    that records a graph for the conv)."""
    # NB: a call_module's parameters (_Attr) by their tensors, which a
    # get_attr node's write is compared with
    inputs = [_attribute(head.graph, v.path) if isinstance(v, _Attr) else v for v in inputs]
    inputs = [v for v in inputs if isinstance(v, (torch.fx.Node, torch.Tensor))]
    for n in _between(head, tail):
        if n in chain:
            continue
        if _switches_mode(n):
            return False
        for w in _writes(n):
            if any(_may_alias(w, v) for v in inputs):
                return False
    return True


def _single_use(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    """hasSingleUse: node's only reader is user (a graph output is a use)."""
    return len(node.users) == 1 and user in node.users


def _autocast_regions(graph: torch.fx.Graph) -> set:
    """The nodes inside a Dynamo autocast region (outsideScriptedAutocast:
    chains there stay as they are, as in TorchScript)."""
    inside, depth = set(), 0
    for n in graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name == "_enter_autocast":
            depth += 1
        elif name == "_exit_autocast":
            depth = max(0, depth - 1)
        elif depth:
            inside.add(n)
    return inside


# -------------------------------------------------------------------- passes


class _Rewriter:
    def __init__(self, graph: torch.fx.Graph, renamed: Dict[str, str]):
        self.graph = graph
        self.autocast = _autocast_regions(graph)
        self.renamed = renamed

    def call(self, v, kind: str) -> Optional[_Call]:
        if not isinstance(v, torch.fx.Node) or v in self.autocast:
            return None
        c = _normalize(v)
        return c if c is not None and c.kind == kind else None

    def replace(self, tail: torch.fx.Node, chain: List[torch.fx.Node], op, args: tuple) -> torch.fx.Node:
        """The fused op at the tail's place; the chain's nodes removed (the
        tail first)."""
        with self.graph.inserting_before(tail):
            args = tuple(self.graph.get_attr(a.path) if isinstance(a, _Attr) else a for a in args)
            fused = self.graph.call_function(op, args)
        fused.meta = dict(tail.meta)
        name = tail.name
        tail.replace_all_uses_with(fused)
        for n in [tail] + [c for c in reversed(chain) if c is not tail]:
            self.graph.erase_node(n)
        self.renamed[name] = fused.name  # an ExportedProgram's signature names its outputs
        return fused

    @staticmethod
    def add_operands(add: _Call, node_is_first: bool):
        """(other, alpha) of the add whose chain operand is first or second;
        None where alphaIsOne, isTensorAdd or addPromotes fails."""
        a = add.args
        if add.inplace or a.get("alpha") is None or not _is_number(a["alpha"]):
            return None
        other = a["other"] if node_is_first else a["input"]
        if not node_is_first and (a["alpha"] != 1 or not _same_layout(a["input"], a["other"])):
            return None  # alpha scales the chain's operand, the op scales other; chainIsAddSelf
        if not _is_tensor_value(other):
            return None
        return other, a["alpha"]

    def chain_add(self, add_node, add: _Call, pred: Callable):
        """The add's operand that pred accepts (the first, else the second),
        with (other, alpha)."""
        for first in (True, False):
            operand = add.args["input"] if first else add.args["other"]
            if isinstance(operand, torch.fx.Node) and pred(operand) and _single_use(operand, add_node):
                ops = self.add_operands(add, first)
                if ops is not None:
                    return (operand,) + ops
        return None

    # conv{1,2,3}d -> relu -> add ------------------------------------------
    def conv_relu_add(self) -> int:
        count = 0
        for node in list(self.graph.nodes):
            add = self.call(node, "add")
            if add is None:
                continue

            # NB: not relu_ (reluWritesConvOutput): it keeps the conv
            # output's strides where their layout is ambiguous, the op's
            # out-of-place relu picks its own; conv_add_act takes conv -> relu_
            def relu_of_conv(v):
                r = self.call(v, "relu")
                return r is not None and not r.inplace and self._conv(r.args["input"]) is not None and _single_use(
                    r.args["input"], v)

            found = self.chain_add(node, add, relu_of_conv)
            if found is None:
                continue
            relu_node, other, alpha = found
            conv_node = self.call(relu_node, "relu").args["input"]
            conv = self._conv(conv_node)
            chain = [conv_node, relu_node, node]
            inputs = [conv["input"], conv["weight"], conv["bias"], other]
            if not _no_intervening_writes(conv_node, node, set(chain), inputs):
                continue
            self.replace(node, chain, _ops.custom_conv_relu_add.default,
                         (conv["input"], conv["weight"], conv["bias"], conv["stride"], conv["padding"],
                          conv["dilation"], conv["groups"], other, alpha))
            count += 1
        return count

    # conv{1,2,3}d -> [add] -> [activation] ---------------------------------
    # NB: the activations of _activation, as in TorchScript's pass.
    def conv_add_act(self) -> int:
        count = 0
        for form in ("add_act", "act", "add"):  # longest first
            for node in list(self.graph.nodes):
                found = self._conv_add_act_at(node, form)
                if found is None:
                    continue
                chain, conv, other, alpha, promote, act = found
                inputs = [conv["input"], conv["weight"], conv["bias"], other]
                if not _no_intervening_writes(chain[0], node, set(chain), inputs):
                    continue
                self.replace(node, chain, _ops.custom_conv_add_act.default,
                             (conv["input"], conv["weight"], conv["bias"], conv["stride"], conv["padding"],
                              conv["dilation"], conv["groups"], other, alpha, promote, act[0], act[1]))
                count += 1
        return count

    def conv_batch_norm_act(self) -> int:
        """conv -> batch_norm -> [activation] (FuseConvBatchNormAct):
        a batch_norm whose training is a bool other than True
        (notTrainingConstant), with running statistics and number momentum
        and eps; longest form first."""
        count = 0
        for with_act in (True, False):
            for node in list(self.graph.nodes):
                act, bn_node, act_args = (self._activation(node) or (None, None, None)) if with_act \
                    else ("none", node, [])
                if act is None or not isinstance(bn_node, torch.fx.Node):
                    continue
                if with_act and not _single_use(bn_node, node):
                    continue
                bn = self.call(bn_node, "batch_norm")
                if bn is None:
                    continue
                a = bn.args
                x = a.get("input")
                if a.get("training") is not False or not _is_number(a.get("eps")):
                    continue
                if not (_is_tensor_value(a.get("running_mean")) and _is_tensor_value(a.get("running_var"))):
                    continue
                if any(a.get(k) is not None and not _is_tensor_value(a[k]) for k in ("weight", "bias")):
                    continue
                if not isinstance(x, torch.fx.Node) or not _single_use(x, bn_node):
                    continue
                conv = self._conv(x)
                if conv is None:
                    continue
                chain = [x, bn_node] + ([node] if with_act else [])
                inputs = [conv["input"], conv["weight"], conv["bias"], a.get("weight"), a.get("bias"),
                          a["running_mean"], a["running_var"]]
                if not _no_intervening_writes(x, chain[-1], set(chain), inputs):
                    continue
                momentum = a.get("momentum")
                self.replace(chain[-1], chain, _ops.custom_conv_batch_norm_act.default,
                             (conv["input"], conv["weight"], conv["bias"], conv["stride"], conv["padding"],
                              conv["dilation"], conv["groups"], a.get("weight"), a.get("bias"), a["running_mean"],
                              a["running_var"], False, float(momentum) if _is_number(momentum) else 0.0,
                              float(a["eps"]), True, act, act_args))
                count += 1
        return count

    def conv_act_max_pool(self) -> int:
        """conv -> [activation] -> max_pool2d (isMaxPool2d: int
        lists, no indices); runs before conv_add_act (the registry's order)."""
        count = 0
        for node in list(self.graph.nodes):
            pool = self.call(node, "max_pool")
            # NB: aten::max_pool2d and torch.max_pool2d have no return_indices
            if pool is None or pool.args.get("return_indices", False) is not False:
                continue
            a = pool.args
            # NB: no stride, or aten's default [], is the kernel size
            stride = [] if a.get("stride") in (None, []) else _int_list(a["stride"])
            lists = [_int_list(a.get(k)) for k in ("kernel_size", "padding", "dilation")]
            x = a.get("input")
            if stride is None or any(v is None for v in lists) or not isinstance(a.get("ceil_mode"), bool):
                continue
            if not isinstance(x, torch.fx.Node) or not _single_use(x, node):
                continue
            act, chain, conv = self._activation(x), [x, node], None
            if act is not None:
                if isinstance(act[1], torch.fx.Node) and _single_use(act[1], x):
                    conv = self._conv(act[1])
                    chain = [act[1], x, node]
            else:
                conv = self._conv(x)
            if conv is None:
                continue
            inputs = [conv["input"], conv["weight"], conv["bias"]]
            if not _no_intervening_writes(chain[0], node, set(chain), inputs):
                continue
            k, p, d = lists
            self.replace(node, chain, _ops.custom_conv_act_max_pool.default,
                         (conv["input"], conv["weight"], conv["bias"], conv["stride"], conv["padding"],
                          conv["dilation"], conv["groups"], act[0] if act else "none", act[2] if act else [],
                          k, stride, p, d,
                          a["ceil_mode"]))
            count += 1
        return count

    def _activation(self, node):
        """(the op's activation, its input, its arguments) of the fusable
        activations (isFusableActivation, activationSpec): relu, relu6 and
        hardtanh (hardtanh's bounds), silu, hardswish, hardsigmoid, sigmoid,
        gelu (exact) and gelu_tanh, leaky_relu (its slope), the arguments
        numbers.  The name ends in '_' for an in-place spelling, whose
        result keeps its input's strides where their layout is ambiguous."""
        if not isinstance(node, torch.fx.Node) or node in self.autocast:
            return None
        c = _normalize(node)
        if c is None or c.kind not in _ACTIVATION_ARGS:
            return None
        a, name = c.args, c.kind
        if c.kind == "relu6":
            name, args = "hardtanh", [0.0, 6.0]
        elif c.kind == "gelu":
            if a.get("approximate") not in ("none", "tanh"):
                return None
            name, args = ("gelu" if a["approximate"] == "none" else "gelu_tanh"), []
        else:
            args = [a.get(k) for k in _ACTIVATION_ARGS[c.kind]]
            if not all(_is_number(v) for v in args):
                return None
            args = [float(v) for v in args]
        return (name + "_" if c.inplace else name), a["input"], args

    def _conv_add(self, node):
        """conv -> add ending at node: (conv node, conv, other, alpha,
        promote); add_ only into the conv output, the conv output scaled by
        alpha only when alpha == 1 (alphaIsOne)."""
        add = self.call(node, "add")
        if add is None or not _is_number(add.args.get("alpha")):
            return None
        a, alpha = add.args, add.args["alpha"]
        for first in (True, False):
            operand, other = (a["input"], a["other"]) if first else (a["other"], a["input"])
            if not first and (add.inplace or alpha != 1 or not _same_layout(operand, other)):
                continue  # chainIsAddSelf
            if not _is_tensor_value(other):
                continue
            if isinstance(operand, torch.fx.Node) and _single_use(operand, node):
                conv = self._conv(operand)
                if conv is not None:
                    return operand, conv, other, alpha, not add.inplace
        return None

    def _conv_add_act_at(self, node, form: str):
        if form == "add":
            found = self._conv_add(node)
            if found is None:
                return None
            conv_node, conv, other, alpha, promote = found
            return [conv_node, node], conv, other, alpha, promote, ("none", [])
        act = self._activation(node)
        if act is None or not isinstance(act[1], torch.fx.Node) or not _single_use(act[1], node):
            return None
        kind, x, args = act
        if form == "act":
            conv = self._conv(x)
            return None if conv is None else ([x, node], conv, None, 1, False, (kind, args))
        found = self._conv_add(x)
        if found is None:
            return None
        conv_node, conv, other, alpha, promote = found
        return [conv_node, x, node], conv, other, alpha, promote, (kind, args)

    def _conv(self, v) -> Optional[Dict[str, Any]]:
        """isIntListConv: a conv{1,2,3}d with int-list (not 'same'/'valid')
        stride, padding and dilation, and an int groups."""
        c = self.call(v, "conv")
        if c is None:
            return None
        a = c.args
        w = _meta(a.get("weight"))
        out = {k: _int_list(a.get(k)) for k in ("stride", "padding", "dilation")}
        if any(x is None for x in out.values()) or not isinstance(a.get("groups"), int):
            return None
        if not _is_tensor_value(a.get("input")) or not _is_tensor_value(a.get("weight")):
            return None
        if a.get("bias") is not None and not _is_tensor_value(a["bias"]):
            return None
        if isinstance(w, torch.Tensor) and w.dim() not in (3, 4, 5):
            return None
        out.update(input=a["input"], weight=a["weight"], bias=a.get("bias"), groups=a["groups"])
        return out

    # the gate of a squeeze-and-excitation block ----------------------------
    # NB: as FuseGateMul: act(gate) * input with act sigmoid or hardsigmoid
    # (isGateActivation: out of place), the mul out of place with the
    # activated gate, read nowhere else, on either side (gate_first), and the
    # gate computed from a spatial squeeze of the input it multiplies
    # (gateSqueezesInput).
    def gate_mul(self) -> int:
        count = 0
        for node in list(self.graph.nodes):
            mul = self.call(node, "mul")
            if mul is None or mul.inplace:
                continue
            a, b = mul.args["input"], mul.args["other"]
            for gate_first, act_node, x in ((True, a, b), (False, b, a)):
                act = self._gate_activation(act_node)
                if act is None or not _single_use(act_node, node) or not _is_tensor_value(x):
                    continue
                kind, gate = act
                if not self._squeezes(gate, x) or not _no_intervening_writes(act_node, node, {act_node, node},
                                                                               [x, gate]):
                    continue
                self.replace(node, [act_node, node], _ops.custom_gate_mul.default, (x, gate, kind, gate_first))
                count += 1
                break
        return count

    def _gate_activation(self, v):
        for kind in ("sigmoid", "hardsigmoid"):
            c = self.call(v, kind)
            if c is not None and not c.inplace and isinstance(c.args.get("input"), torch.fx.Node):
                return kind, c.args["input"]
        return None

    def _squeezes(self, v, x) -> bool:
        """gateSqueezesInput: v comes from adaptive_avg_pool2d(x, 1) or a
        kept mean of x over dims 2 and 3, through at most 8 convolutions
        and activations."""
        for _ in range(8):
            if not isinstance(v, torch.fx.Node):
                return False
            pool = self.call(v, "adaptive_avg_pool")
            if pool is not None:
                size = pool.args.get("output_size")
                sizes = [size] if isinstance(size, int) else list(size) if isinstance(size, (list, tuple)) else []
                return bool(sizes) and all(s == 1 for s in sizes) and pool.args["input"] is x
            mean = self.call(v, "mean")
            if mean is not None:
                dims = mean.args.get("dim")
                dims = sorted(dims) if isinstance(dims, (list, tuple)) else None
                return (dims in ([2, 3], [-2, -1]) and mean.args.get("keepdim") is True
                        and mean.args.get("dtype") is None and mean.args["input"] is x)
            conv = self._conv(v)
            if conv is not None:
                v = conv["input"]
                continue
            act = next((c for c in (self.call(v, k) for k in ("relu", "silu", "sigmoid", "hardsigmoid"))
                        if c is not None), None)
            if act is None:
                return False
            v = act.args["input"]
        return False

    # linear -> add -> relu -----------------------------------------------
    def linear_add_relu(self) -> int:
        count = 0
        for node in list(self.graph.nodes):
            relu = self.call(node, "relu")
            if relu is None:
                continue
            add_node = relu.args["input"]
            add = self.call(add_node, "add")
            if add is None or not _single_use(add_node, node):
                continue

            found = self.chain_add(add_node, add, lambda v: self._linear(v) is not None)
            if found is None:
                continue
            lin_node, other, alpha = found
            lin = self.call(lin_node, "linear").args
            chain = [lin_node, add_node, node]
            if not _no_intervening_writes(lin_node, node, set(chain),
                                          [lin["input"], lin["weight"], lin["bias"], other]):
                continue
            # notWrittenAfter: the op saves its input for the backward, where
            # aten::linear saves a copy of a non-contiguous input of more
            # than two dimensions (matmul's reshape)
            if any(_may_alias(wr, lin["input"]) for n in _after(lin_node) if n not in chain for wr in _writes(n)):
                continue
            self.replace(node, chain, _ops.custom_linear_add_relu.default,
                         (lin["input"], lin["weight"], lin["bias"], other, alpha))
            count += 1
        return count

    def _linear(self, v) -> Optional[Dict[str, Any]]:
        """isLinear: linear(input, weight, bias) with tensor operands."""
        lin = self.call(v, "linear")
        if lin is None:
            return None
        a = lin.args
        if not _is_tensor_value(a["input"]) or not _is_tensor_value(a["weight"]):
            return None
        return a if a["bias"] is None or _is_tensor_value(a["bias"]) else None

    # linear -> activation ---------------------------------------------------
    # NB: the fusable activations of _activation, as for conv_add_act; runs
    # after linear_add_relu (the registry's order).
    def linear_act(self) -> int:
        count = 0
        for node in list(self.graph.nodes):
            act = self._activation(node)
            if act is None or not isinstance(act[1], torch.fx.Node) or not _single_use(act[1], node):
                continue
            kind, lin_node, args = act
            lin = self._linear(lin_node)
            if lin is None:
                continue
            chain = [lin_node, node]
            if not _no_intervening_writes(lin_node, node, set(chain), [lin["input"], lin["weight"], lin["bias"]]):
                continue
            self.replace(node, chain, _ops.custom_linear_act.default,
                         (lin["input"], lin["weight"], lin["bias"], kind, args))
            count += 1
        return count

    # batch_norm -> add -> div -> x*sigmoid(x) ----------------------------
    def batch_norm_add_div_swish(self) -> int:
        count = 0
        for node in list(self.graph.nodes):
            found = self._swish(node)
            if found is None:
                continue
            t_node, chain_tail, silu = found
            div = self.call(t_node, "div")
            if div is None or div.inplace or div.args.get("rounding_mode") is not None:
                continue
            d = div.args["other"]
            # isScalarDivisor, divisorIsNonZero
            if not _is_number(d) or d == 0:
                continue
            s_node = div.args["input"]
            add = self.call(s_node, "add")
            if add is None or not _single_use(s_node, t_node):
                continue
            found_add = self.chain_add(s_node, add, lambda v: self.call(v, "batch_norm") is not None)
            if found_add is None or found_add[2] != 1:
                continue  # alphaIsOne
            bn_node, other, _ = found_add
            bn = self.call(bn_node, "batch_norm").args
            rm, rv, training = bn.get("running_mean"), bn.get("running_var"), bn.get("training")
            # running statistics present (the op's mutated stats cannot be
            # optional); training, momentum and eps constants
            if not (_is_tensor_value(rm) and _is_tensor_value(rv) and isinstance(training, bool)):
                continue
            if not (_is_number(bn.get("momentum")) and _is_number(bn.get("eps"))):
                continue
            x, w, b = bn["input"], bn.get("weight"), bn.get("bias")
            if not _is_tensor_value(x) or any(v is not None and not _is_tensor_value(v) for v in (w, b)):
                continue
            chain = [bn_node, s_node, t_node] + chain_tail
            tail = chain_tail[-1]
            if not _no_intervening_writes(bn_node, tail, set(chain), [x, w, b, rm, rv, other]):
                continue
            # notWrittenAfter: the op saves other and bias for its backward,
            # and in eval mode reads the running statistics there too (a
            # later training batch_norm on the same statistics writes them)
            if any(_may_alias(wr, v) for n in _after(bn_node) if n not in chain
                   for wr in _writes(n) for v in (other, b, rm, rv)):
                continue
            # noInterveningAccess: the statistics' update moves to the tail
            if training and any(_may_alias(u, s) for n in _between(bn_node, tail) if n not in chain
                                for u in n.all_input_nodes + _writes(n) for s in (rm, rv)):
                continue
            if training:
                op, args = _ops.custom_batch_norm_add_div_swish.default, (
                    x, w, b, rm, rv, True, float(bn["momentum"]), float(bn["eps"]), other, d, silu)
            else:
                op, args = _ops.custom_batch_norm_add_div_swish_eval.default, (
                    x, w, b, rm, rv, float(bn["eps"]), other, d, silu)
            self.replace(tail, chain, op, args)
            count += 1
        return count

    def _swish(self, node):
        """(t, the swish's nodes, silu?) where node is silu(t) or
        t * sigmoid(t) (either order), t used only there."""
        silu = self.call(node, "silu")
        if silu is not None:
            t = silu.args["input"]
            if silu.inplace or not isinstance(t, torch.fx.Node) or not _single_use(t, node):
                return None
            return t, [node], True
        mul = self.call(node, "mul")
        if mul is None or mul.inplace:
            return None
        a, b = mul.args["input"], mul.args["other"]
        for t, sig_node in ((a, b), (b, a)):
            sig = self.call(sig_node, "sigmoid")
            if sig is None or sig.args["input"] is not t or not isinstance(t, torch.fx.Node):
                continue
            if _single_use(sig_node, node) and set(t.users) == {sig_node, node}:
                return t, [sig_node, node], False
        return None

    # add -> layer_norm -------------------------------------------------------
    # NB: as FuseAddLayerNorm: the add as written (either operand order, any
    # alpha; add_ only into a fresh tensor), the sum not written in place
    # and read by one layer_norm; where other nodes read the sum too, the
    # op's second result replaces it (write_sum), the op placed at the
    # layer_norm when they all follow it, else at the add when the
    # layer_norm's weight and bias precede it.
    def add_layer_norm(self) -> int:
        count = 0
        for node in list(self.graph.nodes):
            found = self._add_layer_norm_at(node)
            if found is None:
                continue
            s, args, write_sum, at = found
            with self.graph.inserting_before(at):
                args = tuple(self.graph.get_attr(a.path) if isinstance(a, _Attr) else a for a in args)
                fused = self.graph.call_function(_ops.custom_add_layer_norm.default, args)
                out = self.graph.call_function(operator.getitem, (fused, 0))
                total = self.graph.call_function(operator.getitem, (fused, 1))
            val = self._fake_run(_ops.custom_add_layer_norm.default, args)
            if val is not None:
                fused.meta["val"] = val
            out.meta = dict(node.meta)
            total.meta = dict(s.meta)
            name = node.name
            node.replace_all_uses_with(out)
            self.graph.erase_node(node)
            self.renamed[name] = out.name
            if write_sum:
                s.replace_all_uses_with(total)
                self.renamed[s.name] = total.name
            self.graph.erase_node(s)
            if not write_sum:
                self.graph.erase_node(total)
            count += 1
        return count

    def _add_layer_norm_at(self, node):
        """(sum node, the op's arguments, write_sum, the node to insert
        before) for a layer_norm of an add, or None."""
        ln = self.call(node, "layer_norm")
        if ln is None:
            return None
        a = ln.args
        s, shape, eps, w, b = a.get("input"), _int_list(a.get("normalized_shape")), a.get("eps"), a.get("weight"), a.get("bias")
        add = self.call(s, "add")
        if add is None or shape is None or not _is_number(eps):
            return None  # normArgumentsAreConstant
        if any(v is not None and not _is_tensor_value(v) for v in (w, b)):
            return None
        x, other, alpha = add.args.get("input"), add.args.get("other"), add.args.get("alpha", 1)
        if not _is_tensor_value(x) or not _is_tensor_value(other) or not _is_number(alpha):
            return None  # isTensorAdd
        if add.inplace and not (isinstance(x, torch.fx.Node) and self._fresh_unaliased(x, s)):
            return None  # addIsOutOfPlaceOrIntoFresh
        norms = [u for u in s.users if (c := self.call(u, "layer_norm")) is not None and c.args.get("input") is s]
        if len(norms) != 1:
            return None  # sumFeedsOneNorm
        if any(_may_alias(wr, s) for n in self.graph.nodes if n is not s for wr in _writes(n)):
            return None  # sumNotWrittenInPlace
        if not _no_intervening_writes(s, node, {s, node}, [x, other, w, b]):
            return None
        write_sum = not _single_use(s, node)
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        if all(u is node or order[u] > order[node] for u in s.users):
            at = node
        elif all(not isinstance(v, torch.fx.Node) or order[v] < order[s] for v in (w, b)):
            at = s  # normArgumentsHoistable: get_attr nodes are made there
        else:
            return None
        return s, (x, other, alpha, not add.inplace, shape, w, b, float(eps), write_sum), write_sum, at

    @staticmethod
    def _fake_run(op, args):
        """The op's result metadata on the arguments' fake values, where all
        of them have one."""
        vals = []
        for a in args:
            if isinstance(a, torch.fx.Node):
                v = _meta(a)
                if not isinstance(v, torch.Tensor):
                    return None
                vals.append(v)
            else:
                vals.append(a)
        # NB: the values' own mode, not detect_fake_mode's: that prefers the
        # tracing context's, which under Dynamo is another mode than its
        # graph's example values ("Mixing fake modes NYI").
        from torch._subclasses.fake_tensor import FakeTensor

        modes = {id(v.fake_mode): v.fake_mode for v in vals if isinstance(v, FakeTensor)}
        if len(modes) != 1 or any(isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor) for v in vals):
            return None
        with next(iter(modes.values())):
            return op(*vals)

    # a standalone relu ---------------------------------------------------
    def relu(self) -> int:
        count = 0
        for node in list(self.graph.nodes):
            relu = self.call(node, "relu")
            if relu is None:
                continue
            x = relu.args["input"]
            if not _is_tensor_value(x):
                continue
            if relu.inplace and not self._fresh_unaliased(x, node):
                continue
            self.replace(node, [node], _ops.custom_relu.default, (x,))
            count += 1
        return count

    @staticmethod
    def _fresh_unaliased(x, user) -> bool:
        """isFreshUnaliasedTensor: x is a fresh result (not a graph input,
        attribute or view) read only by user."""
        if x.op not in ("call_function", "call_method") or _root(x) is not x or not _single_use(x, user):
            return False
        if isinstance(x.target, torch._ops.OpOverload):
            return not x.target._schema.is_mutable
        c = _normalize(x)
        return c is not None and not c.inplace and c.kind in ("conv", "linear", "add", "mul", "div", "batch_norm")


_PASSES: Dict[str, Callable[[_Rewriter], int]] = {
    "conv_relu_add": _Rewriter.conv_relu_add,
    "conv_act_max_pool": _Rewriter.conv_act_max_pool,
    "gate_mul": _Rewriter.gate_mul,
    "conv_add_act": _Rewriter.conv_add_act,
    "conv_batch_norm_act": _Rewriter.conv_batch_norm_act,
    "linear_add_relu": _Rewriter.linear_add_relu,
    "linear_act": _Rewriter.linear_act,
    "add_layer_norm": _Rewriter.add_layer_norm,
    "batch_norm_add_div_swish": _Rewriter.batch_norm_add_div_swish,
    "relu": _Rewriter.relu,
}


def _registry() -> list:
    import torchfuse

    return torchfuse.fusions()


def pass_names() -> list:
    """The registry's pass names, in pipeline order (as torchfuse.pass_names())."""
    return [f["name"] for f in _registry()]


def _selected(passes: Optional[Iterable[str]], what: str) -> list:
    registry = _registry()
    missing = [f["name"] for f in registry if f["name"] not in _PASSES]
    if missing:  # NB: a registry entry without an FX matcher is a torchfuse bug
        raise RuntimeError(f"torchfuse.fx: no FX rewrite for the registry's {missing}")
    if passes is None:
        return [f["name"] for f in registry if f["by_default"]]
    if isinstance(passes, (str, bytes)):
        raise TypeError(f"torchfuse.fx.{what}: expected passes to be a list of pass names, got the "
                        f"{type(passes).__name__} {passes!r}; write passes=[{passes!r}]")
    names = list(passes)
    known = [f["name"] for f in registry]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"torchfuse.fx.{what}: unknown pass name(s) {unknown}; expected some of {known}")
    return [n for n in known if n in names]  # the registry's order


def fuse_graph(graph: torch.fx.Graph, passes: Optional[Iterable[str]] = None) -> Dict[str, int]:
    """Rewrites the chains of ``graph`` (a Dynamo or ATen-level FX graph) in
    place, the registry's fusions in its order (``passes``: default those on
    by default); returns how many chains each fused."""
    if not isinstance(graph, torch.fx.Graph):
        raise TypeError(f"torchfuse.fx.fuse_graph: expected a torch.fx.Graph, got {type(graph).__name__}")
    return _fuse(graph, _selected(passes, "fuse_graph"), {})


def _fuse(graph: torch.fx.Graph, names: list, renamed: Dict[str, str]) -> Dict[str, int]:
    counts = {name: _PASSES[name](_Rewriter(graph, renamed)) for name in names}
    graph.lint()
    return counts


def optimize(gm: torch.fx.GraphModule, *, passes: Optional[Iterable[str]] = None) -> torch.fx.GraphModule:
    """Returns a new GraphModule whose graph has the chains replaced by the
    torchfuse ops; it shares ``gm``'s submodules, parameters and buffers,
    and ``gm`` is left unchanged."""
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(
            f"torchfuse.fx.optimize: expected a torch.fx.GraphModule, got {type(gm).__name__}; "
            "use torch.fx.symbolic_trace, torch.export (optimize_exported) or torch.compile(backend=torchfuse.fx.backend)")
    return _optimize(gm, _selected(passes, "optimize"), {})


def _optimize(gm: torch.fx.GraphModule, names: list, renamed: Dict[str, str],
              counts: Optional[Dict[str, int]] = None) -> torch.fx.GraphModule:
    """The rewrite on a copy of gm's graph; each pass's count of fused
    chains into ``counts`` where given."""
    graph = torch.fx.Graph(owning_module=None, tracer_cls=gm.graph._tracer_cls)
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = gm.graph._codegen
    # NB: the new module first: it owns the graph, whose call_module nodes
    # the rewrite reads through it, and it shares gm's submodules.
    result = torch.fx.GraphModule(gm, graph, gm.__class__.__name__)
    fused = _fuse(result.graph, names, renamed)
    if counts is not None:
        counts.update(fused)
    result.recompile()
    return result


def report(gm) -> Dict[str, int]:
    """Counts, per pass name, the torchfuse ops of that registry entry in a
    GraphModule or ExportedProgram (as torchfuse.report for TorchScript)."""
    if isinstance(gm, torch.export.ExportedProgram):
        gm = gm.graph_module
    targets = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            targets[n.target.name()] = targets.get(n.target.name(), 0) + 1
    return {f["name"]: sum(targets.get(op, 0) for op in f["ops"]) for f in _registry()}


def optimize_exported(ep: "torch.export.ExportedProgram", *,
                      passes: Optional[Iterable[str]] = None) -> "torch.export.ExportedProgram":
    """Returns a new ExportedProgram with the chains of ``ep``'s graph
    replaced by the torchfuse ops; ``ep`` is left unchanged (the two share
    the state_dict's tensors).  Takes the training IR that
    ``torch.export.export`` gives and, after ``run_decompositions``, the
    convolutions of core ATen."""
    if not isinstance(ep, torch.export.ExportedProgram):
        raise TypeError(f"torchfuse.fx.optimize_exported: expected a torch.export.ExportedProgram, got "
                        f"{type(ep).__name__}; call torch.export.export first")
    renamed: Dict[str, str] = {}
    gm = _optimize(ep.graph_module, _selected(passes, "optimize_exported"), renamed)
    outputs = []
    for spec in ep.graph_signature.output_specs:
        name = getattr(spec.arg, "name", None)
        while name in renamed:  # a fused op's result replaces a chain's
            name = renamed[name]
        if name is not None and name != spec.arg.name:
            spec = dataclasses.replace(spec, arg=dataclasses.replace(spec.arg, name=name))
        outputs.append(spec)
    signature = torch.export.graph_signature.ExportGraphSignature(
        input_specs=list(ep.graph_signature.input_specs), output_specs=outputs)
    # NB: not ep._update, whose deepcopy of the module call graph warns
    # (pytree's LeafSpec deprecation); the new program shares ep's entries.
    return torch.export.ExportedProgram(
        root=gm, graph=gm.graph, graph_signature=signature, state_dict=ep.state_dict,
        range_constraints=dict(ep.range_constraints), module_call_graph=list(ep.module_call_graph),
        example_inputs=ep.example_inputs, constants=ep.constants, verifiers=ep.verifiers)


# The states of make_backend(choice="measured")'s choices, for
# measured_choices(), newest last; older ones drop out.  NB: the states
# alone, which hold no compiled graph, so a freed model's graphs are freed.
_MAX_CHOICES = 64
_choices: List["_ChoiceState"] = []

# The protocol of make_backend(choice="measured"): the TorchScript layout
# trial's (ops/common/measured_choice.h).  NB: a longer one (blocks of 8
# calls after 16 of the original) was measured on the H200 and made the same
# choices, the wrong one on efficientnet_b0 fp32 included (docs/usage.md).
_PROTOCOL = {"settle": 2, "warm": 4, "blocks": 5, "calls_per_block": 2}
# Calls until decided: the trial's, and the one that resolves.
TRIAL_CALLS = (_PROTOCOL["settle"] + _PROTOCOL["warm"]
               + 2 * _PROTOCOL["blocks"] * _PROTOCOL["calls_per_block"] + 1)


class _ChoiceState:
    def __init__(self, counts: Dict[str, int]):
        from torchfuse import _C

        self.choice = _C.MeasuredChoice(**_PROTOCOL)
        self.counts = {k: v for k, v in counts.items() if v}
        self.blocks_ms: List[float] = []

    def report(self) -> Dict[str, Any]:
        medians = self.choice.medians
        return {"fused": self.counts, "calls": self.choice.calls, "chosen_fused": self.choice.decided,
                "original_ms": medians[0] if medians else None, "fused_ms": medians[1] if medians else None,
                "blocks_ms": list(self.blocks_ms)}


class _MeasuredGraph:
    """A compiled graph that runs as the compiled rewrite (the candidate)
    or the compiled original, chosen by timing the calls themselves with
    the protocol of the TorchScript layout trial (ops/common/
    measured_choice.h; _PROTOCOL): the first calls run the original, then
    both alternate, then timed blocks of calls of each (TRIAL_CALLS in all);
    the rewrite is kept only
    where its median block is at least the protocol's margin faster.  A
    block's time runs from its first call's start to the next block's (CUDA
    events on the current stream), so in training it holds the backward and
    the optimizer step too.  Both compute the same values; which one ran
    changes rounding only.  Once decided, the other graph is let go."""

    def __init__(self, fused: Callable, original: Callable, counts: Dict[str, int]):
        self._fns: Optional[tuple] = (original, fused)
        self._state = _ChoiceState(counts)
        self._stamps: List[Any] = []
        self._chosen: Optional[Callable] = None
        _choices.append(self._state)
        del _choices[:-_MAX_CHOICES]

    def __call__(self, *args):
        if self._chosen is not None:
            return self._chosen(*args)
        if torch.cuda.is_current_stream_capturing():
            return self._fns[0](*args)
        choice = self._state.choice
        candidate, stamp, resolve = choice.next()
        if stamp:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._stamps.append(event)
        if resolve:
            self._stamps[-1].synchronize()
            self._state.blocks_ms = [a.elapsed_time(b) for a, b in zip(self._stamps, self._stamps[1:])]
            choice.resolve(self._state.blocks_ms)
            self._chosen = self._fns[1] if choice.decided else self._fns[0]
            self._stamps, self._fns = [], None
            return self._chosen(*args)
        return self._fns[1 if candidate else 0](*args)


def measured_choices() -> List[Dict[str, Any]]:
    """The choices of ``make_backend(choice="measured")`` graphs, oldest
    first (the latest 64): the chains the rewrite fused (``fused``),
    ``calls`` until decided and, once decided, ``chosen_fused`` with the
    median block times in ms it was decided by (``original_ms``,
    ``fused_ms``) and every block's time in the order they ran
    (``blocks_ms``: rewrite, original, original, rewrite, ...)."""
    return [c.report() for c in _choices]


def _on_cuda(gm: torch.fx.GraphModule, example_inputs) -> bool:
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    tensors += list(gm.parameters()) + list(gm.buffers())
    return any(t.is_cuda for t in tensors)


_CHOICES = ("measured", "fused")

# Backends that trace the graph through AOTAutograd, whose fake tensors run
# a CompositeImplicitAutograd op as the ATen ops it is made of.
_AOT_BACKENDS = ("inductor", "aot_eager", "aot_eager_decomp_partition", "cudagraphs")


def _traced_through(name: str) -> bool:
    """Whether every op of registry entry ``name`` is CompositeImplicitAutograd
    (custom_conv_batch_norm_act): under a tracer it records the original's
    ATen ops, so an AOTAutograd backend given the rewrite compiles the
    original graph anyway, and the rewrite would only cost a second compile
    (and a choice between two equal graphs)."""
    (fusion,) = [f for f in _registry() if f["name"] == name]
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeImplicitAutograd")
               for op in fusion["ops"])


# The chains whose op, under Inductor, runs no fewer kernels than
# Inductor's own code, so it saves nothing and adds host work per call.
# - Those made only of ops Inductor generates kernels for (pointwise ops,
#   normalizations and their reductions): Inductor fuses such a chain
#   itself, reading and writing what the fused op does.  Measured on the
#   H200, eval fp16 (docs/performance.md): custom_gate_mul under Inductor
#   cost 0.84x and 0.60x of Inductor's own code.
# - conv_add_act: where its one cuDNN graph does not apply (the SE blocks'
#   1x1 convolutions, for one), the op runs ATen's convolution and then one
#   pass for the bias, the add and the activation: the two kernels Inductor
#   runs (the extern convolution, one Triton kernel), with more host work.
#   Measured on the H200, eval (docs/performance.md, docs/usage.md): 0.82-
#   0.94x of Inductor alone in 8 of 9 rows (efficientnet_b0 and
#   mobilenet_v3_large, fp16 and fp32, four runs), 1.015x in the ninth; the
#   models are host-bound there (efficientnet_b0 fp16: 2.3 ms of GPU time in
#   a 3.1 ms call).
# The others stay, for the measured choice to decide; of them only
# linear_act was measured under Inductor (1.02-1.04x on mobilenet_v3_large).
_INDUCTOR_NO_GAIN = {"gate_mul", "add_layer_norm", "batch_norm_add_div_swish", "relu", "conv_add_act"}


def backend_passes(inner: Any = "inductor") -> list:
    """The passes :func:`make_backend` runs when none are named: those on by
    default, less, where ``inner`` names a backend that traces through
    AOTAutograd (``"inductor"``, ``"aot_eager"``, ...), the fusions whose ops
    trace as the original's ATen ops (``conv_batch_norm_act``), which that
    backend would compile as the original anyway, and for ``"inductor"`` the
    chains whose op runs no fewer kernels than Inductor's own code: those
    Inductor fuses as well itself (pointwise ops and normalizations:
    ``gate_mul``, ``add_layer_norm``, ``batch_norm_add_div_swish``) and
    ``conv_add_act``, measured slower than Inductor alone."""
    selected = _selected(None, "backend_passes")
    if isinstance(inner, str) and inner in _AOT_BACKENDS:
        selected = [name for name in selected if not _traced_through(name)]
    if inner == "inductor":
        selected = [name for name in selected if name not in _INDUCTOR_NO_GAIN]
    return selected


def make_backend(passes: Optional[Iterable[str]] = None, inner: Any = "inductor",
                 choice: str = "measured") -> Callable:
    """A torch.compile backend: the rewrite of :func:`fuse_graph` on
    Dynamo's graph, then ``inner`` (a backend name or callable; default
    Inductor).

    ``choice``: ``"measured"`` (default) compiles a CUDA graph that the
    rewrite changed twice, with and without the rewrite, and times the
    calls to keep the rewrite only where it is faster than ``inner``'s own
    code (see :func:`measured_choices`; twice the compile time, and the
    first ``TRIAL_CALLS`` calls, 27, run either); on the CPU, under deterministic algorithms
    (where the original is kept) or where nothing was fused, it compiles
    once.  ``"fused"`` always keeps the rewrite.

    ``passes`` left out: :func:`backend_passes` of ``inner``."""
    selected = _selected(passes, "make_backend") if passes is not None else backend_passes(inner)
    if choice not in _CHOICES:
        raise ValueError(f"torchfuse.fx.make_backend: expected choice to be one of {list(_CHOICES)}, "
                         f"got {choice!r}")

    def torchfuse_backend(gm: torch.fx.GraphModule, example_inputs):
        compiler = torch._dynamo.lookup_backend(inner) if isinstance(inner, str) else inner
        if choice == "fused" or not _on_cuda(gm, example_inputs):
            fuse_graph(gm.graph, selected)
            gm.recompile()
            return compiler(gm, example_inputs)
        if torch.are_deterministic_algorithms_enabled():
            return compiler(gm, example_inputs)
        # NB: the rewrite on a copy, compiled first: inner may rewrite the
        # graph it is given in place (Inductor's pre-grad passes).
        counts: Dict[str, int] = {}
        fused = _optimize(gm, selected, {}, counts)
        if not any(counts.values()):
            return compiler(gm, example_inputs)
        return _MeasuredGraph(compiler(fused, example_inputs), compiler(gm, example_inputs), counts)

    return torchfuse_backend


def backend(gm: torch.fx.GraphModule, example_inputs):
    """``torch.compile(model, backend=torchfuse.fx.backend)``: the default
    fusions, then Inductor."""
    return make_backend()(gm, example_inputs)
