"""Differential fuzzer for torchfuse.optimize: the rewrite must never change
what a module computes.

    tools/fuzz_pass.py --programs N --seed S [--emit-regressions DIR]
                       [--modes train,eval,frozen,autocast,double_backward,fx,compile]
                       [--features tied,exported,attention,dropout|none]
                       [--device cpu|cuda]

Each program is a random nn.Module written as Python source from a small
vocabulary (linear, conv1d/conv2d, batch_norm, layer_norm, relu/relu_, add/add_/sub,
div, mul, sigmoid, silu, the activations of conv_add_act: relu, relu6,
hardtanh, silu, hardswish, hardsigmoid, sigmoid, gelu, leaky_relu, in and
out of place, a conv of the chain's input as the residual, max_pool2d;
views, in-place writes, if and for blocks), biased towards the eight
fusable chains (conv -> [activation] -> max_pool2d, conv -> [add] ->
activation, linear -> activation and add -> layer_norm among them) and
near-misses of them.  Features, each
from its own random stream (without them a program is the one drawn before
they existed): `tied`, parameters tied and buffers shared between
attributes (`self.fc2.weight = self.fc1.weight`, `self.bn2.running_mean =
self.bn1.running_mean`, a second name for a parameter or buffer, one read
in two places); `exported`, an @torch.jit.export method; `attention`,
scaled_dot_product_attention masked as transformers traces it (true
everywhere: DropAllTrueAttentionMasks' case) and its near-misses;
`dropout`, dropouts of probability 0 (RemoveZeroDropouts' case) between a
linear and an activation, and near-misses.  The module is
scripted and optimized twice, and checked in these modes:

  train     torchfuse.optimize(scripted): two training steps, then one step
            in eval mode of the same modules (and one of the exported
            method); for the programs the frozen mode's channels-last
            variant is drawn for, again with layout="channels_last";
  frozen    torchfuse.optimize(scripted.eval(), freeze=True, with the
            exported method in preserved_attrs): one step, and one of the
            exported method; for half the programs with a 2-d convolution,
            again with layout="channels_last" (in half of those with the
            4-d inputs channels-last), where the outputs' strides must be
            the original's too;
  autocast  the train mode's steps under torch.autocast(device, bfloat16)
            (float32): equal dtypes, values judged against the float64 run;
  double_backward  a gradient penalty: gradients with create_graph=True,
            then the gradients of the sum of their squares;
  fx        torchfuse.fx.optimize (every pass) of torch.fx.symbolic_trace of
            the module, traced in training (two steps) and in eval mode
            (one step), against the unrewritten trace; the parameters,
            gradients and buffers compared are the traced module's, which
            the traces share (a program that does not trace is counted,
            not judged);
  compile   the same steps through torch.compile(m) with torchfuse.fx's
            backend (every pass, the rewrite kept, Dynamo's graphs run as
            they are) against m itself; where they differ and a
            rewrite-free torch.compile(backend="eager") differs from m as
            well, the program is counted, not judged.

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

`--device cuda` runs the same programs with their modules and inputs on
the GPU (drawn on the CPU, then moved), so that the ops' CUDA kernels are
checked against the original's CUDA ops; TF32 is off for the checks, as
float32's tolerances assume.  A program that makes a CPU tensor in its
forward (the `attention` feature's `torch.arange` masks) fails on the
original there and is redrawn.

The package: program (the generator), modes (running the original and the
optimized module in each mode), judge (tolerances, rounding spread,
Outcome), shrink, report (the driver, summaries, regression files) and cli;
tools/fuzz_pass.py and `python -m fuzz` (from tools/) are its command line.
"""

import importlib.util
import os
import sys
import warnings

# TorchScript has warned on every entry point since torch 2.10.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)

if importlib.util.find_spec("torchfuse") is None:  # run from a checkout
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

from .judge import TOLERANCE, Outcome  # noqa: E402
from .modes import (  # noqa: E402
    AFTER_SAVE_LOAD, AUTOCAST, DTYPES, MODES, OPS, Invalid, assert_keeps_meaning, check_program, check_source,
    load_class,
)
from .program import EXPORTED, FEATURES, Program, Stmt, generate  # noqa: E402
from .report import Summary, emit_regression, run  # noqa: E402
from .shrink import shrink  # noqa: E402
from .cli import main  # noqa: E402

__all__ = [
    "AFTER_SAVE_LOAD", "AUTOCAST", "DTYPES", "EXPORTED", "FEATURES", "MODES", "OPS", "TOLERANCE", "Invalid",
    "Outcome", "Program", "Stmt", "Summary", "assert_keeps_meaning", "check_program", "check_source",
    "emit_regression", "generate", "load_class", "main", "run", "shrink",
]
