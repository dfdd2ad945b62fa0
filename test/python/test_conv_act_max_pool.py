"""custom_conv_act_max_pool and the conv_act_max_pool fusion:
max_pool2d(act(conv)).

CPU: the op against the float64 eager chain for every activation (in- and
out-of-place spellings), bias or not, grouped, pools with padding, dilation,
ceil_mode and the default stride; gradcheck and gradgradcheck; opcheck;
NaN/Inf as eager; scripted, frozen and optimized modules, and torchvision's
vgg11 and resnet18 (the stem's conv -> bn -> relu -> max_pool).  CUDA (marked
`cuda`): float32/16/bfloat16, NCHW and channels-last, error against float64
at most 2x eager's, output strides as eager's, NaN/Inf, empty and ambiguous
layouts."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.testing import FileCheck

import torchfuse

from cuda_utils import CUDA_ONLY, assert_close_to_reference, poison_allocator

op = torch.ops.torchfuse.custom_conv_act_max_pool

ACTS = {
    "none": ([], lambda t: t),
    "relu": ([], F.relu),
    "relu_": ([], F.relu),
    "hardtanh": ([-0.5, 1.5], lambda t: F.hardtanh(t, -0.5, 1.5)),
    "silu": ([], F.silu),
    "hardswish": ([], F.hardswish),
    "hardsigmoid": ([], F.hardsigmoid),
    "sigmoid": ([], torch.sigmoid),
    "gelu": ([], F.gelu),
    "gelu_tanh": ([], lambda t: F.gelu(t, approximate="tanh")),
    "leaky_relu": ([0.2], lambda t: F.leaky_relu(t, 0.2)),
}
# (kernel_size, stride, padding, dilation, ceil_mode)
POOLS = {
    "2x2": ([2, 2], [], [0, 0], [1, 1], False),
    "3x3s2p1": ([3, 3], [2, 2], [1, 1], [1, 1], False),
    "mixed_ceil": ([3, 2], [2, 1], [1, 0], [2, 1], True),
}


def signed(*sizes, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*sizes, dtype=dtype, device=device)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)
    return t.requires_grad_(requires_grad)


def eager(x, w, b, groups, act, pool):
    k, s, p, d, ceil = POOLS[pool]
    return F.max_pool2d(ACTS[act][1](F.conv2d(x, w, b, 1, 1, 1, groups)), k, s, p, d, ceil)


def call(x, w, b, groups, act, pool):
    return op(x, w, b, [1], [1], [1], groups, act, ACTS[act][0], *POOLS[pool])


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("groups,bias", [(1, True), (2, False), (6, True)])
def test_cpu_matches_the_float64_chain(act, pool, groups, bias):
    torch.manual_seed(0)
    x = signed(2, 6, 9, 8) * 2
    w, b = signed(6, 6 // groups, 3, 3), signed(6) if bias else None
    got = call(x, w, b, groups, act, pool)
    want = eager(x.double(), w.double(), None if b is None else b.double(), groups, act, pool)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["relu", "silu", "gelu", "leaky_relu"])
def test_gradcheck_and_gradgradcheck(act):
    torch.manual_seed(1)
    g = dict(dtype=torch.float64, requires_grad=True)
    x, w, b = signed(2, 4, 7, 7, **g), signed(6, 2, 3, 3, **g), signed(6, **g)
    fn = lambda x, w, b: call(x, w, b, 2, act, "3x3s2p1")  # noqa: E731
    gradcheck(fn, (x, w, b))
    gradgradcheck(fn, (x, w, b))


@pytest.mark.parametrize("pool", list(POOLS))
def test_opcheck(pool):
    torch.manual_seed(3)
    g = dict(requires_grad=True)
    torch.library.opcheck(op, (signed(2, 4, 7, 7, **g), signed(6, 4, 3, 3, **g), signed(6, **g), [1], [1], [1],
                               1, "hardtanh", [0.0, 6.0], *POOLS[pool]))


def test_rejects_bad_arguments_by_name():
    x, w = signed(1, 2, 4, 4), signed(3, 2, 1, 1)
    with pytest.raises(RuntimeError, match="custom_conv_act_max_pool: expected activation to be one of .* "
                                           "got 'tanh'"):
        op(x, w, None, [1], [0], [1], 1, "tanh", [], [2], [2], [0], [1], False)
    with pytest.raises(RuntimeError, match="pad should be at most half of effective kernel size"):
        op(x, w, None, [1], [0], [1], 1, "relu", [], [2], [2], [2], [1], False)


@pytest.mark.parametrize("act", list(ACTS))
def test_nan_and_inf_as_eager(act):
    torch.manual_seed(4)
    x, w, b = signed(1, 2, 6, 6), signed(3, 2, 3, 3), signed(3)
    x[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    got = call(x, w, b, 1, act, "2x2")
    want = eager(x, w, b, 1, act, "2x2")
    assert want.isnan().any()
    torch.testing.assert_close(got, want, equal_nan=True)


# ---- the fusion ---------------------------------------------------------------


class Block(nn.Module):
    """conv -> bn -> [act] -> max_pool in the spellings torchvision uses."""

    def __init__(self, act, pool):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.act = act
        self.pool = pool

    def forward(self, x):
        return self.pool(self.act(self.bn(self.conv(x))))


MODULE_ACTS = {"relu_": nn.ReLU(inplace=True), "relu6": nn.ReLU6(), "silu": nn.SiLU(), "none": nn.Identity()}
MODULE_POOLS = {"2x2": nn.MaxPool2d(2), "3x3s2p1": nn.MaxPool2d(3, 2, 1), "ceil": nn.MaxPool2d(3, 2, ceil_mode=True)}


@pytest.mark.parametrize("act", list(MODULE_ACTS))
@pytest.mark.parametrize("pool", list(MODULE_POOLS))
def test_scripted_frozen_optimized_modules(act, pool):
    torch.manual_seed(5)
    model = Block(MODULE_ACTS[act], MODULE_POOLS[pool]).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    FileCheck().check("torchfuse::custom_conv_act_max_pool").check_not("aten::max_pool2d").run(opt.graph)
    assert torchfuse.report(opt)["conv_act_max_pool"] == 1
    x = signed(2, 4, 11, 11)
    with torch.no_grad():
        ref = Block(MODULE_ACTS[act], MODULE_POOLS[pool]).double().eval()
        ref.load_state_dict(model.state_dict())
        torch.testing.assert_close(opt(x).double(), ref(x.double()), rtol=1e-4, atol=1e-5)


def test_pool_with_indices_and_a_pool_read_twice_stay_unfused():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            a = F.relu(self.conv(x))
            p, i = F.max_pool2d(a, 2, return_indices=True)
            r = F.relu(self.conv(x))
            return p, i, F.max_pool2d(r, 2) + r.sum()

    model = Twice().eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    assert torchfuse.report(opt)["conv_act_max_pool"] == 0
    FileCheck().check("max_pool2d_with_indices").check("aten::max_pool2d").run(opt.graph)
    x = signed(1, 3, 8, 8)
    with torch.no_grad():
        for got, want in zip(opt(x), model(x)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name,fused", [("vgg11", 5), ("resnet18", 1)])
def test_torchvision_models(name, fused):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(6)
    model = getattr(torchvision.models, name)().eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    assert torchfuse.report(opt)["conv_act_max_pool"] == fused
    assert str(opt.graph).count("torchfuse::custom_conv_act_max_pool") == fused
    x = signed(2, 3, 64, 64)
    with torch.no_grad():
        got = opt(x)
        want = model.double()(x.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4)


# ---- CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("pool", list(POOLS))
@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_against_float64(dtype, channels_last, act, pool):
    torch.manual_seed(7)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    # NB: 12 out-channels: not a multiple of 8 (fp16's vector), so both the
    # vector and the one-channel nhwc paths run across the dtypes.
    for cout in (16, 12):
        x = (signed(2, 8, 13, 11, dtype=dtype, device="cuda") * 2).to(memory_format=fmt)
        w = signed(cout, 4, 3, 3, dtype=dtype, device="cuda") * 0.3
        b = signed(cout, dtype=dtype, device="cuda")
        want = eager(x, w, b, 2, act, pool)
        d = lambda t: t.double().cpu()  # noqa: E731
        ref = eager(d(x), d(w), d(b), 2, act, pool)
        poison_allocator([want.numel() * want.element_size()])
        got = call(x, w, b, 2, act, pool)
        assert got.stride() == want.stride()
        assert_close_to_reference(got, want, ref, what=f"{act} {pool} {dtype} cl={channels_last} cout={cout}")


@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_nan_inf_empty_and_ambiguous_layouts():
    torch.manual_seed(8)
    x, w, b = signed(1, 2, 6, 6, device="cuda"), signed(3, 2, 3, 3, device="cuda"), signed(3, device="cuda")
    x[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for act in ACTS:
        for fmt in (torch.contiguous_format, torch.channels_last):
            xf = x.contiguous(memory_format=fmt)
            got, want = call(xf, w, b, 1, act, "2x2"), eager(xf, w, b, 1, act, "2x2")
            torch.testing.assert_close(got, want, equal_nan=True, msg=act)
            assert got.stride() == want.stride()
    empty = call(x[:0], w, b, 1, "relu", "2x2")
    assert empty.shape == (0, 3, 3, 3)
    # a [3, 1, 2, 2] conv output (one channel) from a channels-last input:
    # the strides are each op's own
    xa = signed(3, 2, 4, 4, device="cuda").contiguous(memory_format=torch.channels_last)
    wa, ba = signed(1, 2, 3, 3, device="cuda"), signed(1, device="cuda")
    for act in ("relu", "relu_"):
        got = op(xa, wa, ba, [1], [0], [1], 1, act, [], [2], [], [0], [1], False)
        conv = F.conv2d(xa, wa, ba)
        want = F.max_pool2d(conv.relu_() if act == "relu_" else F.relu(conv), 2)
        assert got.stride() == want.stride(), act
        torch.testing.assert_close(got, want)


def test_fx_rewrite_matches_the_module():
    import torchfuse.fx

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.pool = nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2)

        def forward(self, x):
            return self.pool(F.relu(self.conv(x))), F.max_pool2d(torch.sigmoid(self.conv(x)), 3, 2, 1)

    torch.manual_seed(9)
    model = M().eval()
    gm = torchfuse.fx.optimize(torch.fx.symbolic_trace(model))
    assert torchfuse.fx.report(gm)["conv_act_max_pool"] == 2
    x = signed(2, 3, 9, 9)
    for got, want in zip(gm(x), model.double()(x.double())):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
