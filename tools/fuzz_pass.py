#!/usr/bin/env python3
"""Differential fuzzer for torchfuse.optimize: the rewrite must never change
what a module computes.

    tools/fuzz_pass.py --programs N --seed S [--emit-regressions DIR]
                       [--modes train,eval,frozen,autocast,double_backward]
                       [--features tied,exported|none]

Each program is a random nn.Module written as Python source from a small
vocabulary (linear, conv1d/conv2d, batch_norm, relu/relu_, add/add_/sub,
div, mul, sigmoid, silu, views, in-place writes, if and for blocks), biased
towards the four fusable chains and near-misses of them.  Features, each
from its own random stream (without them a program is the one drawn before
they existed): `tied`, parameters tied and buffers shared between
attributes (`self.fc2.weight = self.fc1.weight`, `self.bn2.running_mean =
self.bn1.running_mean`, a second name for a parameter or buffer, one read
in two places); `exported`, an @torch.jit.export method.  The module is
scripted and optimized twice, and checked in these modes:

  train     torchfuse.optimize(scripted): two training steps, then one step
            in eval mode of the same modules (and one of the exported
            method);
  frozen    torchfuse.optimize(scripted.eval(), freeze=True, with the
            exported method in preserved_attrs): one step, and one of the
            exported method;
  autocast  the train mode's steps under torch.autocast('cpu', bfloat16)
            (float32): equal dtypes, values judged against the float64 run;
  double_backward  a gradient penalty: gradients with create_graph=True,
            then the gradients of the sum of their squares.

Each step runs the original and the optimized module on equal copies of the
same signed random inputs, in float64 and in float32, and compares outputs,
the inputs afterwards (in-place writes), gradients of inputs and parameters,
and buffers (BatchNorm running statistics).  The optimized module must have
the original's parameters and buffers, shared as they are, and optimize
must leave its input's methods alone.  Where a mode passes, its
optimized module is saved with torch.jit.save to a buffer and loaded with
torch.jit.load (which compiles the saved code again, as for a user of the
optimize-model CLI), and the mode's steps run again on the loaded module
against a copy of the original from the same start; failures say "after
save/load" (see _check_mode for what torch's own round trip excuses).
--round-trip-every K limits that to programs whose index is a multiple
of K.  A failing program is shrunk (statements dropped or simplified
while the failure persists) and, with --emit-regressions, written out as
a pytest file.  The last line is
`N passed, M failed`; the exit status is 1 when M > 0.

Program k of seed S depends only on (S, k): `--seed S --start k --programs 1`
reproduces it.
"""

import argparse
import collections
import contextlib
import copy
import dataclasses
import importlib.util
import io
import itertools
import linecache
import math
import os
import random
import re
import sys
import textwrap
import time
import types
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch

# TorchScript has warned on every entry point since torch 2.10.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)

if importlib.util.find_spec("torchfuse") is None:  # run from a checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torchfuse  # noqa: E402

OPS = torchfuse.pass_names()  # the fusion registry's names, in pipeline order
DTYPES = {"float64": torch.float64, "float32": torch.float32}
# train, eval: steps of optimize(m) (training, then inference); frozen:
# optimize(m.eval(), freeze=True); autocast: the train and eval steps again
# under CPU autocast to bfloat16 (float32 only); double_backward: a
# gradient penalty through optimize(m) (see _double_backward_values).
MODES = ["train", "eval", "frozen", "autocast", "double_backward"]
AUTOCAST = "autocast"
# Differences allowed, relative to max(1, largest magnitude of the reference
# tensor): the CPU kernels are the unfused ATen compositions in the forward;
# backwards are reassociated (and the BN backward runs in float64), so allow
# rounding of the dtype with some accumulation headroom.
# Under autocast (bfloat16 matmuls and convolutions, rounding of 2**-8):
# one bfloat16 ulp at 1, applied as rtol and atol (so about 2 ulps); see
# _judge.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2.0**-7}
BATCH = 4

Shape = Tuple[int, ...]

# ---- programs ----------------------------------------------------------------


@dataclasses.dataclass
class Stmt:
    """One statement of forward.  kind "line" is `text`; "if" renders
    `if text:` blocks[0] `else:` blocks[1]; "for" renders `for text:`
    blocks[0].  `alts` are simpler replacements the shrinker tries."""

    text: str
    kind: str = "line"
    blocks: Tuple[Tuple["Stmt", ...], ...] = ()
    alts: Tuple[Tuple["Stmt", ...], ...] = ()


@dataclasses.dataclass
class Program:
    inits: Dict[str, str]  # attribute -> its line in __init__ ("name.tieK": a later line tying it)
    inputs: List[Tuple[str, Shape]]
    body: Tuple[Stmt, ...]
    returns: Tuple[str, ...]
    # An @torch.jit.export method EXPORTED(inputs) -> (body, returns), and
    # the attributes the frozen mode keeps besides it (preserved_attrs).
    export: Optional[Tuple[Tuple[Stmt, ...], Tuple[str, ...]]] = None
    preserved: Tuple[str, ...] = ()

    def used_names(self) -> set:
        lines = _render_body(self.body, 0) + list(self.returns)
        if self.export:
            lines += _render_body(self.export[0], 0) + list(self.export[1])
        return set(re.findall(r"\b\w+\b", "\n".join(lines)))

    def live_inputs(self) -> List[Tuple[str, Shape]]:
        used = self.used_names()
        return [(n, s) for n, s in self.inputs if n in used]

    def init_lines(self) -> List[str]:
        """The __init__ lines of the attributes used, of the tie lines of
        those, and (transitively) of the attributes those lines read."""
        keep = {n for n in self.inits if n.split(".")[0] in self.used_names() | set(self.preserved)}
        while True:
            read = {r for n in keep for r in re.findall(r"self\.(\w+)", self.inits[n])}
            more = {n for n in self.inits if n.split(".")[0] in read} - keep
            if not more:
                return [line for n, line in self.inits.items() if n in keep]
            keep |= more

    def source(self, cls: str = "Program") -> str:
        args = ", ".join(["self"] + [n for n, _ in self.live_inputs()])
        lines = [f"class {cls}(nn.Module):"]
        if self.export:
            # NB: read back by check_source (_preserved_attrs).
            lines += [f"    # preserved_attrs: {', '.join((EXPORTED,) + self.preserved)}"]
        lines += ["    def __init__(self):", "        super().__init__()"]
        lines += ["        " + line for line in self.init_lines()]
        lines += [f"    def forward({args}):"]
        lines += _render_body(self.body, 2)
        lines += [f"        return {_render_returns(self.returns)}"]
        if self.export:
            lines += ["    @torch.jit.export", f"    def {EXPORTED}({args}):"]
            lines += _render_body(self.export[0], 2)
            lines += [f"        return {_render_returns(self.export[1])}"]
        return "\n".join(lines) + "\n"


EXPORTED = "exported"


def _render_returns(returns: Sequence[str]) -> str:
    return returns[0] if len(returns) == 1 else "(" + ", ".join(returns) + ",)"


def _render_body(stmts: Sequence[Stmt], depth: int) -> List[str]:
    pad = "    " * depth
    out = []
    for s in stmts:
        if s.kind == "line":
            out.append(pad + s.text)
        elif s.kind == "if":
            out.append(f"{pad}if {s.text}:")
            out += _render_body(s.blocks[0], depth + 1) or [pad + "    pass"]
            out.append(f"{pad}else:")
            out += _render_body(s.blocks[1], depth + 1) or [pad + "    pass"]
        else:
            out.append(f"{pad}for {s.text}:")
            out += _render_body(s.blocks[0], depth + 1) or [pad + "    pass"]
    return out


# ---- the generator -------------------------------------------------------------


@dataclasses.dataclass
class Var:
    name: str
    shape: Shape
    contiguous: bool = True


def _broadcast_ok(small: Shape, big: Shape) -> bool:
    """`small` broadcasts to `big` without changing `big`."""
    if len(small) > len(big):
        return False
    return all(s in (1, b) for s, b in zip(reversed(small), reversed(big)))


class Generator:
    """Builds one random Program.  Statements go to the current block
    (`self.out`); `scope` lists the tensors visible there."""

    def __init__(self, rng: random.Random, tie_rng: Optional[random.Random] = None):
        self.rng = rng
        self.inits: Dict[str, str] = {}
        self.counter = itertools.count()
        self.out: List[Stmt] = []
        self.scope: List[Var] = []
        self.must_return: List[str] = []
        # A clean chain is written in a fusable form; otherwise near-misses
        # (extra uses, interfering writes, unfusable variants) are drawn.
        self.clean = False
        # Tied parameters and shared buffers (feature "tied"): drawn from
        # tie_rng alone, so that without it a program is the one `rng`
        # alone has always drawn.  `tensors_by` lists the attribute paths
        # of the tensors made so far by category ("param", "buffer", and
        # BatchNorm statistics "mean", "var") and shape; `modules_by` the
        # modules by what they accept, for the exported method to call.
        self.tie_rng = tie_rng
        self.tie_p = tie_rng.choice([0.0, 0.0, 0.35, 0.7]) if tie_rng else 0.0
        self.reuse_p = 0.0  # chance of reading an existing tensor again (exported method)
        self.tensors_by: Dict[Tuple[str, Shape], List[str]] = collections.defaultdict(list)
        self.modules_by: Dict[tuple, List[Tuple[str, Shape]]] = collections.defaultdict(list)

    # -- names and attributes
    def fresh(self, prefix: str = "v") -> str:
        return f"{prefix}{next(self.counter)}"

    def attr(self, prefix: str, line_fmt: str) -> str:
        name = self.fresh(prefix)
        self.inits[name] = line_fmt.format(name=name)
        return name

    def param(self, shape: Shape) -> str:
        dims = ", ".join(map(str, shape))
        return self._tensor_attr("param", shape, "p", "self.{name} = nn.Parameter(torch.randn(%s))" % dims,
                                 "self.{name} = self.%s")

    def buffer(self, shape: Shape) -> str:
        dims = ", ".join(map(str, shape))
        return self._tensor_attr("buffer", shape, "b", 'self.register_buffer("{name}", torch.randn(%s))' % dims,
                                 'self.register_buffer("{name}", self.%s)')

    # -- ties
    def _shared(self, category: str, shape: Shape) -> Optional[str]:
        """An existing tensor of `category` and `shape` for a new one to be,
        if a tie is drawn."""
        paths = self.tensors_by.get((category, tuple(shape)))
        if paths and self.tie_rng and self.tie_rng.random() < self.tie_p:
            return self.tie_rng.choice(paths)
        return None

    def _tensor_attr(self, category: str, shape: Shape, prefix: str, line: str, alias_line: str) -> str:
        """`self.<new attribute>` made by `line`; or, reused, an existing
        tensor of the same category and shape: read again under its own name
        (exported method), or under a second name given by `alias_line`
        (a tied parameter, a shared buffer)."""
        paths = self.tensors_by.get((category, tuple(shape)))
        if paths and self.reuse_p and self.rng.random() < self.reuse_p:
            return "self." + self.rng.choice(paths)
        shared = self._shared(category, shape)
        if shared and self.tie_rng.random() < 0.4:
            return "self." + shared  # the same attribute read in two places
        name = self.attr(prefix, alias_line % shared if shared else line)
        self.tensors_by[(category, tuple(shape))].append(name)
        return "self." + name

    def _tie_module(self, module: str, fields: Sequence[Tuple[str, str, Shape]]) -> None:
        """Registers a module's tensors (field, category, shape); ties each to
        an earlier tensor of the same category and shape where one is drawn
        (`self.fc2.weight = self.fc1.weight`, `self.bn2.running_mean =
        self.bn1.running_mean`)."""
        for k, (field, category, shape) in enumerate(fields):
            shared = self._shared(category, shape)
            if shared:
                self.inits[f"{module}.tie{k}"] = f"self.{module}.{field} = self.{shared}"
            self.tensors_by[(category, tuple(shape))].append(f"{module}.{field}")

    def _reused_module(self, key: tuple) -> Optional[Tuple[str, Shape]]:
        """An existing module taking `key`'s input, to call again (exported
        method)."""
        found = self.modules_by.get(key)
        if found and self.reuse_p and self.rng.random() < self.reuse_p:
            return self.rng.choice(found)
        return None

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def pick(self, options):
        return self.rng.choice(options)

    def emit(self, text: str, alts: Sequence[Sequence[Stmt]] = ()) -> None:
        self.out.append(Stmt(text, alts=tuple(tuple(a) for a in alts)))

    def define(self, expr: str, shape: Shape, uses: Sequence[Var] = (), contiguous=True) -> Var:
        """`v = expr`; the shrinker may replace it by `v = u` for a use u of
        the same shape."""
        v = Var(self.fresh(), tuple(shape), contiguous)
        alts = [[Stmt(f"{v.name} = {u.name}")] for u in uses if u.shape == v.shape]
        self.emit(f"{v.name} = {expr}", alts)
        self.scope.append(v)
        return v

    def tensors(self, pred=lambda v: True) -> List[Var]:
        return [v for v in self.scope if len(v.shape) >= 1 and pred(v)]

    # -- operands
    def scalar(self, nonzero: bool = True) -> str:
        r = self.rng.random()
        if r < 0.2:
            value = self.pick([0.5, 1.5, 2.5, -2.0, 3.0])
            return "self." + self.attr("k", "self.{name} = %r" % value)
        if r < 0.3:
            return str(self.pick([2, 3, -1]))
        if not nonzero and r < 0.34:
            return self.pick(["0.0", "0"])
        return repr(self.pick([0.5, 2.0, -1.5, 0.25, 3.0, 1.0]))

    def other_for(self, shape: Shape, avoid: Sequence[str] = ()) -> Tuple[str, Optional[Var]]:
        """A tensor operand that broadcasts to `shape` without growing it: a
        value in scope (reused intermediates, residuals), a parameter or a
        buffer of a broadcastable shape."""
        same = [v for v in self.scope if _broadcast_ok(v.shape, shape) and v.name not in avoid]
        r = self.rng.random()
        if same and r < 0.5:
            v = self.pick(same)
            return v.name, v
        shapes = [shape, shape[1:], (1,), (shape[-1],)]
        if len(shape) >= 2:
            shapes.append((shape[1],) + (1,) * (len(shape) - 2))
        target = tuple(self.pick([s for s in shapes if s]))
        make = self.buffer if r > 0.85 else self.param
        return make(target), None

    # -- statement kinds
    def linear(self, x: Var, out_features: Optional[int] = None) -> Var:
        fin = x.shape[-1]
        fout = out_features or self.pick([fin, 3, 5, 6])
        shape = x.shape[:-1] + (fout,)
        r = self.rng.random()
        if r < 0.6:
            reused = self._reused_module(("linear", x.shape))
            if reused:
                return self.define(f"self.{reused[0]}({x.name})", reused[1])
            bias = self.chance(0.7)
            m = self.attr("fc", "self.{name} = nn.Linear(%d, %d, bias=%s)" % (fin, fout, bias))
            self._tie_module(m, [("weight", "param", (fout, fin))] + ([("bias", "param", (fout,))] if bias else []))
            self.modules_by[("linear", x.shape)].append((m, shape))
            return self.define(f"self.{m}({x.name})", shape)
        w = self.param((fout, fin))
        if r < 0.8:
            return self.define(f"F.linear({x.name}, {w}, {self.param((fout,))})", shape)
        if r < 0.9:
            return self.define(f"F.linear({x.name}, {w})", shape)
        b = "self." + self.attr("nb", "self.{name} = None")
        return self.define(f"F.linear({x.name}, {w}, {b})", shape)

    def conv(self, x: Var, same_shape: bool = False) -> Var:
        dims = len(x.shape) - 2
        cin, spatial = x.shape[1], x.shape[2:]
        groups = self.pick([1, 1, 1, cin]) if cin > 1 else 1
        cout = cin if same_shape or groups > 1 else self.pick([cin, 2, 3, 4])
        if groups > 1 and self.chance(0.3):
            cout = 2 * cin
        k = self.pick([1, 3]) if same_shape else self.pick([1, 2, 3])
        stride = 1 if same_shape else self.pick([1, 1, 2])
        dilation = 1 if same_shape or k == 1 else self.pick([1, 1, 2])
        padding = (k // 2) if same_shape else self.pick([0, 1, 2])
        out = tuple((s + 2 * padding - dilation * (k - 1) - 1) // stride + 1 for s in spatial)
        if min(out) < 1:
            padding, stride, dilation = k, 1, 1
            out = tuple(s + 2 * k - k + 1 for s in spatial)
        shape = (x.shape[0], cout) + out
        bias = self.chance(0.7)
        kind = "Conv%dd" % dims
        reused = self._reused_module(("conv", x.shape))
        if reused:
            return self.define(f"self.{reused[0]}({x.name})", reused[1])
        if self.chance(0.7):
            pad = repr(padding)
            if same_shape and stride == 1 and not self.clean and self.chance(0.3):
                pad = "'same'"  # conv*d.padding: not fused
            mode = ", padding_mode='circular'" if pad != "'same'" and padding and self.chance(0.1) else ""
            m = self.attr(
                "conv",
                "self.{name} = nn.%s(%d, %d, %d, stride=%d, padding=%s, dilation=%d, groups=%d, bias=%s%s)"
                % (kind, cin, cout, k, stride, pad, dilation, groups, bias, mode),
            )
            self._tie_module(m, [("weight", "param", (cout, cin // groups) + (k,) * dims)]
                             + ([("bias", "param", (cout,))] if bias else []))
            self.modules_by[("conv", x.shape)].append((m, shape))
            return self.define(f"self.{m}({x.name})", shape)
        w = self.param((cout, cin // groups) + (k,) * dims)
        b = self.param((cout,)) if bias else "None"
        return self.define(
            f"F.conv{dims}d({x.name}, {w}, {b}, {stride}, {padding}, {dilation}, {groups})", shape
        )

    def batch_norm(self, x: Var) -> Var:
        c = x.shape[1]
        kind = "BatchNorm2d" if len(x.shape) == 4 else "BatchNorm1d"
        reused = self._reused_module(("bn", x.shape))
        if reused:
            self.last_bn_stats = None
            return self.define(f"self.{reused[0]}({x.name})", x.shape)
        if self.chance(0.7):
            opts = []
            if self.chance(0.15):
                opts.append("affine=False")
            if not self.clean and self.chance(0.15):
                opts.append("track_running_stats=False")
            if self.chance(0.15):
                opts.append("momentum=" + self.pick(["None", "0.5"]))
            if self.chance(0.1):
                opts.append("eps=1e-3")
            m = self.attr("bn", "self.{name} = nn.%s(%s)" % (kind, ", ".join([str(c)] + opts)))
            self.last_bn_stats = None if "track_running_stats=False" in opts else f"self.{m}.running_mean"
            fields = [] if "affine=False" in opts else [("weight", "param", (c,)), ("bias", "param", (c,))]
            if self.last_bn_stats:
                fields += [("running_mean", "mean", (c,)), ("running_var", "var", (c,))]
            self._tie_module(m, fields)
            self.modules_by[("bn", x.shape)].append((m, x.shape))
            return self.define(f"self.{m}({x.name})", x.shape)
        rm = self._tensor_attr("mean", (c,), "rm", 'self.register_buffer("{name}", torch.zeros(%d))' % c,
                               'self.register_buffer("{name}", self.%s)')
        rv = self._tensor_attr("var", (c,), "rv", 'self.register_buffer("{name}", torch.ones(%d))' % c,
                               'self.register_buffer("{name}", self.%s)')
        w = self.param((c,)) if self.chance(0.7) else "None"
        b = self.param((c,)) if self.chance(0.7) else "None"
        training = self.pick(["self.training", "self.training", "True", "False"])
        momentum = self.pick(["0.1", "0.3"])
        self.last_bn_stats = rm
        return self.define(
            f"F.batch_norm({x.name}, {rm}, {rv}, {w}, {b}, {training}, {momentum}, 1e-05)", x.shape
        )

    def relu(self, x: Var, fresh: bool) -> Var:
        """relu in its spellings; in-place forms write `x`."""
        forms = ["torch.relu({x})", "F.relu({x})", "{x}.relu()", "{x}.relu_()", "F.relu({x}, inplace=True)"]
        if self.chance(0.15):
            m = self.attr("act", "self.{name} = nn.ReLU(inplace=%s)" % self.chance(0.5))
            forms = ["self.%s({x})" % m]
        if not fresh and self.chance(0.6):
            forms = forms[:3]
        return self.define(self.pick(forms).format(x=x.name), x.shape, [x], x.contiguous)

    def add(self, y: Var, fresh: bool, alpha_ok: bool = True) -> Var:
        """y + other in its spellings and operand orders, and near-misses
        (scalar add, sub, alpha on either operand, other.add_(y))."""
        other, ov = self.other_for(y.shape, avoid=[y.name])
        r = self.rng.random() * (0.75 if self.clean else 1.0)
        if self.clean and r >= 0.55 and r < 0.62:
            r = 0.5  # other.add(y, alpha) is fused only with alpha 1
        alpha = self.pick(["2", "0.5", "-1", "1"]) if alpha_ok else "1"
        if r < 0.3:
            expr = f"{y.name} + {other}"
        elif r < 0.45:
            expr = f"{other} + {y.name}"
        elif r < 0.55:
            expr = f"torch.add({y.name}, {other}, alpha={alpha})"
        elif r < 0.62:
            expr = f"{other}.add({y.name}, alpha={alpha})"
        elif r < 0.75 and fresh:
            expr = f"{y.name}.add_({other})" if self.chance(0.7) else f"{y.name}.add_({other}, alpha={alpha})"
        elif r < 0.8 and ov is not None and ov.shape == y.shape:
            expr = f"{other}.add_({y.name})"  # writes a live tensor
        elif r < 0.87:
            expr = f"{y.name} + {self.scalar()}"  # add.Scalar
        elif r < 0.94:
            expr = self.pick([f"{y.name} - {other}", f"{other} - {y.name}", f"torch.sub({y.name}, {other}, alpha={alpha})"])
        else:
            expr = f"{y.name} + {other}"
        return self.define(expr, y.shape, [y] + ([ov] if ov else []), y.contiguous)

    def maybe_interfere(self, chain_inputs: Sequence[str]) -> None:
        """Near-miss: write a chain input in place, or read an intermediate a
        second time, between two chain statements."""
        r = 1.0 if self.clean else self.rng.random()
        if r < 0.08:
            victims = [v for v in self.scope if v.name in chain_inputs and len(v.shape) >= 1]
            if victims:
                v = self.pick(victims)
                self.emit(self.pick([f"{v.name}.mul_(0.5)", f"{v.name}.add_(1.0)", f"{v.name}.relu_()"]))
        elif r < 0.14:
            buffers = [n for n in chain_inputs if n.startswith("self.b") or ".running_" in n]
            if buffers:
                self.emit(f"{self.pick(buffers)}.mul_(0.5)")

    def extra_use(self, v: Var) -> None:
        r = 1.0 if self.clean else self.rng.random()
        if r < 0.08:
            self.must_return.append(v.name)
        elif r < 0.14:
            self.define(f"{v.name} * 0.5", v.shape, [v])

    def chain(self, build, pred=lambda v: True) -> Optional[Var]:
        """Runs a chain builder on a tensor in scope; later statements mostly
        do not see its intermediates (which would be extra uses)."""
        xs = self.tensors(pred)
        if not xs:
            return None
        self.clean = self.chance(0.55)
        before = len(self.scope)
        out = build(self.pick(xs))
        self.clean = False
        if self.chance(0.75):
            self.scope = self.scope[:before] + [out]
        return out

    def chain_linear(self) -> Optional[Var]:
        def build(x):
            y = self.linear(x, out_features=x.shape[-1] if self.chance(0.4) else None)
            self.extra_use(y)
            self.maybe_interfere([x.name])
            s = self.add(y, fresh=True)
            self.extra_use(s)
            return self.relu(s, fresh=True)

        return self.chain(build)

    def chain_conv(self) -> Optional[Var]:
        def build(x):
            c = self.conv(x, same_shape=self.chance(0.5))
            self.extra_use(c)
            r = self.relu(c, fresh=True)
            self.maybe_interfere([x.name])
            self.extra_use(r)
            return self.add(r, fresh=True)

        return self.chain(build, lambda v: len(v.shape) in (3, 4))

    def chain_batch_norm(self) -> Optional[Var]:
        return self.chain(self._batch_norm_chain, lambda v: 2 <= len(v.shape) <= 4)

    def _batch_norm_chain(self, x: Var) -> Var:
        y = self.batch_norm(x)
        stats = self.last_bn_stats
        self.extra_use(y)
        s = self.add(y, fresh=True, alpha_ok=self.chance(0.2))
        if stats and not self.clean and self.chance(0.15):
            # reads the running statistics between the BN and the swish
            self.must_return.append(self.define(f"{stats} * 1.0", (x.shape[1],)).name)
        self.maybe_interfere([x.name] + ([stats] if stats else []))
        r = self.rng.random() * (0.7 if self.clean else 1.0)
        if r < 0.7:
            t = self.define(f"{s.name} / {self.scalar(nonzero=self.clean)}", s.shape, [s], s.contiguous)
        elif r < 0.8:
            d, _ = self.other_for(s.shape)
            t = self.define(f"{s.name} / {d}", s.shape, [s])
        elif r < 0.85:
            t = self.define(f"torch.div({s.name}, 2.0, rounding_mode='floor')", s.shape, [s])
        else:
            t = self.define(f"{s.name} * 0.5", s.shape, [s], s.contiguous)
        self.extra_use(t)
        r = self.rng.random() * (0.85 if self.clean else 1.0)
        if r < 0.4:
            return self.define(f"{t.name} * torch.sigmoid({t.name})", t.shape, [t])
        if r < 0.6:
            return self.define(f"torch.sigmoid({t.name}) * {t.name}", t.shape, [t])
        if r < 0.85:
            return self.define(f"F.silu({t.name})", t.shape, [t])
        sig = self.define(f"torch.sigmoid({t.name})", t.shape, [t])
        self.extra_use(sig)
        return self.define(f"{t.name} * {sig.name}", t.shape, [t, sig])

    def standalone_relu(self) -> Optional[Var]:
        xs = self.tensors()
        if not xs:
            return None
        x = self.pick(xs)
        if self.chance(0.5):
            # on a fresh value
            x = self.define(self.pick([f"{x.name} * 2.0", f"torch.sigmoid({x.name}) - 0.5", f"{x.name} - 0.1"]), x.shape, [x], x.contiguous)
        return self.relu(x, fresh=self.chance(0.5))

    def elementwise(self) -> Optional[Var]:
        xs = self.tensors()
        if not xs:
            return None
        x = self.pick(xs)
        r = self.rng.random()
        if r < 0.15:
            return self.define(self.pick([f"torch.sigmoid({x.name})", f"F.silu({x.name})", f"torch.tanh({x.name})"]), x.shape, [x], x.contiguous)
        if r < 0.3:
            return self.define(self.pick([f"{x.name} * {self.scalar()}", f"{x.name} / {self.scalar()}", f"{x.name} - {self.scalar()}", f"{self.scalar()} - {x.name}"]), x.shape, [x], x.contiguous)
        if r < 0.45:
            return self.define(f"{x.name} * torch.sigmoid({x.name})", x.shape, [x], x.contiguous)
        other, ov = self.other_for(x.shape)
        op = self.pick(["+", "-", "*", "/", "*"])
        if op == "/" and self.chance(0.5):
            other = f"({other}.abs() + 0.5)"
        uses = [x] + ([ov] if ov else [])
        if self.chance(0.5):
            return self.define(f"{x.name} {op} {other}", x.shape, uses, x.contiguous)
        return self.define(f"{other} {op} {x.name}", x.shape, uses, False)

    def inplace(self) -> None:
        """An in-place write on a live tensor (an input, an intermediate, a
        view of one, or a buffer)."""
        xs = self.tensors()
        if not xs:
            return
        x = self.pick(xs)
        r = self.rng.random()
        if r < 0.35:
            other, _ = self.other_for(x.shape, avoid=[x.name])
            self.emit(self.pick([f"{x.name}.add_({other})", f"{x.name}.sub_({other})", f"{x.name}.add_({other}, alpha=2)", f"{x.name}.mul_({other})"]))
        elif r < 0.6:
            self.emit(self.pick([f"{x.name}.relu_()", f"{x.name}.mul_({self.scalar()})", f"{x.name}.div_(2.0)", f"{x.name}.add_(1.0)"]))
        elif r < 0.8:
            view = self.view(x)
            if view is not None:
                self.emit(self.pick([f"{view.name}.relu_()", f"{view.name}.mul_(-1.0)", f"{view.name}.add_(0.5)"]))
        else:
            buf = self.buffer(x.shape[1:] if len(x.shape) > 1 and self.chance(0.5) else x.shape)
            self.emit(self.pick([f"{buf}.relu_()", f"{buf}.mul_(0.9)", f"{buf}.add_(0.1)"]))
            self.define(f"{x.name} + {buf}", x.shape, [x], x.contiguous)

    def view(self, x: Optional[Var] = None) -> Optional[Var]:
        xs = [x] if x is not None else self.tensors()
        if not xs:
            return None
        x = self.pick(xs)
        s = x.shape
        r = self.rng.random()
        if len(s) >= 2 and r < 0.35:
            i, j = self.rng.sample(range(len(s)), 2)
            t = list(s)
            t[i], t[j] = t[j], t[i]
            expr = f"{x.name}.t()" if len(s) == 2 and self.chance(0.3) else f"{x.name}.transpose({i}, {j})"
            return self.define(expr, tuple(t), [x], contiguous=False)
        if len(s) >= 3 and r < 0.7:
            new = s[:1] + (math.prod(s[1:]),)
            expr = self.pick([f"{x.name}.reshape({new[0]}, {new[1]})", f"torch.flatten({x.name}, 1)"])
            if x.contiguous and self.chance(0.5):
                expr = f"{x.name}.view({new[0]}, {new[1]})"
            return self.define(expr, new, [x])
        if len(s) == 2 and s[1] % 2 == 0:
            new = (s[0], 2, s[1] // 2)
            method = "view" if x.contiguous and self.chance(0.5) else "reshape"
            return self.define(f"{x.name}.{method}({s[0]}, 2, {s[1] // 2})", new, [x])
        if len(s) == 2:
            return self.define(f"{x.name}.reshape({s[0]}, {s[1]}, 1)", (s[0], s[1], 1), [x])
        return self.define(f"{x.name}.reshape({s[0]}, -1)", (s[0], math.prod(s[1:])), [x])

    def block(self, depth: int) -> None:
        """An if or for block whose body may hold any statement; it assigns
        one tensor that stays visible after it."""
        xs = self.tensors()
        if not xs:
            return
        x = self.pick(xs)
        outer_scope, outer_out, outer_returns = self.scope, self.out, list(self.must_return)
        is_loop = self.chance(0.4)
        target = x.name if is_loop or self.chance(0.5) else self.fresh()

        def body() -> Tuple[Stmt, ...]:
            self.scope, self.out = list(outer_scope), []
            for _ in range(self.rng.randint(1, 3)):
                self.statement(depth + 1, same_shape_hint=True)
            same = [v for v in self.scope if v.shape == x.shape and v.name != target]
            if same:
                self.emit(f"{target} = {self.pick(same).name}")
            elif target != x.name:
                self.emit(f"{target} = {x.name}")
            return tuple(self.out)

        if is_loop:
            blocks = (body(),)
            kind, text = "for", f"_ in range({self.pick([1, 2, 3])})"
        else:
            blocks = (body(), body())
            kind = "if"
            text = self.pick(["bool(%s.sum() > 0)" % x.name, "self.training"])
            if self.chance(0.3):
                text = "self." + self.attr("flag", "self.{name} = %s" % self.chance(0.5))
        # Values defined inside the blocks are not visible after them.
        self.scope, self.out, self.must_return = outer_scope, outer_out, outer_returns
        # NB: a block's meaning is kept by its first body run straight-line.
        self.out.append(Stmt(text, kind, blocks, alts=(blocks[0],)))
        if target != x.name:
            self.scope.append(Var(target, x.shape, False))
        else:
            x.contiguous = False

    def statement(self, depth: int = 0, same_shape_hint: bool = False) -> None:
        kinds = [
            (self.chain_linear, 5),
            (self.chain_conv, 5),
            (self.chain_batch_norm, 5),
            (self.standalone_relu, 3),
            (self.elementwise, 3),
            (self.inplace, 1.5),
            (self.view, 1 if not same_shape_hint else 0.3),
            (lambda: self.block(depth), 1.2 if depth < 2 else 0),
            (lambda: self.pick(self.tensors() or [None]) and self.linear(self.pick(self.tensors())), 0.7),
        ]
        fns, weights = zip(*kinds)
        self.rng.choices(fns, weights)[0]()

    def exported_method(self, rng: random.Random, inputs: Sequence[Tuple[str, Shape]]):
        """The body and returns of an @torch.jit.export method taking the
        same inputs as forward, drawn from `rng` after forward, and the
        attributes to preserve besides it.  NB: it mostly reads forward's
        parameters, buffers and modules again, whose sharing freezing must
        keep; it may write buffers, which freezing must then keep too."""
        self.rng, self.reuse_p = rng, 0.6
        self.scope = [Var(name, shape) for name, shape in inputs]
        self.out, self.must_return = [], []
        for _ in range(rng.randint(1, 3)):
            self.statement()
        visible = [v.name for v in self.scope]
        returns = list(dict.fromkeys([visible[-1]] + self.must_return))
        attrs = [n for n in self.inits if re.fullmatch(r"(p|b|k|flag)\d+", n)]
        preserved = (rng.choice(attrs),) if attrs and rng.random() < 0.3 else ()
        return (tuple(self.out), tuple(returns)), preserved


# Program features beyond the forward that `rng` draws; each comes from its
# own random stream, so a program drawn without them is the one drawn
# before they existed.
FEATURES = ["tied", "exported"]
EXPORT_PROBABILITY = 0.25


def generate(seed: int, index: int, features: Sequence[str] = tuple(FEATURES)) -> Program:
    rng = random.Random(f"{seed}:{index}")
    g = Generator(rng, random.Random(f"{seed}:{index}:tied") if "tied" in features else None)
    family = rng.choice(["dense", "seq", "image"])
    n = rng.choice([BATCH, BATCH, 3])
    if family == "dense":
        first = (n, rng.choice([3, 4, 6]))
        if rng.random() < 0.08:
            first = (first[1],)  # unbatched linear input
    elif family == "seq":
        first = (n, rng.choice([2, 3, 4]), rng.choice([5, 6]))
    else:
        first = (n, rng.choice([2, 3]), rng.choice([4, 5]), rng.choice([4, 5]))
    inputs = [("x0", first)]
    for i in range(1, rng.choice([1, 2, 2, 3])):
        shape = rng.choice([first, first, first[1:] or first, (first[-1],)])
        inputs.append((f"x{i}", shape))
    g.scope = [Var(name, shape) for name, shape in inputs]
    for _ in range(rng.randint(2, 7)):
        g.statement()
    visible = [v.name for v in g.scope]
    returns = [visible[-1]] + [rng.choice(visible) for _ in range(rng.choice([0, 0, 1, 2]))]
    returns = list(dict.fromkeys(returns + g.must_return))
    body, export, preserved = tuple(g.out), None, ()
    xrng = random.Random(f"{seed}:{index}:exported")
    if "exported" in features and xrng.random() < EXPORT_PROBABILITY:
        export, preserved = g.exported_method(xrng, inputs)
    return Program(g.inits, inputs, body, tuple(returns), export, preserved)


# ---- running and comparing --------------------------------------------------------

_counter = itertools.count()


def load_class(source: str):
    """Defines the class in `source` in a fresh module whose source
    TorchScript can find (through linecache)."""
    name = f"_torchfuse_fuzz_{next(_counter)}"
    filename = f"<{name}>"
    header = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
    text = header + source
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module
    exec(compile(text, filename, "exec"), module.__dict__)
    return module.Program


class Invalid(Exception):
    """The original program does not script or run: not a test case."""


@dataclasses.dataclass
class Outcome:
    failures: List[str] = dataclasses.field(default_factory=list)
    fused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    backward_skipped: int = 0
    # Differences beyond the tolerance accepted as within the rounding
    # spread of the original (see _spread).
    within_spread: int = 0
    # The original's float64 results by step and tensor: the float32 runs
    # use the same values rounded, so these are their exact answers.
    exact: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # Modes whose optimized module, after save/load, differed from the
    # original but agreed with torch's own module after save/load (see
    # _check_mode): torch's doing, not optimize's; and modes where it
    # differed otherwise but torch's own module after save/load differed
    # from the original too (no reference: not judged).
    round_trip_alike: int = 0
    round_trip_torch_differs: int = 0
    # Modes not round-tripped because torch cannot save/load the original.
    round_trip_skipped: int = 0
    # Frozen modes whose optimized module differed from the original as
    # torch's own frozen original did, and agreed with that (see
    # _frozen_by_torch_alike), and the float64 results of those runs.
    frozen_alike: int = 0
    frozen_exact: Dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # Frozen modes not judged: torch's own frozen original differs from the
    # original and has a training batch_norm, and the optimized module
    # agrees with neither (no reference; see _frozen_by_torch_alike).
    frozen_torch_differs: int = 0
    # Double-backward steps not compared because the original raised.
    double_backward_skipped: int = 0
    # Whether the original shares a tensor between two attributes.
    shares: bool = False


def _flat(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _mismatch(a: torch.Tensor, b: torch.Tensor, dtype) -> Optional[str]:
    if a is None or b is None:
        return None if a is None and b is None else f"one is None ({a is None}, {b is None})"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(b.shape)}/{b.dtype} vs {tuple(a.shape)}/{a.dtype}"
    if not a.is_floating_point():
        return None if torch.equal(a, b) else "values differ"
    a, b = a.detach(), b.detach()
    finite = a[torch.isfinite(a)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    tol = TOLERANCE.get(dtype, TOLERANCE[torch.float32]) * scale
    if torch.allclose(b, a, rtol=tol, atol=tol, equal_nan=True):
        return None
    diff = (b - a).abs().nan_to_num(nan=float("inf")).max().item()
    return f"max |diff| {diff:.3g} > {tol:.3g}"


def _message(e: Exception) -> str:
    """An exception's message in one line: for an error inside the
    TorchScript interpreter, its last line (the first is boilerplate)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
    return lines[-1] if lines[0].startswith("The following operation failed") else lines[0]


def _loss_weights(outputs, rng_seed: int) -> List[torch.Tensor]:
    """Random weights for the outputs, drawn in float64 and rounded: the
    float32 (and autocast) runs get the float64 run's weights, so that the
    float64 results are their exact answers (torch.randn in float32 draws
    other numbers than in float64 from 16 elements on)."""
    g = torch.Generator().manual_seed(rng_seed)
    return [torch.randn(o.shape, dtype=torch.float64, generator=g).to(o.dtype) for o in outputs]


def _run_step(ref, opt, inputs, rng_seed, dtype, grads: bool, params: bool, what: str, outcome: Outcome,
              method: str = "forward", autocast: bool = False):
    """One forward (and backward) of both modules' `method` on equal inputs;
    with `autocast`, the forwards under CPU autocast to bfloat16 (see
    _judge for the tolerance) and the backwards after it, as in training
    with mixed precision."""
    before = copy.deepcopy(ref)  # for _spread: the step changes buffers
    leaves_a = [t.clone().requires_grad_(grads) for t in inputs]
    leaves_b = [t.clone().requires_grad_(grads) for t in inputs]
    # NB: non-leaf copies, so programs may write their inputs in place.
    ins_a = [t.clone() for t in leaves_a]
    ins_b = [t.clone() for t in leaves_b]
    for m in (ref, opt):
        for p in m.parameters():
            p.grad = None
    context = (lambda: torch.autocast("cpu", torch.bfloat16)) if autocast else contextlib.nullcontext
    try:
        with context():
            out_a = _flat(getattr(ref, method)(*ins_a))
    except Exception as e:  # noqa: BLE001
        raise Invalid(f"{what}: the original raised {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        with context():
            out_b = _flat(getattr(opt, method)(*ins_b))
    except Exception as e:  # noqa: BLE001
        outcome.failures.append(f"{what}: optimized {method} raised: {_message(e)}")
        return
    if len(out_a) != len(out_b):
        outcome.failures.append(f"{what}: {len(out_b)} outputs vs {len(out_a)}")
        return
    values_a = _values(ref, out_a, ins_a)
    values_b = _values(opt, out_b, ins_b)
    loss = None
    if grads:
        weights = _loss_weights(out_a, rng_seed)
        # NB: freezing folds parameters into constants, and constant
        # propagation may fold outputs that depend on nothing else.
        both = [params or (a.requires_grad and b.requires_grad) for a, b in zip(out_a, out_b)]
        loss = [(i, w) for i, (o, w, k) in enumerate(zip(out_a, weights, both)) if k and o.requires_grad]
        if len(loss) != sum(k and o.requires_grad for o, k in zip(out_b, both)):
            outcome.failures.append(f"{what}: outputs requiring grad differ")
        elif loss:
            try:
                sum((out_a[i] * w).sum() for i, w in loss).backward()
                backward_ok = True
            except Exception:  # noqa: BLE001  (e.g. an input written in place after use)
                backward_ok = False
                loss = None
                outcome.backward_skipped += 1
            if backward_ok:
                try:
                    sum((out_b[i] * w.to(out_b[i].dtype)).sum() for i, w in loss).backward()
                except Exception as e:  # noqa: BLE001
                    outcome.failures.append(f"{what}: optimized backward raised: {_message(e)}")
                    return
                values_a.update(_grads(ref, leaves_a, params))
                values_b.update(_grads(opt, leaves_b, params))

    def evaluate(module, leaves, jitter):
        leaves = [t.requires_grad_(loss is not None) for t in leaves]
        ins = [t.clone() for t in leaves]
        with context():
            outputs = _flat(getattr(module, method)(*ins))
        values = _values(module, outputs, ins)
        if loss:
            # NB: under autocast the backward sums bfloat16 products of the
            # weights (a bias gradient: seed 20261124, program 5795), so
            # the weights are perturbed too.
            sum((outputs[i] * (jitter(w) if autocast else w)).sum() for i, w in loss).backward()
            values.update(_grads(module, leaves, params))
        return values

    step = what.split(" ", 1)[1]
    # NB: the autocast steps repeat the train mode's steps from the same
    # state, whose float64 results are their exact answers too; their
    # rounding is bfloat16's, and so is their spread's perturbation (see
    # PERTURBATION_ULPS_AUTOCAST).
    spread_dtype, ulps = (torch.bfloat16, PERTURBATION_ULPS_AUTOCAST) if autocast else (dtype, PERTURBATION_ULPS)
    _judge(values_a, values_b, torch.bfloat16 if autocast else dtype,
           step.replace(AUTOCAST + " ", "", 1) if autocast else step, what, outcome,
           lambda: _spread(before, inputs, spread_dtype, rng_seed, values_a, evaluate, ulps),
           record=not autocast)


def _judge(values_a, values_b, tol_dtype, step: str, what: str, outcome: Outcome, spread_runs,
           record: bool = True) -> None:
    """Compares the values of a step: within the tolerance of `tol_dtype`
    (the values' dtype; bfloat16 under autocast), or (float32) as accurate
    against the float64 run's results of `step` (recorded here by the
    float64 run), or within the original's rounding spread (`spread_runs()`
    yields it after each perturbed run)."""
    dtype = tol_dtype
    beyond = []  # (name, original, optimized, message)
    for name, a in values_a.items():
        if name not in values_b:  # a buffer frozen into a constant
            continue
        b = values_b[name]
        if record and dtype == torch.float64 and a is not None:
            outcome.exact[f"{step}: {name}"] = a.detach().clone()
        msg = _mismatch(a, b, tol_dtype)
        if msg and not _as_accurate(a, b, outcome.exact.get(f"{step}: {name}"), tol_dtype):
            beyond.append((name, a, b, msg))
    if not beyond:
        return
    # NB: the spread of a result that is zero but for rounding is quantized:
    # most perturbed runs leave its largest rounding residue where it was,
    # and a few move it by a whole residue (seed 5, program 1586: 12% of
    # runs move a float64 gradient by 1.16e-10, the others by 1.5e-11 at
    # most), so PERTURBATION_RUNS runs can miss it.  Differences beyond
    # SPREAD_FACTOR times their spread get more runs, one at a time, until
    # all are within it or PERTURBATION_RUNS_MAX runs are spent; passing
    # programs rarely get here at all.
    spread: Dict[str, float] = {}
    if spread_runs is not None and all(a.dtype == b.dtype for _, a, b, _ in beyond if a is not None and b is not None):
        for runs, spread in enumerate(spread_runs(), 1):
            if runs >= PERTURBATION_RUNS and all(_within_spread(a, b, spread.get(name)) for name, a, b, _ in beyond):
                break
    for name, a, b, msg in beyond:
        if _within_spread(a, b, spread.get(name)):
            outcome.within_spread += 1
        else:
            outcome.failures.append(f"{what}: {name}: {msg}")


def _double_backward_values(module, leaves, rng_seed: int) -> Optional[Dict[str, torch.Tensor]]:
    """A gradient penalty: the gradients of a random weighting of the
    outputs with respect to the inputs and parameters, taken with
    create_graph=True, and the gradients of the sum of their squares with
    respect to the same.  Gradients of what a result does not depend on
    count as zeros (an optimized module may connect a zero gradient that
    the original leaves unconnected).  None if no output requires grad."""
    leaves = [t.requires_grad_(True) for t in leaves]
    ins = [t.clone() for t in leaves]  # NB: programs may write their inputs in place
    try:
        outputs = _flat(module(*ins))
    except Exception as e:  # noqa: BLE001
        raise _ForwardRaised(e) from e
    named = [(f"input {i}", t) for i, t in enumerate(leaves)] + list(module.named_parameters())
    terms = [(o * w).sum() for o, w in zip(outputs, _loss_weights(outputs, rng_seed)) if o.requires_grad]
    if not terms:
        return None
    targets = [t for _, t in named]
    first = torch.autograd.grad(sum(terms), targets, create_graph=True, materialize_grads=True)
    penalty = sum((g * g).sum() for g in first)
    if penalty.requires_grad:
        second = torch.autograd.grad(penalty, targets, materialize_grads=True)
    else:
        second = [torch.zeros_like(t) for t in targets]
    values = {"outputs": torch.cat([o.detach().reshape(-1) for o in outputs])}
    values.update({f"grad of {n} (create_graph)": g for (n, _), g in zip(named, first)})
    values["penalty (sum of the squared gradients)"] = penalty
    values.update({f"grad of the penalty w.r.t. {n}": g for (n, _), g in zip(named, second)})
    return values


class _ForwardRaised(Exception):
    pass


def _run_double_backward_step(ref, opt, inputs, rng_seed, dtype, what: str, outcome: Outcome) -> None:
    """Double backward (WGAN-GP's gradient penalty, MAML, Hessian-vector
    products): _double_backward_values of both modules, compared as a
    step's values are.  Where the original raises in the backwards, the
    step is not compared (Outcome.double_backward_skipped)."""
    before = copy.deepcopy(ref)
    try:
        values_a = _double_backward_values(ref, [t.clone() for t in inputs], rng_seed)
    except _ForwardRaised as e:
        raise Invalid(f"{what}: the original raised {type(e.args[0]).__name__}: {str(e.args[0]).splitlines()[0]}")
    except Exception:  # noqa: BLE001  (e.g. an input written in place after use)
        outcome.double_backward_skipped += 1
        return
    if values_a is None:
        return
    try:
        values_b = _double_backward_values(opt, [t.clone() for t in inputs], rng_seed)
    except Exception as e:  # noqa: BLE001
        outcome.failures.append(f"{what}: optimized module raised: {_message(e)}")
        return
    if values_b is None:
        outcome.failures.append(f"{what}: no output of the optimized module requires grad")
        return
    _judge(values_a, values_b, dtype, what.split(" ", 1)[1], what, outcome,
           lambda: _spread(before, inputs, dtype, rng_seed, values_a,
                           lambda module, leaves, _: _double_backward_values(module, leaves, rng_seed)))


def _values(module, outputs, ins) -> Dict[str, torch.Tensor]:
    """What a step is compared on, before the backward: outputs, inputs
    written in place, buffers."""
    values = {f"output {i}": o for i, o in enumerate(outputs)}
    values.update({f"input {i} after forward": t for i, t in enumerate(ins)})
    values.update({f"buffer {n}": b for n, b in module.named_buffers()})
    return values


def _grads(module, leaves, params: bool) -> Dict[str, torch.Tensor]:
    values = {f"grad of input {i}": t.grad for i, t in enumerate(leaves)}
    if params:
        values.update({f"grad of {n}": p.grad for n, p in module.named_parameters()})
    return values


def _as_accurate(a, b, exact, dtype) -> bool:
    """b is within the tolerance of, or no more than 4 times as far as a
    from, the exact answer: a float32 difference that only reflects an
    ill-conditioned computation (e.g. a BatchNorm of a constant, whose
    1/sqrt(eps) amplifies rounding) is not a change of meaning."""
    if exact is None or a is None or b is None or a.shape != exact.shape or b.shape != exact.shape:
        return False
    if a.dtype != b.dtype:
        return False

    def error(t):
        t = t.detach().double()
        d = (t - exact).abs()
        d[(t == exact) | (torch.isnan(t) & torch.isnan(exact))] = 0
        return d.nan_to_num(nan=float("inf")).max().item() if d.numel() else 0.0

    finite = exact[torch.isfinite(exact)]
    scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
    return error(b) <= TOLERANCE[dtype] * scale + 4 * error(a)


# Relative size of the perturbations in _spread, in units of the dtype's
# machine epsilon; how many perturbed runs measure the spread first, and at
# most (only while a difference is beyond SPREAD_FACTOR times the spread).
PERTURBATION_ULPS = 4
# Under autocast the rounding that matters is bfloat16's (its matmuls,
# convolutions and the casts around them): the perturbations are half a
# bfloat16 ulp at 1 times N(0, 1), about the size of one rounding to
# bfloat16, so that the perturbed runs round their bfloat16 intermediates
# differently (seed 20261124, program 3788: a float32 bias gradient summed
# from bfloat16 terms that cancel moves by a bfloat16 ulp of the terms).
PERTURBATION_ULPS_AUTOCAST = 0.5
PERTURBATION_RUNS = 3
PERTURBATION_RUNS_MAX = 64
SPREAD_FACTOR = 4


def _spread(before, inputs, dtype, seed: int, values_a, evaluate, ulps: float = PERTURBATION_ULPS):
    """Yields, after each of up to PERTURBATION_RUNS_MAX runs, how far the
    original's own results have moved so far, per compared tensor, with its
    inputs, parameters and floating-point buffers scaled by
    1 + PERTURBATION_ULPS * eps * N(0, 1): the rounding-level sensitivity of
    the program.  A result that moves this much under rounding-sized changes
    carries no more than rounding noise (e.g. a gradient that is zero but
    for rounding amplified by a BatchNorm of a constant, or by x / x), so a
    difference within a few times the spread is not a change of meaning.
    `evaluate(module, inputs, jitter)` gives a run's values (inputs:
    leaves to be; jitter: the perturbation, for what else it perturbs).  A run that raises ends it with an empty spread."""
    eps = torch.finfo(dtype).eps * ulps
    spread: Dict[str, float] = collections.defaultdict(float)
    g = torch.Generator().manual_seed(seed + 1000)

    def jitter(t):
        return t * (1 + eps * torch.randn(t.shape, dtype=t.dtype, generator=g))

    for _ in range(PERTURBATION_RUNS_MAX):
        module = copy.deepcopy(before)
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()):
                if t.is_floating_point():
                    t.copy_(jitter(t))
        for t in module.parameters():
            t.detach_().requires_grad_(True)  # deepcopy's clones are not leaves
        try:
            values = evaluate(module, [jitter(t) for t in inputs], jitter) or {}
        except Exception:  # noqa: BLE001  (a perturbation cannot vouch for anything)
            yield {}
            return
        for name, a in values_a.items():
            p = values.get(name)
            if a is None or p is None or p.shape != a.shape or not a.is_floating_point():
                continue
            d = (p.detach().double() - a.detach().double()).abs()
            d[(p == a) | (torch.isnan(p) & torch.isnan(a))] = 0
            if d.numel():
                spread[name] = max(spread[name], d.nan_to_num(nan=float("inf")).max().item())
        yield dict(spread)


def _within_spread(a, b, spread: Optional[float]) -> bool:
    if spread is None or a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    d = (b.detach().double() - a.detach().double()).abs()
    d[(b == a) | (torch.isnan(b) & torch.isnan(a))] = 0
    return not d.numel() or d.max().item() <= SPREAD_FACTOR * spread


def check_source(
    source: str,
    input_shapes: Sequence[Shape],
    seed: int = 0,
    dtypes: Sequence[str] = tuple(DTYPES),
    modes: Sequence[str] = tuple(MODES),
    stop_early: bool = False,
    round_trip: bool = True,
) -> Outcome:
    """Runs `source` (a class Program) and its optimized forms as described
    in the module docstring; with `round_trip`, also the optimized forms
    after torch.jit.save / torch.jit.load.  A line `# preserved_attrs: a, b`
    in the class names what the frozen mode preserves (the first: an
    exported method taking forward's inputs).  Raises Invalid if the
    original cannot run."""
    cls = load_class(source)
    m = re.search(r"^\s*# preserved_attrs: (.*)$", source, re.M)
    preserved = tuple(n.strip() for n in m.group(1).split(",")) if m else ()
    outcome = Outcome()
    # NB: the plain interpreter runs exactly the graphs being compared; the
    # optimizing executor's passes can change meaning on their own (its
    # optimized plan drops a batch_norm whose output is dead, so the
    # running statistics stop updating from the second call on).  One
    # intra-op thread: on tiny tensors, a busy machine makes OpenMP's
    # barriers cost milliseconds per op.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.jit.optimized_execution(False):
            _check(cls, input_shapes, seed, dtypes, modes, stop_early, round_trip, preserved, outcome)
    finally:
        torch.set_num_threads(threads)
    return outcome


def _optimize(module, freeze: bool, preserved: Sequence[str]):
    """torchfuse.optimize; with preserved attributes (frozen programs with
    an exported method) through its preserved_attrs keyword."""
    if freeze and preserved:
        return torchfuse.optimize(module, freeze=True, preserved_attrs=list(preserved))
    return torchfuse.optimize(module, freeze=freeze)


def _script_and_optimize(model, freeze: bool, what: str, outcome: Outcome, preserved: Sequence[str] = ()):
    """(original, optimized), counting the fused nodes; optimized is None
    (a failure recorded) if optimize raised or the result's parameters and
    buffers are not shared as the original's are.  The original returned
    is a copy of the module optimized, made before: optimize may share its
    input's tensors (as torch.compile does), and the two must not run on
    one state.  optimize must not change its input's methods."""
    try:
        scripted = torch.jit.script(model)
    except Exception as e:  # noqa: BLE001
        raise Invalid(f"script: {type(e).__name__}: {str(e).splitlines()[0]}")
    ref = _copy(scripted)
    sharing = _sharing(scripted)
    outcome.shares |= any(len(g) > 1 for g in sharing.values())
    methods = _methods_text(scripted)
    try:
        opt = _optimize(scripted, freeze, preserved)
    except Exception as e:  # noqa: BLE001
        call = f"optimize(freeze=True, preserved_attrs={list(preserved)})" if freeze and preserved else "optimize"
        outcome.failures.append(f"{what}: {call} raised: {type(e).__name__}: {str(e).splitlines()[0]}")
        return ref, None
    for op, n in torchfuse.report(opt).items():
        if op in OPS and n:
            outcome.fused[op] += n
    if _methods_text(scripted) != methods:
        outcome.failures.append(f"{what}: optimize changed its input module's methods")
    msg = _sharing_mismatch(sharing, opt, freeze)
    missing = [n for n in preserved[1:] if not opt._c.hasattr(n)]
    if missing:
        msg = f"preserved attributes {missing} missing"
    if msg:
        outcome.failures.append(f"{what}: {msg}")
        return ref, None
    return ref, opt


def _methods_text(module) -> str:
    return "\n".join(str(module._c._get_method(n).graph) for n in sorted(module._c._method_names()))


def _sharing(module) -> Dict[str, Tuple[str, ...]]:
    """Each parameter and buffer (by kind and qualified name) -> the names
    of all that are the same tensor (tied parameters, shared buffers)."""
    groups: Dict[int, List[str]] = collections.defaultdict(list)
    for kind, named in (("parameter", module.named_parameters(remove_duplicate=False)),
                        ("buffer", module.named_buffers(remove_duplicate=False))):
        for name, t in named:
            if t is not None:
                groups[t._cdata].append(f"{kind} {name}")
    return {n: tuple(sorted(g)) for g in groups.values() for n in g}


def _sharing_mismatch(original: Dict[str, Tuple[str, ...]], module, frozen: bool) -> Optional[str]:
    """How `module`'s parameters and buffers differ from the original's in
    number or sharing; None if they do not.  Frozen: freezing folds
    parameters and unwritten buffers into constants, so only those kept
    are compared, each with the original's group restricted to them."""
    got = _sharing(module)
    unique = [len({g for n, g in d.items() if n.startswith("parameter")}) for d in (got, original)]
    count = f"{unique[0]} parameters vs {unique[1]} in the original"
    if not frozen and set(got) != set(original):
        names = sorted(set(got) ^ set(original))
        return f"{count}; names differ: {', '.join(names[:4])}"
    for name in sorted(got):
        want = tuple(n for n in original.get(name, (name,)) if n in got)
        if got[name] != want:
            return (f"{count}; {name} is one tensor with {len(got[name]) - 1} other ({', '.join(got[name])}), "
                    f"in the original with {len(want) - 1} ({', '.join(want)})")
    return None if frozen or unique[0] == unique[1] else count


AFTER_SAVE_LOAD = "after save/load"


def _save(module) -> bytes:
    buf = io.BytesIO()
    torch.jit.save(module, buf)
    return buf.getvalue()


def _load(data: bytes):
    """A module of its own (parameters and buffers are fresh tensors),
    compiled again from the saved code, as a user's torch.jit.load does."""
    return torch.jit.load(io.BytesIO(data))


def _copy(module):
    """A copy of a scripted module with its state, parameters leaves again
    (deepcopy's clones are not)."""
    module = copy.deepcopy(module)
    for t in module.parameters():
        t.detach_().requires_grad_(True)
    return module


def _run_steps(ref, opt, steps, inputs, seed, dtype, params: bool, what: str, stop_early: bool,
               outcome: Outcome, autocast: bool = False) -> None:
    """One mode's steps, `ref` and `opt` in step: (mode, i) runs step i
    (check seed seed + i) of forward, (mode, i, method) of another method,
    in eval mode from the first "eval" step on.  `what` names a step once
    formatted with its mode and i."""
    for mode, i, *method in steps:
        if mode == "eval":
            ref.eval()
            opt.eval()
        name = what.format(mode=mode, i=i) + "".join(f" {m}()" for m in method)
        _run_step(ref, opt, inputs, seed + i, dtype, True, params, name, outcome,
                  method=method[0] if method else "forward", autocast=autocast)
        if stop_early and outcome.failures:
            return


def _check_mode(ref, opt, steps, inputs, seed, dtype, params: bool, label: str, what: str,
                stop_early: bool, round_trip: bool, outcome: Outcome, preserved: Sequence[str] = ()) -> None:
    """One mode's steps on `opt` against `ref`; then, with `round_trip` and
    where those passed, the same steps on `opt` after torch.jit.save /
    torch.jit.load against a copy of `ref` from the same state.  Where the
    loaded module fails, its steps run once more against torch's own module
    after save/load (the original; for frozen, the original frozen by
    freeze_module as optimize does): when those agree, torch's saving and
    recompilation changed its own module alike, which is counted
    (Outcome.round_trip_alike) instead of a failure; when they do not, but
    torch's own module after save/load differs from the original as well,
    the mode has no reference and is not judged (counted in
    Outcome.round_trip_torch_differs).  The loaded module's parameters and
    buffers must be shared as the original's are (_sharing_mismatch).
    `preserved`: what the frozen modules keep (optimize's preserved_attrs)."""
    saved = start = loaded = None
    if round_trip:
        # NB: both saved and copied before any step, so the loaded module
        # and the reference it is compared with start from the state the
        # in-memory pair starts from.  The loaded module's parameters and
        # buffers are its own tensors.
        start = _copy(ref)
        try:
            saved = _save(opt)
            loaded = _load(saved)
        except Exception as e:  # noqa: BLE001
            try:
                _load(_save(start))
            except Exception:  # noqa: BLE001  (torch cannot round-trip the original either)
                outcome.round_trip_skipped += 1
                round_trip = False
            else:
                outcome.failures.append(f"{label} {AFTER_SAVE_LOAD}: save or load raised: {str(e).splitlines()[0]}")
                return
    # NB: the loaded module's fused node count is not compared: its
    # compilation may drop a fused node whose result is dead (seed 11,
    # program 1920: a custom_relu for a relu_ of a value then overwritten).
    failed = len(outcome.failures)
    _run_steps(ref, opt, steps, inputs, seed, dtype, params, what, stop_early, outcome)
    if not round_trip or len(outcome.failures) > failed:
        return  # NB: the loaded module would mostly repeat an in-memory failure
    msg = _sharing_mismatch(_sharing(start), loaded, not params)
    if msg:
        outcome.failures.append(f"{label} {AFTER_SAVE_LOAD}: {msg}")
        return
    after = Outcome(exact=outcome.exact)
    _run_steps(_copy(start), loaded, steps, inputs, seed, dtype, params,
               f"{what} {AFTER_SAVE_LOAD}", stop_early, after)
    if after.failures:
        alike = Outcome(exact=outcome.exact)
        try:
            # NB: optimize(freeze=True) freezes with freeze_module; so does
            # torch's own reference here (on a copy: it clones in place),
            # with the executor's optimization on, without which it leaves
            # calls to the methods it removes (bug 2 in docs/reliability.md).
            own = _copy(start)
            if not params:
                with torch.jit.optimized_execution(True):
                    own = torch.jit._recursive.wrap_cpp_module(torch._C._freeze_module(own._c, list(preserved)))
            own_saved = _save(own)
            _run_steps(_load(own_saved), _load(saved), steps, inputs, seed, dtype, params,
                       f"{what} {AFTER_SAVE_LOAD} against the loaded original", True, alike)
        except Exception as e:  # noqa: BLE001  (torch's own module raised: no excuse)
            own_saved = None
            alike.failures.append(f"the loaded original raised: {e}")
        if not alike.failures:
            after = alike
            outcome.round_trip_alike += 1
        elif own_saved is not None:
            # NB: where torch's own module changes meaning in the round trip
            # (seed 0, program 147: frozen BatchNorm statistics that the
            # saved code merges into one constant), the loaded optimized
            # module has no reference to be held to.
            torch_own = Outcome(exact={})
            try:
                _run_steps(_copy(start), _load(own_saved), steps, inputs, seed, dtype,
                           params, f"{what} torch's own {AFTER_SAVE_LOAD}", True, torch_own)
            except Invalid:
                torch_own.failures.append("raised")
            if torch_own.failures:
                after = Outcome()
                outcome.round_trip_torch_differs += 1
    # NB: backward_skipped counts the in-memory steps only: the same steps
    # again would only double it.
    outcome.failures += after.failures
    outcome.within_spread += after.within_spread


def _to_dtype(model, dtype):
    """model.to(dtype), its parameters and buffers shared as before
    (Module.to converts each module's buffers apart, untying shared ones)."""
    groups = collections.defaultdict(list)
    for kind, named in (("_parameters", model.named_parameters(remove_duplicate=False)),
                        ("_buffers", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            groups[id(t)].append((kind, name))
    model = model.to(dtype)
    for members in groups.values():
        kind, name = members[0]
        first = getattr(model.get_submodule(name.rpartition(".")[0]), kind)[name.rpartition(".")[2]]
        for kind, name in members[1:]:
            getattr(model.get_submodule(name.rpartition(".")[0]), kind)[name.rpartition(".")[2]] = first
    return model


def _check(cls, input_shapes, seed, dtypes, modes, stop_early, round_trip, preserved, outcome) -> None:
    """The modes of one program, float64 first: the float32 runs are
    judged against its results.  The autocast steps are the train mode's
    steps again (so "autocast" needs those: it runs them), on copies of
    the pair made before them."""
    exported = [EXPORTED] if preserved else []
    for dname in dtypes:
        dtype = DTYPES[dname]
        torch.manual_seed(seed)
        model = _to_dtype(cls(), dtype)
        frozen_base = copy.deepcopy(model).eval()
        g = torch.Generator().manual_seed(seed + 1)
        inputs = [torch.randn(s, generator=g).to(dtype) for s in input_shapes]
        autocast = AUTOCAST in modes and dtype == torch.float32
        names = ((["train"] * 2 if "train" in modes or AUTOCAST in modes else [])
                 + (["eval"] if "eval" in modes or AUTOCAST in modes else []))
        if names or "double_backward" in modes:
            ref, opt = _script_and_optimize(model, False, f"{dname} train", outcome)
            if opt is None:
                return
            copies = {m: (_copy(ref), _copy(opt)) for m in (AUTOCAST, "double_backward")
                      if m in modes and (m != AUTOCAST or autocast)}
            steps = [(mode, i) for i, mode in enumerate(names)]
            if names:
                _check_mode(ref, opt, steps + [(names[-1], len(names), m) for m in exported], inputs, seed, dtype,
                            True, f"{dname} train", f"{dname} {{mode}} step {{i}}", stop_early, round_trip, outcome)
                if stop_early and outcome.failures:
                    return
            if AUTOCAST in copies:
                _run_steps(*copies[AUTOCAST], steps, inputs, seed, dtype, True, f"{dname} {AUTOCAST} {{mode}} step {{i}}",
                           stop_early, outcome, autocast=True)
                if stop_early and outcome.failures:
                    return
            if "double_backward" in copies:
                _run_double_backward_step(*copies["double_backward"], inputs, seed + 9, dtype,
                                          f"{dname} double_backward step 0", outcome)
                if stop_early and outcome.failures:
                    return
        if "frozen" in modes:
            pristine = copy.deepcopy(frozen_base)  # NB: before the steps write its buffers
            ref, opt = _script_and_optimize(frozen_base, True, f"{dname} frozen", outcome, preserved)
            if opt is None:
                return
            steps = [("frozen", 7)] + [("frozen", 8, m) for m in exported]
            failed = len(outcome.failures)
            _check_mode(ref, opt, steps, inputs, seed, dtype,
                        False, f"{dname} frozen", f"{dname} frozen", stop_early, round_trip, outcome, preserved)
            new = outcome.failures[failed:]
            if new and not any(AFTER_SAVE_LOAD in f for f in new):
                verdict = _frozen_by_torch_alike(pristine, steps, inputs, seed, dtype, f"{dname} frozen",
                                                 preserved, outcome)
                if verdict:
                    del outcome.failures[failed:]
                    setattr(outcome, verdict, getattr(outcome, verdict) + 1)
            if stop_early and outcome.failures:
                return


def _frozen_by_torch_alike(model, steps, inputs, seed, dtype, what: str, preserved,
                           outcome: Outcome) -> Optional[str]:
    """For a frozen mode whose optimized module differed from the original:
    "frozen_alike" if torch's own freezing of the original (freeze_module,
    as optimize(freeze=True) freezes) changes its meaning and the optimized
    module agrees with that frozen original (the difference is torch's
    doing, not optimize's); "frozen_torch_differs" if torch's frozen
    original differs from the original, a batch_norm may train in its graph
    or the optimized module's, and the optimized module agrees with neither (no reference:
    not judged); None otherwise (a failure).  NB: freeze_module assumes that
    no batch_norm trains in a frozen module (AliasDb ignores the statistics'
    writes when frozen): a literal training=True batch_norm's statistics
    are folded into constants, so its update is lost where another name of
    the same buffer reads it, or dropped with the node when its output is
    dead (seed 20261124, programs 23 and 714); where the statistics are
    equal to another constant, which constants end up one tensor decides
    what the update changes (program 9491).  Each module comes fresh from
    `model` (frozen graphs hold the constants that their steps write), and
    the steps are judged as any mode's are."""
    def script():
        return torch.jit.script(copy.deepcopy(model))

    def torch_frozen():
        with torch.jit.optimized_execution(True):
            return torch.jit._recursive.wrap_cpp_module(torch._C._freeze_module(script()._c, list(preserved)))

    try:
        differs = Outcome(exact={})
        own = torch_frozen()
        _run_steps(_copy(script()), own, steps, inputs, seed, dtype, False,
                   f"{what} torch's own frozen original", True, differs)
        if not differs.failures:
            return None
        alike = Outcome(exact=outcome.frozen_exact)
        opt = _optimize(script(), True, preserved)
        trains = _trains_batch_norm(own) or _trains_batch_norm(opt)
        _run_steps(torch_frozen(), opt, steps, inputs, seed, dtype, False,
                   f"{what} against torch's own frozen original", False, alike)
    except Exception:  # noqa: BLE001  (no reference to excuse anything)
        return None
    if not alike.failures:
        return "frozen_alike"
    return "frozen_torch_differs" if trains else None


def _trains_batch_norm(module) -> bool:
    """Whether a method of the frozen `module` has a batch_norm whose
    training argument is not the constant False."""
    for name in module._c._method_names():
        for node in module._c._get_method(name).graph.findAllNodes("aten::batch_norm"):
            training = node.inputsAt(5).toIValue()
            if training is None or training:
                return True
    return False


def assert_keeps_meaning(source: str, input_shapes, seed: int, fused: Dict[str, int]) -> None:
    """The body of a regression test: no failure, and `fused` gives the
    fused node count per op (summed over dtypes and modes) where it matters."""
    outcome = check_source(source, input_shapes, seed)
    assert outcome.failures == [], outcome.failures
    for op, n in fused.items():
        assert outcome.fused[op] == n, (op, outcome.fused[op])


def check_program(prog: Program, seed: int, **kw) -> Outcome:
    return check_source(prog.source(), [s for _, s in prog.live_inputs()], seed, **kw)


# ---- shrinking ----------------------------------------------------------------------


def _variants(stmts: Tuple[Stmt, ...]):
    """Programs one step simpler: a statement dropped, replaced by one of its
    alternatives, or simplified inside a block."""
    for i in range(len(stmts)):
        yield stmts[:i] + stmts[i + 1:]
    for i, s in enumerate(stmts):
        for alt in s.alts:
            yield stmts[:i] + alt + stmts[i + 1:]
        for bi, block in enumerate(s.blocks):
            for vb in _variants(block):
                blocks = list(s.blocks)
                blocks[bi] = vb
                yield stmts[:i] + (dataclasses.replace(s, blocks=tuple(blocks), alts=()),) + stmts[i + 1:]


def _candidates(prog: Program):
    for i in range(len(prog.returns)):
        if len(prog.returns) > 1:
            yield dataclasses.replace(prog, returns=prog.returns[:i] + prog.returns[i + 1:])
    for body in _variants(prog.body):
        yield dataclasses.replace(prog, body=body)
    for name in prog.inits:
        if ".tie" in name:  # a tie dropped
            yield dataclasses.replace(prog, inits={n: line for n, line in prog.inits.items() if n != name})
    if prog.export:
        yield dataclasses.replace(prog, export=None, preserved=())
        if prog.preserved:
            yield dataclasses.replace(prog, preserved=())
        body, returns = prog.export
        for i in range(len(returns)):
            if len(returns) > 1:
                yield dataclasses.replace(prog, export=(body, returns[:i] + returns[i + 1:]))
        for variant in _variants(body):
            yield dataclasses.replace(prog, export=(variant, returns))


def _size(prog: Program) -> int:
    return len(prog.source())


def shrink(prog: Program, seed: int, dtypes, modes, budget_s: float = 120.0,
           require: str = "") -> Program:
    """Greedily simplifies `prog` while check_program still fails in the
    given dtypes and modes, with a failure message containing `require`
    (e.g. AFTER_SAVE_LOAD, so that a failure after save/load does not
    shrink into an in-memory one)."""
    deadline = time.monotonic() + budget_s
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in _candidates(prog):
            if time.monotonic() > deadline:
                break
            if _size(cand) >= _size(prog):
                continue
            try:
                out = check_program(cand, seed, dtypes=dtypes, modes=modes, stop_early=True)
            except Invalid:
                continue
            except Exception:  # noqa: BLE001  (e.g. a shape error in the candidate)
                continue
            if any(require in f for f in out.failures):
                prog, improved = cand, True
                break
    return prog


# ---- regressions ----------------------------------------------------------------------

REGRESSION_TEMPLATE = '''\
"""A torchfuse.optimize regression found by tools/fuzz_pass.py
(--seed {seed}, program {index}), shrunk.  Move the case into
test/python/test_fuzz_regressions.py once the bug is fixed."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), {tools_dir!r}))
import fuzz_pass  # noqa: E402

CASES = [
    pytest.param(
{source},
        {shapes!r},
        {index},
        {{}},
        id="seed{seed}_program{index}",
    ),
]


@pytest.mark.parametrize("source,input_shapes,seed,fused", CASES)
def test_optimize_keeps_meaning(source, input_shapes, seed, fused):
    fuzz_pass.assert_keeps_meaning(source, input_shapes, seed, fused)
'''


def emit_regression(directory: str, prog: Program, seed: int, index: int) -> str:
    """Writes a pytest file that checks the (shrunk) program `index` of
    generator seed `seed`; its check seed is `index`, as in run()."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"test_fuzz_seed{seed}_program{index}.py")
    tools_dir = os.path.relpath(os.path.dirname(os.path.abspath(__file__)), os.path.abspath(directory))
    source = '        """\\\n' + prog.source() + '"""'
    text = REGRESSION_TEMPLATE.format(
        seed=seed, index=index, tools_dir=tools_dir, source=source,
        shapes=[list(s) for _, s in prog.live_inputs()],
    )
    with open(path, "w") as f:
        f.write(text)
    return path


# ---- the driver ------------------------------------------------------------------------


@dataclasses.dataclass
class Summary:
    passed: int = 0
    failed: int = 0
    invalid: int = 0
    fused_programs: int = 0
    fused_nodes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fused_in: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    backward_skipped: int = 0
    within_spread: int = 0
    round_trips: int = 0
    round_trip_alike: int = 0
    round_trip_torch_differs: int = 0
    round_trip_skipped: int = 0
    frozen_alike: int = 0
    frozen_torch_differs: int = 0
    double_backward_skipped: int = 0
    shares: int = 0  # programs whose original shares a tensor between attributes
    exported: int = 0  # programs with an exported method
    failures: List[Tuple[int, Program, List[str]]] = dataclasses.field(default_factory=list)


def run(programs: int, seed: int, start: int = 0, shrink_failures: bool = True,
        emit_dir: Optional[str] = None, verbose: bool = False, log=print,
        round_trip_every: int = 1, modes: Sequence[str] = tuple(MODES),
        features: Sequence[str] = tuple(FEATURES)) -> Summary:
    """Checks programs start..start+programs-1 of `seed`, drawn with
    `features`, in `modes`; those whose index is a multiple of
    `round_trip_every` (none if 0) also after save/load."""
    summary = Summary()
    for index in range(start, start + programs):
        round_trip = round_trip_every > 0 and index % round_trip_every == 0
        # NB: an invalid draw (the original itself fails) is redrawn, so
        # `programs` counts checked programs; the redraw is still a function
        # of (seed, index).
        for attempt in range(20):
            prog = generate(seed, index * 100 + attempt, features)
            try:
                outcome = check_program(prog, seed=index, round_trip=round_trip, modes=modes)
                break
            except Invalid:
                summary.invalid += 1
        else:
            raise RuntimeError(f"program {index}: no valid draw in 20 attempts")
        summary.fused_nodes.update(outcome.fused)
        summary.fused_in.update(outcome.fused.keys())
        summary.fused_programs += bool(outcome.fused)
        summary.backward_skipped += outcome.backward_skipped
        summary.within_spread += outcome.within_spread
        summary.round_trips += round_trip
        summary.round_trip_alike += outcome.round_trip_alike
        summary.round_trip_torch_differs += outcome.round_trip_torch_differs
        summary.round_trip_skipped += outcome.round_trip_skipped
        summary.frozen_alike += outcome.frozen_alike
        summary.frozen_torch_differs += outcome.frozen_torch_differs
        summary.double_backward_skipped += outcome.double_backward_skipped
        summary.shares += outcome.shares
        summary.exported += prog.export is not None
        if not outcome.failures:
            summary.passed += 1
            if verbose:
                log(f"program {index}: ok {dict(outcome.fused)}")
            continue
        summary.failed += 1
        log(f"program {index} (seed {seed}): FAILED")
        for f in outcome.failures[:5]:
            log("  " + f)
        if shrink_failures:
            first = outcome.failures[0]
            # NB: float32 is judged against the float64 results.
            dtypes = ["float64", "float32"] if "float32" in first else ["float64"]
            shrink_modes = [m for m in modes if f" {m}" in first] or list(modes)
            require = AFTER_SAVE_LOAD if AFTER_SAVE_LOAD in first else ""
            prog = shrink(prog, index, dtypes, shrink_modes, require=require)
        log(textwrap.indent(prog.source(), "    "))
        log(f"    inputs: {[list(s) for _, s in prog.live_inputs()]}, check seed {index}")
        summary.failures.append((index, prog, outcome.failures))
        if emit_dir:
            log("    regression: " + emit_regression(emit_dir, prog, seed, index))
    return summary


def _names(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        names = [] if text == "none" else [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; expected a comma-separated subset of "
                                             f"{','.join(allowed)}")
        return names
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=100, help="how many programs to check")
    ap.add_argument("--seed", type=int, default=0, help="generator seed")
    ap.add_argument("--start", type=int, default=0, help="index of the first program")
    ap.add_argument("--emit-regressions", metavar="DIR", help="write a pytest file per failure to DIR")
    ap.add_argument("--no-shrink", action="store_true", help="report failures unshrunk")
    ap.add_argument("--round-trip-every", type=int, default=1, metavar="K",
                    help="also check the optimized modules after torch.jit.save/load in programs "
                         "whose index is a multiple of K (default 1: all; 0: none)")
    ap.add_argument("--modes", default=",".join(MODES), type=_names(MODES),
                    help="comma-separated modes to check (default: all, %(default)s)")
    ap.add_argument("--features", default=",".join(FEATURES), type=_names(FEATURES),
                    help="comma-separated program features to draw, or 'none' (default: all, %(default)s); "
                         "without them a program is the one drawn before they existed")
    ap.add_argument("--show", action="store_true", help="print the programs' source and exit")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.show:
        for index in range(args.start, args.start + args.programs):
            print(f"# program {index}\n" + generate(args.seed, index * 100, args.features).source())
        return 0
    t0 = time.monotonic()
    s = run(args.programs, args.seed, args.start, not args.no_shrink, args.emit_regressions, args.verbose,
            round_trip_every=args.round_trip_every, modes=args.modes, features=args.features)
    elapsed = time.monotonic() - t0
    print(f"seed {args.seed}, programs {args.start}..{args.start + args.programs - 1}: {elapsed:.0f} s; "
          f"{s.invalid} invalid draws redrawn; backward skipped (original raised) in {s.backward_skipped} steps; "
          f"{s.within_spread} differences within the original's rounding spread")
    print(f"modes {','.join(args.modes)}; features {','.join(args.features) or 'none'}: {s.shares} programs "
          f"with tied parameters or shared buffers, {s.exported} with an exported method; double backward "
          f"skipped (original raised) in {s.double_backward_skipped} steps")
    print(f"after save/load: {s.round_trips} programs checked; {s.round_trip_alike} modes differed from the "
          f"original as torch's own module did after save/load, {s.round_trip_torch_differs} otherwise where torch's "
          f"own module differed too (not judged); {s.round_trip_skipped} modes not round-tripped "
          f"(torch cannot save/load the original)")
    print(f"frozen: {s.frozen_alike} modes differed from the original as torch's own frozen original did "
          f"(freeze_module), {s.frozen_torch_differs} otherwise where torch's own frozen original with a training "
          f"batch_norm differed too (not judged)")
    print(f"programs with fused nodes: {s.fused_programs} of {s.passed + s.failed}")
    for op in OPS:
        print(f"  {op:26s} {s.fused_nodes[op]:6d} nodes in {s.fused_in[op]:5d} programs")
    print(f"{s.passed} passed, {s.failed} failed")
    return 1 if s.failed else 0


if __name__ == "__main__":
    sys.exit(main())
