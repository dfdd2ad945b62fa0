"""Execution: scripting and optimizing a program, and running the
original and the optimized module side by side in each mode (train, eval,
frozen, autocast, double_backward), in memory and after save/load."""

import collections
import contextlib
import copy
import io
import itertools
import linecache
import math
import random
import re
import sys
import types
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torchfuse

from .program import Shape, Program, EXPORTED
from .judge import (Outcome, _flat, _judge, PERTURBATION_ULPS, PERTURBATION_ULPS_AUTOCAST, _layout_spread, _spread,
                    _with_layout_spread)


# The fusion registry's names, in pipeline order: the ops counted and reported.
OPS = [f["name"] for f in torchfuse.fusions()]
DTYPES = {"float64": torch.float64, "float32": torch.float32}
# train, eval: steps of optimize(m) (training, then inference); frozen:
# optimize(m.eval(), freeze=True); autocast: the train and eval steps again
# under CPU autocast to bfloat16 (float32 only); double_backward: a
# gradient penalty through optimize(m) (see _double_backward_values); fx:
# torchfuse.fx.optimize of torch.fx.symbolic_trace(m), traced in training
# (two steps) and in eval mode (one), against the unrewritten trace;
# compile: the same steps through torch.compile(m) with torchfuse.fx's
# backend (Dynamo's graphs, the rewrite run as they are) against m (see
# _check_fx).
# nonfinite: for NONFINITE_FRACTION of the programs, the train, eval and
# frozen modes' steps (and the fx and compile modes', where those run) again
# on inputs with NaN, +inf and -inf at a few elements (_nonfinite_inputs):
# NaN and Inf must come out where the original's do (the judge's allclose
# takes NaN as equal only to NaN, and an infinity only to itself).
MODES = ["train", "eval", "frozen", "autocast", "double_backward", "fx", "compile", "nonfinite"]
FX, COMPILE = "fx", "compile"
AUTOCAST = "autocast"
NONFINITE = "nonfinite"
NONFINITE_FRACTION = 0.25
# The frozen and train modes' variant: optimize(..., [freeze=True,]
# layout="channels_last") (passes/convert_to_channels_last.cpp; unfrozen,
# the first weight converted per call), values and output strides
# compared, for CHANNELS_LAST_FRACTION of the programs with a 2-d
# convolution, and in half of those with its 4-d inputs channels-last (the
# pass's other case: the original's convolutions run channels-last
# already).  Drawn from the check seed's own stream.
CHANNELS_LAST = "channels_last"
CHANNELS_LAST_FRACTION = 0.5

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
    return [torch.randn(o.shape, dtype=torch.float64, generator=g).to(device=o.device, dtype=o.dtype)
            for o in outputs]


def _run_step(ref, opt, inputs, rng_seed, dtype, grads: bool, params: bool, what: str, outcome: Outcome,
              method: str = "forward", autocast: bool = False, strides: bool = False):
    """One forward (and backward) of both modules' `method` on equal inputs;
    with `autocast`, the forwards under autocast to bfloat16 on the inputs'
    device (see
    _judge for the tolerance) and the backwards after it, as in training
    with mixed precision; with `strides`, the outputs' strides must be the
    original's too (_strides_mismatch)."""
    before = copy.deepcopy(ref)  # for _spread: the step changes buffers
    leaves_a = [t.clone().requires_grad_(grads) for t in inputs]
    leaves_b = [t.clone().requires_grad_(grads) for t in inputs]
    # NB: non-leaf copies, so programs may write their inputs in place.
    ins_a = [t.clone() for t in leaves_a]
    ins_b = [t.clone() for t in leaves_b]
    for m in (ref, opt):
        for p in m.parameters():
            p.grad = None
    device = _device_of(ref, inputs)
    context = (lambda: torch.autocast(device.type, torch.bfloat16)) if autocast else contextlib.nullcontext
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
    if strides:
        for i, (a, b) in enumerate(zip(out_a, out_b)):
            msg = _strides_mismatch(a, b)
            if msg:
                outcome.failures.append(f"{what}: output {i}: {msg}")
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
            # NB: under autocast the spread perturbs the weights alone (see
            # PERTURBATION_ULPS_AUTOCAST).
            sum((outputs[i] * (jitter(w) if autocast else w)).sum() for i, w in loss).backward()
            values.update(_grads(module, leaves, params))
        return values

    step = what.split(" ", 1)[1]
    # NB: the autocast steps repeat the train mode's steps from the same
    # state, whose float64 results are their exact answers too; their
    # rounding is bfloat16's, and so is their spread's perturbation, of the
    # backward only (see PERTURBATION_ULPS_AUTOCAST).
    spread_dtype, ulps = (torch.bfloat16, PERTURBATION_ULPS_AUTOCAST) if autocast else (dtype, PERTURBATION_ULPS)

    def spreads():
        runs = _spread(before, inputs, spread_dtype, rng_seed, values_a, evaluate, ulps, state=not autocast)
        # NB: the channels-last modes (strides) change the layout the
        # original's kernels round in; so does the original run in it.
        return _with_layout_spread(runs, _layout_spread(before, inputs, values_a, evaluate)) if strides else runs

    _judge(values_a, values_b, torch.bfloat16 if autocast else dtype,
           step.replace(AUTOCAST + " ", "", 1) if autocast else step, what, outcome, spreads,
           record=not autocast)


def _strides_mismatch(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """How `b`'s strides differ from `a`'s (optimized, then original), for
    tensors of one shape with more than one element; None if equal.  NB:
    the strides of size-1 dims count too: they decide what
    suggest_memory_format says, so the layout the ops after it choose."""
    if a.shape != b.shape or a.numel() <= 1 or a.stride() == b.stride():
        return None
    return f"strides {tuple(b.stride())} vs {tuple(a.stride())} (shape {tuple(a.shape)})"


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
    before, opt_before = copy.deepcopy(ref), copy.deepcopy(opt)
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
    failed = len(outcome.failures)
    _judge(values_a, values_b, dtype, what.split(" ", 1)[1], what, outcome,
           lambda: _spread(before, inputs, dtype, rng_seed, values_a,
                           lambda module, leaves, _: _double_backward_values(module, leaves, rng_seed)))
    new = outcome.failures[failed:]
    if new and all(": grad of the penalty w.r.t. " in f for f in new):
        # NB: the float64 run decides; the float32 run of the program follows it.
        if dtype == torch.float64:
            differing = [re.search(r": grad of the penalty w\.r\.t\. (.*?): ", f).group(1) for f in new]
            outcome.original_second_derivative_wrong = _second_derivative_wrong(
                before, opt_before, inputs, rng_seed, values_a, values_b, differing)
        if outcome.original_second_derivative_wrong:
            del outcome.failures[failed:]
            outcome.double_backward_original_wrong += 1


# Central differences of the penalty along a random direction: step, and
# how far the original's directional derivative must be from them (relative
# to max(1, |difference quotient|)) while the optimized module's is within
# SECOND_DERIVATIVE_AGREE.
SECOND_DERIVATIVE_STEP = 1e-6
SECOND_DERIVATIVE_WRONG = 1e-3
SECOND_DERIVATIVE_AGREE = 1e-6


def _second_derivative_wrong(ref, opt, inputs, seed: int, values_a, values_b, differing) -> bool:
    """Whether the original's gradient of the penalty is wrong and the
    optimized module's right, as central differences of the penalty (in
    float64) along one random direction of the inputs and parameters whose
    gradients differ (`differing`, names as in the values) tell.  NB: along
    those only: the penalty may also depend on a parameter through a path
    autograd does not see (a training BatchNorm's running statistics read
    later in the same forward), which no gradient has to follow.
    NB: eager's batch_norm double backward with weight=None in eval mode
    gives half the bias's (and `other`'s) true second derivative (seed
    20261124, program 1532; with an input that requires grad it raises), and
    the fused op gives the true one."""
    g = torch.Generator().manual_seed(seed + 2000)
    names = [f"input {i}" for i in range(len(inputs))] + [n for n, _ in ref.named_parameters()]
    shapes = [t.shape for t in inputs] + [p.shape for _, p in ref.named_parameters()]
    device = _device_of(ref, inputs)
    dirs = {n: (torch.randn(s, dtype=torch.float64, generator=g) if n in differing
                else torch.zeros(s, dtype=torch.float64)).to(device)
            for n, s in zip(names, shapes)}

    def penalty(module0, sign: float) -> float:
        module = _copy(module0)
        leaves = [t.clone() for t in inputs]
        with torch.no_grad():
            for i, t in enumerate(leaves):
                t.add_(dirs[f"input {i}"], alpha=sign * SECOND_DERIVATIVE_STEP)
            for n, p in module.named_parameters():
                p.add_(dirs[n], alpha=sign * SECOND_DERIVATIVE_STEP)
        return _double_backward_values(module, leaves, seed)["penalty (sum of the squared gradients)"].item()

    def error(module0, values) -> float:
        key = "grad of the penalty w.r.t. "
        if any(key + n not in values for n in names):
            return math.inf
        analytic = sum((values[key + n].double() * dirs[n]).sum().item() for n in names)
        quotient = (penalty(module0, 1.0) - penalty(module0, -1.0)) / (2 * SECOND_DERIVATIVE_STEP)
        return abs(analytic - quotient) / max(1.0, abs(quotient))

    try:
        return (error(ref, values_a) > SECOND_DERIVATIVE_WRONG
                and error(opt, values_b) <= SECOND_DERIVATIVE_AGREE)
    except Exception:  # noqa: BLE001  (no verdict: the difference stands)
        return False


def _device_of(module, inputs) -> torch.device:
    """The device a check runs on: its inputs', else its parameters' and
    buffers' (the CPU for a program without tensors)."""
    for t in itertools.chain(inputs, module.parameters(), module.buffers()):
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


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


def check_source(
    source: str,
    input_shapes: Sequence[Shape],
    seed: int = 0,
    dtypes: Sequence[str] = tuple(DTYPES),
    modes: Sequence[str] = tuple(MODES),
    stop_early: bool = False,
    round_trip: bool = True,
    channels_last: Optional[str] = None,
    device: str = "cpu",
) -> Outcome:
    """Runs `source` (a class Program) and its optimized forms as described
    in the module docstring; with `round_trip`, also the optimized forms
    after torch.jit.save / torch.jit.load.  A line `# preserved_attrs: a, b`
    in the class names what the frozen mode preserves (the first: an
    exported method taking forward's inputs).  `channels_last`: the frozen
    mode's channels-last variant, "contiguous" or "channels_last" (its 4-d
    inputs so), "none", or None to draw it (see CHANNELS_LAST).  `device`:
    where the modules and inputs live (drawn on the CPU, then moved); on
    CUDA, TF32 is off for the check (cuDNN's default allows it for float32
    convolutions), so that float32 results carry float32 rounding, as the
    judge's tolerances assume.  Raises Invalid if the original cannot run."""
    cls = load_class(source)
    if channels_last is None:
        channels_last = _draw_channels_last(source, seed)
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
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.jit.optimized_execution(False):
            _check(cls, input_shapes, seed, dtypes, modes, stop_early, round_trip, preserved, outcome,
                   channels_last, torch.device(device))
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    return outcome


def _nonfinite_inputs(inputs: Sequence[torch.Tensor], seed: int) -> Optional[List[torch.Tensor]]:
    """For NONFINITE_FRACTION of the check seeds (their own stream, so that
    the other modes' inputs stay those drawn before), copies of `inputs`
    with a NaN, and each of +inf and -inf half the time, at distinct
    elements of about half the floating inputs, at least one in all; None
    for the other seeds."""
    rng = random.Random(f"{seed}:{NONFINITE}")
    floating = [i for i, t in enumerate(inputs) if t.is_floating_point() and t.numel()]
    if not floating or rng.random() >= NONFINITE_FRACTION:
        return None
    out = [t.clone() for t in inputs]
    chosen = [i for i in floating if rng.random() < 0.5] or [rng.choice(floating)]
    for i in chosen:
        flat = out[i].view(-1)  # NB: drawn by randn: contiguous
        values = [math.nan] + [v for v in (math.inf, -math.inf) if rng.random() < 0.5]
        for value, at in zip(values, rng.sample(range(flat.numel()), min(len(values), flat.numel()))):
            flat[at] = value
    return out


def _draw_channels_last(source: str, seed: int) -> str:
    rng = random.Random(f"{seed}:{CHANNELS_LAST}")
    if not re.search(r"\bConv2d\(|\bF\.conv2d\(", source) or rng.random() >= CHANNELS_LAST_FRACTION:
        return "none"
    return "channels_last" if rng.random() < 0.5 else "contiguous"


def _optimize(module, freeze: bool, preserved: Sequence[str], layout: str = "auto"):
    """torchfuse.optimize; with preserved attributes (frozen programs with
    an exported method) through its preserved_attrs keyword.  Every pass
    runs, the ones only run when named (relu) included.  `layout`:
    optimize's layout keyword."""
    passes = torchfuse.pass_names()
    kw = {"layout": layout} if layout != "auto" else {}
    if freeze and preserved:
        return torchfuse.optimize(module, freeze=True, passes=passes, preserved_attrs=list(preserved), **kw)
    return torchfuse.optimize(module, freeze=freeze, passes=passes, **kw)


def _script_and_optimize(model, freeze: bool, what: str, outcome: Outcome, preserved: Sequence[str] = (),
                         layout: str = "auto"):
    """(original, optimized), counting the fused nodes (not for
    layout="channels_last": the frozen mode's counts again, which the
    regression cases' expected counts do not include); optimized is None
    (a failure recorded) if optimize raised or the result's parameters and
    buffers are not shared as the original's are.  The original returned
    is a copy of the module optimized, made before: optimize may share its
    input's tensors (as torch.compile does), and the two must not run on
    one state.  optimize must not change its input's methods."""
    try:
        scripted = torch.jit.script(model)
    except Exception as e:  # noqa: BLE001
        raise Invalid(f"script: {type(e).__name__}: {str(e).splitlines()[0]}")
    ref = _own_copy(scripted)
    sharing = _sharing(scripted)
    outcome.shares |= any(len(g) > 1 for g in sharing.values())
    methods = _methods_text(scripted)
    try:
        # NB: the layout only where asked (tests replace _optimize).
        opt = _optimize(scripted, freeze, preserved, *([layout] if layout != "auto" else []))
    except Exception as e:  # noqa: BLE001
        call = f"optimize(freeze=True, preserved_attrs={list(preserved)})" if freeze and preserved else "optimize"
        if layout != "auto":
            call = call.replace(")", f", layout={layout!r})") if "(" in call else f"optimize(layout={layout!r})"
        outcome.failures.append(f"{what}: {call} raised: {type(e).__name__}: {str(e).splitlines()[0]}")
        return ref, None
    if layout == "auto":
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


def _own_copy(module):
    """A copy of a scripted module with graph executors of its own.  A
    deepcopy shares its source's class types, so their methods and
    executors, and with nothing fused optimize's result runs those too: on
    one executor the steps of ref and opt would not be in step (an
    executor's first calls profile)."""
    return torch.jit.load(io.BytesIO(_save(module)))


def _copy(module):
    """A copy of a scripted module with its state, parameters leaves again
    (deepcopy's clones are not)."""
    module = copy.deepcopy(module)
    for t in module.parameters():
        t.detach_().requires_grad_(True)
    return module


def _run_steps(ref, opt, steps, inputs, seed, dtype, params: bool, what: str, stop_early: bool,
               outcome: Outcome, autocast: bool = False, strides: bool = False) -> None:
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
                  method=method[0] if method else "forward", autocast=autocast, strides=strides)
        if stop_early and outcome.failures:
            return


def _check_mode(ref, opt, steps, inputs, seed, dtype, params: bool, label: str, what: str,
                stop_early: bool, round_trip: bool, outcome: Outcome, preserved: Sequence[str] = (),
                strides: bool = False) -> None:
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
    `preserved`: what the frozen modules keep (optimize's preserved_attrs);
    `strides`: every run compares the outputs' strides too."""
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
    _run_steps(ref, opt, steps, inputs, seed, dtype, params, what, stop_early, outcome, strides=strides)
    if not round_trip or len(outcome.failures) > failed:
        return  # NB: the loaded module would mostly repeat an in-memory failure
    msg = _sharing_mismatch(_sharing(start), loaded, not params)
    if msg:
        outcome.failures.append(f"{label} {AFTER_SAVE_LOAD}: {msg}")
        return
    after = Outcome(exact=outcome.exact)
    _run_steps(_copy(start), loaded, steps, inputs, seed, dtype, params,
               f"{what} {AFTER_SAVE_LOAD}", stop_early, after, strides=strides)
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
                       f"{what} {AFTER_SAVE_LOAD} against the loaded original", True, alike, strides=strides)
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
                           params, f"{what} torch's own {AFTER_SAVE_LOAD}", True, torch_own, strides=strides)
            except Invalid:
                torch_own.failures.append("raised")
            if torch_own.failures:
                after = Outcome()
                outcome.round_trip_torch_differs += 1
    # NB: backward_skipped counts the in-memory steps only: the same steps
    # again would only double it.
    outcome.failures += after.failures
    outcome.within_spread += after.within_spread


def _to_dtype(model, dtype, device=None):
    """model.to(device, dtype), its parameters and buffers shared as before
    (Module.to converts each module's buffers apart, untying shared ones)."""
    groups = collections.defaultdict(list)
    for kind, named in (("_parameters", model.named_parameters(remove_duplicate=False)),
                        ("_buffers", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            groups[id(t)].append((kind, name))
    model = model.to(device=device, dtype=dtype)
    for members in groups.values():
        kind, name = members[0]
        first = getattr(model.get_submodule(name.rpartition(".")[0]), kind)[name.rpartition(".")[2]]
        for kind, name in members[1:]:
            getattr(model.get_submodule(name.rpartition(".")[0]), kind)[name.rpartition(".")[2]] = first
    return model


def _check(cls, input_shapes, seed, dtypes, modes, stop_early, round_trip, preserved, outcome,
           channels_last: str = "none", device: torch.device = torch.device("cpu")) -> None:
    """The modes of one program, float64 first: the float32 runs are
    judged against its results.  The autocast steps are the train mode's
    steps again (so "autocast" needs those: it runs them), on copies of
    the pair made before them."""
    exported = [EXPORTED] if preserved else []
    for dname in dtypes:
        dtype = DTYPES[dname]
        torch.manual_seed(seed)
        model = _to_dtype(cls(), dtype, device)
        frozen_base = copy.deepcopy(model).eval()
        train_base = copy.deepcopy(model)  # NB: before the steps write its state
        nonfinite_base = copy.deepcopy(model) if NONFINITE in modes else None
        fx_base = copy.deepcopy(model) if FX in modes or COMPILE in modes else None
        g = torch.Generator().manual_seed(seed + 1)
        inputs = [torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in input_shapes]
        variant_inputs = None if channels_last == "none" else [
            t.contiguous(memory_format=torch.channels_last) if channels_last == "channels_last" and t.dim() == 4
            else t for t in inputs]
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
            if names and variant_inputs is not None:
                outcome.channels_last += 1
                label = f"{dname} {CHANNELS_LAST}" + ("+inputs" if channels_last == "channels_last" else "")
                ref, opt = _script_and_optimize(train_base, False, f"{label} train", outcome, (),
                                                "channels_last")
                if opt is None:
                    return
                _check_mode(ref, opt, steps, variant_inputs, seed, dtype, True, f"{label} train",
                            f"{label} {{mode}} step {{i}}", stop_early, round_trip, outcome, strides=True)
                if stop_early and outcome.failures:
                    return
        for how in (FX, COMPILE):
            if how in modes and not _check_fx(fx_base, inputs, seed, dtype, dname, stop_early, outcome, how):
                return
        if "frozen" in modes:
            # NB: copies before the steps write its buffers.
            variant = copy.deepcopy(frozen_base) if variant_inputs is not None else None
            if not _check_frozen(frozen_base, inputs, seed, dtype, dname, round_trip, preserved, exported,
                                 stop_early, outcome):
                return
            if variant is not None:
                outcome.channels_last += 1
                # NB: "channels_last+inputs": its 4-d inputs channels-last too.
                label = f"{dname} {CHANNELS_LAST}" + ("+inputs" if channels_last == "channels_last" else "")
                if not _check_frozen(variant, variant_inputs, seed, dtype, label,
                                     round_trip, preserved, exported, stop_early, outcome, "channels_last"):
                    return
        bad = _nonfinite_inputs(inputs, seed) if nonfinite_base is not None else None
        if bad is not None:
            outcome.nonfinite += 1
            if not _check_nonfinite(nonfinite_base, bad, seed, dtype, dname, modes, round_trip, preserved,
                                    exported, stop_early, outcome):
                return


def _check_nonfinite(model, bad, seed, dtype, dname: str, modes, round_trip: bool, preserved, exported,
                     stop_early: bool, outcome: Outcome) -> bool:
    """The nonfinite mode: the train and eval steps of optimize(m), the fx
    and compile modes where they run, and the frozen mode, on `bad` (inputs
    with NaN and Inf).  NB: on an Outcome of its own, of which only the
    failures and the differences within the rounding spread count: the
    modes' fused nodes and graphs were counted on the finite inputs.  False
    where the check is to stop."""
    label = f"{dname} {NONFINITE}"
    own = Outcome(exact=outcome.exact)
    frozen = copy.deepcopy(model).eval()
    try:
        for how in (FX, COMPILE):
            if how in modes and not _check_fx(model, bad, seed, dtype, label, stop_early, own, how):
                return False
        ref, opt = _script_and_optimize(model, False, f"{label} train", own)
        if opt is None:
            return False
        _check_mode(ref, opt, [("train", 0), ("eval", 1)], bad, seed, dtype, True, f"{label} train",
                    f"{label} {{mode}} step {{i}}", stop_early, round_trip, own)
        if stop_early and own.failures:
            return False
        return _check_frozen(frozen, bad, seed, dtype, label, round_trip, preserved, exported, stop_early, own)
    finally:
        outcome.failures += own.failures
        outcome.within_spread += own.within_spread


class _Traced(torch.nn.Module):
    """A trace of `root` run as a module whose parameters and buffers are
    root's: the trace shares them, so the steps compare what the user's
    module holds, under the same names for both traces (a rewritten graph
    references fewer attributes than the module has)."""

    def __init__(self, root, traced):
        super().__init__()
        self.root = root
        object.__setattr__(self, "traced", traced)  # NB: not a submodule: its attributes are root's

    def forward(self, *args):
        return self.traced(*args)


def _compiled(module, backend):
    """torch.compile(module, backend=backend), called with Dynamo's warning
    about reading a non-leaf input's .grad (its guards do; the steps'
    inputs are non-leaf copies) silenced: pytest's configuration turns
    warnings into errors."""
    fn = torch.compile(module, backend=backend)

    def call(*args):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf",
                                    category=UserWarning)
            return fn(*args)

    return call


def _fx_pair(a, b, how: str, outcome: Outcome):
    """(reference, rewritten) callables over modules a and b (copies of one
    program, in one mode): how="fx", symbolic traces of both, the second
    rewritten by torchfuse.fx.optimize; how="compile", a itself and
    torch.compile(b) with torchfuse.fx's backend (every pass, the rewrite
    kept, Dynamo's graphs then run as they are).  None where a does not
    trace; raises where the rewrite fails."""
    import torchfuse.fx

    passes = torchfuse.fx.pass_names()
    if how == FX:
        try:
            ref, traced = torch.fx.symbolic_trace(a), torch.fx.symbolic_trace(b)
        except Exception:  # noqa: BLE001  (data-dependent control flow, ...)
            return None
        opt = torchfuse.fx.optimize(traced, passes=passes)
        outcome.fx_fused.update(torchfuse.fx.report(opt))
        return ref, opt

    def keep(gm, example_inputs):
        outcome.fx_fused.update(torchfuse.fx.report(gm))
        return gm

    torch._dynamo.reset()
    return a, _compiled(b, torchfuse.fx.make_backend(passes=passes, inner=keep, choice="fused"))


def _check_fx(model, inputs, seed, dtype, label: str, stop_early: bool, outcome: Outcome, how: str = FX) -> bool:
    """The fx or compile mode (`how`) of `model`, in training and in eval
    mode, each on fresh copies of `model` (_fx_pair): two training steps,
    one eval step.  A program that does not trace, or (compile) whose
    steps through a rewrite-free torch.compile already differ from the
    module's, is not judged.  False where the check is to stop."""
    for training, steps in ((True, [("train", 0), ("train", 1)]), (False, [("eval", 2)])):
        a, b, c = (copy.deepcopy(model).train(training) for _ in range(3))
        what = f"{label} {how} {'train' if training else 'eval'}"
        try:
            pair = _fx_pair(a, b, how, outcome)
        except Exception as e:  # noqa: BLE001
            outcome.failures.append(f"{what}: the rewrite raised: {type(e).__name__}: {_message(e)}")
            return not stop_early
        if pair is None:
            outcome.fx_untraceable[how] += 1
            return True
        outcome.fx_traced[how] += 1
        failed = len(outcome.failures)
        try:
            _run_steps(_Traced(a, pair[0]), _Traced(b, pair[1]), steps, inputs, seed, dtype, True,
                       f"{label} {how} {{mode}} step {{i}}", stop_early, outcome)
        except Invalid:
            outcome.fx_untraceable[how] += 1
            return True
        if how == COMPILE and len(outcome.failures) > failed:
            # NB: Dynamo's own capture may differ from the module (not the
            # rewrite's doing): then nothing is judged.
            plain = Outcome(exact={})
            torch._dynamo.reset()
            try:
                r = copy.deepcopy(model).train(training)
                _run_steps(_Traced(r, r), _Traced(c, _compiled(c, "eager")), steps, inputs, seed, dtype, True,
                           f"{label} {how} {{mode}} step {{i}} (rewrite-free)", True, plain)
            except Exception:  # noqa: BLE001  (Dynamo itself raised)
                plain.failures.append("raised")
            if plain.failures:
                del outcome.failures[failed:]
                outcome.fx_traced[how] -= 1
                outcome.fx_untraceable[how] += 1
                return True
        if stop_early and outcome.failures:
            return False
    return True


def _check_frozen(model, inputs, seed, dtype, label: str, round_trip: bool, preserved, exported,
                  stop_early: bool, outcome: Outcome, layout: str = "auto") -> bool:
    """The frozen mode of `model` (in eval mode), labelled `label`
    ("float64" or "float64 channels_last"); with layout="channels_last",
    optimize(..., layout="channels_last") and the outputs' strides compared
    too.  False where the check is to stop (optimize failed, or
    stop_early and a failure)."""
    pristine = copy.deepcopy(model)  # NB: before the steps write its buffers
    strides = layout != "auto"
    ref, opt = _script_and_optimize(model, True, f"{label} frozen", outcome, preserved, layout)
    if opt is None:
        return False
    steps = [("frozen", 7)] + [("frozen", 8, m) for m in exported]
    failed = len(outcome.failures)
    _check_mode(ref, opt, steps, inputs, seed, dtype, False, f"{label} frozen", f"{label} frozen", stop_early,
                round_trip, outcome, preserved, strides=strides)
    new = outcome.failures[failed:]
    if new and not any(AFTER_SAVE_LOAD in f for f in new):
        verdict = _frozen_by_torch_alike(pristine, steps, inputs, seed, dtype, f"{label} frozen",
                                         preserved, outcome, layout)
        if verdict:
            del outcome.failures[failed:]
            setattr(outcome, verdict, getattr(outcome, verdict) + 1)
    return not (stop_early and outcome.failures)


def _frozen_by_torch_alike(model, steps, inputs, seed, dtype, what: str, preserved,
                           outcome: Outcome, layout: str = "auto") -> Optional[str]:
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
    the steps are judged as any mode's are (with layout="channels_last",
    the optimized module's so, and its outputs' strides against torch's
    frozen original's)."""
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
        opt = _optimize(script(), True, preserved, *([layout] if layout != "auto" else []))
        trains = _trains_batch_norm(own) or _trains_batch_norm(opt)
        _run_steps(torch_frozen(), opt, steps, inputs, seed, dtype, False,
                   f"{what} against torch's own frozen original", False, alike, strides=layout != "auto")
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
