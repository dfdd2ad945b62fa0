"""custom_linear_act and the linear_act fusion: act(linear(x, W, b)).

CPU: the op against the float64 eager chain for every activation, 2-D and
3-D inputs, with and without bias; gradcheck and gradgradcheck; opcheck;
NaN/Inf as eager; autocast dtypes; scripted, frozen and optimized modules,
optimize_for_inference's matmul + add form, a small BERT (transformers) and
torchvision's mobilenet_v3_small classifier.  CUDA (marked `cuda`):
float32 (TF32 off and on)/16/bfloat16, error against float64 at most 2x
eager's, NaN/Inf, fallbacks."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.testing import FileCheck

import torchfuse

from cuda_utils import CUDA_ONLY, assert_close_to_reference, poison_allocator, tf32_flags

op = torch.ops.torchfuse.custom_linear_act

# name -> (activation_args, eager function)
ACTS = {
    "none": ([], lambda t: t),
    "relu": ([], F.relu),
    "relu_": ([], lambda t: t.relu_()),
    "hardtanh": ([-0.5, 1.5], lambda t: F.hardtanh(t, -0.5, 1.5)),
    "silu": ([], F.silu),
    "hardswish": ([], F.hardswish),
    "hardsigmoid": ([], F.hardsigmoid),
    "sigmoid": ([], torch.sigmoid),
    "gelu": ([], F.gelu),
    "gelu_tanh": ([], lambda t: F.gelu(t, approximate="tanh")),
    "leaky_relu": ([0.2], lambda t: F.leaky_relu(t, 0.2)),
}
SHAPES = {"2d": (7, 9), "3d": (2, 5, 9), "1d": (9,)}


def signed(*sizes, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*sizes, dtype=dtype, device=device)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)
    return t.requires_grad_(requires_grad)


def eager(x, w, b, act):
    return ACTS[act][1](F.linear(x, w, b))


def d(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpu_matches_the_float64_chain(act, shape):
    torch.manual_seed(len(act) * 10 + len(shape))
    x = signed(*SHAPES[shape]) * 2
    w = signed(6, 9)
    for b in (signed(6), None):
        out = op(x, w, b, act, ACTS[act][0])
        ref = eager(d(x), d(w), d(b), act)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        # the CPU kernel is eager's own chain, strides included
        want = eager(x, w, b, act)
        assert torch.equal(out, want) and out.stride() == want.stride()


@pytest.mark.parametrize("act", ["relu", "hardtanh", "silu", "hardswish", "gelu", "gelu_tanh", "leaky_relu",
                                 "sigmoid"])
def test_gradcheck_and_gradgradcheck(act):
    torch.manual_seed(1)
    g = dict(dtype=torch.float64, requires_grad=True)
    x, w, b = signed(2, 3, 5, **g), signed(4, 5, **g), signed(4, **g)
    fn = lambda x, w, b: op(x, w, b, act, ACTS[act][0])  # noqa: E731
    gradcheck(fn, (x, w, b))
    gradgradcheck(fn, (x, w, b))


def test_gradients_are_eagers():
    torch.manual_seed(2)
    x, w, b = signed(3, 4, 8, requires_grad=True), signed(5, 8, requires_grad=True), signed(5, requires_grad=True)
    out = op(x, w, b, "relu_", [])
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    want = F.linear(*leaves).relu_()
    g = signed(*out.shape)
    for a, r in zip(torch.autograd.grad(out, (x, w, b), g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("sample", ["bias", "no_bias", "3d"])
def test_opcheck(sample):
    torch.manual_seed(3)
    g = dict(requires_grad=True)
    if sample == "bias":
        args = (signed(4, 6, **g), signed(5, 6, **g), signed(5, **g), "hardtanh", [0.0, 6.0])
    elif sample == "no_bias":
        args = (signed(4, 6, **g), signed(5, 6, **g), None, "silu", [])
    else:
        args = (signed(2, 3, 6, **g), signed(5, 6, **g), signed(5, **g), "gelu", [])
    torch.library.opcheck(op, args)


def test_rejects_bad_arguments_by_name():
    x, w = signed(3, 4), signed(5, 4)
    with pytest.raises(RuntimeError, match="custom_linear_act: expected activation to be one of .* got 'tanh'"):
        op(x, w, None, "tanh", [])
    with pytest.raises(RuntimeError, match="custom_linear_act: expected activation_args to have 2 elements for "
                                           "activation 'hardtanh', got 1"):
        op(x, w, None, "hardtanh", [1.0])
    with pytest.raises(RuntimeError, match=r"custom_linear_act: expected input.size\(-1\) to equal weight.size"):
        op(signed(3, 5), w, None, "relu", [])


@pytest.mark.parametrize("act", list(ACTS))
def test_nan_and_inf_as_eager(act):
    torch.manual_seed(4)
    x, w, b = signed(4, 6), signed(5, 6), signed(5)
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    x[1, 0] = float("inf")
    b[2] = -float("inf")
    out = op(x, w, b, act, ACTS[act][0])
    want = eager(x, w, b, act)
    torch.testing.assert_close(out, want, equal_nan=True)
    assert out.isnan().any()  # the case reaches the activation


def test_autocast_dtype_is_linears():
    torch.manual_seed(5)
    x, w, b = signed(4, 6), signed(5, 6), signed(5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = op(x, w, b, "gelu", [])
        want = F.gelu(F.linear(x, w, b))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


# ---- the fusion ---------------------------------------------------------------


class Mlp(nn.Module):
    def __init__(self, act, bias=True):
        super().__init__()
        self.fc = nn.Linear(8, 6, bias=bias)
        self.act = act

    def forward(self, x):
        return self.act(self.fc(x))


MODULE_ACTS = {
    "relu_": nn.ReLU(inplace=True), "relu6": nn.ReLU6(), "hardswish": nn.Hardswish(), "silu": nn.SiLU(),
    "sigmoid": nn.Sigmoid(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"),
    "leaky_relu": nn.LeakyReLU(0.3), "hardsigmoid": nn.Hardsigmoid(inplace=True),
}


@pytest.mark.parametrize("freeze", [False, True])
@pytest.mark.parametrize("act", list(MODULE_ACTS))
def test_scripted_modules(act, freeze):
    torch.manual_seed(6)
    model = Mlp(MODULE_ACTS[act]).eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=freeze)
    FileCheck().check("torchfuse::custom_linear_act").check_not("aten::linear").run(opt.inlined_graph)
    assert torchfuse.report(opt)["linear_act"] == 1
    for shape in ((3, 8), (2, 4, 8)):
        x = signed(*shape)
        with torch.no_grad():
            ref = Mlp(MODULE_ACTS[act]).double().eval()
            ref.load_state_dict(model.state_dict())
            torch.testing.assert_close(opt(x).double(), ref(x.double()), rtol=1e-5, atol=1e-6)


def test_training_gradients_through_the_fused_op():
    torch.manual_seed(7)
    model = Mlp(nn.GELU())
    opt = torchfuse.optimize(torch.jit.script(model))
    assert torchfuse.report(opt)["linear_act"] == 1
    x = signed(2, 3, 8)
    opt(x).square().sum().backward()
    model(x).square().sum().backward()
    fused = dict(opt.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name].grad, p.grad)


def test_gradient_penalty_through_the_fused_op():
    """Double backward (WGAN-GP's penalty) through custom_linear_act in a
    scripted, optimized module: eager's own, the ATen chain being recorded."""
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(6, 8), nn.SiLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)).double()
    original = torch.jit.script(model)
    optimized = torchfuse.optimize(original)
    assert torchfuse.report(optimized)["linear_act"] == 2
    x = signed(16, 6, dtype=torch.float64, requires_grad=True)

    def penalty_grads(m):
        (gx,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
        penalty = ((gx.norm(2, dim=1) - 1) ** 2).mean()
        params = list(m.parameters())
        grads = torch.autograd.grad(penalty, params, allow_unused=True)  # the last bias: unused
        return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]

    got, want = penalty_grads(optimized), penalty_grads(original)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert sum(g.abs().sum() for g in got) > 0


def test_intermediate_used_twice_stays_unfused():
    class TwoUses(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return F.relu(y), y

    opt = torchfuse.optimize(torch.jit.script(TwoUses().eval()), freeze=True)
    assert torchfuse.report(opt)["linear_act"] == 0
    FileCheck().check("aten::linear").check("aten::relu").run(opt.graph)


def test_linear_add_relu_keeps_its_chain():
    class Seed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, y):
            return F.relu(self.fc(x) + y)

    opt = torchfuse.optimize(torch.jit.script(Seed().eval()), freeze=True)
    assert torchfuse.report(opt)["linear_act"] == 0
    assert torchfuse.report(opt)["linear_add_relu"] == 1


def _optimized_for_inference(model):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ofi = torch.jit.optimize_for_inference(torch.jit.script(model))
    graph = ofi.graph.copy()
    FileCheck().check("aten::matmul").run(graph)
    counts = torchfuse.fuse_graph(graph, passes=["linear_act"])
    return ofi, graph, counts["linear_act"], torch._C._create_function_from_graph("fused", graph)


def test_optimize_for_inference_matmul_form():
    """FrozenLinearTranspose leaves matmul(x, Wᵀ) of a linear without bias:
    fused as a linear, under autocast too."""
    torch.manual_seed(8)
    model = Mlp(nn.SiLU(), bias=False).eval()
    ofi, graph, fused, fn = _optimized_for_inference(model)
    assert fused == 1
    FileCheck().check("torchfuse::custom_linear_act").check_not("aten::matmul").run(graph)
    x = signed(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(fn(ofi._c, x), model(x), rtol=1e-5, atol=1e-6)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got, want = fn(ofi._c, x), ofi(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)


def test_optimize_for_inference_matmul_add_form_stays_unfused():
    """matmul(x, Wᵀ) + b is not a linear under autocast: the add promotes
    the bfloat16 matmul with the float32 bias to float32."""
    torch.manual_seed(8)
    model = Mlp(nn.ReLU(), bias=True).eval()
    ofi, graph, fused, fn = _optimized_for_inference(model)
    assert fused == 0
    x = signed(2, 3, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert fn(ofi._c, x).dtype == ofi(x).dtype == torch.float32


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
    # NB: as bench/models.py traces BERT (return_dict=False: transformers 5
    # dropped torchscript=True's implication)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, torchscript=True,
                                     return_dict=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(9)
    return transformers.BertModel(config).eval(), config


@pytest.mark.parametrize("freeze", [False, True])
def test_traced_tiny_bert(freeze):
    model, config = _tiny_bert()
    ids = torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad(), warnings.catch_warnings():
        # NB: transformers' shape conditions become trace constants, each
        # with a TracerWarning: expected, the shapes do not change
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, (ids,))
        want = model(ids)[0]
    opt = torchfuse.optimize(traced, freeze=freeze)
    # the intermediate dense -> gelu (exact) of each layer
    assert torchfuse.report(opt)["linear_act"] == config.num_hidden_layers
    graph = opt.graph if freeze else opt.inlined_graph
    assert str(graph).count("torchfuse::custom_linear_act") == config.num_hidden_layers
    FileCheck().check("prim::Constant[value=\"gelu\"]").run(graph)
    with torch.no_grad():
        got = opt(ids)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_torchvision_mobilenet_classifier():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(10)
    model = torchvision.models.mobilenet_v3_small().eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    assert torchfuse.report(opt)["linear_act"] == 1  # classifier: linear -> hardswish
    FileCheck().check("torchfuse::custom_linear_act").run(opt.graph)
    x = signed(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(opt(x).double(), model.double()(x.double()), rtol=1e-3, atol=1e-4)


# ---- CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("shape", ["2d", "3d"])
@pytest.mark.parametrize("tf32", [False, True])
@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_against_float64(dtype, act, shape, tf32):
    if tf32 and dtype != torch.float32:
        pytest.skip("TF32 concerns float32 only")
    torch.manual_seed(11)
    sizes = {"2d": (24, 40), "3d": (3, 10, 40)}[shape]
    x = signed(*sizes, dtype=dtype, device="cuda") * 2
    w = signed(56, 40, dtype=dtype, device="cuda") * 0.3
    for b in (signed(56, dtype=dtype, device="cuda"), None):
        with tf32_flags(tf32, None):
            want = eager(x, w, b, act)
            poison_allocator([want.numel() * want.element_size()])
            got = op(x, w, b, act, ACTS[act][0])
        ref = eager(d(x).cpu(), d(w).cpu(), None if b is None else d(b).cpu(), act)
        assert got.stride() == want.stride()
        assert_close_to_reference(got, want, ref, what=f"{act} {shape} {dtype} tf32={tf32} bias={b is not None}")


@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_nan_inf_fallbacks_and_empty():
    torch.manual_seed(12)
    x, w, b = signed(8, 16, device="cuda"), signed(12, 16, device="cuda"), signed(12, device="cuda")
    x[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    b[1] = float("nan")
    for act, (args, _) in ACTS.items():
        got = op(x, w, b, act, args)
        want = eager(x, w, b, act)
        torch.testing.assert_close(got, want, equal_nan=True, msg=act)
        assert got.isnan().any(), act  # relu(NaN) stays NaN (not cuBLASLt's RELU epilogue)
    # non-contiguous input and float64 take the composite
    xt = signed(16, 8, device="cuda").t()
    torch.testing.assert_close(op(xt, w, b, "silu", []), F.silu(F.linear(xt, w, b)), equal_nan=True)
    x64, w64, b64 = x.double(), w.double(), b.double()
    torch.testing.assert_close(op(x64, w64, b64, "relu", []), F.relu(F.linear(x64, w64, b64)), equal_nan=True)
    empty = op(x[:0], w, b, "relu", [])
    assert empty.shape == (0, 12)


@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_autograd_and_autocast():
    torch.manual_seed(13)
    x = signed(2, 5, 16, device="cuda", requires_grad=True)
    w, b = signed(12, 16, device="cuda", requires_grad=True), signed(12, device="cuda", requires_grad=True)
    out = op(x, w, b, "gelu", [])
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    want = F.gelu(F.linear(*leaves))
    g = signed(*out.shape, device="cuda")
    for a, r in zip(torch.autograd.grad(out, (x, w, b), g), torch.autograd.grad(want, leaves, g)):
        torch.testing.assert_close(a, r)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        got = op(x, w, b, "silu", [])
        want = F.silu(F.linear(x, w, b))
    assert got.dtype == want.dtype == torch.float16
    torch.testing.assert_close(got, want)


# ---- FX --------------------------------------------------------------------------


class FxMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 6), nn.Linear(6, 6, bias=False), nn.Linear(6, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x, r):
        y = self.act(self.fc1(x))          # a module activation
        y = torch.sigmoid(F.linear(y, self.fc2.weight))
        z = self.fc3(y)
        return F.silu(z), z + r            # z used twice: left


@pytest.mark.parametrize("how", ["symbolic_trace", "export"])
def test_fx_rewrites_linear_act(how):
    import torchfuse.fx as tfx

    torch.manual_seed(14)
    model = FxMlp().eval()
    x, r = signed(2, 3, 8), signed(2, 3, 4)
    if how == "export":
        ep = tfx.optimize_exported(torch.export.export(model, (x, r)))
        counts, run = tfx.report(ep), ep.module()
    else:
        gm = tfx.optimize(torch.fx.symbolic_trace(model))
        counts, run = tfx.report(gm), gm
    assert counts["linear_act"] == 2
    with torch.no_grad():
        for got, want in zip(run(x, r), model(x, r)):
            torch.testing.assert_close(got, want)
