"""custom_linear_act's residual forms and the linear -> add [-> act] fusion:
act(linear(x, W, b) + alpha * other) as the graph spells the add: add(y,
other, alpha), y.add_(other, alpha) into the fresh linear output, or
add(other, y, alpha) with the residual first (a transformer block's
`x + mlp(x)`).

CPU: the op against the float64 eager chain and bit for bit against eager's
float32 chain (strides included) in each spelling; broadcasting, dtype
promotion and strides as add gives them; gradcheck and gradgradcheck;
opcheck; errors naming the argument; NaN/Inf; autocast; scripted, frozen and
optimized modules with their negative forms; torchvision's VisionTransformer.
CUDA (marked `cuda`): the GEMM's C path in float32 (TF32 off and on)/16/
bfloat16 against float64 (at most 2x eager's error), and its fallbacks."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.testing import FileCheck

import torchfuse

from cuda_utils import CUDA_ONLY, assert_close_to_reference, poison_allocator, tf32_flags
from test_linear_act import ACTS, d, signed

op = torch.ops.torchfuse.custom_linear_act
FORMS = {  # name -> (promote, other_first)
    "add": (True, False),
    "add_": (False, False),
    "other_first": (True, True),
}


def eager(x, w, b, other, alpha, form, act):
    y = F.linear(x, w, b)
    if form == "add":
        y = torch.add(y, other, alpha=alpha)
    elif form == "add_":
        y = y.add_(other, alpha=alpha)
    else:
        y = torch.add(other, y, alpha=alpha)
    return ACTS[act][1](y)


def fused(x, w, b, other, alpha, form, act):
    promote, other_first = FORMS[form]
    return op(x, w, b, act, ACTS[act][0], other, alpha, promote, other_first)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("act", ["none", "relu_", "gelu", "silu", "hardtanh"])
@pytest.mark.parametrize("alpha", [1, 0.5])
@pytest.mark.parametrize("shape", [(7, 9), (2, 5, 9)])
def test_cpu_matches_the_float64_chain(form, act, alpha, shape):
    torch.manual_seed(len(form) + len(act) + len(shape))
    x, w = signed(*shape) * 2, signed(6, 9)
    other = signed(*shape[:-1], 6)
    for b in (signed(6), None):
        out = fused(x, w, b, other, alpha, form, act)
        ref = eager(d(x), d(w), d(b), d(other), alpha, form, act)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        want = eager(x, w, b, other, alpha, form, act)
        assert torch.equal(out, want) and out.stride() == want.stride() and out.dtype == want.dtype


def test_broadcasting_promotion_and_strides_as_add_gives_them():
    torch.manual_seed(1)
    x, w, b = signed(4, 9), signed(6, 9), signed(6)
    cases = [
        (signed(6), "add"),                                   # a per-feature residual broadcasts
        (signed(1, 6), "other_first"),
        (signed(4, 6, dtype=torch.float64), "add"),           # add promotes to float64
        (signed(4, 6, dtype=torch.float64), "other_first"),
        (signed(4, 6, dtype=torch.float64), "add_"),          # add_ keeps the linear output's float32
        (signed(6, 4).t(), "other_first"),                    # a transposed residual: add's strides
        (signed(6, 4).t(), "add"),
        (signed(3, 4, 6), "add"),                             # add grows the result
    ]
    for other, form in cases:
        out = fused(x, w, b, other, 1, form, "none")
        want = eager(x, w, b, other, 1, form, "none")
        what = f"{form} other {tuple(other.shape)} {other.dtype} stride {other.stride()}"
        assert out.dtype == want.dtype and out.shape == want.shape and out.stride() == want.stride(), what
        assert torch.equal(out, want), what


@pytest.mark.parametrize("form", list(FORMS))
def test_gradcheck_and_gradgradcheck(form):
    torch.manual_seed(2)
    g = dict(dtype=torch.float64, requires_grad=True)
    x, w, b, other = signed(2, 3, 5, **g), signed(4, 5, **g), signed(4, **g), signed(2, 3, 4, **g)
    fn = lambda x, w, b, o: fused(x, w, b, o, 0.5, form, "silu")  # noqa: E731
    gradcheck(fn, (x, w, b, other))
    gradgradcheck(fn, (x, w, b, other))


@pytest.mark.parametrize("form", list(FORMS))
def test_opcheck(form):
    torch.manual_seed(3)
    g = dict(requires_grad=True)
    promote, other_first = FORMS[form]
    args = (signed(2, 3, 6, **g), signed(5, 6, **g), signed(5, **g), "gelu", [], signed(2, 3, 5, **g), 2.0,
            promote, other_first)
    torch.library.opcheck(op, args)


def test_rejects_bad_residuals_by_name():
    x, w = signed(3, 4), signed(5, 4)
    with pytest.raises(RuntimeError, match=r"custom_linear_act: expected other .*broadcast.*got \[3, 4\]"):
        op(x, w, None, "none", [], signed(3, 4), 1, True, False)
    with pytest.raises(RuntimeError, match=r"custom_linear_act: expected other to broadcast to the linear "
                                           r"output's shape \[3, 5\] \(promote=false adds in place\), got \[2, 3, 5\]"):
        op(x, w, None, "none", [], signed(2, 3, 5), 1, False, False)
    with pytest.raises(RuntimeError, match="custom_linear_act: expected promote=True with other_first=True"):
        op(x, w, None, "none", [], signed(3, 5), 1, False, True)
    # what add takes, the op takes: add may grow the result in either order
    assert op(x, w, None, "none", [], signed(2, 3, 5), 1, True, True).shape == (2, 3, 5)


@pytest.mark.parametrize("form", list(FORMS))
def test_nan_and_inf_in_the_residual_as_eager(form):
    torch.manual_seed(4)
    x, w, b, other = signed(4, 6), signed(5, 6), signed(5), signed(4, 5)
    other[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    for alpha in (1, 0):  # 0 * NaN is NaN in eager
        out = fused(x, w, b, other, alpha, form, "relu")
        torch.testing.assert_close(out, eager(x, w, b, other, alpha, form, "relu"), equal_nan=True)
        assert out.isnan().any()


def test_autocast_dtypes_are_the_chains():
    torch.manual_seed(5)
    x, w, b, other = signed(4, 6), signed(5, 6), signed(5), signed(4, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for form in FORMS:
            got = fused(x, w, b, other, 1, form, "gelu")
            want = eager(x, w, b, other, 1, form, "gelu")
            # add promotes the bfloat16 linear output with the float32 residual; add_ keeps bfloat16
            assert got.dtype == want.dtype == (torch.bfloat16 if form == "add_" else torch.float32), form
            torch.testing.assert_close(got, want)


# ---- the fusion ---------------------------------------------------------------


class MlpBlock(nn.Module):
    """A transformer MLP block: x + fc2(gelu(fc1(x)))."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Forms(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, r):
        a = self.fc(x)
        a += r                                          # add_ into the linear output
        c = F.silu(torch.add(self.fc(x), r, alpha=2))  # add -> act
        return a, c


def _check_module(model, args, want_counts, freeze):
    opt = torchfuse.optimize(torch.jit.script(model), freeze=freeze)
    report = torchfuse.report(opt)
    for name, n in want_counts.items():
        assert report[name] == n, (name, report)
    with torch.no_grad():
        got = opt(*args)
        ref = model.double()(*[a.double() for a in args])
        model.float()
    got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)
    return opt


@pytest.mark.parametrize("freeze", [False, True])
def test_mlp_block_fuses_its_residual(freeze):
    torch.manual_seed(6)
    opt = _check_module(MlpBlock().eval(), (signed(2, 5, 8),), {"linear_act": 2}, freeze)
    graph = opt.graph if freeze else opt.inlined_graph
    FileCheck().check_not("aten::add").check_not("aten::linear").run(graph)


@pytest.mark.parametrize("freeze", [False, True])
def test_each_spelling_fuses(freeze):
    torch.manual_seed(7)
    _check_module(Forms().eval(), (signed(3, 8), signed(3, 8)), {"linear_act": 2}, freeze)


def test_a_sum_that_a_layer_norm_reads_stays_add_layer_norms():
    """sumIsLayerNormed: a post-LN block's dense -> add -> LayerNorm keeps
    the measured add -> layer_norm fusion."""

    class PostLn(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.ln(self.fc(x) + x)

    torch.manual_seed(8)
    _check_module(PostLn().eval(), (signed(2, 3, 8),), {"linear_act": 0, "add_layer_norm": 1}, True)


def test_an_add_into_the_residual_stays():
    """r.add_(fc(x)) writes r, which the caller sees: not this chain."""

    class IntoResidual(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x, r):
            r.add_(self.fc(x))
            return r

    torch.manual_seed(9)
    model = IntoResidual().eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    assert torchfuse.report(opt)["linear_act"] == 0
    x, r = signed(3, 8), signed(3, 8)
    r1, r2 = r.clone(), r.clone()
    with torch.no_grad():
        opt(x, r1)
        model(x, r2)
    torch.testing.assert_close(r1, r2)


def test_training_gradients_through_the_residual():
    torch.manual_seed(10)
    model = MlpBlock()
    opt = torchfuse.optimize(torch.jit.script(model))
    assert torchfuse.report(opt)["linear_act"] == 2
    x = signed(2, 3, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    opt(x).square().sum().backward()
    model(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    fused_params = dict(opt.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_params[name].grad, p.grad)


def _residual_calls(graph):
    calls = graph.findAllNodes("torchfuse::custom_linear_act")
    return calls, [n for n in calls if not isinstance(list(n.inputs())[5].type(), torch._C.NoneType)]


def _check_against_float64(opt, model, x):
    with torch.no_grad():
        got = opt(x).double()
        torch.testing.assert_close(got, model.double()(x.double()), rtol=1e-4, atol=1e-5)
    model.float()


def test_torchvision_swin_transformer():
    """A stage's last block ends in `x + mlp(norm2(x))` (its stochastic
    depth the identity in eval) read by the patch merging's slices, not a
    layer_norm: fc2 -> add with the residual first."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(11)
    model = models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                   window_size=[2, 2], num_classes=10).eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
    calls, residual = _residual_calls(opt.graph)
    assert len(residual) == 1 and len(calls) == 3, opt.graph  # and each block's fc1 -> gelu
    _check_against_float64(opt, model, signed(2, 3, 32, 32))


@pytest.mark.parametrize("freeze", [False, True])
def test_torchvision_vision_transformer_leaves_its_sums_to_add_layer_norm(freeze):
    """sumIsLayerNormed in a pre-LN model: every `x + mlp(x)` is read by the
    next block's ln_1 (or the encoder's ln), so each stays add -> layer_norm
    (custom_add_layer_norm, the sum written too); fc1 -> gelu fuses."""
    models = pytest.importorskip("torchvision.models")
    torch.manual_seed(11)
    model = models.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2, hidden_dim=16,
                                     mlp_dim=32, num_classes=10).eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=freeze)
    calls, residual = _residual_calls(opt.graph if freeze else opt.inlined_graph)
    assert len(calls) == 2 and residual == []
    assert torchfuse.report(opt)["add_layer_norm"] >= 2
    _check_against_float64(opt, model, signed(2, 3, 32, 32))


# ---- CUDA ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("act", ["none", "gelu", "relu"])
@pytest.mark.parametrize("tf32", [False, True])
@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_against_float64(dtype, form, act, tf32):
    if tf32 and dtype != torch.float32:
        pytest.skip("TF32 concerns float32 only")
    torch.manual_seed(12)
    x = signed(3, 10, 40, dtype=dtype, device="cuda") * 2
    w = signed(56, 40, dtype=dtype, device="cuda") * 0.3
    other = signed(3, 10, 56, dtype=dtype, device="cuda")
    for b in (signed(56, dtype=dtype, device="cuda"), None):
        for alpha in (1, 0.5):
            with tf32_flags(tf32, None):
                want = eager(x, w, b, other, alpha, form, act)
                poison_allocator([want.numel() * want.element_size()])
                got = fused(x, w, b, other, alpha, form, act)
            ref = eager(d(x).cpu(), d(w).cpu(), None if b is None else d(b).cpu(), d(other).cpu(), alpha, form, act)
            assert got.stride() == want.stride() and got.dtype == want.dtype
            assert_close_to_reference(got, want, ref, what=f"{form} {act} {dtype} tf32={tf32} alpha={alpha} "
                                                           f"bias={b is not None}")


@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_residual_fallbacks_and_nan():
    """What the GEMM's C does not take runs the chain: a broadcast, strided
    or float32 residual of a float16 linear, alpha 0 (NaN in the residual
    must reach the output), the residual first with alpha != 1."""
    torch.manual_seed(13)
    x, w, b = signed(8, 16, device="cuda"), signed(12, 16, device="cuda"), signed(12, device="cuda")
    other = signed(8, 12, device="cuda")
    other[0, 0] = float("nan")
    cases = [(signed(12, device="cuda"), 1, "add"), (signed(12, 8, device="cuda").t(), 1, "other_first"),
             (other, 0, "add"), (other, 2, "other_first"), (other, 1, "add_")]
    for o, alpha, form in cases:
        got, want = fused(x, w, b, o, alpha, form, "relu"), eager(x, w, b, o, alpha, form, "relu")
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, equal_nan=True, msg=f"{form} alpha={alpha}")
    h = x.half(), w.half(), b.half()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        got, want = fused(x, w, b, other, 1, "add", "none"), eager(x, w, b, other, 1, "add", "none")
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, equal_nan=True)
    got = fused(*h, other, 1, "other_first", "none")
    assert got.dtype == torch.float32  # add promotes with the float32 residual
