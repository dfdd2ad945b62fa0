"""Writes to loop-carried tensors that TorchScript's AliasDb misses
(`v2 = relu(v1); for ...: v1.add_(b); v1 = v2`: the second iteration writes
v2, AliasDb sees a write to v1's first value only; docs/passes.md,
"Loop-carried alias guards"): optimize keeps them when the loop sits in a
free function or in a TorchScript class's method, and through
torch.jit.save / torch.jit.load.

Each case defines its classes and free functions in a fresh Python module:
TorchScript compiles a free function once per Python function and caches its
optimized graph, so a function shared between cases would carry one case's
state into the next."""

import io
import os
import sys

import pytest
import torch

import torchfuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz_pass  # noqa: E402
from fuzz.cases import HEADER  # noqa: E402
from test_fuzz_regressions import CASES as REGRESSIONS  # noqa: E402

# NB: count(2) is a call that the executor's preoptimization folds to 2, and
# whose folding runs its dead-code elimination; make() hides the conv from
# the compiler, which would drop the write at scripting otherwise.
HELPERS = """\
def count(n: int) -> int:
    if n > 1:
        return n
    return 1

def make(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.conv2d(x, w)

"""


def _loop(head: str = "", count: str = "count(2)", scale: str = "3.0", indent: str = "    ") -> str:
    """`head` (v1's producer, if any) and the loop whose second iteration
    writes v2 through v1, returning v1 * `scale`: a function's body."""
    lines = [head] * bool(head) + ["v2 = torch.relu(v1)", f"for _ in range({count}):", "    v1.add_(b)", "    v1 = v2",
             f"return v1 * {scale}"]
    return "".join(indent + line + "\n" for line in lines)


# A conv's weight and a buffer for the loop to add.
WEIGHT_AND_BUFFER = """\
        self.w = nn.Parameter(torch.randn(3, 3, 1, 1))
        self.register_buffer("b", torch.randn(2, 3, 4, 4))
"""


def _program(members: str, returns: str) -> str:
    return HEADER + members + "    def forward(self, x):\n        return " + returns + "\n"


# v1 is an argument of the function, produced by a conv in forward.
LOOP_ON_ARGUMENT = HELPERS + "def loop(v1: torch.Tensor, b: torch.Tensor) -> torch.Tensor:\n" + _loop() + "\n" + _program("""\
        self.conv = nn.Conv2d(3, 3, 1)
        self.register_buffer("b", torch.randn(2, 3, 4, 4))
""", "loop(self.conv(x), self.b)")

# v1 is produced inside the function, by a call to another function.
LOOP_ON_CALL_RESULT = HELPERS + """\
def loop(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
""" + _loop("v1 = make(x, w)") + "\n" + _program(WEIGHT_AND_BUFFER, "loop(x, self.w, self.b)")

# The same function, called from a submodule's forward.
LOOP_IN_SUBMODULE = LOOP_ON_CALL_RESULT.replace("class Program", "class Inner") + "\n" + _program(
    "        self.inner = Inner()\n", "self.inner(x) + 1.0")

# The same loop in a method of a TorchScript class (not a module) that
# forward instantiates: a class's methods are shared and their optimized
# graphs cached like free functions' (prim::CallMethod on a non-module class).
LOOP_IN_CLASS_METHOD = HELPERS + """\
@torch.jit.script
class Looper:
    def __init__(self, scale: float):
        self.scale = scale

    def loop(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
""" + _loop("v1 = make(x, w)", scale="self.scale", indent="        ") + "\n" + _program(
    WEIGHT_AND_BUFFER, "Looper(3.0).loop(x, self.w, self.b)")

# v1 is produced inside the function by a visible conv: torch.jit.script
# itself drops the write (TorchScript's compiler), and optimize keeps what
# the scripted function computes.
LOOP_ON_VISIBLE_PRODUCER = HELPERS + """\
def loop(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
""" + _loop("v1 = F.conv2d(x, w)", count="2") + "\n" + _program(WEIGHT_AND_BUFFER, "loop(x, self.w, self.b)")


def _model(source: str, freeze: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = fuzz_pass.load_class(source)().double()
    return model.eval() if freeze else model


def _optimized(source: str, freeze: bool, shape):
    """An input of `shape`, the eager output of `source`'s model on it, the
    model scripted and the module optimize makes of it (both without the
    executor's optimization)."""
    model = _model(source, freeze)
    x = torch.randn(*shape, dtype=torch.float64)
    with torch.no_grad():
        eager = model(x.clone())
    with torch.jit.optimized_execution(False):
        scripted = torch.jit.script(model)
        optimized = torchfuse.optimize(scripted, freeze=freeze)
    return x, eager, scripted, optimized


@pytest.mark.parametrize("freeze", [False, True], ids=["train", "frozen"])
@pytest.mark.parametrize(
    "source,scripted_keeps_write",
    [
        pytest.param(LOOP_ON_ARGUMENT, True, id="argument"),
        pytest.param(LOOP_ON_CALL_RESULT, True, id="call_result"),
        pytest.param(LOOP_IN_SUBMODULE, True, id="submodule"),
        pytest.param(LOOP_IN_CLASS_METHOD, True, id="class_method"),
        pytest.param(LOOP_ON_VISIBLE_PRODUCER, False, id="visible_producer"),
    ],
)
def test_keeps_writes_to_loop_carried_tensors_in_free_functions(source, scripted_keeps_write, freeze):
    # NB: the original runs after optimize: optimize must not leave an
    # optimized graph of the shared function behind for it either.
    x, eager, scripted, optimized = _optimized(source, freeze, (2, 3, 4, 4))
    with torch.jit.optimized_execution(False):
        want = scripted(x.clone())
        got = optimized(x.clone())
    torch.testing.assert_close(got, want)
    if scripted_keeps_write:
        torch.testing.assert_close(want, eager)
    else:
        assert not torch.allclose(want, eager)


# The fuzzer's program (seed 4, program 1565) whose write optimize dropped,
# a case of test_fuzz_regressions.py.
SEED_4_PROGRAM_1565 = next(c.values[0] for c in REGRESSIONS if c.id == "loop_carried_write_dropped")


def _save_and_load(module: torch.jit.ScriptModule) -> torch.jit.ScriptModule:
    buffer = io.BytesIO()
    torch.jit.save(module, buffer)
    buffer.seek(0)
    return torch.jit.load(buffer)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("freeze", [False, True], ids=["train", "frozen"])
def test_loaded_optimized_module_keeps_writes_to_loop_carried_tensors(freeze, grad):
    """Loading compiles the saved code again; its dead-code elimination
    would drop the write in the inlined forward, so optimize leaves the
    slot's guard in a persistent form (`[returned, received][0]`)."""
    x, eager, scripted, optimized = _optimized(SEED_4_PROGRAM_1565, freeze, (4, 3, 4, 5))
    with torch.jit.optimized_execution(False):
        loaded = _save_and_load(optimized)
        assert "print" not in loaded.code
        with torch.set_grad_enabled(grad):
            for module in (scripted, optimized, _save_and_load(scripted), loaded):
                for _ in range(2):
                    torch.testing.assert_close(module(x.clone()), eager)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("freeze", [False, True], ids=["train", "frozen"])
def test_optimizing_executor_drops_writes_to_loop_carried_tensors(freeze, grad):
    """TorchScript behaviour that docs/passes.md describes, asserted so that
    a change in torch is noticed: the optimizing executor (the default)
    drops the write from the original, saved and loaded or not, and from
    the unfrozen optimized module alike (its list peephole folds the
    guard).  freeze_module unrolls the constant loop: the frozen module's
    write is no longer loop-carried and stays."""
    x, eager, scripted, optimized = _optimized(SEED_4_PROGRAM_1565, freeze, (4, 3, 4, 5))
    # NB: fresh loads: nothing has run, so no executor caches a plan.
    modules = [_save_and_load(scripted), _save_and_load(optimized)]
    with torch.jit.optimized_execution(True), torch.set_grad_enabled(grad):
        original, opt = [[m(x.clone()) for _ in range(3)] for m in modules]
    for o, p in zip(original, opt):
        assert not torch.allclose(o, eager)
        if freeze:
            torch.testing.assert_close(p, eager)
        else:
            torch.testing.assert_close(p, o)
