"""custom_linear_add_relu saves its input for the backward; aten::linear
saves a copy of a non-contiguous input of more than two dimensions (matmul
reshapes it), so a write to that input after the chain raised "modified by
an inplace operation" in the optimized module's backward only (found by the
fuzzer, seed 20261124, program 9852).  A chain whose input may be written
after it now stays unfused."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse


class LinearOnATransposedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6, dtype=torch.float64)
        self.p = nn.Parameter(torch.randn(1, dtype=torch.float64))

    def forward(self, x):
        v = x.transpose(2, 0)
        return torch.relu(self.fc(v) + self.p)


class ThenWritesItsInput(LinearOnATransposedInput):
    def forward(self, x):
        v = x.transpose(2, 0)
        y = torch.relu(self.fc(v) + self.p)
        F.relu(x, inplace=True)
        return y


def _grads(module, x):
    for p in module.parameters():
        p.grad = None
    leaf = x.clone().requires_grad_(True)
    y = module(leaf.clone())
    g = torch.Generator().manual_seed(3)
    (y * torch.randn(y.shape, dtype=y.dtype, generator=g)).sum().backward()
    return [y, leaf.grad] + [p.grad for p in module.parameters()]


def _pair(write_after):
    # NB: the reference is the eager module: a copy of the scripted one
    # shares its methods and executor, whose differentiable second call
    # raises on this program in TorchScript itself.
    torch.manual_seed(0)
    eager = ThenWritesItsInput() if write_after else LinearOnATransposedInput()
    return copy.deepcopy(eager), torchfuse.optimize(torch.jit.script(eager))


def test_input_written_after_the_chain_stays_unfused_and_trains():
    original, optimized = _pair(write_after=True)
    assert torchfuse.report(optimized)["linear_add_relu"] == 0
    x = torch.randn(4, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for a, b in zip(_grads(original, x), _grads(optimized, x)):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_input_not_written_after_the_chain_is_fused():
    # NB: the negative of the test above.
    original, optimized = _pair(write_after=False)
    assert torchfuse.report(optimized)["linear_add_relu"] == 1
    x = torch.randn(4, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for a, b in zip(_grads(original, x), _grads(optimized, x)):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)
