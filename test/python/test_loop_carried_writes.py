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

# v1 is an argument of the function, produced by a conv in forward.
LOOP_ON_ARGUMENT = HELPERS + """\
def loop(v1: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    v2 = torch.relu(v1)
    for _ in range(count(2)):
        v1.add_(b)
        v1 = v2
    return v1 * 3.0

class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.register_buffer("b", torch.randn(2, 3, 4, 4))
    def forward(self, x):
        return loop(self.conv(x), self.b)
"""

# v1 is produced inside the function, by a call to another function.
LOOP_ON_CALL_RESULT = HELPERS + """\
def loop(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    v1 = make(x, w)
    v2 = torch.relu(v1)
    for _ in range(count(2)):
        v1.add_(b)
        v1 = v2
    return v1 * 3.0

class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, 1, 1))
        self.register_buffer("b", torch.randn(2, 3, 4, 4))
    def forward(self, x):
        return loop(x, self.w, self.b)
"""

# The same function, called from a submodule's forward.
LOOP_IN_SUBMODULE = LOOP_ON_CALL_RESULT.replace("class Program", "class Inner") + """\

class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
    def forward(self, x):
        return self.inner(x) + 1.0
"""

# The same loop in a method of a TorchScript class (not a module) that
# forward instantiates: a class's methods are shared and their optimized
# graphs cached like free functions' (prim::CallMethod on a non-module class).
LOOP_IN_CLASS_METHOD = HELPERS + """\
@torch.jit.script
class Looper:
    def __init__(self, scale: float):
        self.scale = scale

    def loop(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        v1 = make(x, w)
        v2 = torch.relu(v1)
        for _ in range(count(2)):
            v1.add_(b)
            v1 = v2
        return v1 * self.scale

class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, 1, 1))
        self.register_buffer("b", torch.randn(2, 3, 4, 4))
    def forward(self, x):
        return Looper(3.0).loop(x, self.w, self.b)
"""

# v1 is produced inside the function by a visible conv: torch.jit.script
# itself drops the write (TorchScript's compiler), and optimize keeps what
# the scripted function computes.
LOOP_ON_VISIBLE_PRODUCER = HELPERS + """\
def loop(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    v1 = F.conv2d(x, w)
    v2 = torch.relu(v1)
    for _ in range(2):
        v1.add_(b)
        v1 = v2
    return v1 * 3.0

class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, 1, 1))
        self.register_buffer("b", torch.randn(2, 3, 4, 4))
    def forward(self, x):
        return loop(x, self.w, self.b)
"""


def _model(source: str, freeze: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = fuzz_pass.load_class(source)().double()
    return model.eval() if freeze else model


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
    model = _model(source, freeze)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        eager = model(x.clone())
    # NB: the original runs after optimize: optimize must not leave an
    # optimized graph of the shared function behind for it either.
    with torch.jit.optimized_execution(False):
        scripted = torch.jit.script(model)
        optimized = torchfuse.optimize(scripted, freeze=freeze)
        want = scripted(x.clone())
        got = optimized(x.clone())
    torch.testing.assert_close(got, want)
    if scripted_keeps_write:
        torch.testing.assert_close(want, eager)
    else:
        assert not torch.allclose(want, eager)


# The fuzzer's program (seed 4, program 1565) whose write optimize dropped.
SEED_4_PROGRAM_1565 = """\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 6, 1, stride=1, padding=0, dilation=1, groups=3, bias=True)
        self.register_buffer("b5", torch.randn(4, 6, 4, 5))
        self.conv8 = nn.Conv2d(6, 6, 3, stride=1, padding=1, dilation=1, groups=1, bias=True)
    def forward(self, x0):
        v1 = self.conv0(x0)
        v2 = torch.relu(v1)
        for _ in range(2):
            v1.add_(self.b5)
            v1 = v2
        return self.conv8(v1)
"""


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
    model = _model(SEED_4_PROGRAM_1565, freeze)
    x = torch.randn(4, 3, 4, 5, dtype=torch.float64)
    with torch.no_grad():
        eager = model(x.clone())
    with torch.jit.optimized_execution(False):
        scripted = torch.jit.script(model)
        optimized = torchfuse.optimize(scripted, freeze=freeze)
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
    model = _model(SEED_4_PROGRAM_1565, freeze)
    x = torch.randn(4, 3, 4, 5, dtype=torch.float64)
    with torch.no_grad():
        eager = model(x.clone())
    with torch.jit.optimized_execution(False):
        scripted = torch.jit.script(model)
        optimized = torchfuse.optimize(scripted, freeze=freeze)
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
