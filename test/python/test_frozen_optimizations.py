"""optimize(freeze=True) runs torch.jit.freeze's frozen graph optimizations
(passes/frozen_optimizations.cpp) before the fusions, except where a
BatchNorm is not constantly in inference (batchNormsAreInference), and
folds a BatchNorm into a linear only where that keeps the meaning
(linearBatchNormFoldingKeepsMeaning), and joins linears of one input only
where none of their outputs is written or returned
(linearConcatenationKeepsMeaning)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import FileCheck

import torchfuse


def signed(*sizes):
    t = torch.randn(sizes, dtype=torch.float64)
    return torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)


def kinds(module):
    nodes = module.inlined_graph.nodes()
    return sorted(n.kind() for n in nodes if n.kind().startswith(("aten::", "torchfuse::")))


class ConvBnAdd(nn.Module):
    """conv -> BatchNorm -> add of a constant -> relu, and linear -> BatchNorm."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 6)
        self.bn1 = nn.BatchNorm1d(6)
        self.shift = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)) + self.shift)
        return self.bn1(self.fc(h.mean((2, 3))))


def _seeded(module):
    """module in float64, with every BatchNorm's statistics and affine
    parameters drawn away from their defaults."""
    m = module.double()
    with torch.no_grad():
        for bn in m.modules():
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                bn.running_mean.copy_(signed(bn.num_features) * 0.3)
                bn.running_var.copy_(torch.rand(bn.num_features, dtype=torch.float64) + 0.5)
                bn.weight.copy_(signed(bn.num_features))
                bn.bias.copy_(signed(bn.num_features))
    return m


def _model():
    torch.manual_seed(0)
    return _seeded(ConvBnAdd())


def test_frozen_result_folds_what_torch_jit_freeze_folds():
    """The conv's BatchNorm and constant add are folded as torch.jit.freeze
    folds them; the BatchNorm after the linear stays: the inlined graph does
    not show that the linear's output is 2-D (ctest
    FrozenOptimizations.LinearFoldingOnlyIntoA2dLinearReadByTheBatchNormAlone
    has the case where it does)."""
    model = _model().eval()
    x = signed(2, 3, 8, 8)
    want = model(x)
    frozen = torch.jit.freeze(torch.jit.script(copy.deepcopy(model)))
    # NB: without conv_add_act, which would take the folded conv -> add
    passes = [n for n in torchfuse.pass_names() if n not in ("conv_add_act", "relu")]
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True, passes=passes)
    FileCheck().check("aten::conv2d").check_not("aten::batch_norm").check("aten::linear").check(
        "aten::batch_norm").run(opt.graph)
    assert kinds(opt) == sorted(kinds(frozen) + ["aten::batch_norm"]), (kinds(opt), kinds(frozen))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), want)


class LinearBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.fc(x))


def _linear_bn():
    torch.manual_seed(0)
    return _seeded(LinearBn()).eval()


def test_batch_norm_after_a_3d_linear_is_not_folded():
    """BatchNorm normalizes dim 1, the linear's features are the last dim:
    torch.jit.freeze folds them all the same (fuzzer seed 20261130, program
    5672)."""
    model = _linear_bn()
    x = signed(2, 3, 4)
    opt = torchfuse.optimize(torch.jit.trace(copy.deepcopy(model), (x,)), freeze=True)
    assert "aten::batch_norm" in kinds(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))
        frozen = torch.jit.freeze(torch.jit.trace(copy.deepcopy(model), (x,)))
        assert not torch.allclose(frozen(x), model(x))


def test_batch_norm_left_in_training_mode_is_not_folded():
    """A submodule in training mode inside an eval-mode module: its BatchNorm
    uses batch statistics and updates its running statistics, which torch's
    folding would drop."""
    ref = _model().eval()
    ref.bn.train()
    ref.bn1.train()
    src = copy.deepcopy(ref)
    initial = ref.bn.running_mean.clone()
    opt = torchfuse.optimize(torch.jit.script(src), freeze=True)
    assert "aten::batch_norm" in kinds(opt)
    for _ in range(2):
        x = signed(4, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), ref(x))
    for a, b in ((src.bn, ref.bn), (src.bn1, ref.bn1)):
        torch.testing.assert_close(a.running_mean, b.running_mean)
        torch.testing.assert_close(a.running_var, b.running_var)
    assert not torch.equal(ref.bn.running_mean, initial)


class LinearBnResidual(nn.Module):
    """A linear whose output a BatchNorm and an add both read."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        h = self.fc(x)
        return self.bn(h) + h


def test_batch_norm_after_a_linear_read_elsewhere_is_not_folded():
    torch.manual_seed(0)
    model = _seeded(LinearBnResidual()).eval()
    x = signed(4, 6)
    opt = torchfuse.optimize(torch.jit.script(copy.deepcopy(model)), freeze=True)
    assert "aten::batch_norm" in kinds(opt)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_unfrozen_result_keeps_batch_norm():
    model = _model().eval()
    opt = torchfuse.optimize(torch.jit.script(copy.deepcopy(model)))
    assert "aten::batch_norm" in kinds(opt)


class SiblingLinears(nn.Module):
    """Two linears of one input: one output clamped, the other written in
    place ("in_place"; fuzzer, --device cuda, seed 0, program 52), or
    clamped too ("neither"), or both returned as they are ("returned")."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.fc0 = nn.Linear(6, 6)
        self.fc1 = nn.Linear(6, 5)

    def forward(self, x):
        a, b = self.fc0(x), self.fc1(x)
        if self.form == "returned":
            return a, b
        a = F.hardtanh(a, -1.0, 1.0)
        b = F.relu6(b, inplace=True) if self.form == "in_place" else F.relu6(b)
        return a, b


def _grads(module, x):
    x = x.detach().clone().requires_grad_()
    a, b = module(x)
    (a * 1.5 + 0.5).sum().backward(retain_graph=True)
    (b * -0.25).sum().backward()
    return (a.detach(), b.detach(), x.grad)


@pytest.mark.parametrize("form", ["in_place", "returned", "neither"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_linears_joined_only_where_no_output_is_written_or_returned(form):
    """On CUDA, torch's FrozenConcatLinear makes the two outputs slices of one
    tensor.  relu6_ on one then bumps the version of the other, which
    hardtanh's backward saved, and the backward raises (as it does for
    torch.jit.freeze's own result); returned, the slices are not contiguous
    where the original's outputs were.  Only where neither holds are the
    linears joined (one aten::linear left)."""
    torch.manual_seed(0)
    model = SiblingLinears(form).double().cuda().eval()
    x = signed(3, 4, 6).cuda()
    opt = torchfuse.optimize(torch.jit.script(copy.deepcopy(model)), freeze=True,
                             passes=[n for n in torchfuse.pass_names() if n != "linear_act"])
    assert kinds(opt).count("aten::linear") == (1 if form == "neither" else 2), kinds(opt)
    got, want = _grads(opt, x), _grads(model, x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert [t.is_contiguous() for t in got[:2]] == [t.is_contiguous() for t in want[:2]] == [True, True]
    frozen = torch.jit.freeze(torch.jit.script(copy.deepcopy(model)))
    if form == "in_place":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            _grads(frozen, x)
    if form == "returned":
        with torch.no_grad():
            assert not all(t.is_contiguous() for t in frozen(x))
