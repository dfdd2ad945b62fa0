"""Autocast: under torch.autocast, an optimized module gives the dtype, the
values and the gradients of the scripted module it replaces.

The scripted original is cast twice: eager (dispatcher) autocast casts the
inputs of linear and conv to the lower-precision dtype, and TorchScript's
autocast pass (on by default, torch._C._jit_set_autocast_mode) casts the
inputs of add, div and mul back to float32.  So relu(fc1(x) + fc2(x)) is
float32 there.  With the pass off, or optimized execution off, only eager
autocast applies.  Each case compares the optimized module with the original
run the same way: same dtype, values equal (CPU: the same ATen ops run, bit for
bit), same gradients of inputs and parameters, same BN running statistics.
"""

import contextlib
import copy
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import FileCheck

import torchfuse
from cuda_utils import CUDA_ONLY

LOWP = [torch.bfloat16, torch.float16]
_fresh = itertools.count()


pytestmark = pytest.mark.usefixtures("no_texpr_fuser")


# ---- models: each chain, with `other` (and the input) arriving in the lower
# precision, where the unfused add promotes differently from the fused op ----


class LinearAddRelu(nn.Module):
    """The issue's model: relu(fc1(x) + fc2(x))."""

    op = "custom_linear_add_relu"
    # NB: frozen on CUDA, torch's FrozenConcatLinear joins fc1 and fc2 (one
    # input) into one linear, as torch.jit.freeze does: no chain is left.
    concatenated_when_frozen_on = "cuda"

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 6)
        self.fc2 = nn.Linear(8, 6)

    def forward(self, x):
        return torch.relu(self.fc1(x) + self.fc2(x))

    @staticmethod
    def inputs(device):
        return [torch.randn(5, 8, device=device)]


class LinearAfterLinear(nn.Module):
    """The fused linear's input is itself a lower-precision linear output."""

    op = "custom_linear_add_relu"

    def __init__(self):
        super().__init__()
        self.fc0 = nn.Linear(8, 8)
        self.fc1 = nn.Linear(8, 6, bias=False)
        self.fc2 = nn.Linear(8, 6)

    def forward(self, x):
        return torch.relu(self.fc1(self.fc0(x)) + self.fc2(x))

    @staticmethod
    def inputs(device):
        return [torch.randn(2, 5, 8, device=device)]


class LinearPlusInput(nn.Module):
    """`other` is a float32 input; the linear's input arrives in float16 or
    bfloat16 (a graph input of the autocast dtype's other 16-bit type)."""

    op = "custom_linear_add_relu"

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x, r):
        return torch.relu(self.fc(x) + r)

    @staticmethod
    def inputs(device):
        return [torch.randn(5, 8, device=device, dtype=torch.float16), torch.randn(5, 6, device=device)]


class ConvReluAdd(nn.Module):
    """relu(conv1(x)) + conv2(x), conv1d/2d/3d."""

    op = "custom_conv_relu_add"

    def __init__(self, dim):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.conv1 = conv(3, 4, 3, padding=1)
        self.conv2 = conv(3, 4, 1)
        self.dim = dim

    def forward(self, x):
        return torch.relu(self.conv1(x)) + self.conv2(x)

    def inputs(self, device):
        return [torch.randn((2, 3) + (5,) * self.dim, device=device)]


class BnSwish(nn.Module):
    """(bn(relu(fc(x))) + fc2(x)) / 2.5, then the swish in one of its
    spellings: the batch norm's input arrives in the lower precision."""

    op = "custom_batch_norm_add_div_swish"
    __constants__ = ["silu", "sigmoid_first"]

    def __init__(self, silu=False, sigmoid_first=False):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.fc2 = nn.Linear(4, 5)
        self.bn = nn.BatchNorm1d(5)
        self.scale = 2.5
        self.silu, self.sigmoid_first = silu, sigmoid_first

    def forward(self, x):
        # NB: fc2 first: the pass fuses no chain with a read of an attribute
        # between the batch norm and the swish.  The relu keeps freezing
        # (where it knows ranks) from folding the batch norm into fc.
        r = self.fc2(x)
        t = (self.bn(torch.relu(self.fc(x))) + r) / self.scale
        if self.silu:
            return F.silu(t)
        if self.sigmoid_first:
            return torch.sigmoid(t) * t
        return t * torch.sigmoid(t)

    @staticmethod
    def inputs(device):
        return [torch.randn(8, 4, device=device)]


class BnOnInput(nn.Module):
    """A float32 batch norm (its input is the module's) plus a lower-precision
    `other`."""

    op = "custom_batch_norm_add_div_swish"

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x):
        c = self.conv(x)
        t = (self.bn(x) + c) / 0.5
        return t * torch.sigmoid(t)

    @staticmethod
    def inputs(device):
        return [torch.randn(2, 3, 4, 4, device=device)]


class Relu(nn.Module):
    op = "custom_relu"

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        return torch.relu(self.fc(x) * 2)

    @staticmethod
    def inputs(device):
        return [torch.randn(5, 8, device=device)]


MODELS = {
    "linear": LinearAddRelu,
    "linear_after_linear": LinearAfterLinear,
    "linear_plus_input": LinearPlusInput,
    "conv1d": lambda: ConvReluAdd(1),
    "conv2d": lambda: ConvReluAdd(2),
    "conv3d": lambda: ConvReluAdd(3),
    "bn_mul": BnSwish,
    "bn_silu": lambda: BnSwish(silu=True),
    "bn_sigmoid_first": lambda: BnSwish(sigmoid_first=True),
    "bn_on_input": BnOnInput,
    "relu": Relu,
}


# ---- helpers ------------------------------------------------------------------


def _fresh_copy(model):
    """A deep copy whose classes, submodules' included, are new to TorchScript.

    NB: TorchScript compiles a method once per class and keeps, per autocast
    on/off state, the graph it optimized at the first call, with the autocast
    casts of that call's JIT autocast mode and dtype; inlining copies a
    submodule's kept graph.  A class already run another way would keep that
    way's casts."""
    m = copy.deepcopy(model)
    for sub in m.modules():
        cls = type(sub)
        sub.__class__ = type(f"{cls.__name__}Fresh{next(_fresh)}", (cls,), {})
    return m


def _pair(name, device, freeze):
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    ref = torch.jit.script(_fresh_copy(model))
    src = torch.jit.script(_fresh_copy(model))
    if freeze:
        ref.eval()
        src.eval()
    opt = torchfuse.optimize(src, freeze=freeze, passes=torchfuse.pass_names())
    if freeze and getattr(model, "concatenated_when_frozen_on", None) == device:
        FileCheck().check_count("aten::linear", 1, exactly=True).check_not(f"torchfuse::{model.op}").run(opt.graph)
    else:
        FileCheck().check(f"torchfuse::{model.op}").run(opt.graph)
    return model, ref, opt


def _rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def _no_worse(actual, original, ref, dtype):
    """actual has original's dtype and is no further from the float64
    reference than twice original's error, plus a floor of 2 eps."""
    assert actual.dtype == original.dtype, (actual.dtype, original.dtype)
    floor = 2 * torch.finfo(dtype).eps
    assert _rel_err(actual, ref) <= 2 * _rel_err(original, ref) + floor, (
        _rel_err(actual, ref),
        _rel_err(original, ref),
    )


def _check(name, device, dtype, freeze, mode=contextlib.nullcontext, runs=3, backward_in_autocast=True):
    """The optimized module against the original, both run `runs` times under
    autocast (`mode` entered around each call): outputs, gradients of inputs
    and parameters, running statistics.

    On the CPU the forward runs the original's ATen ops (or the op's CPU
    kernel, which is that composition) and must match bit for bit.  The
    gradients (the original's come from TorchScript's autodiff), and on CUDA
    the outputs, may round differently: they are compared with a float64
    reference, the model run in float64 without autocast."""
    model, ref, opt = _pair(name, device, freeze)
    model64 = copy.deepcopy(model).double()
    if freeze:
        model64.eval()
    for _ in range(runs):
        inputs = model.inputs(device)
        ins = [[t.detach().clone().requires_grad_(not freeze) for t in inputs] for _ in range(2)]
        ins64 = [t.detach().double().requires_grad_(not freeze) for t in inputs]
        out64 = model64(*ins64)
        with mode(), torch.autocast(device, dtype):
            out_a = ref(*ins[0])
            out_b = opt(*ins[1])
            if device == "cpu":
                assert out_b.dtype == out_a.dtype, (out_b.dtype, out_a.dtype)
                torch.testing.assert_close(out_b, out_a, rtol=0, atol=0, equal_nan=True)
            else:
                _no_worse(out_b, out_a, out64, dtype)
            if freeze:
                continue
            g = torch.randn_like(out64)
            loss_a = (out_a * g.to(out_a.dtype)).sum()
            loss_b = (out_b * g.to(out_b.dtype)).sum()
            if backward_in_autocast:
                loss_a.backward()
                loss_b.backward()
        if not backward_in_autocast:
            loss_a.backward()
            loss_b.backward()
        (out64 * g).sum().backward()
        for a, b, r in zip(ins[0], ins[1], ins64):
            _no_worse(b.grad, a.grad, r.grad, dtype)
    if freeze:
        return
    pa, pb, p64 = dict(ref.named_parameters()), dict(opt.named_parameters()), dict(model64.named_parameters())
    assert pa.keys() == pb.keys() == p64.keys()
    for key, p in pa.items():
        assert p.grad is not None and pb[key].grad is not None, key
        _no_worse(pb[key].grad, p.grad, p64[key].grad, dtype)
    # NB: on the CPU the statistics come from the original's ATen ops; the
    # CUDA kernels reduce in another order, so there they are judged against
    # the float64 model's.
    buffers64 = dict(model64.named_buffers())
    for (key, a), (_, b) in zip(ref.named_buffers(), opt.named_buffers()):
        if device == "cpu" or not a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=key)
        else:
            _no_worse(b, a, buffers64[key], dtype)


@contextlib.contextmanager
def _jit_autocast_off():
    old = torch._C._jit_set_autocast_mode(False)
    try:
        yield
    finally:
        torch._C._jit_set_autocast_mode(old)


# ---- CPU ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_training_matches_the_original_under_cpu_autocast(name, dtype):
    _check(name, "cpu", dtype, freeze=False)


@pytest.mark.parametrize("name", ["linear", "linear_after_linear", "conv2d", "bn_mul", "bn_silu"])
def test_backward_outside_autocast_matches_the_original(name):
    _check(name, "cpu", torch.bfloat16, freeze=False, backward_in_autocast=False)


@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_frozen_inference_matches_the_original_under_cpu_autocast(name, dtype):
    with torch.no_grad():
        _check(name, "cpu", dtype, freeze=True)


def test_the_issue_model_returns_float32_under_cpu_bfloat16_autocast():
    _, ref, opt = _pair("linear", "cpu", freeze=False)
    x = torch.randn(5, 8)
    with torch.autocast("cpu", torch.bfloat16):
        assert ref(x).dtype == torch.float32
        assert opt(x).dtype == torch.float32


@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_jit_autocast_mode_off_matches_eager_autocast(name, dtype):
    # NB: the JIT pass is off both when the original first runs (its graph
    # gets no casts) and when the op runs.
    with _jit_autocast_off():
        _check(name, "cpu", dtype, freeze=False)


@pytest.mark.parametrize("name", ["linear", "linear_after_linear", "conv2d", "bn_mul"])
def test_optimized_execution_off_matches_eager_autocast(name):
    _check(name, "cpu", torch.bfloat16, freeze=False, mode=lambda: torch.jit.optimized_execution(False))


@contextlib.contextmanager
def _legacy_executor():
    old = torch._C._jit_set_profiling_executor(False)
    try:
        yield
    finally:
        torch._C._jit_set_profiling_executor(old)


@pytest.mark.parametrize("name", ["linear", "conv2d", "bn_mul"])
def test_legacy_executor_matches_the_original(name):
    # NB: the autocast pass runs where GraphFunction prepares the graph, for
    # every executor.
    with _legacy_executor():
        _check(name, "cpu", torch.bfloat16, freeze=False)


def test_the_jit_autocast_mode_decides_the_dtype():
    """Guards the premise of the tests above: the original is float32 with the
    pass on and bfloat16 with it off, and the optimized module follows."""
    for jit_on, expected in [(True, torch.float32), (False, torch.bfloat16)]:
        with contextlib.nullcontext() if jit_on else _jit_autocast_off():
            _, ref, opt = _pair("linear", "cpu", freeze=False)
            x = torch.randn(5, 8)
            with torch.autocast("cpu", torch.bfloat16):
                assert ref(x).dtype == expected
                assert opt(x).dtype == expected


def test_float64_model_is_left_alone_by_autocast():
    torch.manual_seed(0)
    model = LinearAddRelu().double()
    ref = torch.jit.script(_fresh_copy(model))
    opt = torchfuse.optimize(torch.jit.script(_fresh_copy(model)))
    x = torch.randn(5, 8, dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        out_a, out_b = ref(x), opt(x)
    assert out_b.dtype == torch.float64
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)


# ---- autocast scopes inside the scripted code ------------------------------------
# NB: there only TorchScript's autocast pass casts (entering the scope in
# scripted code leaves the thread's autocast state alone), and nothing tells
# the fused ops: the passes leave such graphs' blocks unfused.


class ScopeAroundChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 6)
        self.fc2 = nn.Linear(8, 6)

    def forward(self, x):
        with torch.autocast("cpu", torch.bfloat16):
            y = torch.relu(self.fc1(x) + self.fc2(x))
        return y


class ScopeAroundTheLinear(ScopeAroundChain):
    def forward(self, x):
        with torch.autocast("cpu", torch.bfloat16):
            y = self.fc1(x)
        return torch.relu(y + self.fc2(x))


class ScopeInABranch(ScopeAroundChain):
    def forward(self, x, flag: bool):
        if flag:
            with torch.autocast("cpu", torch.bfloat16):
                x = torch.tanh(x @ x.t() @ x).float()
        return torch.relu(self.fc1(x) + self.fc2(x))


@pytest.mark.parametrize("cls", [ScopeAroundChain, ScopeAroundTheLinear])
def test_chains_under_a_scripted_autocast_scope_stay_unfused(cls):
    torch.manual_seed(0)
    model = cls()
    ref = torch.jit.script(_fresh_copy(model))
    opt = torchfuse.optimize(torch.jit.script(_fresh_copy(model)))
    FileCheck().check_not("torchfuse::custom_linear_add_relu").run(opt.graph)
    for _ in range(3):
        x = torch.randn(5, 8)
        out_a, out_b = ref(x), opt(x)
        assert out_b.dtype == out_a.dtype
        torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)


def test_a_scripted_autocast_scope_in_a_branch_leaves_the_rest_fused():
    torch.manual_seed(0)
    model = ScopeInABranch()
    ref = torch.jit.script(_fresh_copy(model))
    opt = torchfuse.optimize(torch.jit.script(_fresh_copy(model)))
    FileCheck().check("torchfuse::custom_linear_add_relu").run(opt.graph)
    for flag in [True, False, True]:
        x = torch.randn(5, 8)
        torch.testing.assert_close(opt(x, flag), ref(x, flag), rtol=0, atol=0)


# ---- CUDA -----------------------------------------------------------------------


def cuda_only(f):
    for mark in reversed(CUDA_ONLY):
        f = mark(f)
    return f



@pytest.mark.parametrize("freeze", [False, True], ids=["train", "frozen"])
@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
@cuda_only
def test_matches_the_original_under_cuda_autocast(name, dtype, freeze):
    with torch.no_grad() if freeze else contextlib.nullcontext():
        _check(name, "cuda", dtype, freeze=freeze)


@pytest.mark.parametrize("dtype", LOWP, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
@cuda_only
def test_jit_autocast_mode_off_matches_eager_cuda_autocast(name, dtype):
    with _jit_autocast_off():
        _check(name, "cuda", dtype, freeze=False)
