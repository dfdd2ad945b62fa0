"""With nothing fused, `optimize` returns the input's own program: new module
objects of the same class types, so the methods and their graph executors
are the input's, and the attribute values are shared."""
import warnings

import torch
import torch.nn as nn

import torchfuse


class _Block(nn.Module):
    """No chain torchfuse fuses: linear, tanh, mul, layer_norm, a shared
    child.  NB: not linear -> gelu, which linear_act fuses, nor add ->
    layer_norm, which add_layer_norm fuses."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.shared = self.fc  # one submodule object under two names

    def forward(self, x):
        return self.norm(x * torch.tanh(self.shared(self.fc(x))))


def _traced(m, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return torch.jit.trace(m, (x,))


def _differentiable_graphs(fn, x):
    fn(x)
    return str(torch.jit.last_executed_optimized_graph()).count("prim::DifferentiableGraph")


def test_unfused_result_runs_the_inputs_executor():
    """torch.jit.trace's check runs the module under no_grad, so its executor
    never differentiates; a fresh executor first run with grad does, which is
    another program (a traced BERT-base on CUDA gives different outputs
    there).  The result must run as its input runs."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    src = _traced(_Block().train(), x)
    opt = torchfuse.optimize(src)
    assert not any(torchfuse.report(opt).values())
    for fn in (src, opt):
        for _ in range(4):
            fn(x).sum().backward()
    assert _differentiable_graphs(src, x) == 0
    assert _differentiable_graphs(opt, x) == 0
    # and the same executor's results: the same values, gradients included
    for p in src.parameters():
        p.grad = None
    ref = src(x)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in src.parameters()]
    for p in src.parameters():
        p.grad = None
    out = opt(x)
    out.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for g, r in zip((p.grad for p in opt.parameters()), ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_unfused_result_is_its_own_module_sharing_tensors():
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    src = torch.jit.script(_Block().train())
    opt = torchfuse.optimize(src)
    assert not any(torchfuse.report(opt).values())
    # tensors shared, tied parameters stay tied
    assert opt.fc.weight.data_ptr() == src.fc.weight.data_ptr()
    assert opt.shared.weight.data_ptr() == opt.fc.weight.data_ptr()
    assert len(list(opt.parameters())) == len(list(src.parameters()))
    # the modules are new: the training mode and attributes are the result's
    opt.eval()
    assert src.training and src.fc.training and src.norm.training
    assert not opt.norm.training
    opt.fc.weight = nn.Parameter(torch.zeros(8, 8))
    assert src.fc.weight.abs().sum() > 0
