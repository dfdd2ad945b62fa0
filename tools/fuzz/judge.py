"""Judgement: whether two runs' values agree (tolerances, the float64
run's results as the float32 runs' exact answers, the original's own
rounding spread), and the Outcome a program's checks collect."""

import collections
import copy
import dataclasses
import itertools
import math
from typing import Dict, List, Optional

import torch



# Differences allowed, relative to max(1, largest magnitude of the reference
# tensor): the CPU kernels are the unfused ATen compositions in the forward;
# backwards are reassociated (and the BN backward runs in float64), so allow
# rounding of the dtype with some accumulation headroom.
# Under autocast (bfloat16 matmuls and convolutions, rounding of 2**-8):
# one bfloat16 ulp at 1, applied as rtol and atol (so about 2 ulps); see
# _judge.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 2.0**-7}


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
    # Double-backward steps whose penalty gradients differed where the
    # original's were wrong and the optimized module's right (see
    # modes._second_derivative_wrong), and whether the float64 run found so.
    double_backward_original_wrong: int = 0
    original_second_derivative_wrong: bool = False
    # Frozen modes not judged: torch's own frozen original differs from the
    # original and has a training batch_norm, and the optimized module
    # agrees with neither (no reference; see _frozen_by_torch_alike).
    frozen_torch_differs: int = 0
    # Double-backward steps not compared because the original raised.
    double_backward_skipped: int = 0
    # Whether the original shares a tensor between two attributes.
    shares: bool = False
    # Train and frozen modes run again with layout="channels_last" (modes.CHANNELS_LAST).
    channels_last: int = 0
    # Train, eval and frozen modes run again on inputs with NaN and Inf (modes.NONFINITE).
    nonfinite: int = 0
    # fx and compile modes, by mode: the graphs checked (train and eval,
    # per dtype), the dtypes whose module did not trace (symbolic_trace) or
    # whose torch.compile with a rewrite-free backend already differed from
    # the module (not judged); and the chains torchfuse.fx fused in either
    # (apart from `fused`, the TorchScript pipeline's).
    fx_traced: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fx_untraceable: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fx_fused: collections.Counter = dataclasses.field(default_factory=collections.Counter)


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
# Under autocast the spread measures the backward's bfloat16 rounding
# alone: only the loss weights are perturbed (the forward's rounding is the
# tolerance's; perturbing the state moves a training BatchNorm's bfloat16
# outputs by percents), by half a bfloat16 ulp at 1 times N(0, 1), about
# one rounding to bfloat16, so that the backward's bfloat16 products and
# sums round differently (seed 20261124: program 5795, a bias gradient
# summed from bfloat16 products of the weights; program 3788, a float32
# bias gradient from bfloat16 terms that cancel).
PERTURBATION_ULPS_AUTOCAST = 0.5
PERTURBATION_RUNS = 3
PERTURBATION_RUNS_MAX = 64
SPREAD_FACTOR = 4


def _spread(before, inputs, dtype, seed: int, values_a, evaluate, ulps: float = PERTURBATION_ULPS,
            state: bool = True):
    """Yields, after each of up to PERTURBATION_RUNS_MAX runs, how far the
    original's own results have moved so far, per compared tensor, with its
    inputs, parameters and floating-point buffers scaled by
    1 + ulps * eps * N(0, 1) (with `state`; else only what `evaluate`
    perturbs): the rounding-level sensitivity of
    the program.  A result that moves this much under rounding-sized changes
    carries no more than rounding noise (e.g. a gradient that is zero but
    for rounding amplified by a BatchNorm of a constant, or by x / x), so a
    difference within a few times the spread is not a change of meaning.
    `evaluate(module, inputs, jitter)` gives a run's values (inputs:
    leaves to be; jitter: the perturbation, for what else it perturbs).  A
    run that raises ends it with an empty spread."""
    eps = torch.finfo(dtype).eps * ulps
    spread: Dict[str, float] = collections.defaultdict(float)
    g = torch.Generator().manual_seed(seed + 1000)

    def jitter(t):
        return t * (1 + eps * torch.randn(t.shape, dtype=t.dtype, generator=g).to(t.device))

    for _ in range(PERTURBATION_RUNS_MAX):
        module = copy.deepcopy(before)
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()) if state else ():
                if t.is_floating_point():
                    t.copy_(jitter(t))
        for t in module.parameters():
            t.detach_().requires_grad_(True)  # deepcopy's clones are not leaves
        try:
            values = evaluate(module, [jitter(t) if state else t.clone() for t in inputs], jitter) or {}
        except Exception:  # noqa: BLE001  (a perturbation cannot vouch for anything)
            yield {}
            return
        for name, d in _deviations(values, values_a).items():
            spread[name] = max(spread[name], d)
        yield dict(spread)


def _max_deviation(p, a) -> Optional[float]:
    """max |p - a| (equal values and NaN against NaN count 0; NaN against a
    number gives NaN), or None for empty tensors."""
    d = (p.detach().double() - a.detach().double()).abs()
    d[(p == a) | (torch.isnan(p) & torch.isnan(a))] = 0
    return d.max().item() if d.numel() else None


def _deviations(values, values_a) -> Dict[str, float]:
    """_max_deviation per compared tensor, NaN counted as inf."""
    out: Dict[str, float] = {}
    for name, a in values_a.items():
        p = values.get(name)
        if a is None or p is None or p.shape != a.shape or not a.is_floating_point():
            continue
        d = _max_deviation(p, a)
        if d is not None:
            out[name] = float("inf") if math.isnan(d) else d
    return out


def _layout_spread(before, inputs, values_a, evaluate) -> Dict[str, float]:
    """How far the original's own results move with its 4-d and 5-d
    parameters and buffers in channels-last memory format (nn.Module.to's
    memory_format), the inputs as they are: ATen's kernels round otherwise
    in that layout, the one the channels-last pass gives the convolutions.
    A training BatchNorm of a per-channel constant amplifies that rounding
    by up to 1 / sqrt(eps), and perturbations of the original's state
    cannot show it (its result stays exact under them): fuzz seed 20261252
    program 879, 4.2e-6 NCHW against 7.6e-5 channels-last in ATen's own CPU
    BatchNorm.  Empty where that run raises."""
    module = copy.deepcopy(before)
    for t in module.parameters():
        t.detach_().requires_grad_(True)  # deepcopy's clones are not leaves
    module.to(memory_format=torch.channels_last)
    try:
        values = evaluate(module, [t.clone() for t in inputs], lambda t: t) or {}
    except Exception:  # noqa: BLE001  (a layout change cannot vouch for anything)
        return {}
    return _deviations(values, values_a)


def _with_layout_spread(spreads, layout: Dict[str, float]):
    """`spreads` (a _spread generator), each yield raised to `layout`'s
    deviations (_layout_spread) where those are larger."""
    for spread in spreads:
        yield {name: max(spread.get(name, 0.0), layout.get(name, 0.0)) for name in set(spread) | set(layout)}


def _within_spread(a, b, spread: Optional[float]) -> bool:
    if spread is None or a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return False
    d = _max_deviation(b, a)
    return d is None or d <= SPREAD_FACTOR * spread
