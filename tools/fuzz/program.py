"""Random programs: a Program is an nn.Module written as Python source
from a small vocabulary, biased towards the fusable chains and near-misses
of them; generate(seed, index, features) draws program `index` of `seed`."""

import collections
import dataclasses
import itertools
import math
import random
import re
from typing import Dict, List, Optional, Sequence, Tuple




BATCH = 4

Shape = Tuple[int, ...]


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
        self.bn_rng: Optional[random.Random] = None  # conv -> batch_norm draws (generate sets it)
        self.residual_rng: Optional[random.Random] = None  # linear -> add draws (generate sets it)
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

    def activation(self, x: Var, fresh: bool) -> Var:
        """An activation conv_add_act fuses, in its spellings (functional,
        method, module, in place); in-place forms write `x` (on a value not
        fresh, a near-miss).  Near-misses: hardtanh bounds and leaky_relu
        slopes read from float attributes (constants only once frozen) or
        computed from a tensor; gelu's approximate from an attribute."""
        r = self.rng.random()
        if r < 0.2:
            return self.relu(x, fresh)
        inplace = fresh or self.chance(0.4)
        kw = ", inplace=True" if inplace and self.chance(0.4) else ""
        if r < 0.38:  # relu6 and hardtanh
            lo, hi = ("0.0", "6.0") if self.chance(0.5) else (self.pick(["-1.0", "-0.5", "-2.0", "0.0"]),
                                                              self.pick(["1.0", "0.5", "2.0"]))
            if not self.clean and self.chance(0.25):
                if self.chance(0.6):
                    attr = "self." + self.attr("k", "self.{name} = %s" % lo)
                    lo = attr
                else:
                    hi = "float(%s.abs().mean()) + 0.5" % x.name  # also a second use of x
            forms = [f"F.hardtanh({{x}}, {lo}, {hi}{kw})", f"F.hardtanh({{x}}, {lo}, {hi})"]
            if (lo, hi) == ("0.0", "6.0"):
                forms += [f"F.relu6({{x}}{kw})", f"F.relu6({{x}})"]
            if self.chance(0.15) and not lo.startswith("self.") and not hi.startswith("float("):
                m = self.attr("act", "self.{name} = nn.Hardtanh(%s, %s, inplace=%s)" % (lo, hi, bool(kw)))
                if (lo, hi) == ("0.0", "6.0") and self.chance(0.5):
                    m = self.attr("act", "self.{name} = nn.ReLU6(inplace=%s)" % bool(kw))
                forms = ["self.%s({x})" % m]
        elif r < 0.5:
            forms = ["F.silu({x})", f"F.silu({{x}}{kw})", "self.%s({x})"
                     % self.attr("act", "self.{name} = nn.SiLU(inplace=%s)" % bool(kw))]
        elif r < 0.6:
            forms = ["F.hardswish({x})", f"F.hardswish({{x}}{kw})"]
        elif r < 0.7:
            forms = ["F.hardsigmoid({x})", f"F.hardsigmoid({{x}}{kw})"]
        elif r < 0.8:
            forms = ["torch.sigmoid({x})", "{x}.sigmoid()"] + (["{x}.sigmoid_()"] if inplace else [])
        elif r < 0.9:
            forms = ["F.gelu({x})", "F.gelu({x}, approximate='tanh')", "F.gelu({x}, approximate='none')"]
            if self.chance(0.15):
                forms = ["self.%s({x})" % self.attr("act", "self.{name} = nn.GELU(approximate=%r)"
                                                     % self.pick(["none", "tanh"]))]
            elif not self.clean and self.chance(0.15):
                a = self.attr("k", "self.{name} = %r" % self.pick(["none", "tanh"]))
                forms = ["F.gelu({x}, approximate=self.%s)" % a]
        else:
            slope = self.pick(["0.01", "0.2", "0.1", "1.5", "-0.5"])
            if not self.clean and self.chance(0.25):
                slope = "self." + self.attr("k", "self.{name} = %s" % slope)
            forms = ["F.leaky_relu({x})", f"F.leaky_relu({{x}}, {slope})", f"F.leaky_relu({{x}}, {slope}{kw})"]
            if self.chance(0.15) and not slope.startswith("self."):
                forms = ["self.%s({x})" % self.attr("act", "self.{name} = nn.LeakyReLU(%s, inplace=%s)"
                                                     % (slope, bool(kw)))]
        text = self.pick(forms).format(x=x.name)
        return self.define(text, x.shape, [x], x.contiguous)

    def add(self, y: Var, fresh: bool, alpha_ok: bool = True, residual: Optional[Var] = None) -> Var:
        """y + other in its spellings and operand orders, and near-misses
        (scalar add, sub, alpha on either operand, other.add_(y));
        `residual`, if given, is `other`."""
        other, ov = (residual.name, residual) if residual is not None else self.other_for(y.shape, avoid=[y.name])
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

    def chain_linear_act(self) -> Optional[Var]:
        """linear_act's forms: linear -> act, 2-D and 3-D (batch, tokens,
        features) inputs, the activations and spellings conv_add_act's
        vocabulary draws (activation(): their near-misses included), and the
        near-misses of a chain: the linear output used twice (extra_use), an
        input written in between (maybe_interfere), a linear alone.  The
        residual forms linear -> add [-> act] (a transformer block's
        `x + mlp(x)`: the chain's input itself where shapes allow) in add()'s
        spellings and operand orders, drawn from their own random stream."""
        def build(x):
            y = self.linear(x, out_features=x.shape[-1] if self.chance(0.4) else None)
            if self.chance(0.05):
                return y
            self.extra_use(y)
            self.maybe_interfere([x.name])
            if self.residual_rng is not None and self.residual_rng.random() < 0.4:
                # NB: its own random stream, so the programs drawn before it
                # existed stay the same where it draws no add
                self.rng, main = self.residual_rng, self.rng
                residual = x if x.shape == y.shape and self.chance(0.5) else None
                y = self.add(y, fresh=True, residual=residual)
                alone = self.chance(0.4)
                if not alone:
                    self.extra_use(y)
                self.rng = main
                if alone:
                    return y
            return self.activation(y, fresh=True)

        return self.chain(build)

    def chain_attention(self) -> Optional[Var]:
        """DropAllTrueAttentionMasks' forms: scaled_dot_product_attention of
        a (batch, tokens, features) tensor as one head, masked by the mask
        transformers traces (arange(t) + 0 >= 0, expanded), and near-misses
        that keep the call: a bound below the threshold (>= 1, > 0), a narrow
        arange dtype, the mask written in place, dropout."""
        def build(x):
            n, t, d = x.shape
            q = self.define(f"{x.name}.unsqueeze(1)", (n, 1, t, d), [x], x.contiguous)
            r = 0.0 if self.clean else self.rng.random()
            cmp = self.pick([">= 1", "> 0"]) if 0.5 <= r < 0.65 else ">= 0"
            dtype = ", dtype=torch.int8" if 0.65 <= r < 0.75 else ""
            # NB: the mask is no tensor of scope: later statements would
            # take its booleans for operands
            m = self.fresh("m")
            self.emit(f"{m} = (torch.arange({t}{dtype}) + 0)[None, None, :, None] {cmp}")
            if 0.75 <= r < 0.85:
                self.emit(f"{m}[0, 0, 0, 0] = False")
            dropout = ", dropout_p=0.5" if 0.85 <= r < 0.9 else ""
            a = self.define(f"F.scaled_dot_product_attention({q.name}, {q.name}, {q.name}, "
                            f"attn_mask={m}.expand({n}, 1, {t}, {t}){dropout})", (n, 1, t, d), [q])
            return self.define(f"{a.name}.squeeze(1)", (n, t, d), [a])

        return self.chain(build, pred=lambda v: len(v.shape) == 3)

    def chain_gate(self) -> Optional[Var]:
        """gate_mul's forms: a squeeze-and-excitation block on a 4-D tensor,
        squeeze (adaptive_avg_pool2d to 1, or timm's mean over H and W) ->
        1x1 conv -> act -> 1x1 conv -> sigmoid / hardsigmoid -> mul with the
        squeezed tensor, the gate on either side; near-misses: a mean over W
        alone, a tanh gate, an in-place sigmoid_, the activated gate read
        again, a gate multiplying another tensor or its own input (swish)."""
        def build(x):
            n, c, h, w = x.shape
            r = 0.0 if self.clean else self.rng.random()
            if r < 0.05:
                s = self.define(f"{x.name}.mean(3, keepdim=True)", (n, c, h, 1), [x])
            elif self.chance(0.7):
                s = self.define(f"F.adaptive_avg_pool2d({x.name}, 1)", (n, c, 1, 1), [x])
            else:
                s = self.define(f"{x.name}.mean((2, 3), keepdim=True)", (n, c, 1, 1), [x])
            mid = self.pick([2, 4])
            w1, b1 = self.param((mid, c, 1, 1)), self.param((mid,))
            w2, b2 = self.param((c, mid, 1, 1)), self.param((c,))
            t = self.define(f"F.conv2d({s.name}, {w1}, {b1})", (n, mid) + s.shape[2:])
            t = self.define(self.pick([f"F.silu({t.name})", f"torch.relu({t.name})"]), t.shape, [t])
            e = self.define(f"F.conv2d({t.name}, {w2}, {b2})", s.shape)
            if 0.05 <= r < 0.1:
                g = self.define(f"torch.tanh({e.name})", e.shape, [e])
            elif 0.1 <= r < 0.15:
                self.emit(f"{e.name}.sigmoid_()")
                g = e
            else:
                g = self.define(self.pick([f"torch.sigmoid({e.name})", f"F.hardsigmoid({e.name})"]), e.shape, [e])
            if 0.15 <= r < 0.2:
                self.must_return.append(g.name)
            target = x
            others = [v for v in self.scope if v.shape == x.shape and v.name != x.name]
            if 0.2 <= r < 0.25 and others:
                target = self.pick(others)
            elif 0.25 <= r < 0.28:
                target = e
            expr = f"{g.name} * {target.name}" if self.chance(0.5) else f"{target.name} * {g.name}"
            return self.define(expr, target.shape, [target], target.contiguous)

        return self.chain(build, pred=lambda v: len(v.shape) == 4)

    def chain_dropout(self) -> Optional[Var]:
        """RemoveZeroDropouts' forms: dropouts of probability 0 (in training,
        in self.training's mode, in place, the feature and alpha kinds),
        mostly after a linear and before an activation, whose chain they
        hide until removed, and a nonzero probability with train=False (an
        identity, removed too); the near-miss that stays: a probability read
        from a float attribute (a nonzero one in training would draw random
        numbers)."""
        def build(x):
            y = self.linear(x) if self.chance(0.6) else x
            r = self.rng.random()
            if r < 0.3:
                spelling = "F.dropout({}, 0.0, True)"
            elif r < 0.45:
                spelling = "F.dropout({}, p=0.0, training=self.training)"
            elif r < 0.55:
                spelling = "F.dropout({}, 0.0, True, inplace=True)"
            elif r < 0.65:
                spelling = self.pick(["torch.feature_dropout({}, 0.0, True)", "torch.alpha_dropout({}, 0.0, True)",
                                      "torch.feature_alpha_dropout({}, 0.0, False)"])
            elif r < 0.85:
                spelling = "F.dropout({}, 0.5, False)"
            else:
                rate = "self." + self.attr("rate", "self.{name} = 0.0")
                spelling = "F.dropout({}, %s, True)" % rate
            d = self.define(spelling.format(y.name), y.shape, [y], y.contiguous)
            return self.activation(d, fresh=True) if self.chance(0.6) else d

        return self.chain(build, pred=lambda v: len(v.shape) >= 2)

    def chain_add_layer_norm(self) -> Optional[Var]:
        """add_layer_norm's forms: add -> layer_norm over the last dim (or the
        last two), post-LN (the sum read by the norm only: BERT) and pre-LN
        (the sum read again after the norm, x + mlp(ln(x)), or returned:
        ViT), the add's spellings and near-misses (add(): operand orders,
        alpha, add_ into a fresh linear output or on a live tensor, a scalar
        add, sub), LayerNorm modules with and without affine parameters and
        F.layer_norm, and the near-misses of a chain: the sum written in
        place after the norm, read by a second norm, a runtime eps (an
        unfrozen float attribute), an input written in between."""
        def build(x):
            base = x
            if self.chance(0.5):
                base = self.linear(x, out_features=x.shape[-1])
            s = self.add(base, fresh=base is not x)
            self.maybe_interfere([x.name, s.name])
            nd = 2 if len(s.shape) >= 3 and self.chance(0.2) else 1
            ns = tuple(s.shape[-nd:])
            dims = ", ".join(map(str, ns)) + ("," if nd == 1 else "")
            r = self.rng.random() * (0.9 if self.clean else 1.0)
            eps = self.pick(["1e-5", "1e-6", "1e-12"])
            if r < 0.45:
                affine, bias = self.chance(0.8), self.chance(0.8)
                m = self.attr("ln", "self.{name} = nn.LayerNorm((%s), eps=%s, elementwise_affine=%s, bias=%s)"
                              % (dims, eps, affine, bias))
                y = self.define(f"self.{m}({s.name})", s.shape, [s], True)
            elif r < 0.9:
                w = self.param(ns) if self.chance(0.8) else "None"
                b = self.param(ns) if self.chance(0.8) else "None"
                y = self.define(f"F.layer_norm({s.name}, ({dims}), {w}, {b}, {eps})", s.shape, [s], True)
            else:  # a runtime eps where not frozen
                k = self.attr("k", "self.{name} = %s" % eps)
                y = self.define(f"F.layer_norm({s.name}, ({dims}), None, None, self.{k})", s.shape, [s], True)
            q = 1.0 if self.clean else self.rng.random()
            if q < 0.06:
                self.emit(f"{s.name}.mul_(0.5)")  # the sum written in place after the norm
                self.must_return.append(s.name)
            elif q < 0.1:
                self.define(f"F.layer_norm({s.name}, ({dims}))", s.shape, [s])  # a second norm of the sum
            if self.chance(0.45):
                # pre-LN: the residual stream read again
                return self.define(f"{s.name} + {y.name}", s.shape, [s, y], s.contiguous)
            self.extra_use(s)
            return y

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

    def chain_conv_add_act(self) -> Optional[Var]:
        """conv_add_act's forms: conv -> add -> act (a residual: the conv's
        input itself where shapes allow, as resnet's `out += identity`, or
        another conv of it, as its downsample),
        conv -> act, conv -> add, and a conv alone (nothing to fuse); a
        batch_norm after the conv (conv_batch_norm_act's chain where the
        graph is not frozen, BatchNorm folded where it is)."""
        def build(x):
            c = self.conv(x, same_shape=self.chance(0.6))
            # NB: its own random stream, so the programs drawn before it
            # existed stay the same but for the batch_norm
            if self.bn_rng is not None and self.bn_rng.random() < 0.3:
                self.rng, main = self.bn_rng, self.rng
                c = self.batch_norm(c)
                self.rng = main
            r = self.rng.random()
            if r < 0.06:
                return c
            self.extra_use(c)
            out = c
            if r < 0.78:
                self.maybe_interfere([x.name])
                residual = None
                if x.shape == c.shape:
                    q = self.rng.random()
                    if q < 0.5:
                        residual = x
                    elif q < 0.7:
                        # resnet's downsample: a second conv of the chain's
                        # input (FoldResidualConvBias takes its bias)
                        d = self.conv(x, same_shape=True)
                        residual = d if d.shape == c.shape else None
                out = self.add(c, fresh=True, residual=residual)
                self.extra_use(out)
            if r >= 0.6 or self.chance(0.8):
                out = self.activation(out, fresh=True)
            if r >= 0.78 and self.chance(0.5):
                # conv_act_max_pool's forms: conv -> [act] -> max_pool2d
                self.extra_use(out)
                out = self.max_pool(out)
            return out

        return self.chain(build, lambda v: len(v.shape) in (3, 4))

    def max_pool(self, x: Var) -> Var:
        """max_pool2d over the last two dims in its spellings (functional,
        module, default stride, padding, dilation, ceil_mode).  Near-miss:
        return_indices=True (max_pool2d_with_indices)."""
        h, w = x.shape[-2], x.shape[-1]
        k = self.pick([k for k in (1, 2, 3) if k <= min(h, w)])
        stride = self.pick([None, 1, 2, k])
        pad = self.pick([p for p in (0, 1) if p <= k // 2])
        dil = 2 if self.chance(0.15) and 2 * (k - 1) + 1 <= min(h, w) + 2 * pad else 1
        ceil = self.chance(0.3)

        def size(n):
            s = stride or k
            num = n + 2 * pad - dil * (k - 1) - 1
            out = (num + (s - 1 if ceil else 0)) // s + 1
            if ceil and (out - 1) * s >= n + pad:
                out -= 1
            return out

        shape = tuple(x.shape[:-2]) + (size(h), size(w))
        args = f"{k}, stride={stride}, padding={pad}, dilation={dil}, ceil_mode={ceil}"
        if not self.clean and self.chance(0.1):
            p = self.define(f"F.max_pool2d({x.name}, {args}, return_indices=True)[0]", shape, [x])
            return p
        if self.chance(0.2):
            m = self.attr("pool", "self.{name} = nn.MaxPool2d(%s)" % args)
            return self.define(f"self.{m}({x.name})", shape, [x], x.contiguous)
        return self.define(f"F.max_pool2d({x.name}, {args})", shape, [x], x.contiguous)

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
            (self.chain_conv_add_act, 6),
            (self.chain_linear_act, 4),
            (self.chain_add_layer_norm, 4),
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
FEATURES = ["tied", "exported", "attention", "dropout", "gate"]
EXPORT_PROBABILITY = 0.25
ATTENTION_PROBABILITY = 0.3  # of an attention chain after forward's statements
DROPOUT_PROBABILITY = 0.3  # of a dropout chain after forward's statements
GATE_PROBABILITY = 0.3  # of a squeeze-and-excitation gate after forward's statements


def generate(seed: int, index: int, features: Sequence[str] = tuple(FEATURES)) -> Program:
    rng = random.Random(f"{seed}:{index}")
    g = Generator(rng, random.Random(f"{seed}:{index}:tied") if "tied" in features else None)
    g.bn_rng = random.Random(f"{seed}:{index}:conv_batch_norm")
    g.residual_rng = random.Random(f"{seed}:{index}:linear_add")
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
    arng = random.Random(f"{seed}:{index}:attention")
    if "attention" in features and arng.random() < ATTENTION_PROBABILITY:
        g.rng, main = arng, g.rng
        g.chain_attention()
        g.rng = main
    drng = random.Random(f"{seed}:{index}:dropout")
    if "dropout" in features and drng.random() < DROPOUT_PROBABILITY:
        g.rng, main = drng, g.rng
        g.chain_dropout()
        g.rng = main
    grng = random.Random(f"{seed}:{index}:gate")
    if "gate" in features and grng.random() < GATE_PROBABILITY:
        g.rng, main = grng, g.rng
        g.chain_gate()
        g.rng = main
    visible = [v.name for v in g.scope]
    returns = [visible[-1]] + [rng.choice(visible) for _ in range(rng.choice([0, 0, 1, 2]))]
    returns = list(dict.fromkeys(returns + g.must_return))
    body, export, preserved = tuple(g.out), None, ()
    xrng = random.Random(f"{seed}:{index}:exported")
    if "exported" in features and xrng.random() < EXPORT_PROBABILITY:
        export, preserved = g.exported_method(xrng, inputs)
    return Program(g.inits, inputs, body, tuple(returns), export, preserved)
