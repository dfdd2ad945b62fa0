"""The driver and its reports: checking programs start..start+N-1 of a
seed, the summary counts, and a pytest file per failure."""

import collections
import dataclasses
import os
import textwrap
from typing import List, Optional, Sequence, Tuple

from .modes import AFTER_SAVE_LOAD, CHANNELS_LAST, MODES, OPS, Invalid, check_program
from .program import FEATURES, Program, generate
from .shrink import shrink

TOOLS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

REGRESSION_TEMPLATE = '''\
"""A torchfuse.optimize regression found by tools/fuzz_pass.py
(--seed {seed}, program {index}), shrunk.  Move the case into
test/python/test_fuzz_regressions.py once the bug is fixed."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), {tools_dir!r}))
from fuzz.cases import keeps_meaning_test  # noqa: E402

CASES = [
    pytest.param(
{source},
        {shapes!r},
        {index},
        {{}},
        id="seed{seed}_program{index}",
    ),
]

test_optimize_keeps_meaning = keeps_meaning_test(CASES)
'''


def emit_regression(directory: str, prog: Program, seed: int, index: int) -> str:
    """Writes a pytest file that checks the (shrunk) program `index` of
    generator seed `seed`; its check seed is `index`, as in run()."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"test_fuzz_seed{seed}_program{index}.py")
    # NB: tools/, the directory of the fuzz package, which the file imports.
    tools_dir = os.path.relpath(TOOLS_DIR, os.path.abspath(directory))
    source = '        """\\\n' + prog.source() + '"""'
    text = REGRESSION_TEMPLATE.format(
        seed=seed, index=index, tools_dir=tools_dir, source=source,
        shapes=[list(s) for _, s in prog.live_inputs()],
    )
    with open(path, "w") as f:
        f.write(text)
    return path


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
    double_backward_original_wrong: int = 0
    shares: int = 0  # programs whose original shares a tensor between attributes
    exported: int = 0  # programs with an exported method
    channels_last: int = 0  # programs whose train or frozen mode ran with layout="channels_last" too
    nonfinite: int = 0  # programs whose train, eval and frozen modes ran on inputs with NaN and Inf too
    # fx and compile modes: graphs checked and not judged, by mode; chains fused
    fx_traced: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fx_untraceable: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fx_fused: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: List[Tuple[int, Program, List[str]]] = dataclasses.field(default_factory=list)


def run(programs: int, seed: int, start: int = 0, shrink_failures: bool = True,
        emit_dir: Optional[str] = None, verbose: bool = False, log=print,
        round_trip_every: int = 1, modes: Sequence[str] = tuple(MODES),
        features: Sequence[str] = tuple(FEATURES), device: str = "cpu") -> Summary:
    """Checks programs start..start+programs-1 of `seed`, drawn with
    `features`, in `modes`, on `device`; those whose index is a multiple of
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
                outcome = check_program(prog, seed=index, round_trip=round_trip, modes=modes, device=device)
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
        summary.double_backward_original_wrong += outcome.double_backward_original_wrong
        summary.shares += outcome.shares
        summary.exported += prog.export is not None
        summary.channels_last += outcome.channels_last > 0
        summary.nonfinite += outcome.nonfinite > 0
        summary.fx_traced.update(outcome.fx_traced)
        summary.fx_untraceable.update(outcome.fx_untraceable)
        summary.fx_fused.update(outcome.fx_fused)
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
            if f" {CHANNELS_LAST}" in first:
                require = f" {CHANNELS_LAST}"  # NB: not into a failure of the plain frozen mode
            prog = shrink(prog, index, dtypes, shrink_modes, require=require, device=device)
        log(textwrap.indent(prog.source(), "    "))
        log(f"    inputs: {[list(s) for _, s in prog.live_inputs()]}, check seed {index}")
        summary.failures.append((index, prog, outcome.failures))
        if emit_dir:
            log("    regression: " + emit_regression(emit_dir, prog, seed, index))
    return summary


def print_summary(s: Summary, seed: int, start: int, programs: int, elapsed: float, modes: Sequence[str],
                  features: Sequence[str]) -> None:
    """The summary lines; the last is `N passed, M failed`."""
    print(f"seed {seed}, programs {start}..{start + programs - 1}: {elapsed:.0f} s; "
          f"{s.invalid} invalid draws redrawn; backward skipped (original raised) in {s.backward_skipped} steps; "
          f"{s.within_spread} differences within the original's rounding spread")
    print(f"modes {','.join(modes)}; features {','.join(features) or 'none'}: {s.shares} programs "
          f"with tied parameters or shared buffers, {s.exported} with an exported method; double backward "
          f"skipped (original raised) in {s.double_backward_skipped} steps, "
          f"{s.double_backward_original_wrong} where the original's second derivative was wrong (central differences)")
    print(f"after save/load: {s.round_trips} programs checked; {s.round_trip_alike} modes differed from the "
          f"original as torch's own module did after save/load, {s.round_trip_torch_differs} otherwise where torch's "
          f"own module differed too (not judged); {s.round_trip_skipped} modes not round-tripped "
          f"(torch cannot save/load the original)")
    print(f"train/frozen: {s.channels_last} programs also with layout='channels_last' (values and output strides); "
          f"{s.frozen_alike} modes differed from the original as torch's own frozen original did "
          f"(freeze_module), {s.frozen_torch_differs} otherwise where torch's own frozen original with a training "
          f"batch_norm differed too (not judged)")
    print(f"nonfinite: {s.nonfinite} programs also with NaN and Inf in their inputs (train, eval, frozen; fx and "
          f"compile where those run)")
    if "fx" in modes or "compile" in modes:
        print(f"fx: {s.fx_traced['fx']} symbolic traces checked, {s.fx_untraceable['fx']} programs x dtypes that "
              f"did not trace; compile: {s.fx_traced['compile']} Dynamo captures checked, "
              f"{s.fx_untraceable['compile']} programs x dtypes whose rewrite-free torch.compile already differed "
              f"(neither judged); torchfuse.fx fused "
              + (", ".join(f"{op} {n}" for op, n in s.fx_fused.items() if n) or "nothing"))
    print(f"programs with fused nodes: {s.fused_programs} of {s.passed + s.failed}")
    for op in OPS:
        print(f"  {op:26s} {s.fused_nodes[op]:6d} nodes in {s.fused_in[op]:5d} programs")
    print(f"{s.passed} passed, {s.failed} failed")
