"""FoldResidualConvBias through torchfuse.optimize(freeze=True): the bias of
a residual conv that feeds custom_conv_add_act's `other` (resnet's
downsample) moves into the op's bias.

CPU: torchvision's resnet18 and resnet50 (scripted and traced) lose every
bias of their remaining aten convs, and their outputs are as close to a
float64 run as the original's (at most 2x its error); a conv1d residual into
a conv2d chain keeps its bias (its channels are another dim of the sum);
an unbatched residual conv folds, and keeps its values.  CUDA (marked
`cuda`): resnet50 in float32 and float16 against float64, at most 2x
eager's error.  The fuzzer draws the residual conv and keeps its meaning
where it folds."""

import os
import re
import sys

import pytest
import torch
import torch.nn as nn

import torchfuse

from cuda_utils import CUDA_ONLY, assert_close_to_reference

torchvision = pytest.importorskip("torchvision")

CONVS = ("aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::_convolution")


def biased_convs(graph):
    """The aten convolutions of `graph` whose bias is not None."""
    return [n for n in graph.nodes() if n.kind() in CONVS and n.inputsAt(2).type().kind() != "NoneType"]


def aten_convs(graph):
    return [n for n in graph.nodes() if n.kind() in CONVS]


def randomized(model):
    """Non-trivial BN statistics and affine parameters: the folded conv
    biases are then nonzero (torchvision's init leaves them zero)."""
    torch.manual_seed(3)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model.eval()


def signed(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def resnet(name):
    torch.manual_seed(0)
    return randomized(getattr(torchvision.models, name)(weights=None))


DOWNSAMPLES = {"resnet18": 3, "resnet50": 4}


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
@pytest.mark.parametrize("how", ["script", "trace"])
def test_resnet_downsample_biases_fold(name, how):
    model = resnet(name)
    x = signed(2, 3, 64, 64)
    scripted = torch.jit.script(model) if how == "script" else torch.jit.trace(model, x)
    # NB: torch's own freeze keeps each downsample conv (BN folded into it)
    # with a bias; so would ours without the fold.
    reference = torch.jit.freeze(torch.jit.script(model))
    assert len(biased_convs(reference.graph)) >= DOWNSAMPLES[name]
    opt = torchfuse.optimize(scripted, freeze=True)
    assert len(aten_convs(opt.graph)) == DOWNSAMPLES[name]
    assert biased_convs(opt.graph) == []
    with torch.no_grad():
        got, want = opt(x), model(x)
        ref = model.double()(x.double())
    model.float()
    assert_close_to_reference(got, want, ref, what=f"{name} {how}")


class Conv1dResidual(nn.Module):
    """relu(conv2d(x) + conv1d(x[0]ᵀ)): on x of (2, 3, 4, 5) the conv1d's
    (4, 4, 5) output broadcasts against the conv2d's (2, 4, 4, 5), its
    channels on the sum's dim 2, not the conv2d's dim 1."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 1)
        self.b = nn.Conv1d(3, 4, 1)

    def forward(self, x):
        return torch.relu(self.a(x) + self.b(x[0].transpose(0, 1)))


class UnbatchedResidual(nn.Module):
    """relu(conv2d(x) + conv2d(z)) with z unbatched: both convs put their
    channels 3 dims from the end, which the broadcasting add aligns."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1)
        self.b = nn.Conv2d(5, 4, 1)

    def forward(self, x, z):
        return torch.relu(self.a(x) + self.b(z))


def optimized(model):
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    assert torchfuse.report(opt)["conv_add_act"] == 1
    return opt


def check_values(model, opt, *inputs):
    with torch.no_grad():
        got, want = opt(*inputs), model(*inputs)
        ref = model.double()(*(t.double() for t in inputs))
    model.float()
    assert_close_to_reference(got, want, ref, what=type(model).__name__)


def test_a_conv1d_residual_into_a_conv2d_chain_keeps_its_bias():
    torch.manual_seed(4)
    model = Conv1dResidual().eval()
    opt = optimized(model)
    assert [n.kind() for n in biased_convs(opt.graph)] == ["aten::conv1d"]
    check_values(model, opt, signed(2, 3, 4, 5))


def test_an_unbatched_residual_conv_folds():
    torch.manual_seed(5)
    model = UnbatchedResidual().eval()
    opt = optimized(model)
    assert len(aten_convs(opt.graph)) == 1
    assert biased_convs(opt.graph) == []
    check_values(model, opt, signed(2, 3, 6, 7), signed(5, 6, 7))


# ---- the fuzzer's vocabulary --------------------------------------------------

CONV_LINE = re.compile(r"^\s*(v\d+) = (?:self\.conv\d+|F\.conv[123]d)\((\w+)", re.M)
ADD_LINE = re.compile(r"^\s*v\d+ = (?:(v\d+) \+ (v\d+)|torch\.add\((v\d+), (v\d+)|(v\d+)\.add_?\((v\d+))", re.M)


def adds_two_convs_of_one_input(source):
    convs = {m.group(1): m.group(2) for m in CONV_LINE.finditer(source)}
    for m in ADD_LINE.finditer(source):
        a, b = [g for g in m.groups() if g]
        if a in convs and b in convs and convs[a] == convs[b]:
            return True
    return False


def folded_module_convs(model, opt):
    """The nn.Conv modules of `model` with a bias whose conv the frozen
    graph runs as custom_conv_add_act's `other` without one (matched by
    weight: no BatchNorm is folded into a residual conv)."""
    biased = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd) and m.bias is not None]
    found = []
    for n in opt.graph.nodes():
        if n.kind() != "torchfuse::custom_conv_add_act":
            continue
        conv = n.inputsAt(7).node()
        if conv.kind() not in CONVS or conv.inputsAt(2).type().kind() != "NoneType":
            continue
        w = conv.inputsAt(1).toIValue()
        found += [m for m in biased if isinstance(w, torch.Tensor) and m.weight.shape == w.shape
                  and torch.equal(m.weight.detach(), w)]
    return found


def test_fuzz_programs_fold_a_residual_conv_and_keep_their_meaning():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    import fuzz

    progs = [(i, fuzz.generate(3, i * 100)) for i in range(400)]
    drawn = [(i, p) for i, p in progs if adds_two_convs_of_one_input(p.source())]
    assert len(drawn) >= 5
    folded = 0
    for i, prog in drawn[:12]:
        torch.manual_seed(i)
        model = fuzz.load_class(prog.source())().eval()
        try:
            opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
        except Exception:  # a program that does not script: not a case
            continue
        if not folded_module_convs(model, opt):
            continue
        folded += 1
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64", "float32"), modes=("frozen",), round_trip=False)
        except fuzz.Invalid:
            continue
        assert out.failures == [], (i, out.failures)
    assert folded >= 1


# ---- CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_resnet50_against_float64(dtype):
    model = resnet("resnet50").cuda().to(dtype)
    torch.manual_seed(6)
    x = signed(2, 3, 64, 64, device="cuda").to(dtype)
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    assert len(aten_convs(opt.graph)) == DOWNSAMPLES["resnet50"]
    assert biased_convs(opt.graph) == []
    with torch.no_grad():
        got, want = opt(x), model(x)
        ref = model.double().cpu()(x.double().cpu())
    assert_close_to_reference(got, want, ref, what=f"resnet50 {dtype}")
