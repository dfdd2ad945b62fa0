"""DropAllTrueAttentionMasks and custom_unmasked_attention: a
scaled_dot_product_attention call whose attn_mask the graph proves a boolean
mask true everywhere (transformers traces one for BERT without an
attention_mask, which keeps ATen's fused attention kernels out) becomes
torchfuse::custom_unmasked_attention; every other call stays.  Each rule that
keeps a call has a negative test here.  Where nothing is recorded for
autograd and ATen runs the unmasked call by flash or cuDNN attention on
CUDA, the op makes that call; elsewhere (the CPU, whose flash kernel maps NaN
rows to 0, CUDA's memory-efficient kernel, and wherever autograd records: the
fused kernels' gradients have inf where the masked call's have NaN) a masked
call as the original's."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from cuda_utils import poison_allocator

import torchfuse


OP = torch.ops.torchfuse.custom_unmasked_attention


def calls(graph):
    """(scaled_dot_product_attention calls, custom_unmasked_attention calls)."""
    return (len(graph.findAllNodes("aten::scaled_dot_product_attention")),
            len(graph.findAllNodes("torchfuse::custom_unmasked_attention")))


def qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, 5, 8, generator=g) for _ in range(3)]


def check(fn, dropped):
    """Scripts fn, runs the graph stage, checks whether the mask went and
    that the results are the original's."""
    scripted = torch.jit.script(fn)
    graph = scripted.graph.copy()
    torch._C._jit_pass_inline(graph)
    report = torchfuse.fuse_graph(graph)
    assert report["attention_masks_dropped"] == (1 if dropped else 0)
    assert calls(graph) == ((0, 1) if dropped else (1, 0)), graph
    q, k, v = qkv()
    rewritten = torch._C._create_function_from_graph("rewritten", graph)
    want = fn(q, k, v)
    torch.testing.assert_close(rewritten(q, k, v), want)
    return graph


def arange_mask(q, k, v):
    s = q.size(-2)
    m = (torch.arange(s) + 0)[None, None, :, None] >= 0
    m = m.expand(q.size(0), 1, s, k.size(-2))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


def test_an_all_true_arange_mask_is_dropped():
    check(arange_mask, dropped=True)


def test_views_adds_and_gt_carry_the_bound():
    def f(q, k, v):
        s = q.size(-2)
        idx = torch.arange(2, s + 2).unsqueeze(0)
        m = (idx + torch.tensor(3), 2)[0].view(1, 1, s, 1) > 4  # bound 2 + 3 > 4
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(q.size(0), 1, s, s))

    check(f, dropped=True)


# ---- masks that stay (one per rule) ---------------------------------------

def test_bound_below_the_threshold_keeps_the_mask():  # ge needs bound >= c
    def f(q, k, v):
        m = torch.arange(q.size(-2))[None, None, :, None] >= 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))

    check(f, dropped=False)


def test_gt_needs_a_bound_above_the_threshold():
    def f(q, k, v):
        m = torch.arange(q.size(-2))[None, None, :, None] > 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))

    check(f, dropped=False)


def test_causal_calls_keep_their_mask():  # notCausal: ATen rejects the pair
    def f(q, k, v, causal: bool = True):
        m = torch.arange(q.size(-2))[None, None, :, None] >= 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5), is_causal=causal)

    graph = torch.jit.script(f).graph.copy()
    report = torchfuse.fuse_graph(graph)
    assert report["attention_masks_dropped"] == 0 and calls(graph) == (1, 0)


def test_dropout_keeps_the_call():  # noDropout: the fused kernels draw other numbers
    def f(q, k, v):
        m = torch.arange(q.size(-2))[None, None, :, None] >= 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5), dropout_p=0.5)

    graph = torch.jit.script(f).graph.copy()
    assert torchfuse.fuse_graph(graph)["attention_masks_dropped"] == 0 and calls(graph) == (1, 0)


def test_a_call_whose_output_is_written_is_dropped():
    """Where autograd records the op makes the original's masked call, so an
    in-place write to its output leaves the backward as the original's."""
    def f(q, k, v):
        m = torch.arange(q.size(-2))[None, None, :, None] >= 0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))
        y.transpose(1, 2).mul_(2.0)
        return y

    graph = check(f, dropped=True)
    rewritten = torch._C._create_function_from_graph("rewritten", graph)
    gy = torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(7))

    def grads(fn):
        """fn's gradients, or the type of the error its backward raises."""
        xs = [t.requires_grad_() for t in qkv(3)]
        try:
            return torch.autograd.grad(fn(*xs), xs, gy)
        except RuntimeError as e:
            return type(e)

    want, got = grads(f), grads(rewritten)
    if isinstance(want, type):  # the CPU's flash backward reads the written output
        assert got is want
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_written_mask_stays():  # unwritten: an in-place write may change it
    def f(q, k, v):
        m = torch.arange(q.size(-2))[None, None, :, None] >= 0
        m[0, 0, 1, 0] = False  # row 1 attends to nothing: zeros
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))

    check(f, dropped=False)


def test_a_written_arange_stays():
    def f(q, k, v):
        idx = torch.arange(q.size(-2))
        idx.sub_(3)
        m = idx[None, None, :, None] >= 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))

    check(f, dropped=False)


def test_a_narrow_arange_dtype_stays():  # int8 values could wrap below 0
    def f(q, k, v):
        m = torch.arange(q.size(-2), dtype=torch.int8)[None, None, :, None] >= 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))

    check(f, dropped=False)


def test_a_negative_alpha_or_unknown_operand_stays():
    def neg_alpha(q, k, v):
        m = torch.add(torch.arange(q.size(-2)), 1, alpha=-1)[None, None, :, None] >= -10
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))

    def from_input(q, k, v):
        m = (q[:, :1, :, :1] * 0 + 1) >= 0  # values unknown to the graph
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))

    check(neg_alpha, dropped=False)
    check(from_input, dropped=False)


def test_a_scripted_autocast_scope_keeps_the_call():  # outsideScriptedAutocast
    class Scoped(torch.nn.Module):
        def forward(self, q, k, v):
            m = torch.arange(q.size(-2))[None, None, :, None] >= 0
            with torch.autocast("cpu", torch.bfloat16):
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=m.expand(2, 1, 5, 5))
            return y

    opt = torchfuse.optimize(torch.jit.script(Scoped()))
    assert calls(opt.inlined_graph) == (1, 0)


def test_additive_float_masks_stay():
    def f(q, k, v):
        m = torch.zeros(2, 1, 5, 5)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    check(f, dropped=False)


def test_a_constant_mask_with_a_false_element_stays():
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    mask[1, 0, 2, 3] = False

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", mask)

        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)

    frozen = torch.jit.freeze(torch.jit.script(M().eval()))
    graph = frozen.graph.copy()
    assert torchfuse.fuse_graph(graph)["attention_masks_dropped"] == 0


# ---- a real model ------------------------------------------------------------

class EmbedsIn(torch.nn.Module):
    """A BERT called with inputs_embeds only (no attention_mask), returning
    its outputs or, with `first`, the last hidden state."""

    def __init__(self, bert, first=False):
        super().__init__()
        self.bert = bert
        self.first = first

    def forward(self, e):
        out = self.bert(inputs_embeds=e)
        return out[0] if self.first else out


def tiny_bert():
    """A 2-layer transformers BertModel of hidden size 32 without dropout,
    seeded; inputs_embeds of [3, 7, 32]."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, vocab_size=128, torchscript=True, return_dict=False,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.BertModel(cfg)


@pytest.mark.parametrize("freeze", [False, True], ids=["traced", "frozen"])
def test_traced_bert_loses_its_all_true_masks(freeze):
    model = tiny_bert().eval()
    x = torch.randn(3, 7, 32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(EmbedsIn(model).eval(), (x,))
        assert calls(traced.inlined_graph) == (2, 0)
        opt = torchfuse.optimize(traced, freeze=freeze)
        assert calls(opt.inlined_graph) == (0, 2)
        ref = EmbedsIn(copy.deepcopy(model).double())(x.double())
        for got, want, exact in zip(opt(x), traced(x), ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-6


def test_traced_bert_trains_through_the_op():
    """A training step of a traced BERT through the op: the output and
    every parameter's gradient within twice the traced original's error
    against float64."""
    model = tiny_bert().train()
    x = torch.randn(3, 7, 32)
    gy = torch.randn(3, 7, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(EmbedsIn(copy.deepcopy(model), first=True), (x,))
        opt = torchfuse.optimize(torch.jit.trace(EmbedsIn(copy.deepcopy(model), first=True), (x,)))
    assert calls(opt.inlined_graph) == (0, 2)
    exact = EmbedsIn(copy.deepcopy(model).double(), first=True)

    def step(m, inp, g):
        m.zero_grad()
        y = m(inp)
        y.backward(g)
        return {"out": y.detach(), **{n: p.grad for n, p in m.named_parameters()}}

    for _ in range(2):  # the profiling executor's runs, then the optimized graph
        want, got = step(traced, x, gy), step(opt, x, gy)
    ref = step(exact, x.double(), gy.double())
    for name, r in ref.items():
        if r is None:  # the pooler's: not on the path to the output
            assert got[name] is None and want[name] is None, name
            continue
        err = (got[name].double() - r).abs().max()
        allowed = 2 * (want[name].double() - r).abs().max() + 1e-6
        assert err <= allowed, f"{name}: {err:.3g} > {allowed:.3g}"


# ---- the op ------------------------------------------------------------------

def bert_like_mask(q, k):
    """transformers' traced mask: arange(L) >= 0, an [L, 1] column expanded."""
    return (torch.arange(q.size(-2), device=q.device)[:, None] >= 0).expand(*q.shape[:-1], k.size(-2))


def non_finite_qkv(seed=0, device="cpu", dtype=torch.float32):
    """qkv with a NaN in one query row, +inf in a key and -inf in a value."""
    return with_non_finite(*(t.to(device, dtype) for t in qkv(seed)))


def with_non_finite(q, k, v):
    """q, k and v, written: a NaN in one query row, +inf in a key and -inf
    in a value."""
    q[0, 1, 2, 3] = float("nan")
    k[1, 0, 4, 1] = float("inf")
    v[1, 2, 0, 5] = -float("inf")
    return q, k, v


def same_non_finite(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_cpu_op_is_the_masked_call(dtype, grad):
    """On the CPU (unmaskedKeepsNonFinite): the unmasked call's flash kernel
    gives 0 where a NaN in the query made a row of scores NaN, and the masked
    call NaN (fuzz seed 20261244 program 287), so the op makes the masked
    call: values, NaN and Inf, and gradients bit for bit, with and without
    autograd."""
    for inputs in (qkv(1), non_finite_qkv(1)):
        leaves = [t.to(dtype).requires_grad_(grad) for t in inputs]
        mine = [t.detach().clone().requires_grad_(grad) for t in leaves]
        with torch.set_grad_enabled(grad):
            want = F.scaled_dot_product_attention(*leaves, attn_mask=bert_like_mask(leaves[0], leaves[1]))
            got = OP(*mine)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()) and same_non_finite(got, want)
        if grad:
            gy = torch.randn(want.shape, dtype=dtype, generator=torch.Generator().manual_seed(3))
            for a, b in zip(torch.autograd.grad(got, mine, gy), torch.autograd.grad(want, leaves, gy)):
                assert torch.equal(a.nan_to_num(), b.nan_to_num()) and same_non_finite(a, b)
    # NB: that the test can fail: the unmasked call differs from the masked one
    q, k, v = non_finite_qkv(1)
    with torch.no_grad():
        unmasked = F.scaled_dot_product_attention(q, k, v)
        masked = F.scaled_dot_product_attention(q, k, v, attn_mask=bert_like_mask(q, k))
    assert not same_non_finite(unmasked, masked)
    with torch.no_grad():
        torch.testing.assert_close(OP(q, k, v, scale=0.3), F.scaled_dot_product_attention(
            q, k, v, attn_mask=bert_like_mask(q, k), scale=0.3), rtol=0, atol=0, equal_nan=True)


def second(gs, xs):
    """The second derivatives of sum(gs) with respect to xs, or the type of
    the error raised."""
    try:
        return torch.autograd.grad(sum(g.sum() for g in gs), xs)
    except RuntimeError as e:
        return type(e)


def assert_same_derivatives(got, mine, want, leaves, gy):
    """The first and second derivatives of got (of inputs mine) are want's
    (of leaves), bit for bit, under the upstream gradient gy."""
    g_want = torch.autograd.grad(want, leaves, gy, create_graph=True)
    g_got = torch.autograd.grad(got, mine, gy, create_graph=True)
    for a, b in zip(g_got, g_want):
        assert torch.equal(a, b)
    for a, b in zip(second(g_got, mine), second(g_want, leaves)):
        assert torch.equal(a, b)


def test_op_under_autocast_saves_autocasts_copies_as_the_original():
    """Under CPU autocast the original's call computes on autocast's bfloat16
    copies, so an in-place write to its float32 inputs after the call leaves
    its backward valid; the op's must be too, with the same
    dtype, values and gradients.  Without autocast both backwards raise: the
    saved inputs are the written tensors themselves."""
    def run(fn, autocast):
        leaves = [t.requires_grad_() for t in qkv(2)]
        xs = [t * 1 for t in leaves]
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            y = fn(*xs)
        for x in xs:
            x.mul_(2)
        try:
            return y, torch.autograd.grad(y.float().sum(), leaves)
        except RuntimeError as e:
            return y, type(e)

    def original(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bert_like_mask(q, k))

    want, g_want = run(original, True)
    got, g_got = run(OP, True)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    assert not isinstance(g_want, type) and not isinstance(g_got, type)
    for a, b in zip(g_got, g_want):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b)
    assert run(original, False)[1] is RuntimeError and run(OP, False)[1] is RuntimeError


def test_op_under_autograd_where_the_unmasked_call_is_math_is_the_masked_call():
    """Where ATen would take the math path for the unmasked call too (here:
    only math enabled), the op makes the original's masked call: values and
    gradients bit for bit, and double backward as the original's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.double().requires_grad_() for t in qkv(2)]
    mine = [t.detach().clone().requires_grad_() for t in leaves]
    with sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(*leaves, attn_mask=bert_like_mask(leaves[0], leaves[1]))
        got = OP(*mine)
    assert torch.equal(got, want)
    gy = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(3))
    assert_same_derivatives(got, mine, want, leaves, gy)


def test_op_errors_name_the_argument_and_schema_checks():
    q, k, v = qkv(4)
    with pytest.raises(RuntimeError, match="custom_unmasked_attention.*query"):
        OP(None, k, v)
    torch.library.opcheck(OP, (q, k, v))
    q.requires_grad_()
    torch.library.opcheck(OP, (q, k, v))


# The fused backends whose unmasked call keeps the masked call's NaN and Inf
# (unmaskedKeepsNonFinite), and the one that does not: ATen's choice is
# narrowed to each in turn (sdpa_kernel), so that each is tested on every
# GPU, whichever ATen would prefer there.
KEEPS = ["FLASH_ATTENTION", "CUDNN_ATTENTION"]
NOT_KEEPS = ["EFFICIENT_ATTENTION"]


def only(backend):
    """ATen's choice narrowed to backend, with the math path for what it
    does not take (the masked call)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, backend), SDPBackend.MATH])


def cuda_qkv(seed, dtype=torch.float16, shape=(2, 4, 64, 64)):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", generator=g).to(dtype) for _ in range(3)]


def choice(q, k, v):
    from torch.nn.attention import SDPBackend

    return SDPBackend(torch._fused_sdp_choice(q, k, v)).name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", KEEPS + NOT_KEEPS)
def test_cuda_op_without_autograd_is_the_unmasked_call_where_it_keeps_nan(backend):
    """By a backend that keeps NaN and Inf the op makes the unmasked call
    (bit for bit); by the memory-efficient kernel, the masked one."""
    q, k, v = cuda_qkv(1)
    with torch.no_grad(), only(backend):
        assert choice(q, k, v) == backend
        got = [OP(q, k, v), OP(q, k, v, scale=0.3)]
        unmasked = [F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, scale=0.3)]
        masked = [F.scaled_dot_product_attention(q, k, v, attn_mask=bert_like_mask(q, k)),
                  F.scaled_dot_product_attention(q, k, v, attn_mask=bert_like_mask(q, k), scale=0.3)]
    for a, u, m in zip(got, unmasked, masked):
        if backend in KEEPS:
            assert not torch.equal(u, m)  # so that the check can fail
        assert torch.equal(a, u if backend in KEEPS else m)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", KEEPS + NOT_KEEPS)
@pytest.mark.parametrize("shape", [(2, 3, 5, 8), (2, 4, 64, 64)], ids=["5x8", "64x64"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "autograd"])
def test_cuda_op_gives_nan_and_inf_where_the_masked_call_does(backend, shape, dtype, grad):
    """unmaskedKeepsNonFinite on CUDA: with ATen's choice narrowed to each
    fused backend, the op's NaN and Inf are where the original's masked call
    (ATen's own choice) has them, in the output and the gradients under a
    random upstream gradient."""
    q, k, v = with_non_finite(*cuda_qkv(2, dtype, shape))
    leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    mine = [t.detach().clone().requires_grad_(grad) for t in leaves]
    gy = torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(dtype)
    with torch.set_grad_enabled(grad):
        want = F.scaled_dot_product_attention(*leaves, attn_mask=bert_like_mask(leaves[0], leaves[1]))
        with only(backend):
            got = OP(*mine)
            g_got = torch.autograd.grad(got, mine, gy) if grad else []
    assert same_non_finite(got, want)
    for a, b in zip(g_got, torch.autograd.grad(want, leaves, gy) if grad else []):
        assert same_non_finite(a, b)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("backend", KEEPS)
def test_cuda_op_under_autograd_is_the_masked_call(backend):
    """Where autograd records, the op makes the masked call even where ATen
    would run the unmasked one by a backend that keeps NaN and Inf in the
    output: those backends' gradients have inf where the masked call's have
    NaN.  Output, gradients and second derivatives bit for bit as the masked
    call's."""
    leaves = [t.requires_grad_() for t in cuda_qkv(2)]
    mine = [t.detach().clone().requires_grad_() for t in leaves]
    gy = torch.randn(leaves[0].shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).half()
    with only(backend):
        assert choice(*leaves) == backend
        want = F.scaled_dot_product_attention(*leaves, attn_mask=bert_like_mask(leaves[0], leaves[1]))
        got = OP(*mine)
        unmasked = F.scaled_dot_product_attention(*leaves)
    assert not torch.equal(unmasked, want)  # so that the check can fail
    assert torch.equal(got, want)
    assert_same_derivatives(got, mine, want, leaves, gy)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_op_against_float64(dtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(4, 12, 128, 64, device="cuda", generator=g).to(dtype) for _ in range(3))
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    with torch.no_grad():
        eager = F.scaled_dot_product_attention(q, k, v, attn_mask=bert_like_mask(q, k))
        got = OP(q, k, v)
    assert got.dtype == dtype
    assert (got.double() - exact).abs().max() <= 2 * (eager.double() - exact).abs().max() + 1e-6


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_op_under_autograd_against_float64(dtype):
    """Training: output and gradients against float64, at most twice the
    original masked call's error; a backward that records a graph gives a
    double backward."""
    g = torch.Generator(device="cuda").manual_seed(6)
    base = [torch.randn(4, 12, 128, 64, device="cuda", generator=g) for _ in range(3)]
    gy = torch.randn(4, 12, 128, 64, device="cuda", generator=g)
    exact_in = [t.double().requires_grad_() for t in base]
    exact = F.scaled_dot_product_attention(*exact_in)
    exact_g = torch.autograd.grad(exact, exact_in, gy.double())

    def run(fn):
        xs = [t.to(dtype).requires_grad_() for t in base]
        y = fn(xs)
        return [y] + list(torch.autograd.grad(y, xs, gy.to(dtype)))

    eager = run(lambda xs: F.scaled_dot_product_attention(*xs, attn_mask=bert_like_mask(xs[0], xs[1])))
    poison_allocator([base[0].numel() * 4])
    got = run(lambda xs: OP(*xs))
    for name, a, e, x in zip(("out", "dq", "dk", "dv"), got, eager, [exact] + list(exact_g)):
        assert a.dtype == dtype, name
        err, eager_err = ((t.double() - x).abs().max() for t in (a, e))
        assert err <= 2 * eager_err + 1e-6, f"{dtype} {name}: {err:.3g} against the original's {eager_err:.3g}"
    xs = [t.to(dtype).requires_grad_() for t in base]
    gs = torch.autograd.grad(OP(*xs), xs, gy.to(dtype), create_graph=True)
    assert all(isinstance(t, torch.Tensor) for t in second(gs, xs))
