#!/usr/bin/env python3
"""Differential fuzzer for torchfuse.optimize: the rewrite must never change
what a module computes.

    tools/fuzz_pass.py --programs N --seed S [--emit-regressions DIR]

Each program is a random nn.Module written as Python source from a small
vocabulary (linear, conv1d/conv2d, batch_norm, relu/relu_, add/add_/sub,
div, mul, sigmoid, silu, views, in-place writes, if and for blocks), biased
towards the four fusable chains and near-misses of them.  The module is
scripted and optimized twice:

  train   torchfuse.optimize(scripted): two training steps, then one step
          in eval mode of the same modules;
  frozen  torchfuse.optimize(scripted.eval(), freeze=True): one step.

Each step runs the original and the optimized module on equal copies of the
same signed random inputs, in float64 and in float32, and compares outputs,
the inputs afterwards (in-place writes), gradients of inputs and parameters,
and buffers (BatchNorm running statistics).  Where a mode passes, its
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

OPS = ["linear_add_relu", "conv_relu_add", "batch_norm_add_div_swish", "relu"]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
MODES = ["train", "eval", "frozen"]
# Differences allowed, relative to max(1, largest magnitude of the reference
# tensor): the CPU kernels are the unfused ATen compositions in the forward;
# backwards are reassociated (and the BN backward runs in float64), so allow
# rounding of the dtype with some accumulation headroom.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5}
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
    inits: Dict[str, str]  # attribute -> its line in __init__
    inputs: List[Tuple[str, Shape]]
    body: Tuple[Stmt, ...]
    returns: Tuple[str, ...]

    def used_names(self) -> set:
        text = "\n".join(_render_body(self.body, 0) + list(self.returns))
        return set(re.findall(r"\b\w+\b", text))

    def live_inputs(self) -> List[Tuple[str, Shape]]:
        used = self.used_names()
        return [(n, s) for n, s in self.inputs if n in used]

    def source(self, cls: str = "Program") -> str:
        used = self.used_names()
        inits = [line for name, line in self.inits.items() if name in used]
        args = ", ".join(["self"] + [n for n, _ in self.live_inputs()])
        ret = self.returns[0] if len(self.returns) == 1 else "(" + ", ".join(self.returns) + ",)"
        lines = [f"class {cls}(nn.Module):", "    def __init__(self):", "        super().__init__()"]
        lines += ["        " + line for line in inits]
        lines += [f"    def forward({args}):"]
        lines += _render_body(self.body, 2)
        lines += [f"        return {ret}"]
        return "\n".join(lines) + "\n"


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

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.inits: Dict[str, str] = {}
        self.counter = itertools.count()
        self.out: List[Stmt] = []
        self.scope: List[Var] = []
        self.must_return: List[str] = []
        # A clean chain is written in a fusable form; otherwise near-misses
        # (extra uses, interfering writes, unfusable variants) are drawn.
        self.clean = False

    # -- names and attributes
    def fresh(self, prefix: str = "v") -> str:
        return f"{prefix}{next(self.counter)}"

    def attr(self, prefix: str, line_fmt: str) -> str:
        name = self.fresh(prefix)
        self.inits[name] = line_fmt.format(name=name)
        return name

    def param(self, shape: Shape) -> str:
        dims = ", ".join(map(str, shape))
        return "self." + self.attr("p", "self.{name} = nn.Parameter(torch.randn(%s))" % dims)

    def buffer(self, shape: Shape) -> str:
        dims = ", ".join(map(str, shape))
        return "self." + self.attr("b", 'self.register_buffer("{name}", torch.randn(%s))' % dims)

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
            bias = self.chance(0.7)
            m = self.attr("fc", "self.{name} = nn.Linear(%d, %d, bias=%s)" % (fin, fout, bias))
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
            return self.define(f"self.{m}({x.name})", shape)
        w = self.param((cout, cin // groups) + (k,) * dims)
        b = self.param((cout,)) if bias else "None"
        return self.define(
            f"F.conv{dims}d({x.name}, {w}, {b}, {stride}, {padding}, {dilation}, {groups})", shape
        )

    def batch_norm(self, x: Var) -> Var:
        c = x.shape[1]
        kind = "BatchNorm2d" if len(x.shape) == 4 else "BatchNorm1d"
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
            return self.define(f"self.{m}({x.name})", x.shape)
        rm = "self." + self.attr("rm", 'self.register_buffer("{name}", torch.zeros(%d))' % c)
        rv = "self." + self.attr("rv", 'self.register_buffer("{name}", torch.ones(%d))' % c)
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


def generate(seed: int, index: int) -> Program:
    rng = random.Random(f"{seed}:{index}")
    g = Generator(rng)
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
    return Program(g.inits, inputs, tuple(g.out), tuple(returns))


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


def _run_step(ref, opt, inputs, rng_seed, dtype, grads: bool, params: bool, what: str, outcome: Outcome):
    """One forward (and backward) of both modules on equal inputs."""
    before = copy.deepcopy(ref)  # for _spread: the step changes buffers
    leaves_a = [t.clone().requires_grad_(grads) for t in inputs]
    leaves_b = [t.clone().requires_grad_(grads) for t in inputs]
    # NB: non-leaf copies, so programs may write their inputs in place.
    ins_a = [t.clone() for t in leaves_a]
    ins_b = [t.clone() for t in leaves_b]
    for m in (ref, opt):
        for p in m.parameters():
            p.grad = None
    try:
        out_a = _flat(ref(*ins_a))
    except Exception as e:  # noqa: BLE001
        raise Invalid(f"{what}: the original raised {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        out_b = _flat(opt(*ins_b))
    except Exception as e:  # noqa: BLE001
        outcome.failures.append(f"{what}: optimized forward raised: {str(e).splitlines()[0]}")
        return
    if len(out_a) != len(out_b):
        outcome.failures.append(f"{what}: {len(out_b)} outputs vs {len(out_a)}")
        return
    values_a = _values(ref, out_a, ins_a)
    values_b = _values(opt, out_b, ins_b)
    loss = None
    if grads:
        g = torch.Generator().manual_seed(rng_seed)
        weights = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in out_a]
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
                    sum((out_b[i] * w).sum() for i, w in loss).backward()
                except Exception as e:  # noqa: BLE001
                    outcome.failures.append(f"{what}: optimized backward raised: {str(e).splitlines()[0]}")
                    return
                values_a.update(_grads(ref, leaves_a, params))
                values_b.update(_grads(opt, leaves_b, params))
    step = what.split(" ", 1)[1]
    beyond = []  # (name, original, optimized, message)
    for name, a in values_a.items():
        if name not in values_b:  # a buffer frozen into a constant
            continue
        b = values_b[name]
        if dtype == torch.float64 and a is not None:
            outcome.exact[f"{step}: {name}"] = a.detach().clone()
        msg = _mismatch(a, b, dtype)
        if msg and not _as_accurate(a, b, outcome.exact.get(f"{step}: {name}"), dtype):
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
    for runs, spread in enumerate(_spread(before, inputs, dtype, loss, params, rng_seed, values_a), 1):
        if runs >= PERTURBATION_RUNS and all(_within_spread(a, b, spread.get(name)) for name, a, b, _ in beyond):
            break
    for name, a, b, msg in beyond:
        if _within_spread(a, b, spread.get(name)):
            outcome.within_spread += 1
        else:
            outcome.failures.append(f"{what}: {name}: {msg}")


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
PERTURBATION_RUNS = 3
PERTURBATION_RUNS_MAX = 64
SPREAD_FACTOR = 4


def _spread(before, inputs, dtype, loss, params: bool, seed: int, values_a):
    """Yields, after each of up to PERTURBATION_RUNS_MAX runs, how far the
    original's own results have moved so far, per compared tensor, with its
    inputs, parameters and floating-point buffers scaled by
    1 + PERTURBATION_ULPS * eps * N(0, 1): the rounding-level sensitivity of
    the program.  A result that moves this much under rounding-sized changes
    carries no more than rounding noise (e.g. a gradient that is zero but
    for rounding amplified by a BatchNorm of a constant, or by x / x), so a
    difference within a few times the spread is not a change of meaning.
    A run that raises ends it with an empty spread."""
    eps = torch.finfo(dtype).eps * PERTURBATION_ULPS
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
        leaves = [jitter(t).requires_grad_(loss is not None) for t in inputs]
        ins = [t.clone() for t in leaves]
        try:
            outputs = _flat(module(*ins))
            values = _values(module, outputs, ins)
            if loss:
                sum((outputs[i] * w).sum() for i, w in loss).backward()
                values.update(_grads(module, leaves, params))
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
    if spread is None or a is None or b is None or a.shape != b.shape:
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
    after torch.jit.save / torch.jit.load.  Raises Invalid if the original
    cannot run."""
    cls = load_class(source)
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
            _check(cls, input_shapes, seed, dtypes, modes, stop_early, round_trip, outcome)
    finally:
        torch.set_num_threads(threads)
    return outcome


def _script_and_optimize(model, freeze: bool, what: str, outcome: Outcome):
    """(scripted, optimized), counting the fused nodes; optimized is None
    (a failure recorded) if optimize raised."""
    try:
        ref = torch.jit.script(model)
    except Exception as e:  # noqa: BLE001
        raise Invalid(f"script: {type(e).__name__}: {str(e).splitlines()[0]}")
    try:
        # NB: the result shares its parameters and buffers with its input:
        # optimize a copy, so that ref and opt each step their own state.
        opt = torchfuse.optimize(_copy(ref), freeze=freeze)
    except Exception as e:  # noqa: BLE001
        outcome.failures.append(f"{what}: optimize raised: {str(e).splitlines()[0]}")
        return ref, None
    for op, n in torchfuse.report(opt).items():
        if op in OPS and n:
            outcome.fused[op] += n
    return ref, opt


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
               outcome: Outcome) -> None:
    """One mode's steps, `ref` and `opt` in step: (mode, i) runs step i
    (check seed seed + i), in eval mode from the first "eval" step on.
    `what` names a step once formatted with its mode and i."""
    for mode, i in steps:
        if mode == "eval":
            ref.eval()
            opt.eval()
        _run_step(ref, opt, inputs, seed + i, dtype, True, params, what.format(mode=mode, i=i), outcome)
        if stop_early and outcome.failures:
            return


def _check_mode(ref, opt, steps, inputs, seed, dtype, params: bool, label: str, what: str,
                stop_early: bool, round_trip: bool, outcome: Outcome) -> None:
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
    Outcome.round_trip_torch_differs)."""
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
                    own = torch.jit._recursive.wrap_cpp_module(torch._C._freeze_module(own._c))
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


def _check(cls, input_shapes, seed, dtypes, modes, stop_early, round_trip, outcome) -> None:
    for dname in dtypes:
        dtype = DTYPES[dname]
        torch.manual_seed(seed)
        model = cls().to(dtype)
        frozen_base = copy.deepcopy(model).eval()
        g = torch.Generator().manual_seed(seed + 1)
        inputs = [torch.randn(s, generator=g).to(dtype) for s in input_shapes]
        if "train" in modes or "eval" in modes:
            ref, opt = _script_and_optimize(model, False, f"{dname} train", outcome)
            if opt is None:
                return
            names = (["train"] * 2 if "train" in modes else []) + (["eval"] if "eval" in modes else [])
            steps = [(mode, i) for i, mode in enumerate(names)]
            _check_mode(ref, opt, steps, inputs, seed, dtype, True, f"{dname} train",
                        f"{dname} {{mode}} step {{i}}", stop_early, round_trip, outcome)
            if stop_early and outcome.failures:
                return
        if "frozen" in modes:
            ref, opt = _script_and_optimize(frozen_base, True, f"{dname} frozen", outcome)
            if opt is None:
                return
            _check_mode(ref, opt, [("frozen", 7)], inputs, seed, dtype, False, f"{dname} frozen",
                        f"{dname} frozen", stop_early, round_trip, outcome)
            if stop_early and outcome.failures:
                return


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
    failures: List[Tuple[int, Program, List[str]]] = dataclasses.field(default_factory=list)


def run(programs: int, seed: int, start: int = 0, shrink_failures: bool = True,
        emit_dir: Optional[str] = None, verbose: bool = False, log=print,
        round_trip_every: int = 1) -> Summary:
    """Checks programs start..start+programs-1 of `seed`; those whose index
    is a multiple of `round_trip_every` (none if 0) also after save/load."""
    summary = Summary()
    for index in range(start, start + programs):
        round_trip = round_trip_every > 0 and index % round_trip_every == 0
        # NB: an invalid draw (the original itself fails) is redrawn, so
        # `programs` counts checked programs; the redraw is still a function
        # of (seed, index).
        for attempt in range(20):
            prog = generate(seed, index * 100 + attempt)
            try:
                outcome = check_program(prog, seed=index, round_trip=round_trip)
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
            modes = [m for m in MODES if f" {m}" in first] or list(MODES)
            require = AFTER_SAVE_LOAD if AFTER_SAVE_LOAD in first else ""
            prog = shrink(prog, index, dtypes, modes, require=require)
        log(textwrap.indent(prog.source(), "    "))
        log(f"    inputs: {[list(s) for _, s in prog.live_inputs()]}, check seed {index}")
        summary.failures.append((index, prog, outcome.failures))
        if emit_dir:
            log("    regression: " + emit_regression(emit_dir, prog, seed, index))
    return summary


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
    ap.add_argument("--show", action="store_true", help="print the programs' source and exit")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.show:
        for index in range(args.start, args.start + args.programs):
            print(f"# program {index}\n" + generate(args.seed, index * 100).source())
        return 0
    t0 = time.monotonic()
    s = run(args.programs, args.seed, args.start, not args.no_shrink, args.emit_regressions, args.verbose,
            round_trip_every=args.round_trip_every)
    elapsed = time.monotonic() - t0
    print(f"seed {args.seed}, programs {args.start}..{args.start + args.programs - 1}: {elapsed:.0f} s; "
          f"{s.invalid} invalid draws redrawn; backward skipped (original raised) in {s.backward_skipped} steps; "
          f"{s.within_spread} differences within the original's rounding spread")
    print(f"after save/load: {s.round_trips} programs checked; {s.round_trip_alike} modes differed from the "
          f"original as torch's own module did after save/load, {s.round_trip_torch_differs} otherwise where torch's "
          f"own module differed too (not judged); {s.round_trip_skipped} modes not round-tripped "
          f"(torch cannot save/load the original)")
    print(f"programs with fused nodes: {s.fused_programs} of {s.passed + s.failed}")
    for op in OPS:
        print(f"  {op:26s} {s.fused_nodes[op]:6d} nodes in {s.fused_in[op]:5d} programs")
    print(f"{s.passed} passed, {s.failed} failed")
    return 1 if s.failed else 0


if __name__ == "__main__":
    sys.exit(main())
