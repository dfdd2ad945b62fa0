"""A fused eval-mode BN chain must not be followed by a write to its
running statistics under another name of the same tensor (a buffer shared
with a training BatchNorm): the fused op reads the statistics in its
backward, the unfused chain does not (found by the fuzzer, seed 20261124,
programs 1497, 2047, 3297, 4417, ...).  optimize() gives the passes the
module's shared tensors, so a write through any of their names counts."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse


class EvalChainThenTrainingBN(nn.Module):
    """An eval-mode bn -> add -> div -> swish chain on rm/rv, then a
    training BatchNorm whose running_var (or running_mean) is rv (rm) when
    `shared`, its own buffer otherwise."""

    def __init__(self, shared: str):
        # NB: float64 from the start: Module.double() would untie the buffers.
        super().__init__()
        f64 = torch.float64
        self.register_buffer("rm", torch.randn(3, dtype=f64) * 0.1)
        self.register_buffer("rv", torch.rand(3, dtype=f64) + 0.5)
        self.w = nn.Parameter(torch.randn(3, dtype=f64))
        self.b = nn.Parameter(torch.randn(3, dtype=f64))
        self.bn = nn.BatchNorm2d(3, dtype=f64)
        if shared == "running_var":
            self.bn.running_var = self.rv
        elif shared == "running_mean":
            self.bn.running_mean = self.rm

    def forward(self, x, other, y):
        t = F.batch_norm(x, self.rm, self.rv, self.w, self.b, False, 0.1, 1e-5)
        s = (t + other) / 3.0
        z = s * torch.sigmoid(s)
        return z, self.bn(y)


def _copy(scripted):
    # NB: deepcopy's parameter clones are not leaves.
    module = copy.deepcopy(scripted)
    for p in module.parameters():
        p.detach_().requires_grad_(True)
    return module


def _run(module, inputs):
    for p in module.parameters():
        p.grad = None
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    z, u = module(*leaves)
    g = torch.Generator().manual_seed(1)
    (z * torch.randn(z.shape, dtype=z.dtype, generator=g)).sum().backward(retain_graph=True)
    (u * torch.randn(u.shape, dtype=u.dtype, generator=g)).sum().backward()
    grads = [t.grad for t in leaves] + [p.grad for p in module.parameters()]
    return [z, u] + grads + list(module.buffers())


@pytest.mark.parametrize("shared", ["running_var", "running_mean"])
def test_statistic_written_after_the_chain_under_another_name_stays_unfused(shared):
    torch.manual_seed(0)
    model = EvalChainThenTrainingBN(shared).train()
    scripted = torch.jit.script(model)
    original = _copy(scripted)
    optimized = torchfuse.optimize(scripted)
    assert torchfuse.report(optimized)["batch_norm_add_div_swish"] == 0
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(4, 3, 5, 5, dtype=torch.float64, generator=g) for _ in range(3)]
    for _ in range(2):  # the second step reads the statistics the first wrote
        for a, b in zip(_run(original, inputs), _run(optimized, inputs)):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_statistics_of_their_own_still_fuse():
    # NB: the negative of the test above: the same program with the
    # training BatchNorm on buffers of its own is fused, and keeps meaning.
    torch.manual_seed(0)
    model = EvalChainThenTrainingBN("none").train()
    scripted = torch.jit.script(model)
    original = _copy(scripted)
    optimized = torchfuse.optimize(scripted)
    assert torchfuse.report(optimized)["batch_norm_add_div_swish"] == 1
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(4, 3, 5, 5, dtype=torch.float64, generator=g) for _ in range(3)]
    for _ in range(2):
        for a, b in zip(_run(original, inputs), _run(optimized, inputs)):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_a_view_of_a_statistic_counts_as_the_statistic():
    # NB: shared storage, not only the same tensor: a buffer that is a view
    # of the running variance is written with it.
    torch.manual_seed(0)
    model = EvalChainThenTrainingBN("none").train()
    model.bn.running_var = model.rv[:]
    optimized = torchfuse.optimize(torch.jit.script(model))
    assert torchfuse.report(optimized)["batch_norm_add_div_swish"] == 0
