"""custom_gate_mul and FuseGateMul: the gate of a squeeze-and-excitation
block, act(gate) * input with act sigmoid or hardsigmoid.  On the CPU, and
for every input the CUDA kernel does not take, the op is the original ops:
values, strides, errors and derivatives.  The CUDA tests compare the kernel
against a float64 reference under the accuracy rule (cuda_utils), with the
strides ATen gives."""

import os
import re
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cuda_utils as cu
import torchfuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz  # noqa: E402

OP = torch.ops.torchfuse.custom_gate_mul
ACTS = {"sigmoid": torch.sigmoid, "hardsigmoid": F.hardsigmoid}


def original(x, gate, activation, gate_first):
    g = ACTS[activation](gate)
    return g * x if gate_first else x * g


def samples(device="cpu", dtype=torch.float32):
    """(input, gate) pairs: the SE shapes in both layouts, a gate shared by
    the batch, a same-shape gate, a gate broadcast over rows, sliced and
    unbatched inputs, a permuted gate."""
    g = torch.Generator().manual_seed(3)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    cl = torch.channels_last
    return [
        (r(2, 5, 7, 3), r(2, 5, 1, 1)),
        (r(2, 5, 7, 3).contiguous(memory_format=cl), r(2, 5, 1, 1).contiguous(memory_format=cl)),
        (r(2, 5, 7, 3).contiguous(memory_format=cl), r(2, 5, 1, 1)),
        (r(3, 6, 4, 4), r(1, 6, 1, 1)),
        (r(2, 4, 3, 3), r(2, 4, 3, 3)),
        (r(2, 4, 3, 5), r(2, 4, 3, 1)),
        (r(2, 6, 8, 9)[:, :, 1:7, ::2], r(2, 6, 1, 1)),
        (r(4, 6, 5), r(4, 1, 1)),
        (r(2, 5, 1, 1), r(2, 5, 1, 1).contiguous(memory_format=cl)),
        (r(3, 5, 4, 4), r(5, 3, 1, 1).permute(1, 0, 2, 3)),
    ]


def kernel_takes(x, gate):
    """The CUDA kernel's domain (gateMulHandles)."""
    if x.dim() != 4 or gate.dim() != 4 or x.dtype != gate.dtype:
        return False
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return False
    n, c, h, w = x.shape
    if min(c, h, w) < 2 or gate.shape[0] not in (1, n) or tuple(gate.shape[1:]) != (c, 1, 1):
        return False
    if gate.shape[0] > 1 and gate.stride(1) > gate.stride(0):
        return False
    return x.stride() in ((c * h * w, h * w, w, 1), (h * w * c, 1, w * c, c))


@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_cpu_is_the_original(activation, gate_first, dtype):
    for x, gate in samples(dtype=dtype):
        want = original(x, gate, activation, gate_first)
        got = OP(x, gate, activation, gate_first)
        assert torch.equal(got, want)
        assert got.stride() == want.stride() and got.dtype == want.dtype


def test_mixed_dtypes_promote_as_the_original():
    x = torch.randn(2, 3, 4, 4, dtype=torch.bfloat16)
    gate = torch.randn(2, 3, 1, 1)
    got = OP(x, gate, "sigmoid", True)
    assert got.dtype == torch.float32 and torch.equal(got, torch.sigmoid(gate) * x)


def test_opcheck_meta_and_derivatives():
    for x, gate in samples():
        for activation in ACTS:
            torch.library.opcheck(OP, (x, gate, activation, True))
            meta = OP(x.to("meta"), gate.to("meta"), activation, False)
            want = original(x, gate, activation, False)
            assert meta.shape == want.shape and meta.stride() == want.stride()
    for x, gate in samples(dtype=torch.float64):
        x = x.detach().requires_grad_()
        gate = gate.detach().requires_grad_()
        # NB: sigmoid: hardsigmoid's kinks at +-3 are not smooth.
        assert torch.autograd.gradcheck(lambda a, b: OP(a, b, "sigmoid", False), (x, gate))
        assert torch.autograd.gradgradcheck(lambda a, b: OP(a, b, "sigmoid", True) ** 2, (x, gate))


def test_gradient_is_the_originals():
    for x, gate in samples():
        for activation in ACTS:
            a, ga = x.detach().requires_grad_(), gate.detach().requires_grad_()
            b, gb = x.detach().requires_grad_(), gate.detach().requires_grad_()
            gy = torch.randn(original(x, gate, activation, True).shape)
            OP(a, ga, activation, True).backward(gy)
            original(b, gb, activation, True).backward(gy)
            assert torch.equal(a.grad, b.grad) and torch.equal(ga.grad, gb.grad)


def test_errors_name_the_argument():
    x, gate = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 1, 1)
    with pytest.raises(ValueError, match=r"custom_gate_mul: activation must be 'sigmoid' or 'hardsigmoid', got 'tanh'"):
        OP(x, gate, "tanh", False)
    with pytest.raises(RuntimeError, match="custom_gate_mul.*input"):
        OP(None, gate, "sigmoid", False)
    with pytest.raises(RuntimeError) as ours:
        OP(x, torch.randn(2, 4, 1, 1), "sigmoid", False)
    with pytest.raises(RuntimeError) as atens:
        x * torch.sigmoid(torch.randn(2, 4, 1, 1))
    assert str(ours.value) == str(atens.value)


# ---- the pass -------------------------------------------------------------------


class SE(nn.Module):
    """torchvision's SqueezeExcitation gating its input."""

    gate_first: torch.jit.Final[bool]
    squeeze: torch.jit.Final[str]

    def __init__(self, c, hard=False, gate_first=True, squeeze="pool"):
        super().__init__()
        self.fc1 = nn.Conv2d(c, 4, 1)
        self.fc2 = nn.Conv2d(4, c, 1)
        self.act = nn.SiLU()
        self.gate = nn.Hardsigmoid() if hard else nn.Sigmoid()
        self.gate_first = gate_first
        self.squeeze = squeeze

    def forward(self, x):
        if self.squeeze == "pool":
            s = F.adaptive_avg_pool2d(x, 1)
        else:  # timm's
            s = x.mean((2, 3), keepdim=True)
        s = self.gate(self.fc2(self.act(self.fc1(s))))
        return s * x if self.gate_first else x * s


class Block(nn.Module):
    def __init__(self, se):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.se = se

    def forward(self, x):
        return self.se(torch.relu(self.conv(x)))


def fused_count(module, **kw):
    m = torchfuse.optimize(torch.jit.script(module.eval()), **kw)
    return torchfuse.report(m)["gate_mul"], m


@pytest.mark.parametrize("hard", [False, True])
@pytest.mark.parametrize("gate_first", [False, True])
@pytest.mark.parametrize("squeeze", ["pool", "mean"])
@pytest.mark.parametrize("freeze", [False, True])
def test_se_gates_are_fused(hard, gate_first, squeeze, freeze):
    torch.manual_seed(0)
    model = Block(SE(8, hard, gate_first, squeeze)).eval()
    x = torch.randn(2, 8, 6, 5)
    n, m = fused_count(model, freeze=freeze)
    assert n == 1
    with torch.no_grad():
        want = model(x)
        for _ in range(3):  # the profiling executor's runs
            got = m(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert got.stride() == want.stride()


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class OtherTensor(nn.Module):
    """A gate squeezed from another tensor than the one it multiplies."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Conv2d(8, 8, 1)

    def forward(self, x, y):
        return y * torch.sigmoid(self.fc(F.adaptive_avg_pool2d(x, 1)))


class NotASqueeze(nn.Module):
    """A pool to 2x2: the gate broadcasts over nothing of a 2x2 input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc(F.adaptive_avg_pool2d(x, 2)))


class GateReadTwice(SE):
    def forward(self, x):
        s = self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return s * x, s


class InPlaceGate(SE):
    def forward(self, x):
        s = self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1))))
        return s.sigmoid_() * x


class TanhGate(SE):
    def forward(self, x):
        return torch.tanh(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1))))) * x


@pytest.mark.parametrize(
    "module, inputs, rule",
    [
        (Swish(), (torch.randn(2, 8, 4, 4),), "gateSqueezesInput: swish's t * sigmoid(t)"),
        (OtherTensor(), (torch.randn(2, 8, 4, 4), torch.randn(2, 8, 4, 4)), "gateSqueezesInput: another tensor"),
        (NotASqueeze(), (torch.randn(2, 8, 2, 2),), "gateSqueezesInput: output size 2"),
        (GateReadTwice(8), (torch.randn(2, 8, 4, 4),), "single use of the activated gate"),
        (InPlaceGate(8), (torch.randn(2, 8, 4, 4),), "isGateActivation: sigmoid_"),
        (TanhGate(8), (torch.randn(2, 8, 4, 4),), "isGateActivation: tanh"),
    ],
)
def test_chains_that_are_not_se_gates_are_left(module, inputs, rule):
    torch.manual_seed(0)
    n, m = fused_count(module, freeze=False)
    assert n == 0, rule
    with torch.no_grad():
        want = module.eval()(*inputs)
        got = m(*inputs)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name, gates", [("mobilenet_v3_small", 9), ("efficientnet_b0", 16)])
@pytest.mark.parametrize("kw", [dict(freeze=True), dict(freeze=True, layout="channels_last"), dict(freeze=False)])
def test_torchvision_models(name, gates, kw):
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().eval()
    x = torch.randn(2, 3, 64, 64)
    n, m = fused_count(model, **kw)
    assert n == gates
    with torch.no_grad():
        want = model(x)
        got = m(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_training_records_the_original_ops():
    torch.manual_seed(0)
    model = Block(SE(8)).train()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=False)
    assert torchfuse.report(opt)["gate_mul"] == 1
    x = torch.randn(2, 8, 5, 5)
    grads = []
    for m in (model, opt):
        for p in model.parameters():
            p.grad = None
        xx = x.clone().requires_grad_()
        m(xx).square().sum().backward()
        grads.append([xx.grad] + [p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fuzz_vocabulary_draws_se_gates():
    text = "\n".join(fuzz.generate(5, i * 100).source() for i in range(300))
    for pattern in (r"F\.adaptive_avg_pool2d\(\w+, 1\)", r"\.mean\(\(2, 3\), keepdim=True\)",
                    r"torch\.sigmoid\(", r"F\.hardsigmoid\("):
        assert re.search(pattern, text), pattern
    counts = []
    for i in range(60):
        prog = fuzz.generate(20261128, i * 100)
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64",), modes=("frozen",), round_trip=False)
        except fuzz.Invalid:
            continue
        assert out.failures == [], out.failures
        counts.append(out.fused["gate_mul"])
    assert sum(n > 0 for n in counts) >= 3, counts


# ---- CUDA ---------------------------------------------------------------------

# (N, C, H, W): efficientnet's first gate, a late one, channels and
# positions that are not multiples of a vector, one image.
CUDA_SHAPES = [(16, 96, 56, 56), (8, 672, 7, 7), (3, 45, 17, 23), (1, 6, 5, 3)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("shape", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
@pytest.mark.parametrize("activation", list(ACTS))
def test_cuda_kernel_against_float64(shape, dtype, layout, activation):
    g = torch.Generator(device="cuda").manual_seed(11)
    x = cu.signed_randn(*shape, dtype=dtype, generator=g, scale=2.0)
    gate = cu.signed_randn(shape[0], shape[1], 1, 1, dtype=dtype, generator=g, scale=4.0)
    if layout == "nhwc":
        x = x.contiguous(memory_format=torch.channels_last)
        gate = gate.contiguous(memory_format=torch.channels_last)
    for gate_first in (False, True):
        eager = original(x, gate, activation, gate_first)
        cu.poison_allocator(cu.nbytes_of(eager))
        got = OP(x, gate, activation, gate_first)
        assert got.dtype == dtype and got.shape == eager.shape and got.stride() == eager.stride()
        ref = original(x.double(), gate.double(), activation, gate_first)
        cu.assert_close_to_reference(got, eager, ref, what=f"gate mul {shape} {dtype} {layout} {activation}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_gate_shared_by_the_batch_and_unaligned_input():
    g = torch.Generator(device="cuda").manual_seed(13)
    x = cu.signed_randn(4, 40, 9, 9, dtype=torch.float16, generator=g)
    gate = cu.signed_randn(1, 40, 1, 1, dtype=torch.float16, generator=g)
    unaligned = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view(x.shape).copy_(x)
    for inp in (x, unaligned):
        eager = original(inp, gate, "hardsigmoid", True)
        got = OP(inp, gate, "hardsigmoid", True)
        assert got.stride() == eager.stride()
        ref = original(inp.double(), gate.double(), "hardsigmoid", True)
        cu.assert_close_to_reference(got, eager, ref, what="gate mul, broadcast gate")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_nan_and_inf_as_eager():
    g = torch.Generator(device="cuda").manual_seed(12)
    x = cu.signed_randn(4, 40, 9, 9, dtype=torch.float32, generator=g)
    x = cu.inject_nonfinite(x, torch.Generator().manual_seed(5), count=6)
    gate = cu.signed_randn(4, 40, 1, 1, dtype=torch.float32, generator=g)
    gate = cu.inject_nonfinite(gate, torch.Generator().manual_seed(6), count=4)
    for activation in ACTS:
        eager = original(x, gate, activation, False)
        got = OP(x, gate, activation, False)
        assert torch.equal(cu.nonfinite_pattern(got), cu.nonfinite_pattern(eager))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cuda_other_inputs_are_the_original(dtype):
    # NB: the inputs the kernel takes may differ from ATen's by a rounding:
    # test_cuda_kernel_against_float64 covers them.
    taken = 0
    for x, gate in samples(device="cuda", dtype=dtype):
        if kernel_takes(x, gate):
            taken += 1
            continue
        for activation in ACTS:
            want = original(x, gate, activation, True)
            got = OP(x, gate, activation, True)
            assert got.stride() == want.stride() and got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert taken == (0 if dtype == torch.float64 else 4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_peak_memory_is_the_output():
    x = torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    gate = torch.randn(8, 64, 1, 1, device="cuda", dtype=torch.float16)
    OP(x, gate, "sigmoid", True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = OP(x, gate, "sigmoid", True)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base == out.untyped_storage().nbytes()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_efficientnet_frozen(dtype):
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0().eval().cuda().to(dtype)
    x = torch.randn(4, 3, 96, 96, device="cuda", dtype=dtype)
    n, m = fused_count(model, freeze=True)
    assert n == 16
    with torch.no_grad():
        eager = model(x)
        for _ in range(3):
            got = m(x)
        ref = model.double()(x.double())
    cu.assert_close_to_reference(got, eager, ref, what=f"efficientnet_b0 frozen {dtype}")


# ---- FX: torch.fx.symbolic_trace and torch.export --------------------------------


class FxSE(nn.Module):
    """torchvision's SqueezeExcitation as modules (symbolic_trace keeps them
    as call_module nodes)."""

    def __init__(self, c=8):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(c, 4, 1)
        self.act = nn.ReLU()
        self.fc2 = nn.Conv2d(4, c, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x):
        return self.gate(self.fc2(self.act(self.fc1(self.pool(x))))) * x


class FxSwish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def test_fx_symbolic_trace_and_export_fuse_the_gate():
    import torchfuse.fx as tfx

    torch.manual_seed(0)
    x = torch.randn(2, 8, 5, 5)
    for model in (FxSE().eval(), Block(SE(8, squeeze="mean")).eval()):
        want = model(x)
        gm = tfx.optimize(torch.fx.symbolic_trace(model))
        assert tfx.report(gm)["gate_mul"] == 1
        torch.testing.assert_close(gm(x), want, rtol=0, atol=0)
        ep = tfx.optimize_exported(torch.export.export(model, (x,)))
        assert tfx.report(ep)["gate_mul"] == 1
        torch.testing.assert_close(ep.module()(x), want, rtol=0, atol=0)
    gm = tfx.optimize(torch.fx.symbolic_trace(FxSwish()))
    assert tfx.report(gm)["gate_mul"] == 0  # gateSqueezesInput
