"""custom_add_layer_norm and the add_layer_norm fusion: s = a + alpha * b;
(layer_norm(s), s).

CPU: the op against the float64 eager chain (broadcast `other`, one- and
two-dim normalized_shape, with and without weight and bias, the in-place
form's dtype); gradcheck and gradgradcheck; opcheck; NaN/Inf as eager;
autocast dtypes (the op and scripted modules); scripted, frozen and
training modules in the post-LN (BERT) and pre-LN (ViT) forms; a small BERT
(transformers, traced) and a small torchvision VisionTransformer; FX.
CUDA (marked `cuda`): float32/16/bfloat16 against float64 (error at most 2x
eager's), warp and block rows, the sum written or not, NaN/Inf, fallbacks,
autocast."""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck
from torch.testing import FileCheck

import torchfuse

from cuda_utils import CUDA_ONLY, assert_close_to_reference, poison_allocator

op = torch.ops.torchfuse.custom_add_layer_norm


def signed(*sizes, dtype=torch.float32, device="cpu", requires_grad=False):
    t = torch.randn(*sizes, dtype=dtype, device=device)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)
    return t.requires_grad_(requires_grad)


def eager(x, y, alpha, shape, w, b, eps=1e-5, promote=True):
    s = torch.add(x, y, alpha=alpha) if promote else x.clone().add_(y, alpha=alpha)
    return F.layer_norm(s, shape, w, b, eps), s


def d(t):
    return None if t is None else t.double()


def d_cpu(t):
    return None if t is None else t.double().cpu()


# (input, other, normalized_shape)
CASES = {
    "2d": ((6, 16), (6, 16), [16]),
    "broadcast": ((2, 5, 16), (1, 5, 16), [16]),
    "other_bigger": ((5, 16), (2, 5, 16), [16]),
    "two_dims": ((2, 3, 4, 8), (4, 8), [4, 8]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("write_sum", [True, False])
def test_cpu_matches_the_float64_chain(case, affine, write_sum):
    xs, ys, shape = CASES[case]
    x, y = signed(*xs) * 2, signed(*ys)
    w, b = (signed(*shape), signed(*shape)) if affine else (None, None)
    out, s = op(x, y, 0.5, True, shape, w, b, 1e-5, write_sum)
    ref, ref_s = eager(d(x), d(y), 0.5, shape, d(w), d(b))
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    want, want_s = eager(x, y, 0.5, shape, w, b)
    # the CPU kernel is eager's own chain
    assert torch.equal(out, want) and out.stride() == want.stride()
    if write_sum:
        assert torch.equal(s, want_s) and s.stride() == want_s.stride()
    else:
        assert s.numel() == 0 and s.dtype == want_s.dtype


def test_in_place_form_keeps_the_input_dtype():
    x, y = signed(3, 8), signed(3, 8, dtype=torch.float64)
    out, s = op(x, y, 2, False, [8], None, None, 1e-5, True)
    want, want_s = eager(x, y, 2, [8], None, None, promote=False)
    assert out.dtype == s.dtype == torch.float32
    assert torch.equal(out, want) and torch.equal(s, want_s)
    out, s = op(x, y, 2, True, [8], None, None, 1e-5, True)
    assert out.dtype == s.dtype == torch.float64


@pytest.mark.parametrize("write_sum", [True, False])
def test_gradcheck_and_gradgradcheck(write_sum):
    g = dict(dtype=torch.float64, requires_grad=True)
    x, y, w, b = signed(2, 3, 6, **g), signed(3, 6, **g), signed(6, **g), signed(6, **g)

    def fn(x, y, w, b):
        out, s = op(x, y, 2.0, True, [6], w, b, 1e-5, write_sum)
        return (out, s) if write_sum else out

    gradcheck(fn, (x, y, w, b))
    gradgradcheck(fn, (x, y, w, b))


@pytest.mark.parametrize("sample", ["affine", "plain", "broadcast_in_place"])
def test_opcheck(sample):
    g = dict(requires_grad=True)
    if sample == "affine":
        args = (signed(4, 6, **g), signed(4, 6, **g), 1, True, [6], signed(6, **g), signed(6, **g), 1e-5, True)
    elif sample == "plain":
        args = (signed(2, 3, 6, **g), signed(2, 3, 6, **g), 0.5, True, [3, 6], None, None, 1e-6, False)
    else:
        args = (signed(2, 3, 6, **g), signed(3, 6, **g), 1, False, [6], signed(6, **g), None, 1e-5, True)
    torch.library.opcheck(op, args)


def test_rejects_bad_arguments_by_name():
    x, y = signed(3, 8), signed(3, 8)
    with pytest.raises(RuntimeError, match="custom_add_layer_norm: expected normalized_shape to have at least 1"):
        op(x, y, 1, True, [], None, None, 1e-5, False)
    with pytest.raises(RuntimeError, match=r"custom_add_layer_norm: expected normalized_shape \[4\] to be the "
                                           r"trailing sizes of input \+ other \(sizes \[3, 8\]\)"):
        op(x, y, 1, True, [4], None, None, 1e-5, False)
    with pytest.raises(RuntimeError, match=r"custom_add_layer_norm: expected bias to have sizes normalized_shape "
                                           r"= \[8\], got \[3\]"):
        op(x, y, 1, True, [8], None, signed(3), 1e-5, False)
    with pytest.raises(RuntimeError, match=r"custom_add_layer_norm: expected other \(sizes \[4, 8\]\) to "
                                           r"broadcast with input"):
        op(x, signed(4, 8), 1, True, [8], None, None, 1e-5, False)


def test_nan_and_inf_as_eager():
    x, y, w, b = signed(5, 8), signed(5, 8), signed(8), signed(8)
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    y[2, 1], x[2, 1] = float("inf"), -float("inf")
    b[4] = -float("inf")
    out, s = op(x, y, 1, True, [8], w, b, 1e-5, True)
    want, want_s = eager(x, y, 1, [8], w, b)
    torch.testing.assert_close(out, want, equal_nan=True)
    torch.testing.assert_close(s, want_s, equal_nan=True)
    assert out[:3].isnan().all() and out[3].isfinite().sum() == 7


@contextlib.contextmanager
def jit_autocast(enabled):
    old = torch._C._jit_set_autocast_mode(enabled)
    try:
        yield
    finally:
        torch._C._jit_set_autocast_mode(old)


def scripted_chain(promote):
    """A new scripted function: the graph executor keeps the graph it first
    optimized for an autocast state, TorchScript's pass included or not.
    promote=False: add_ into a fresh tensor (a clone, which the pass does
    not cast)."""
    add = "s = x + y" if promote else "s = x.clone()\n    s.add_(y)"
    cu = torch.jit.CompilationUnit(f"""
def chain(x, y, w, b):
    {add}
    return torch.layer_norm(s, [8], w, b, 1e-5), s
""")
    return cu.chain


def scripted_op():
    """A new scripted function calling the op, as a rewritten graph does."""
    cu = torch.jit.CompilationUnit("""
def fused(x, y, w, b, promote: bool):
    return torch.ops.torchfuse.custom_add_layer_norm(x, y, 1, promote, [8], w, b, 1e-5, True)
""")
    return cu.fused


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("jit_pass", [True, False])
@pytest.mark.parametrize("promote", [True, False])
def test_autocast_dtypes_are_the_chains(dtypes, jit_pass, promote):
    """Under CPU autocast (bfloat16), called from TorchScript, the op gives
    the scripted chain's dtypes and values: with TorchScript's autocast pass
    (the default), add's and layer_norm's inputs cast to float32; without
    it, eager's (CPU autocast leaves add and layer_norm alone: the inputs'
    dtypes).  Called from eager code (torchfuse.fx's rewrite), eager's."""
    x, y = signed(4, 8, dtype=dtypes[0]), signed(4, 8, dtype=dtypes[0])
    w, b = signed(8, dtype=dtypes[1]), signed(8, dtype=dtypes[1])
    with jit_autocast(jit_pass), torch.autocast("cpu", dtype=torch.bfloat16):
        fused, chain = scripted_op(), scripted_chain(promote)
        for _ in range(3):  # the profiling executor optimizes the graph from the second run on
            out, s = fused(x, y, w, b, promote)
            want, want_s = chain(x, y, w, b)
        direct_out, direct_s = op(x, y, 1, promote, [8], w, b, 1e-5, True)
        eager_out, eager_s = eager(x, y, 1, [8], w, b, promote=promote)
    assert (out.dtype, s.dtype) == (want.dtype, want_s.dtype)
    assert (direct_out.dtype, direct_s.dtype) == (eager_out.dtype, eager_s.dtype) == (dtypes[0], dtypes[0])
    if not jit_pass:
        assert (out.dtype, s.dtype) == (dtypes[0], dtypes[0])
    elif dtypes[0] == torch.bfloat16:
        # the pass casts add's inputs, not add_'s; and layer_norm's input
        assert (out.dtype, s.dtype) == (torch.float32, torch.float32 if promote else torch.bfloat16)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(direct_out, eager_out)
    torch.testing.assert_close(direct_s, eager_s)


# ---- the fusion ---------------------------------------------------------------


class PostNorm(nn.Module):
    """BERT's BertSelfOutput: LayerNorm(dense(h) + input)."""

    def __init__(self, inplace=False):
        super().__init__()
        self.dense = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.inplace = inplace

    def forward(self, h, residual):
        t = self.dense(h)
        if self.inplace:
            t += residual
            return self.norm(t)
        return self.norm(t + residual)


class PreNorm(nn.Module):
    """torchvision's EncoderBlock: x = x + attn; y = ln_2(x); x + mlp(y)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.ln_2 = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        torch._assert(x.dim() == 3, "3-D")
        x = x + self.attn(x)
        y = self.ln_2(x)
        return x + self.mlp(y)


def _reference(model, *inputs):
    ref = type(model)() if not isinstance(model, PostNorm) else PostNorm(model.inplace)
    ref.load_state_dict(model.state_dict())
    return ref.double().eval()(*[t.double() for t in inputs])


@pytest.mark.parametrize("freeze", [False, True])
@pytest.mark.parametrize("form", ["post", "post_inplace", "pre"])
def test_scripted_modules(form, freeze):
    model = (PreNorm() if form == "pre" else PostNorm(inplace=form == "post_inplace")).eval()
    inputs = (signed(2, 5, 16),) if form == "pre" else (signed(2, 5, 16), signed(2, 5, 16))
    opt = torchfuse.optimize(torch.jit.script(model), freeze=freeze)
    assert torchfuse.report(opt)["add_layer_norm"] == 1
    graph = opt.graph if freeze else opt.inlined_graph
    FileCheck().check("torchfuse::custom_add_layer_norm").check_not("aten::layer_norm").run(graph)
    write_sum = graph.findAllNodes("torchfuse::custom_add_layer_norm", recurse=True)[0].inputsAt(8)
    assert write_sum.toIValue() is (form == "pre")
    with torch.no_grad():
        got = opt(*inputs)
        want = model(*inputs)
        ref = _reference(model, *inputs)
    assert_close_to_reference(got, want, ref, what=f"{form} freeze={freeze}")


def test_pre_norm_training_gradients_match():
    model = PreNorm()
    opt = torchfuse.optimize(torch.jit.script(model))
    assert torchfuse.report(opt)["add_layer_norm"] == 1
    x = signed(2, 5, 16)
    xo, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    opt(xo).square().sum().backward()
    model(xm).square().sum().backward()
    torch.testing.assert_close(xo.grad, xm.grad)
    fused = dict(opt.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name].grad, p.grad, msg=name)


def test_autocast_scripted_module_dtypes_and_values():
    """A scripted pre-LN block under CPU autocast: TorchScript's autocast
    pass casts add's and layer_norm's inputs to float32 in the original;
    the fused op's Autocast kernel gives the same dtypes and values."""
    model = PreNorm()
    original = torch.jit.script(model)
    opt = torchfuse.optimize(torch.jit.script(model))
    assert torchfuse.report(opt)["add_layer_norm"] == 1
    x = signed(2, 5, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(2):  # the profiling executor's second run is optimized
            want = original(x)
            got = opt(x)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want)


def test_sum_written_in_place_stays_unfused():
    class Written(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x, y):
            s = x + y
            out = self.norm(s)
            s.mul_(2.0)
            return out, s

    opt = torchfuse.optimize(torch.jit.script(Written().eval()), freeze=True)
    assert torchfuse.report(opt)["add_layer_norm"] == 0
    FileCheck().check("aten::add").check("aten::layer_norm").run(opt.graph)


def test_add_into_live_tensor_stays_unfused():
    class Live(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

        def forward(self, x, y):
            x += y
            return self.norm(x)

    opt = torchfuse.optimize(torch.jit.script(Live().eval()), freeze=True)
    assert torchfuse.report(opt)["add_layer_norm"] == 0


def _tiny_bert():
    transformers = pytest.importorskip("transformers")
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
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, (ids,))
        want = model(ids)[0]
        ref = model.double()(ids)[0]
        model.float()
    opt = torchfuse.optimize(traced, freeze=freeze)
    # the embeddings' sum, then each layer's attention and output residuals
    fused = 1 + 2 * config.num_hidden_layers
    assert torchfuse.report(opt)["add_layer_norm"] == fused
    graph = opt.graph if freeze else opt.inlined_graph
    assert str(graph).count("torchfuse::custom_add_layer_norm") == fused
    assert "aten::layer_norm" not in str(graph)
    with torch.no_grad():
        got = opt(ids)[0]
    assert_close_to_reference(got, want, ref, what=f"bert freeze={freeze}")


def _tiny_vit():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(10)
    return torchvision.models.VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2,
                                                hidden_dim=32, mlp_dim=64)


@pytest.mark.parametrize("freeze", [False, True])
def test_scripted_tiny_vit(freeze):
    model = _tiny_vit().eval()
    opt = torchfuse.optimize(torch.jit.script(model), freeze=freeze)
    # per layer: ln_2 of x + attention (the sum read again: write_sum), the
    # next layer's ln_1 of x + mlp (write_sum); the last one feeds the
    # encoder's final ln only.  The dropout (p = 0) after the position
    # embedding's add is gone (frozen: torch's eval dropout removal;
    # unfrozen: RemoveZeroDropouts): that add and the first ln_1 fuse too.
    graph = opt.graph if freeze else opt.inlined_graph  # NB: keeps the nodes' graph alive
    nodes = graph.findAllNodes("torchfuse::custom_add_layer_norm")
    assert torchfuse.report(opt)["add_layer_norm"] == len(nodes) == 5
    assert sorted(n.inputsAt(8).toIValue() for n in nodes) == [False] + [True] * 4
    x = signed(2, 3, 32, 32)
    with torch.no_grad():
        got, want = opt(x), model(x)
        ref = _tiny_vit().double().eval()
        ref.load_state_dict(model.state_dict())
        ref = ref(x.double())
    assert_close_to_reference(got, want, ref, what=f"vit freeze={freeze}")


def test_scripted_tiny_vit_training_gradients():
    model = _tiny_vit()
    opt = torchfuse.optimize(torch.jit.script(model))
    assert torchfuse.report(opt)["add_layer_norm"] == 5
    x = signed(2, 3, 32, 32)
    opt(x).square().sum().backward()
    model(x).square().sum().backward()
    fused = dict(opt.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


# ---- FX --------------------------------------------------------------------------


class FxBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16, elementwise_affine=False)

    def forward(self, x, r):
        h = self.ln1(self.fc(x) + r)                  # post-LN
        s = h + x
        y = F.layer_norm(s, (16,), None, None, 1e-6)  # pre-LN: s read again
        z = s * 2
        return self.ln2(z + y), s


@pytest.mark.parametrize("how", ["symbolic_trace", "export"])
def test_fx_rewrites_add_layer_norm(how):
    import torchfuse.fx as tfx

    model = FxBlocks().eval()
    x, r = signed(2, 3, 16), signed(2, 3, 16)
    if how == "export":
        ep = tfx.optimize_exported(torch.export.export(model, (x, r)))
        counts, run = tfx.report(ep), ep.module()
    else:
        gm = tfx.optimize(torch.fx.symbolic_trace(model))
        counts, run = tfx.report(gm), gm
    assert counts["add_layer_norm"] == 3
    with torch.no_grad():
        for got, want in zip(run(x, r), model(x, r)):
            torch.testing.assert_close(got, want)


# ---- CUDA ------------------------------------------------------------------------

# (rows, cols): warp rows of 1 to 8 vectors per thread, block rows, BERT-base
# and ViT-H widths.
CUDA_SHAPES = [(7, 32), (33, 256), (16, 768), (9, 1024), (5, 1280), (4, 4096), (3, 8192)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=[f"{r}x{c}" for r, c in CUDA_SHAPES])
@pytest.mark.parametrize("write_sum", [True, False])
@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_against_float64(dtype, shape, write_sum):
    rows, cols = shape
    x = signed(2, rows, cols, dtype=dtype, device="cuda") * 2
    y = signed(2, rows, cols, dtype=dtype, device="cuda")
    for w, b in ((signed(cols, dtype=dtype, device="cuda"), signed(cols, dtype=dtype, device="cuda")),
                 (None, None)):
        want, want_s = eager(x, y, 0.5, [cols], w, b)
        poison_allocator([want.numel() * want.element_size()])
        got, got_s = op(x, y, 0.5, True, [cols], w, b, 1e-5, write_sum)
        ref, ref_s = eager(d_cpu(x), d_cpu(y), 0.5, [cols], d_cpu(w), d_cpu(b))
        what = f"{dtype} {shape} write_sum={write_sum} affine={w is not None}"
        assert got.stride() == want.stride()
        # NB: the reference normalizes eager's rounded sum, as both compute.
        ref = F.layer_norm(want_s.double().cpu(), [cols], d_cpu(w), d_cpu(b), 1e-5)
        assert_close_to_reference(got, want, ref, what=what)
        if write_sum:
            assert torch.equal(got_s, want_s), what
        else:
            assert got_s.numel() == 0


@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_nan_inf_and_fallbacks():
    x, y = signed(6, 64, device="cuda"), signed(6, 64, device="cuda")
    w, b = signed(64, device="cuda"), signed(64, device="cuda")
    x[0, 3] = float("nan")
    x[1, 0] = float("inf")
    y[2, 1], x[2, 1] = float("inf"), -float("inf")
    b[4] = -float("inf")
    got, s = op(x, y, 1, True, [64], w, b, 1e-5, True)
    want, want_s = eager(x, y, 1, [64], w, b)
    torch.testing.assert_close(got, want, equal_nan=True)
    torch.testing.assert_close(s, want_s, equal_nan=True)
    assert got[:3].isnan().all()
    # the composite: broadcast other, float64, non-contiguous input, a row
    # longer than the kernel holds, a row not a multiple of the vector
    cases = [
        (signed(2, 6, 64, device="cuda"), signed(6, 64, device="cuda"), [64]),
        (x.double(), y.double(), [64]),
        (signed(64, 6, device="cuda").t(), y, [64]),
        (signed(2, 40000, device="cuda"), signed(2, 40000, device="cuda"), [40000]),
        (signed(3, 12, dtype=torch.float16, device="cuda"), signed(3, 12, dtype=torch.float16, device="cuda"), [12]),
    ]
    for a, o, shape in cases:
        got, s = op(a, o, 1, True, shape, None, None, 1e-5, True)
        want, want_s = eager(a, o, 1, shape, None, None)
        # NB: the float64 case is x and y above, non-finite values included.
        torch.testing.assert_close(got, want, equal_nan=True)
        torch.testing.assert_close(s, want_s, equal_nan=True)
    empty, s = op(x[:0], y[:0], 1, True, [64], w, b, 1e-5, False)
    assert empty.shape == (0, 64)


@CUDA_ONLY[0]
@CUDA_ONLY[1]
def test_cuda_autograd_and_autocast():
    x = signed(2, 5, 64, device="cuda", requires_grad=True)
    y = signed(2, 5, 64, device="cuda", requires_grad=True)
    w, b = signed(64, device="cuda", requires_grad=True), signed(64, device="cuda", requires_grad=True)
    out, s = op(x, y, 1, True, [64], w, b, 1e-5, True)
    leaves = [t.detach().clone().requires_grad_() for t in (x, y, w, b)]
    want, want_s = eager(leaves[0], leaves[1], 1, [64], leaves[2], leaves[3])
    g = signed(*out.shape, device="cuda")
    got_g = torch.autograd.grad((out * s).sum() + (out * g).sum(), (x, y, w, b))
    want_g = torch.autograd.grad((want * want_s).sum() + (want * g).sum(), leaves)
    for a, r in zip(got_g, want_g):
        torch.testing.assert_close(a, r)
    # CUDA autocast (without TorchScript's pass, i.e. eager's chain):
    # layer_norm is on the float32 list, add is not
    xh, yh = x.detach().half(), y.detach().half()
    with torch.no_grad(), jit_autocast(False), torch.autocast("cuda", dtype=torch.float16):
        got, got_s = op(xh, yh, 1, True, [64], w, b, 1e-5, True)
        want, want_s = eager(xh, yh, 1, [64], w, b)
    assert (got.dtype, got_s.dtype) == (want.dtype, want_s.dtype) == (torch.float32, torch.float16)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_s, want_s)
