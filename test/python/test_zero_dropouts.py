"""RemoveZeroDropouts: a dropout of constant probability 0, or with a
constant train=False, becomes its input,
as ATen computes it (TorchScript's autodiff would run it as native_dropout,
whose CUDA kernel drops the elements that draw exactly 1.0).  Each rule that
keeps a dropout has a negative test here; the rewritten graphs compute what
the originals do, aliasing included."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse

KINDS = ["dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"]


def dropouts(graph):
    return sum(len(graph.findAllNodes(f"aten::{k}")) + len(graph.findAllNodes(f"aten::{k}_")) for k in KINDS)


def fused(fn):
    """Scripts fn, runs the graph stage; (graph, report, rewritten function)."""
    graph = torch.jit.script(fn).graph.copy()
    torch._C._jit_pass_inline(graph)
    report = torchfuse.fuse_graph(graph)
    return graph, report, torch._C._create_function_from_graph("rewritten", graph)


def signed(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def zero_dropout(x):
    return torch.dropout(x, 0.0, True) * 2


def zero_feature_dropout(x):
    return torch.feature_dropout(x, 0.0, True) * 2


def zero_alpha_dropout(x):
    return torch.alpha_dropout(x, 0.0, True) * 2


def zero_feature_alpha_dropout(x):
    return torch.feature_alpha_dropout(x, 0.0, True) * 2


def zero_dropout_eval(x):
    return torch.dropout(x, 0.0, False) * 2


@pytest.mark.parametrize("fn", [zero_dropout, zero_feature_dropout, zero_alpha_dropout,
                                zero_feature_alpha_dropout, zero_dropout_eval])
def test_a_zero_dropout_is_its_input(fn):
    graph, report, rewritten = fused(fn)
    assert report["zero_dropouts_removed"] == 1 and dropouts(graph) == 0, graph
    x = signed(3, 4, 5)
    torch.testing.assert_close(rewritten(x), fn(x), rtol=0, atol=0)


def zero_dropout_in_place(x):
    y = x * 1
    z = torch.dropout_(y, 0.0, True)
    return z + y


def test_an_in_place_zero_dropout_is_its_input():
    graph, report, rewritten = fused(zero_dropout_in_place)
    assert report["zero_dropouts_removed"] == 1 and dropouts(graph) == 0, graph
    x = signed(3, 4)
    torch.testing.assert_close(rewritten(x), zero_dropout_in_place(x), rtol=0, atol=0)


def written_after(x):
    # ATen's dropout at p = 0 returns x itself: the write reaches x, in eager
    # and in TorchScript's interpreter alike
    y = torch.dropout(x, 0.0, True)
    y.add_(1.0)
    return y * 3


def test_the_output_aliases_the_input_as_in_eager():
    graph, report, rewritten = fused(written_after)
    assert report["zero_dropouts_removed"] == 1
    want_in, got_in = signed(4, 3), signed(4, 3)
    want = written_after(want_in)
    got = rewritten(got_in)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_in, want_in, rtol=0, atol=0)


def half_dropout_train(x):
    return torch.dropout(x, 0.5, True) * 2


def test_zero_probability_negative_a_nonzero_probability_in_training_stays():
    graph, report, _ = fused(half_dropout_train)
    assert report["zero_dropouts_removed"] == 0 and dropouts(graph) == 1


def half_dropout_eval(x):
    return torch.dropout(x, 0.5, False) * 2


def test_a_dropout_not_in_training_is_its_input():
    graph, report, rewritten = fused(half_dropout_eval)
    assert report["zero_dropouts_removed"] == 1 and dropouts(graph) == 0, graph
    x = signed(3, 4)
    torch.testing.assert_close(rewritten(x), half_dropout_eval(x), rtol=0, atol=0)


class _WritesThroughEvalDropout(nn.Module):
    """ATen's dropout with train=False returns x itself, so the in-place
    relu6 writes x; the schema promises a fresh tensor, and a dead write to
    one would be dropped.  Found by the fuzzer (seed 0, program 173)."""

    def forward(self, x):
        y = F.relu(x * 2.0)
        F.relu6(F.dropout(x, 0.5, False), inplace=True)
        return y


def test_an_in_place_write_through_an_eval_dropout_reaches_the_input():
    m = torch.jit.script(_WritesThroughEvalDropout())
    opt = torchfuse.optimize(m, passes=["relu"])
    assert torchfuse.report(opt)["relu"] == 1 and dropouts(opt.graph) == 0
    want_in, got_in = signed(2, 3, 4, 4), signed(2, 3, 4, 4)
    want = _WritesThroughEvalDropout()(want_in)
    got = opt(got_in)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_in, want_in, rtol=0, atol=0)
    assert not torch.equal(got_in, signed(2, 3, 4, 4))


class _RuntimeTraining(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.5, self.training) * 2


def test_not_training_negative_a_train_flag_read_at_run_time_stays():
    m = torch.jit.script(_RuntimeTraining().eval())
    graph = m.graph.copy()
    torch._C._jit_pass_inline(graph)
    report = torchfuse.fuse_graph(graph)
    assert report["zero_dropouts_removed"] == 0 and dropouts(graph) == 1, graph


class _AttributeRate(nn.Module):
    """p read from a float attribute at run time (nn.Dropout's p is a
    scripted constant, and goes)."""

    def __init__(self):
        super().__init__()
        self.rate = 0.0

    def forward(self, x):
        return F.dropout(x, self.rate, self.training) * 2


def test_zero_probability_negative_a_probability_read_from_an_attribute_stays():
    m = torch.jit.script(_AttributeRate().train())
    graph = m.graph.copy()
    torch._C._jit_pass_inline(graph)
    report = torchfuse.fuse_graph(graph)
    assert report["zero_dropouts_removed"] == 0 and dropouts(graph) == 1, graph
    # the module may set the rate later: the optimized module honours it
    opt = torchfuse.optimize(m)
    opt.rate = 1.0
    assert torch.count_nonzero(opt(signed(8, 8))) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_write_through_a_dropout_of_runtime_probability_reaches_its_input(kind):
    """p known at run time only: ATen returns the input itself at p = 0, so
    the in-place hardtanh writes x in eager.  The dropout becomes
    prim::If(p == 0 or not train) of its input or itself, and the write stays
    one to x (the bare node let EliminateDeadCode drop it as a write to a
    dead fresh tensor)."""
    cu = torch.jit.CompilationUnit(f"""
def write_through(x, p: float, train: bool):
    y = x * 2
    torch.nn.functional.hardtanh(torch.{kind}(x, p, train), 0.0, 0.5, inplace=True)
    return y
""")
    graph = cu.write_through.graph.copy()
    report = torchfuse.fuse_graph(graph)
    assert report["zero_dropouts_removed"] == 0
    assert len(graph.findAllNodes("prim::If")) >= 1 and dropouts(graph) == 1, graph
    torch._C._jit_pass_dce(graph)
    assert dropouts(graph) == 1, "the write was taken for a dead one"
    run = torch._C._create_function_from_graph("rewritten", graph)
    for p, train in ((0.0, True), (0.5, False)):
        x = signed(4, 6, seed=7) * 3
        want = x.clone()
        F.hardtanh(getattr(torch, kind)(want, p, train), 0.0, 0.5, inplace=True)  # eager writes want
        run(x, p, train)
        torch.testing.assert_close(x, want, rtol=0, atol=0)


def test_runtime_probability_negative_a_dropout_not_written_through_stays_bare():
    """Only a dropout whose result is written in place gets the guard."""
    cu = torch.jit.CompilationUnit("""
def bare(x, p: float, train: bool):
    return torch.dropout(x, p, train) * 2
""")
    graph = cu.bare.graph.copy()
    torchfuse.fuse_graph(graph)
    assert graph.findAllNodes("prim::If") == [] and dropouts(graph) == 1, graph


def test_a_scripted_nn_dropout_of_zero_goes():
    m = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.Tanh()).train())
    opt = torchfuse.optimize(m)
    assert dropouts(opt.graph) == 0
    x = signed(3, 4)
    torch.testing.assert_close(opt(x), m(x), rtol=0, atol=0)


def test_is_dropout_negative_other_random_ops_stay():
    def bernoulli_zero(x):
        return x * torch.bernoulli(torch.zeros_like(x), 0.0)

    graph, report, _ = fused(bernoulli_zero)
    assert report["zero_dropouts_removed"] == 0
    assert len(graph.findAllNodes("aten::bernoulli")) == 1


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, torchscript=True,
                                     return_dict=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(3)
    return transformers.BertModel(config).train()


def _trace(m, x):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(m, example_kwarg_inputs={"inputs_embeds": x}, check_trace=False)


def _step(f, params, x, g):
    for p in params:
        p.grad = None
    out = f(x)[0]
    out.backward(g)
    return out.detach().clone(), [None if p.grad is None else p.grad.clone() for p in params]


def test_traced_tiny_bert_in_training_keeps_outputs_and_gradients():
    """transformers traces its dropouts with the constant p: the zero ones go
    and the training step is eager's (outputs, every parameter gradient)."""
    bert = _tiny_bert()
    x = signed(2, 8, 16, seed=1)
    g = signed(2, 8, 16, seed=2)
    traced = _trace(copy.deepcopy(bert), x)
    graph = traced.inlined_graph
    report = torchfuse.fuse_graph(graph)
    assert report["zero_dropouts_removed"] >= 5 and dropouts(graph) == 0, report  # embeddings + 2 per layer
    opt = torchfuse.optimize(traced)
    assert dropouts(opt.graph) == 0 and dropouts(traced.inlined_graph) >= 5
    params = [p for p in opt.parameters() if p.requires_grad]
    want_out, want_grads = _step(lambda t: bert(inputs_embeds=t), list(bert.parameters()), x, g)
    for _ in range(3):  # the profiling run, then the optimized graph
        out, grads = _step(opt, params, x, g)
        torch.testing.assert_close(out, want_out)
        assert len(grads) == len(want_grads)
        assert [a is None for a in grads] == [b is None for b in want_grads]
        assert sum(a is not None for a in grads) > 20
        for a, b in zip(grads, want_grads):
            if a is not None:
                torch.testing.assert_close(a, b)


class _ZeroDropoutNet(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.0, True) * 1.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_a_zero_dropout_drops_nothing_in_training():
    """The case the pass exists for: TorchScript's autodiff runs the dropout
    as native_dropout, whose CUDA kernel drops an element of 2^26 about twice
    per call at p = 0; the optimized module returns every element, each call."""
    x = signed(1 << 26, seed=4).cuda().requires_grad_()
    traced = torch.jit.trace(_ZeroDropoutNet(), (x,))
    opt = torchfuse.optimize(traced)
    assert dropouts(opt.graph) == 0 and dropouts(traced.inlined_graph) == 1
    want = x.detach() * 1.5
    for _ in range(4):
        out = opt(x)
        out.sum().backward()
        torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
