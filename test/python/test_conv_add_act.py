"""custom_conv_add_act and the conv_add_act fusion: act(conv + alpha * other).

CPU: the op against the float64 eager chain for every activation, with and
without `other`, promote or not, bias or not, grouped and depthwise, 1-d, 2-d
and 3-d; gradcheck and gradgradcheck; opcheck; NaN/Inf as eager; scripted,
frozen and optimized modules, and torchvision's resnet18 and
mobilenet_v3_small.  CUDA (marked `cuda`): float32/16/bfloat16, NCHW and
channels-last, error against float64 at most 2x eager's."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.testing import FileCheck

import torchfuse

from cuda_utils import CUDA_ONLY, assert_close_to_reference, poison_allocator

op = torch.ops.torchfuse.custom_conv_add_act

# name -> (activation_args, eager function)
ACTS = {
    "none": ([], lambda t: t),
    "relu": ([], F.relu),
    "hardtanh": ([-0.5, 1.5], lambda t: F.hardtanh(t, -0.5, 1.5)),
    "silu": ([], F.silu),
    "hardswish": ([], F.hardswish),
    "hardsigmoid": ([], F.hardsigmoid),
    "sigmoid": ([], torch.sigmoid),
    "gelu": ([], F.gelu),
    "gelu_tanh": ([], lambda t: F.gelu(t, approximate="tanh")),
    "leaky_relu": ([0.2], lambda t: F.leaky_relu(t, 0.2)),
}
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def signed(*sizes, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*sizes, dtype=dtype, device=device)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)
    return t.requires_grad_(requires_grad)


def eager(x, w, b, stride, padding, dilation, groups, other, alpha, promote, act):
    y = CONV[w.dim() - 2](x, w, b, stride, padding, dilation, groups)
    if other is not None:
        y = torch.add(y, other, alpha=alpha) if promote else y.add_(other, alpha=alpha)
    return ACTS[act][1](y)


def problem(dims, groups, bias, dtype=torch.float32, device="cpu", requires_grad=False):
    """(x, w, b, stride, padding, dilation, groups) with out-channels 6."""
    cin = 6 if groups == 6 else 4
    spatial = {1: (11,), 2: (7, 6), 3: (5, 4, 6)}[dims]
    g = dict(dtype=dtype, device=device, requires_grad=requires_grad)
    x = signed(2, cin, *spatial, **g)
    w = signed(6, cin // groups, *([3] * dims), **g)
    b = signed(6, **g) if bias else None
    return x, w, b, [2] + [1] * (dims - 1), [1], [1] + [2] * (dims - 1) if dims > 1 else [1], groups


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 6])
def test_cpu_matches_the_float64_chain(act, dims, groups):
    torch.manual_seed(dims * 10 + groups)
    args = list(ACTS[act][0])
    for bias in (True, False):
        x, w, b, stride, padding, dilation, groups_ = problem(dims, groups, bias)
        conv = CONV[dims](x, w, b, stride, padding, dilation, groups_)
        for other in (None, signed(*conv.shape), signed(6, *[1] * dims)):
            for promote in (True, False):
                out = op(x, w, b, stride, padding, dilation, groups_, other, -0.75, promote, act, args)
                d = lambda t: None if t is None else t.double()  # noqa: E731
                ref = eager(d(x), d(w), d(b), stride, padding, dilation, groups_, d(other), -0.75, promote, act)
                assert out.dtype == torch.float32 and out.shape == ref.shape
                torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
                # the CPU kernel is eager's own chain
                want = eager(x, w, b, stride, padding, dilation, groups_, other, -0.75, promote, act)
                assert torch.equal(out, want)


def test_cpu_unbatched_and_promotion():
    torch.manual_seed(0)
    x, w = signed(3, 5, 5), signed(4, 3, 3, 3)
    other = signed(4, 3, 3, dtype=torch.float64)
    out = op(x, w, None, [1], [0], [1], 1, other, 1, True, "silu", [])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, F.silu(F.conv2d(x.double(), w.double()) + other), rtol=1e-5, atol=1e-5)
    kept = op(x, w, None, [1], [0], [1], 1, other, 1, False, "silu", [])
    assert kept.dtype == torch.float32
    torch.testing.assert_close(kept.double(), F.silu(F.conv2d(x.double(), w.double()) + other), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["relu", "hardtanh", "silu", "hardswish", "gelu", "leaky_relu"])
def test_gradcheck_and_gradgradcheck(act):
    torch.manual_seed(1)
    x, w, b, stride, padding, dilation, groups = problem(2, 2, True, dtype=torch.float64, requires_grad=True)
    shape = F.conv2d(x, w, b, stride, padding, dilation, groups).shape
    other = signed(*shape, dtype=torch.float64, requires_grad=True)
    args = ACTS[act][0]
    fn = lambda x, w, b, o: op(x, w, b, stride, padding, dilation, groups, o, 0.5, True, act, args)  # noqa: E731
    gradcheck(fn, (x, w, b, other))
    gradgradcheck(fn, (x, w, b, other))


def test_gradients_are_eagers():
    torch.manual_seed(2)
    x, w, b, stride, padding, dilation, groups = problem(2, 1, True, requires_grad=True)
    other = signed(*F.conv2d(x, w, b, stride, padding, dilation, groups).shape, requires_grad=True)
    out = op(x, w, b, stride, padding, dilation, groups, other, 2.0, False, "hardswish", [])
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b, other)]
    want = F.hardswish(F.conv2d(leaves[0], leaves[1], leaves[2], stride, padding, dilation, groups)
                       .add_(leaves[3], alpha=2.0))
    g = signed(*out.shape)
    got = torch.autograd.grad(out, (x, w, b, other), g)
    ref = torch.autograd.grad(want, leaves, g)
    for a, r in zip(got, ref):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("sample", ["full", "none_other", "conv1d_depthwise"])
def test_opcheck(sample):
    torch.manual_seed(3)
    g = dict(requires_grad=True)
    if sample == "full":
        args = (signed(2, 4, 5, 5, **g), signed(6, 4, 3, 3, **g), signed(6, **g), [1], [1], [1], 1,
                signed(2, 6, 5, 5, **g), 0.5, True, "hardtanh", [0.0, 6.0])
    elif sample == "none_other":
        args = (signed(2, 4, 5, 5, **g), signed(6, 2, 3, 3, **g), None, [2], [0], [1], 2, None, 1, False,
                "silu", [])
    else:
        args = (signed(2, 4, 9, **g), signed(4, 1, 3, **g), signed(4, **g), [1], [2], [2], 4,
                signed(4, 1, **g), 1, False, "gelu_tanh", [])
    torch.library.opcheck(op, args)


def test_rejects_bad_activations_by_name():
    x, w = signed(1, 2, 4, 4), signed(3, 2, 1, 1)
    with pytest.raises(RuntimeError, match="expected activation to be one of .* got 'tanh'"):
        op(x, w, None, [1], [0], [1], 1, None, 1, True, "tanh", [])
    with pytest.raises(RuntimeError, match="expected activation_args to have 1 elements for activation "
                                           "'leaky_relu', got 0"):
        op(x, w, None, [1], [0], [1], 1, None, 1, True, "leaky_relu", [])


@pytest.mark.parametrize("act", list(ACTS))
def test_nan_and_inf_as_eager(act):
    torch.manual_seed(4)
    x, w, b = signed(1, 2, 4, 4), signed(3, 2, 1, 1), signed(3)
    other = signed(1, 3, 4, 4)
    other[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    args = ACTS[act][0]
    out = op(x, w, b, [1], [0], [1], 1, other, 1, True, act, args)
    want = eager(x, w, b, [1], [0], [1], 1, other, 1, True, act)
    torch.testing.assert_close(out, want, equal_nan=True)


# ---- the fusion ---------------------------------------------------------------


class Block(nn.Module):
    """conv -> [add] -> [act] in the spellings torchvision uses."""

    def __init__(self, form, act):
        super().__init__()
        self.form, self.act = form, act
        self.conv = nn.Conv2d(4, 4, 3, padding=1, groups=2)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        out = self.bn(self.conv(x))
        if self.form == "add_":
            out += x
        elif self.form == "add":
            out = out + x
        elif self.form == "residual_first":
            out = x + out
        return self.act(out)


MODULE_ACTS = {
    "relu_": nn.ReLU(inplace=True), "relu6": nn.ReLU6(inplace=True), "hardswish": nn.Hardswish(),
    "silu_": nn.SiLU(inplace=True), "sigmoid": nn.Sigmoid(), "gelu": nn.GELU(approximate="tanh"),
    "leaky_relu": nn.LeakyReLU(0.3), "none": nn.Identity(),
}


@pytest.mark.parametrize("form", ["add_", "add", "plain"])
@pytest.mark.parametrize("act", list(MODULE_ACTS))
def test_scripted_frozen_optimized_modules(form, act):
    if form == "plain" and act == "none":
        pytest.skip("a conv alone is not fused (no pass to save): see the C++ test LeavesAConvAlone")
    torch.manual_seed(5)
    model = Block(form, MODULE_ACTS[act]).eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    FileCheck().check("torchfuse::custom_conv_add_act").check_not("aten::conv2d").run(opt.graph)
    assert torchfuse.report(opt)["conv_add_act"] == 1
    x = signed(2, 4, 6, 6)
    with torch.no_grad():
        ref = Block(form, MODULE_ACTS[act]).double().eval()
        ref.load_state_dict(model.state_dict())
        torch.testing.assert_close(opt(x).double(), ref(x.double()), rtol=1e-4, atol=1e-5)


def test_residual_as_the_first_operand_stays_unfused_and_keeps_its_strides():
    """chainIsAddSelf: `x + conv` takes x's strides where the two layouts
    differ; the op, which returns the conv output's layout, was given it."""
    torch.manual_seed(5)
    model = Block("residual_first", nn.ReLU()).eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    FileCheck().check("aten::add").run(opt.graph)
    assert torchfuse.report(opt)["conv_add_act"] == 0
    # NB: x channels-last, the conv output contiguous (NCHW weight, layout
    # kept on the CPU): eager's add follows x.
    x = signed(2, 4, 6, 6).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want, got = model(x), opt(x)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want)


def test_batch_norm_in_training_stays_unfused():
    model = Block("add_", nn.ReLU()).train()
    opt = torchfuse.optimize(torch.jit.script(model))
    FileCheck().check("aten::batch_norm").check_not("custom_conv_add_act").run(opt.inlined_graph)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small"])
def test_torchvision_models(name):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(6)
    model = getattr(torchvision.models, name)().eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    fused = torchfuse.report(opt)["conv_add_act"]
    assert fused > 0
    assert str(opt.graph).count("torchfuse::custom_conv_add_act") == fused
    x = signed(2, 3, 64, 64)
    with torch.no_grad():
        got = opt(x)
        want = model.double()(x.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4)


# ---- CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("form", ["none", "add", "add_", "broadcast"])
# The epilogue's vectors (4 float32 or 8 16-bit elements) lie in one channel
# (nchw, 8x8), span several (nchw, 9x11; channels-last, 12 channels) or
# consecutive ones whose bias is read as a vector (channels-last, 16).
@pytest.mark.parametrize("cout, height, width", [(16, 9, 11), (16, 8, 8), (12, 8, 8)])
@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_against_float64(dtype, channels_last, act, form, cout, height, width):
    torch.manual_seed(7)
    args = ACTS[act][0]
    x = signed(2, 8, height, width, dtype=dtype, device="cuda") * 2
    w = signed(cout, 4, 3, 3, dtype=dtype, device="cuda") * 0.3
    b = signed(cout, dtype=dtype, device="cuda")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = x.to(memory_format=fmt)
    conv_shape = F.conv2d(x, w, None, 1, 1, 1, 2).shape
    other = None
    if form in ("add", "add_"):
        other = signed(*conv_shape, dtype=dtype, device="cuda").to(memory_format=fmt)
    elif form == "broadcast":
        other = signed(cout, 1, 1, dtype=dtype, device="cuda")
    promote = form != "add_"
    want = eager(x, w, b, [1], [1], [1], 2, other, 0.5, promote, act)
    d = lambda t: None if t is None else t.double().cpu()  # noqa: E731
    ref = eager(d(x), d(w), d(b), [1], [1], [1], 2, d(other), 0.5, promote, act)
    poison_allocator([want.numel() * want.element_size()])
    got = op(x, w, b, [1], [1], [1], 2, other, 0.5, promote, act, args)
    assert got.is_contiguous(memory_format=fmt) == want.is_contiguous(memory_format=fmt)
    assert_close_to_reference(got, want, ref, what=f"{act} {form} {dtype} cl={channels_last} {cout}x{height}x{width}")


@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_nan_inf_and_empty():
    torch.manual_seed(8)
    x, w, b = signed(1, 2, 4, 4, device="cuda"), signed(3, 2, 1, 1, device="cuda"), signed(3, device="cuda")
    other = signed(1, 3, 4, 4, device="cuda")
    other[0, 0, 0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for act, (args, fn) in ACTS.items():
        got = op(x, w, b, [1], [0], [1], 1, other, 1, True, act, args)
        want = eager(x, w, b, [1], [0], [1], 1, other, 1, True, act)
        torch.testing.assert_close(got, want, equal_nan=True, msg=act)
    empty = op(x[:0], w, b, [1], [0], [1], 1, None, 1, True, "relu", [])
    assert empty.shape == (0, 3, 4, 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_ONLY)])
@pytest.mark.parametrize("act", ["relu", "hardtanh", "silu", "leaky_relu"])
def test_in_place_spelling_keeps_the_strides_of_each_spelling(act, device):
    """A [3, 2, 1, 1] conv output from a channels-last input has ambiguous
    strides: eager's in-place activation keeps the conv output's (2, 1, 2, 2),
    its out-of-place one gives TensorIterator's (2, 1, 1, 1).  The op gives
    each spelling's ("relu_" the in-place one); the values are the same."""
    torch.manual_seed(3)
    x = signed(3, 2, 4, 4).to(device).contiguous(memory_format=torch.channels_last)
    w, b = signed(2, 2, 3, 3).to(device), signed(2).to(device)
    args = {"hardtanh": [-0.5, 0.5], "leaky_relu": [0.2]}.get(act, [])
    conv = F.conv2d(x, w, b, 2)
    fn = {"relu": F.relu, "hardtanh": F.hardtanh, "silu": F.silu, "leaky_relu": F.leaky_relu}[act]
    eager = (fn(conv, *args), fn(conv.clone(), *args, inplace=True))
    if act == "relu":
        assert eager[0].stride() != eager[1].stride()  # the case is ambiguous
    for spelling, want in zip((act, act + "_"), eager):
        got = torch.ops.torchfuse.custom_conv_add_act(x, w, b, [2, 2], [0, 0], [1, 1], 1, None, 1, True,
                                                       spelling, args)
        assert got.stride() == want.stride(), spelling
        torch.testing.assert_close(got, want)


# conv problems whose outputs have size-1 dimensions: (x sizes, w sizes, stride)
AMBIGUOUS = {
    "se_1x1": ((3, 8, 1, 1), (6, 8, 1, 1), 1),         # a squeeze-excitation conv
    "pooled_to_1x1": ((3, 4, 5, 5), (6, 4, 3, 3), 2),  # the output is [3, 6, 1, 1]
    "one_channel": ((3, 4, 5, 6), (1, 4, 3, 3), 1),    # [3, 1, 3, 4]
    "one_row": ((2, 4, 3, 7), (6, 4, 3, 3), 1),        # [2, 6, 1, 5]
    "batch_of_one": ((1, 4, 1, 1), (6, 4, 1, 1), 1),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA_ONLY)])
@pytest.mark.parametrize("form", list(AMBIGUOUS))
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("residual", [None, "add", "add_"])
def test_outputs_with_size_one_dims_take_each_spellings_strides(form, channels_last, residual, device):
    """Convolutions whose outputs have size-1 dimensions (the [N, C, 1, 1] of
    squeeze-excitation blocks): the result's strides are those of eager's
    chain in every spelling (out- and in-place activation, add and add_ of a
    residual of the conv output's strides; hardtanh's out-of-place result
    keeps its input's strides), its values eager's, and it is no
    view (eager's is none: an in-place op under autograd may follow)."""
    xs, ws, stride = AMBIGUOUS[form]
    torch.manual_seed(7)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = signed(*xs).to(device).contiguous(memory_format=fmt)
    w = signed(*ws).to(device).contiguous(memory_format=fmt)
    b = signed(ws[0]).to(device)
    conv = F.conv2d(x, w, b, stride)
    # the residual: of the conv output's sizes and strides
    other = None if residual is None else torch.empty_like(conv).copy_(signed(*conv.shape).to(device))
    for act in ("relu", "hardsigmoid", "silu", "hardtanh", "none"):
        args, fn = ACTS[act]
        for spelling in ([act] if act == "none" else [act, act + "_"]):
            y = conv.clone()
            if other is not None:
                y = torch.add(y, other) if residual == "add" else y.add_(other)
            if spelling == act:
                want = fn(y)
            else:
                want = {"relu": torch.relu_, "hardsigmoid": lambda t: F.hardsigmoid(t, inplace=True),
                        "silu": lambda t: F.silu(t, inplace=True),
                        "hardtanh": lambda t: F.hardtanh(t, *args, inplace=True)}[act](y)
            got = op(x, w, b, [stride, stride], [0, 0], [1, 1], 1, other, 1, residual != "add_", spelling, args)
            assert got.stride() == want.stride(), (spelling, got.stride(), want.stride())
            torch.testing.assert_close(got, want, msg=spelling)
            assert got._base is None
        with torch.enable_grad():
            scale = torch.ones((), device=device, requires_grad=True)
            op(x, w, b, [stride, stride], [0, 0], [1, 1], 1, other, 1, residual != "add_", "relu", []).mul_(scale)
