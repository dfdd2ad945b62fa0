"""DropAllTrueAttentionMasks: scaled_dot_product_attention's attn_mask is
dropped where the graph proves it a boolean mask that is true everywhere
(transformers traces one for BERT without an attention_mask, which keeps
ATen's fused attention kernels out); every other mask stays.  Each rule that
keeps a mask has a negative test here."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchfuse


def sdpa_masks(graph):
    """The attn_mask input of each scaled_dot_product_attention call: None
    where dropped."""
    nodes = graph.findAllNodes("aten::scaled_dot_product_attention")
    return [None if n.inputsAt(3).type().kind() == "NoneType" else n.inputsAt(3) for n in nodes]


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
    assert (sdpa_masks(graph) == [None]) == dropped, graph
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
    assert report["attention_masks_dropped"] == 0 and sdpa_masks(graph) != [None]


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

@pytest.mark.parametrize("freeze", [False, True], ids=["traced", "frozen"])
def test_traced_bert_loses_its_all_true_masks(freeze):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, vocab_size=128, torchscript=True, return_dict=False,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    x = torch.randn(3, 7, 32)

    class EmbedsIn(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, e):
            return self.bert(inputs_embeds=e)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(EmbedsIn(model).eval(), (x,))
        before = sdpa_masks(traced.inlined_graph)
        assert len(before) == 2 and all(m is not None for m in before)
        opt = torchfuse.optimize(traced, freeze=freeze)
        assert sdpa_masks(opt.inlined_graph) == [None, None]
        ref = EmbedsIn(copy.deepcopy(model).double())(x.double())
        for got, want, exact in zip(opt(x), traced(x), ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert (got.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-6
