"""End-to-end tests of torchfuse.optimize on small scripted/traced modules:
the fused ops appear, and outputs, gradients and BN running statistics match
the original module."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.testing import FileCheck

import torchfuse

DTYPES = [torch.float32, torch.float64]


pytestmark = pytest.mark.usefixtures("no_texpr_fuser")


# ---- models, one per pattern variant ----------------------------------------


class LinearAddRelu(nn.Module):
    # NB: constants, so that scripting resolves the variant statically.
    __constants__ = ["inplace", "swap", "functional_relu"]

    def __init__(self, bias=True, inplace=False, swap=False, functional_relu=False):
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=bias)
        self.inplace, self.swap, self.functional_relu = inplace, swap, functional_relu

    def forward(self, x, r):
        y = self.fc(x)
        if self.inplace:
            y = y + r
            return y.relu_()
        s = r + y if self.swap else y + r
        if self.functional_relu:
            return F.relu(s)
        return torch.relu(s)


class UserLinearBias(nn.Module):
    """Linear(bias=False) + a separate bias + ReLU (a user's model)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3, bias=False)
        self.bias = nn.Parameter(torch.randn(3))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.fc(x) + self.bias)


class ConvReluAdd(nn.Module):
    __constants__ = ["swap"]

    def __init__(self, dim=2, bias=True, swap=False, inplace=False):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.conv = conv(3, 3, 3, padding=1, bias=bias)
        self.act = nn.ReLU(inplace=inplace)
        self.swap = swap

    def forward(self, x):
        y = self.act(self.conv(x))
        return x + y if self.swap else y + x


class UserConvBias(nn.Module):
    """Conv2d + ReLU + per-channel bias (a user's model)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bias = nn.Parameter(torch.randn(4, 1, 1))

    def forward(self, x):
        return F.relu(self.conv(x)) + self.bias


class BnSwish(nn.Module):
    """Linear + BatchNorm1d + scalar bias (1,) + division by a float attribute
    + x * sigmoid(x) (a user's model)."""

    __constants__ = ["silu", "sigmoid_first", "relu_first"]

    def __init__(self, silu=False, sigmoid_first=False, relu_first=False):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.bn = nn.BatchNorm1d(5)
        self.bias = nn.Parameter(torch.randn(1))
        self.scale = 2.5
        self.silu, self.sigmoid_first, self.relu_first = silu, sigmoid_first, relu_first

    def forward(self, x):
        h = self.fc(x)
        if self.relu_first:
            h = torch.relu(h)
        t = (self.bn(h) + self.bias) / self.scale
        if self.silu:
            return F.silu(t)
        if self.sigmoid_first:
            return torch.sigmoid(t) * t
        return t * torch.sigmoid(t)


class PlainRelu(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2)


class InBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, n: int):
        if bool(x.sum() > 0):
            x = torch.relu(self.fc(x) + x)
        for _ in range(n):
            x = torch.relu(self.fc(x) + x)
        return x


# ---- helpers ------------------------------------------------------------------


def _script(m, dtype):
    return torch.jit.script(m.to(dtype))


def _optimize(scripted, freeze=False):
    # NB: every pass, the opt-in ones (relu) included
    out = torchfuse.optimize(scripted, freeze=freeze, passes=torchfuse.pass_names())
    assert isinstance(out, torch.jit.ScriptModule)
    return out


def _check_same(ref, opt, inputs, frozen=False):
    """Outputs, input gradients and parameter gradients match."""
    ins_a = [i.detach().clone().requires_grad_(i.is_floating_point()) if isinstance(i, torch.Tensor) else i for i in inputs]
    ins_b = [i.detach().clone().requires_grad_(i.is_floating_point()) if isinstance(i, torch.Tensor) else i for i in inputs]
    out_a, out_b = ref(*ins_a), opt(*ins_b)
    torch.testing.assert_close(out_b, out_a)
    if not out_a.requires_grad:
        return
    g = torch.randn_like(out_a)
    out_a.backward(g)
    out_b.backward(g)
    for a, b in zip(ins_a, ins_b):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            torch.testing.assert_close(b.grad, a.grad)
    if frozen:
        return  # parameters are constants of the frozen graph
    pa = dict(ref.named_parameters())
    pb = dict(opt.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert pb[name].is_leaf
        if p.grad is not None:
            torch.testing.assert_close(pb[name].grad, p.grad)


def _twin(model, dtype):
    """A scripted module and an independent deep copy (same weights)."""
    a = _script(model, dtype)
    b = _script(copy.deepcopy(model), dtype)
    return a, b


# ---- linear_add_relu ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"bias": False}, {"inplace": True}, {"swap": True}, {"functional_relu": True}],
    ids=["bias", "no_bias", "inplace", "swap", "F.relu"],
)
def test_linear_add_relu(kwargs, dtype):
    torch.manual_seed(0)
    ref, src = _twin(LinearAddRelu(**kwargs), dtype)
    opt = _optimize(src)
    # chainIsAddSelf: `r + linear` keeps r's strides in eager; not the seed
    # op's chain, custom_linear_act takes it with the residual first
    fused = not kwargs.get("swap")
    FileCheck().check("torchfuse::custom_linear_add_relu" if fused else "torchfuse::custom_linear_act").run(
        opt.graph)
    assert torchfuse.report(opt)["linear_add_relu"] == int(fused)
    assert torchfuse.report(opt)["linear_act"] == int(not fused)
    x, r = torch.randn(5, 4, dtype=dtype), torch.randn(5, 3, dtype=dtype)
    _check_same(ref, opt, [x, r])


class InPlaceAddRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, r):
        y = self.fc(x)
        y += r
        return torch.relu(y)


def test_inplace_add_keeps_its_dtype_and_is_not_fused():
    # addPromotes: `y += r` keeps y's dtype where `y + r` (and the seed op)
    # would promote to r's; custom_linear_act takes it as add_ (promote
    # false), which keeps it.
    torch.manual_seed(0)
    ref, src = _twin(InPlaceAddRelu(), torch.float32)
    opt = _optimize(src)
    FileCheck().check_not("torchfuse::custom_linear_add_relu").check("torchfuse::custom_linear_act").run(
        opt.graph)
    x, r = torch.randn(5, 4), torch.randn(5, 3, dtype=torch.float64)
    out = opt(x, r)
    assert out.dtype == ref(x, r).dtype == torch.float32
    torch.testing.assert_close(out, ref(x, r))


@pytest.mark.parametrize("dtype", DTYPES)
def test_user_linear_bias_relu_fuses_fully(dtype):
    torch.manual_seed(0)
    ref, src = _twin(UserLinearBias(), dtype)
    opt = _optimize(src)
    FileCheck().check("torchfuse::custom_linear_add_relu").check_not("aten::relu").run(opt.graph)
    _check_same(ref, opt, [torch.randn(6, 4, dtype=dtype)])


# ---- conv_relu_add ------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs,shape",
    [
        ({}, (2, 3, 5, 5)),
        ({"bias": False}, (2, 3, 5, 5)),
        ({"swap": True}, (2, 3, 5, 5)),
        ({"inplace": True}, (2, 3, 5, 5)),
        ({"dim": 1}, (2, 3, 7)),
        ({"dim": 3}, (1, 3, 3, 4, 4)),
    ],
    ids=["conv2d", "no_bias", "swap", "inplace_relu", "conv1d", "conv3d"],
)
def test_conv_relu_add(kwargs, shape, dtype):
    torch.manual_seed(0)
    ref, src = _twin(ConvReluAdd(**kwargs), dtype)
    opt = _optimize(src)
    # chainIsAddSelf: `x + relu(conv)` keeps x's strides in eager;
    # reluWritesConvOutput: relu_ keeps the conv output's.  Only their
    # conv -> relu fuses (conv_add_act)
    if kwargs.get("swap") or kwargs.get("inplace"):
        FileCheck().check("torchfuse::custom_conv_add_act").check("aten::add").run(opt.graph)
    else:
        FileCheck().check("torchfuse::custom_conv_relu_add").check_not("aten::conv").run(opt.graph)
    _check_same(ref, opt, [torch.randn(*shape, dtype=dtype)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_user_conv_relu_bias_fuses_fully(dtype):
    torch.manual_seed(0)
    ref, src = _twin(UserConvBias(), dtype)
    opt = _optimize(src)
    FileCheck().check("torchfuse::custom_conv_relu_add").check_not("aten::relu").run(opt.graph)
    _check_same(ref, opt, [torch.randn(2, 3, 6, 6, dtype=dtype)])


def test_traced_conv_is_canonicalized_and_fused():
    torch.manual_seed(0)
    model = ConvReluAdd()
    x = torch.randn(2, 3, 5, 5)
    traced = torch.jit.trace(model, (x,))
    opt = _optimize(traced)
    FileCheck().check("torchfuse::custom_conv_relu_add").check_not("aten::_convolution").run(opt.graph)
    _check_same(torch.jit.trace(copy.deepcopy(model), (x,)), opt, [x])


# ---- batch_norm_add_div_swish -------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kwargs", [{}, {"silu": True}, {"sigmoid_first": True}], ids=["x*sigmoid(x)", "silu", "sigmoid(x)*x"]
)
def test_bn_swish_training_matches_including_running_stats(kwargs, dtype):
    torch.manual_seed(0)
    ref, src = _twin(BnSwish(**kwargs), dtype)
    opt = _optimize(src)
    FileCheck().check("torchfuse::custom_batch_norm_add_div_swish(").check_not("aten::batch_norm").run(
        opt.graph
    )
    # Fully fused: nothing of the chain is left.
    FileCheck().check_not("aten::sigmoid").check_not("aten::silu").check_not("aten::div").run(opt.graph)
    x = torch.randn(8, 4, dtype=dtype)
    _check_same(ref, opt, [x])
    torch.testing.assert_close(opt.bn.running_mean, ref.bn.running_mean)
    torch.testing.assert_close(opt.bn.running_var, ref.bn.running_var)
    torch.testing.assert_close(opt.bn.num_batches_tracked, ref.bn.num_batches_tracked)
    # eval mode of the same (unfrozen) optimized module
    ref.eval()
    opt.eval()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bn_swish_frozen_uses_eval_op(dtype):
    torch.manual_seed(0)
    # NB: after a relu: freezing may fold a BatchNorm that follows a linear
    # into it (test_frozen_optimizations.py)
    model = BnSwish(relu_first=True)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    ref, src = _twin(model.eval(), dtype)
    opt = _optimize(src, freeze=True)
    FileCheck().check("torchfuse::custom_batch_norm_add_div_swish_eval").check_not("aten::batch_norm").run(
        opt.graph
    )
    x = torch.randn(8, 4, dtype=dtype, requires_grad=True)
    _check_same(ref, opt, [x], frozen=True)


# ---- relu, blocks, mixtures ----------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_relu(dtype):
    ref, src = _twin(PlainRelu(), dtype)
    opt = _optimize(src)
    FileCheck().check("torchfuse::custom_relu").check_not("aten::relu").run(opt.graph)
    _check_same(ref, opt, [torch.randn(4, 5, dtype=dtype)])


@pytest.mark.parametrize("freeze", [False, True])
def test_patterns_inside_if_and_loop(freeze):
    torch.manual_seed(0)
    ref, src = _twin(InBranches().eval() if freeze else InBranches(), torch.float32)
    opt = _optimize(src, freeze=freeze)
    assert torchfuse.report(opt)["linear_add_relu"] == 2
    x = torch.rand(3, 4)
    if freeze:
        with torch.no_grad():
            torch.testing.assert_close(opt(x, 2), ref(x, 2))
    else:
        _check_same(ref, opt, [x, 2])


def test_training_the_optimized_module_updates_the_shared_tensors():
    """The result shares the input's parameters and buffers (docs/usage.md)."""
    torch.manual_seed(0)
    src = torch.jit.script(BnSwish())
    mean, weight = src.bn.running_mean.clone(), src.fc.weight.detach().clone()
    opt = _optimize(src)
    sgd = torch.optim.SGD(opt.parameters(), lr=0.1)
    opt(torch.randn(8, 4)).sum().backward()
    sgd.step()
    assert opt.fc.weight is src.fc.weight and opt.bn.running_mean is src.bn.running_mean
    assert not torch.equal(src.bn.running_mean, mean)
    assert not torch.equal(src.fc.weight.detach(), weight)


@pytest.mark.parametrize("train", [True, False])
def test_frozen_and_unfrozen_in_train_and_eval(train):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU())
    ref, src = _twin(model.train(train), torch.float32)
    opt = _optimize(src, freeze=not train)
    # NB: conv -> relu is conv_add_act's chain, which runs before ReplaceRelu
    FileCheck().check("torchfuse::custom_conv_add_act").check_not("aten::relu").run(opt.graph)
    x = torch.randn(1, 3, 4, 4)
    _check_same(ref, opt, [x], frozen=not train)


# ---- module safety -------------------------------------------------------------


def test_optimize_leaves_original_and_sibling_instances_untouched():
    torch.manual_seed(0)
    a = torch.jit.script(LinearAddRelu())
    x, r = torch.randn(2, 4), torch.randn(2, 3)
    a(x, r)  # already executed
    before = str(a.graph)
    opt = _optimize(a)
    assert str(a.graph) == before
    FileCheck().check_not("torchfuse::").run(a.graph)
    FileCheck().check_not("torchfuse::").run(a.inlined_graph)
    b = torch.jit.script(LinearAddRelu())
    FileCheck().check_not("torchfuse::").run(b.inlined_graph)
    assert torchfuse.report(a)["linear_add_relu"] == 0
    assert torchfuse.report(opt)["linear_add_relu"] == 1
    # The optimized module shares a's parameters.
    torch.testing.assert_close(opt(x, r), a(x, r))


class WritesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        self.count.add_(1.0)
        return torch.relu(x + self.count)


def test_frozen_result_shares_written_buffers():
    """freeze_module keeps a written buffer as an attribute, which shares its
    tensor with the input module as every attribute of the result does."""
    src = torch.jit.script(WritesBuffer().eval())
    ref = torch.jit.script(WritesBuffer().eval())
    opt = _optimize(src, freeze=True)
    x = torch.randn(2, 3)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(opt(x), ref(x))
    torch.testing.assert_close(src.count, torch.full((3,), 2.0))
    assert opt.count is src.count


@pytest.mark.parametrize("freeze", [False, True])
def test_optimize_does_not_depend_on_executor_optimization(freeze):
    """Inline takes callees' optimized graphs, which are inlined only while
    the executor optimizes; under optimized_execution(False) the calls
    inside submodules would stay (unfused, or freeze_module raising)."""
    torch.manual_seed(0)
    # NB: relu_first: freezing may fold a BatchNorm right after a linear
    ref, src = _twin(BnSwish(relu_first=freeze).train(not freeze), torch.float32)
    with torch.jit.optimized_execution(False):
        src(torch.randn(8, 4))  # caches the submodules' unoptimized graphs
        opt = _optimize(src, freeze=freeze)
    assert torchfuse.report(opt)["batch_norm_add_div_swish"] == 1
    opt_again = _optimize(src, freeze=freeze)
    assert torchfuse.report(opt_again)["batch_norm_add_div_swish"] == 1


def test_optimize_rejects_bad_arguments():
    with pytest.raises(TypeError, match="torch.jit.script"):
        torchfuse.optimize(LinearAddRelu())
    with pytest.raises(RuntimeError, match="unknown pass"):
        torchfuse.optimize(torch.jit.script(LinearAddRelu()), passes=["nope"])
    with pytest.raises(RuntimeError, match="eval mode"):
        torchfuse.optimize(torch.jit.script(LinearAddRelu()), freeze=True)


def test_pass_selection():
    opt = torchfuse.optimize(torch.jit.script(LinearAddRelu()), passes=["relu"])
    FileCheck().check("aten::linear").check("torchfuse::custom_relu").run(opt.graph)


def test_fuse_graph_on_a_fresh_graph():
    m = torch.jit.script(LinearAddRelu())
    g = m.inlined_graph
    torch._C._jit_pass_constant_propagation(g)
    counts = torchfuse.fuse_graph(g)
    assert counts["linear_add_relu"] == 1
    FileCheck().check("torchfuse::custom_linear_add_relu").run(g)


def test_save_load_round_trip_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = BnSwish(relu_first=True).eval()  # NB: see test_bn_swish_frozen_uses_eval_op
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    path = str(tmp_path / "m.pt")
    torch.jit.save(opt, path)
    x = torch.randn(4, 4)
    torch.save(x, str(tmp_path / "x.pt"))
    with torch.no_grad():
        torch.save(opt(x), str(tmp_path / "y.pt"))
    script = textwrap.dedent(
        f"""
        import warnings, torch
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.ops.load_library({torchfuse.library_path()!r})
        m = torch.jit.load({path!r})
        assert "torchfuse::custom_batch_norm_add_div_swish_eval" in str(m.graph)
        x = torch.load({str(tmp_path / 'x.pt')!r})
        y = torch.load({str(tmp_path / 'y.pt')!r})
        with torch.no_grad():
            torch.testing.assert_close(m(x), y)
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCHFUSE_BUILD_DIR")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


# ---- negative cases, one per filter --------------------------------------------


class ScalarAdd(nn.Module):  # isTensorAdd
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.relu(self.fc(x) + 1.0)


class ReturnsIntermediate(nn.Module):  # hasSingleUse
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, r):
        y = self.fc(x)
        return torch.relu(y + r), y


class AlphaOnLinear(nn.Module):  # alphaIsOne
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, r):
        return torch.relu(r.add(self.fc(x), alpha=2))


class InPlaceOnLive(nn.Module):  # notInPlaceOnLiveTensor
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, r):
        r.add_(self.fc(x))
        return torch.relu(r)


class SamePadding(nn.Module):  # isIntListConv
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding="same")

    def forward(self, x):
        return torch.relu(self.conv(x)) + x


class TensorDivisor(nn.Module):  # isScalarDivisor
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, d):
        t = (self.bn(x) + x) / d
        return t * torch.sigmoid(t)


class RoundingDiv(nn.Module):  # isScalarDivisor (rounding_mode)
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        t = torch.div(self.bn(x) + x, 2.0, rounding_mode="floor")
        return t * torch.sigmoid(t)


class NoRunningStats(nn.Module):  # runningStatsPresent
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4, track_running_stats=False)

    def forward(self, x):
        t = (self.bn(x) + x) / 2.0
        return t * torch.sigmoid(t)


class OtherWrittenAfter(nn.Module):  # notWrittenAfter
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, r):
        r = r * 1.0
        t = (self.bn(x) + r) / 2.0
        out = t * torch.sigmoid(t)
        r.mul_(0.5)  # the fused op would have saved r for its backward
        return out, r


def test_bn_chain_whose_other_is_written_afterwards_stays_and_trains():
    torch.manual_seed(0)
    ref, src = _twin(OtherWrittenAfter(), torch.float32)
    opt = _optimize(src)
    assert torchfuse.report(opt)["batch_norm_add_div_swish"] == 0
    x, r = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    (out_a, r_a), (out_b, r_b) = ref(x, r), opt(x, r)
    torch.testing.assert_close(out_b, out_a)
    (ga,) = torch.autograd.grad(out_a.sum(), r)
    (gb,) = torch.autograd.grad(out_b.sum(), r)
    torch.testing.assert_close(gb, ga)


@pytest.mark.parametrize(
    "model,inputs,kind",
    [
        (ScalarAdd, lambda: [torch.randn(2, 4)], "linear_add_relu"),
        (ReturnsIntermediate, lambda: [torch.randn(2, 4), torch.randn(2, 3)], "linear_add_relu"),
        (AlphaOnLinear, lambda: [torch.randn(2, 4), torch.randn(2, 3)], "linear_add_relu"),
        (InPlaceOnLive, lambda: [torch.randn(2, 4), torch.randn(2, 3)], "linear_add_relu"),
        (SamePadding, lambda: [torch.randn(1, 3, 5, 5)], "conv_relu_add"),
        (TensorDivisor, lambda: [torch.randn(3, 4), torch.tensor(2.0)], "batch_norm_add_div_swish"),
        (RoundingDiv, lambda: [torch.randn(3, 4)], "batch_norm_add_div_swish"),
        (NoRunningStats, lambda: [torch.randn(3, 4)], "batch_norm_add_div_swish"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else None,
)
def test_filters_prevent_fusion(model, inputs, kind):
    torch.manual_seed(0)
    m = model()
    ref = torch.jit.script(copy.deepcopy(m))
    opt = _optimize(torch.jit.script(m))
    assert torchfuse.report(opt)[kind] == 0
    FileCheck().check_not(f"torchfuse::custom_{kind}").run(opt.graph)
    a, b = inputs(), None
    b = [t.clone() for t in a]
    with torch.no_grad():
        torch.testing.assert_close(opt(*b), ref(*a))


class ReluInPlaceOnBuffer(nn.Module):  # isFreshUnaliasedTensor
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.randn(4))

    def forward(self, x):
        return x + self.state.relu_()


def test_relu_inplace_on_a_buffer_stays_inplace():
    """relu_ writes module state here: made functional, the buffer would keep
    its negative values."""
    torch.manual_seed(0)
    m = ReluInPlaceOnBuffer()
    assert bool((m.state < 0).any())
    ref = torch.jit.script(copy.deepcopy(m))
    opt = _optimize(torch.jit.script(m))
    assert torchfuse.report(opt)["relu"] == 0
    FileCheck().check("aten::relu_").check_not("torchfuse::custom_relu").run(opt.graph)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x))
    assert bool((opt.state >= 0).all())
    torch.testing.assert_close(opt.state, ref.state)


class _ConvBnReluInPlace(nn.Module):
    """torchvision's block: no chain torchfuse fuses by default but
    conv_add_act (conv -> relu_ once frozen folds the BN) and, unfrozen,
    conv_batch_norm_act."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("freeze", [False, True])
def test_unfused_in_place_relu_stays_in_place(freeze):
    """Canonicalize makes relu_ functional for matching; with no fusion
    taking it, the optimized graph keeps relu_ (no extra allocation)."""
    torch.manual_seed(0)
    ref, src = _twin(_ConvBnReluInPlace().train(not freeze), torch.float32)
    passes = [f["name"] for f in torchfuse.fusions()
              if f["by_default"] and f["name"] not in ("conv_add_act", "conv_batch_norm_act")]
    opt = torchfuse.optimize(src, freeze=freeze, passes=passes)
    # NB: unfrozen and with nothing fused, the result runs src's own methods
    graph = opt.graph if freeze else opt.inlined_graph
    FileCheck().check("aten::relu_(").check_not("aten::relu(").run(graph)
    assert not any(torchfuse.report(opt).values())
    _check_same(ref, opt, [torch.randn(2, 3, 5, 5)], frozen=freeze)
