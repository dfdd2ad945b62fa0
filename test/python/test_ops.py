"""CPU tests of the torchfuse ops from Python: gradcheck, opcheck, TorchScript
scripting and save/load, the no-grad path, and batch-norm running stats.

The CUDA side is tested in test_cuda_ops.py, except where one test compares
every device with eager.
"""

import copy
import pathlib
import re

import pytest
import torch
import torch.nn.functional as F
import torch.testing._internal.optests.generate_tests  # noqa: F401  (OpCheckError)
from cuda_utils import CUDA_ONLY, poison_allocator

ops = torch.ops.torchfuse
F64 = torch.float64


def signed(*sizes, dtype=F64, requires_grad=False):
    """Standard-normal values pushed away from zero (never 0, both signs)."""
    t = torch.randn(*sizes, dtype=dtype)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)
    return t.requires_grad_(requires_grad)


def positive(*sizes, dtype=F64):
    return torch.rand(*sizes, dtype=dtype) + 0.5


def gradcheck(fn, inputs):
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------- references


def linear_add_relu_ref(x, w, b, other, alpha=1):
    return torch.relu(F.linear(x, w, b) + alpha * other)


def conv_relu_add_ref(x, w, b, stride, padding, dilation, groups, other, alpha=1):
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[w.dim()]
    return torch.relu(conv(x, w, b, stride, padding, dilation, groups)) + alpha * other


def bn_swish_ref(x, w, b, rm, rv, training, momentum, eps, other, divisor):
    t = (F.batch_norm(x, rm, rv, w, b, training, momentum, eps) + other) / divisor
    return t * torch.sigmoid(t)


# ------------------------------------------------------------------ gradcheck

LINEAR_OTHERS = {
    "per_feature": (5,),
    "scalar_like": (1,),
    "full": (3, 5),
    "beyond_output": (2, 3, 5),
}


@pytest.mark.parametrize("other", list(LINEAR_OTHERS))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_linear_add_relu_gradcheck(other, bias):
    x = signed(3, 4, requires_grad=True)
    w = signed(5, 4, requires_grad=True)
    o = signed(*LINEAR_OTHERS[other], requires_grad=True)
    if bias:
        b = signed(5, requires_grad=True)
        gradcheck(lambda x, w, b, o: ops.custom_linear_add_relu(x, w, b, o, 0.5), (x, w, b, o))
    else:
        gradcheck(lambda x, w, o: ops.custom_linear_add_relu(x, w, None, o, -2), (x, w, o))


CONV_CASES = {
    # name: (input sizes, weight sizes, stride, padding, dilation, groups)
    "1d": ((2, 4, 7), (6, 4, 3), [1], [1], [1], 1),
    "2d": ((2, 4, 5, 6), (6, 2, 3, 2), [2, 1], [1, 0], [1, 2], 2),
    "3d": ((1, 2, 3, 3, 3), (2, 2, 2, 2, 2), [1], [1], [1], 1),
    "2d_unbatched": ((4, 5, 5), (6, 4, 3, 3), [1], [1], [1], 1),
}


def conv_other_sizes(form, out_sizes, spatial):
    if form == "per_channel":
        return (out_sizes[-spatial - 1],) + (1,) * spatial
    if form == "scalar_like":
        return (1,)
    return tuple(out_sizes)


@pytest.mark.parametrize("other", ["per_channel", "scalar_like", "full"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_relu_add_gradcheck(case, bias, other):
    xs, ws, stride, padding, dilation, groups = CONV_CASES[case]
    x = signed(*xs, requires_grad=True)
    w = signed(*ws, requires_grad=True)
    out_sizes = conv_relu_add_ref(x, w, None, stride, padding, dilation, groups, 0).shape
    o = signed(*conv_other_sizes(other, out_sizes, len(ws) - 2), requires_grad=True)
    args = (stride, padding, dilation, groups)
    if bias:
        b = signed(ws[0], requires_grad=True)
        gradcheck(lambda x, w, b, o: ops.custom_conv_relu_add(x, w, b, *args, o, 0.5), (x, w, b, o))
    else:
        gradcheck(lambda x, w, o: ops.custom_conv_relu_add(x, w, None, *args, o), (x, w, o))


def _pack_bits(bits):
    words = (bits.numel() + 31) // 32
    flat = torch.zeros(words * 32, dtype=torch.int64)
    flat[: bits.numel()] = bits.long()
    w = (flat.view(words, 32) << torch.arange(32)).sum(1)
    return torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], 1).reshape(-1).to(torch.uint8)


@pytest.mark.parametrize("layout", ["nchw", "input_cl", "weight_cl"])
def test_conv_relu_add_mask_order(layout):
    """The forward's mask is in the conv output's memory order
    (ops/conv_relu_add.h): flat NCHW order for NCHW outputs, words spanning
    channels and images; channels-last, each position's channels padded to
    32 bits, for channels-last ones.  The backward reads it in that order
    whatever format grad_output arrives in."""
    x = signed(3, 2, 4, 7, dtype=torch.float32)  # conv output [3, 5, 2, 5]: 10 positions
    w = signed(5, 2, 3, 3, dtype=torch.float32)
    if layout == "input_cl":
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "weight_cl":
        w = w.contiguous(memory_format=torch.channels_last)
    b, o = signed(5, dtype=torch.float32), signed(5, 1, 1, dtype=torch.float32)
    args = ([1, 1], [0, 0], [1, 1], 1)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, o, 1.0)
    keep = F.conv2d(x, w, b) > 0
    if layout == "nchw":
        want = _pack_bits(keep.reshape(-1))
    else:
        padded = torch.zeros(3, 10, 32, dtype=torch.bool)
        padded[:, :, :5] = keep.reshape(3, 5, 10).transpose(1, 2)
        want = _pack_bits(padded.reshape(-1))
    assert torch.equal(mask, want)
    for gy in (torch.randn(out.shape), torch.randn(out.shape).contiguous(memory_format=torch.channels_last)):
        got = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
        xr, wr, br, orr = (t.detach().clone().requires_grad_(True) for t in (x, w, b, o))
        conv_relu_add_ref(xr, wr, br, *args, orr).backward(gy)
        assert len(got) == 4
        for g, r in zip(got, (xr.grad, wr.grad, br.grad, orr.grad.reshape(5))):
            torch.testing.assert_close(g, r)


# Convolutions whose outputs have size-1 dimensions (their layout ambiguous):
# name -> (x, weight, stride); the comment gives the conv output.
AMBIGUOUS_CONVS = {
    "se_1x1": ((3, 8, 1, 1), (6, 8, 1, 1), 1),         # [3, 6, 1, 1]
    "pooled_to_1x1": ((3, 4, 5, 5), (6, 4, 3, 3), 2),  # [3, 6, 1, 1]
    "one_channel": ((3, 4, 5, 6), (1, 4, 3, 3), 1),    # [3, 1, 3, 4]
    "one_row": ((2, 4, 3, 7), (6, 4, 3, 3), 1),        # [2, 6, 1, 5]
    "batch_of_one": ((1, 4, 1, 1), (6, 4, 1, 1), 1),   # [1, 6, 1, 1]
}


@pytest.mark.parametrize("device", ["cpu", "meta", pytest.param("cuda", marks=CUDA_ONLY)])
@pytest.mark.parametrize("form", list(AMBIGUOUS_CONVS))
@pytest.mark.parametrize("layout", ["nchw", "input_cl", "weight_cl"])
def test_conv_relu_add_strides_of_ambiguous_outputs(form, layout, device):
    """Where the conv output has a size-1 dimension, eager's out-of-place
    relu picks its own strides and the add follows them: the op and its
    _forward form give those strides (the CUDA kernels write their epilogue
    into the convolution's output, whose strides differ), the values of a
    float64 reference and no view; the Meta kernels predict them, for every
    `other`."""
    xs, ws, stride = AMBIGUOUS_CONVS[form]
    gen = torch.Generator().manual_seed(3)

    def ints(*sizes):
        # nonzero small integers of both signs: every conv sum is exact in
        # float32 and TF32, whichever algorithm each device picks
        t = torch.randint(1, 4, sizes, generator=gen) * (torch.randint(0, 2, sizes, generator=gen) * 2 - 1)
        return t.to(torch.float32)

    x, w, b = ints(*xs), ints(*ws), ints(ws[0])
    if layout == "input_cl":
        x = x.contiguous(memory_format=torch.channels_last)
    if layout == "weight_cl":
        w = w.contiguous(memory_format=torch.channels_last)
    conv_sizes = F.conv2d(x, w, b, stride).shape
    others = {"per_channel": ints(ws[0], 1, 1),
              "scalar_like": ints(1),
              "full": ints(*conv_sizes),
              "full_cl": ints(*conv_sizes).contiguous(memory_format=torch.channels_last)}
    args = ([stride, stride], [0, 0], [1, 1], 1)
    on = "cuda" if device == "cuda" else "cpu"

    def place(t, dev):
        # NB: Tensor.to keeps a dense tensor's strides, channels-last included
        return t.to(dev) if dev != "meta" else torch.empty_strided(t.shape, t.stride(), device="meta")

    for name, o in others.items():
        ref = torch.add(torch.relu(F.conv2d(x.double(), w.double(), b.double(), stride)), o.double(), alpha=0.5)
        eager = torch.add(torch.relu(F.conv2d(place(x, on), place(w, on), place(b, on), stride)), place(o, on),
                          alpha=0.5)
        for fn in (ops.custom_conv_relu_add, ops.custom_conv_relu_add_forward):
            if device == "cuda":
                poison_allocator([eager.numel() * 4])
            got = fn(place(x, device), place(w, device), place(b, device), *args, place(o, device), 0.5)
            got = got[0] if isinstance(got, tuple) else got
            assert got.stride() == eager.stride(), (name, fn, got.stride(), eager.stride())
            if device != "meta":
                assert torch.equal(got.cpu().double(), ref), name
                assert got._base is None, name


@pytest.mark.parametrize("forward_layout", ["nchw", "input_cl"])
def test_conv_relu_add_backward_reads_the_mask_in_the_order_named(forward_layout):
    """mask_order names the order the forward wrote the mask in: a backward
    whose input and weight were restrided since (Inductor's layout
    optimization does) reads it so, with the gradients of the forward's
    layouts; None derives it from the layouts; a value that is no order is
    refused, naming the argument."""
    torch.manual_seed(4)
    x = signed(3, 2, 4, 7, dtype=torch.float32)
    w = signed(5, 2, 3, 3, dtype=torch.float32)
    if forward_layout == "input_cl":
        x = x.contiguous(memory_format=torch.channels_last)
    b, o = signed(5, dtype=torch.float32), signed(5, 1, 1, dtype=torch.float32)
    args = ([1, 1], [0, 0], [1, 1], 1)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, o, 1.0)
    order = 0 if forward_layout == "nchw" else 1
    gy = torch.randn(out.shape)
    want = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
    # the other layout than the forward's
    x2 = x.contiguous(memory_format=torch.channels_last) if order == 0 else x.contiguous()
    got = ops.custom_conv_relu_add_backward(gy, mask, x2, w, *args, [True, True, True, True], order)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r)
    with pytest.raises(RuntimeError, match="expected mask to be the 1-D uint8 tensor"):
        ops.custom_conv_relu_add_backward(gy, mask, x2, w, *args, [True, True, True, True])
    with pytest.raises(RuntimeError, match=r"expected mask_order to be None, 0 \(positions-inner\) or 1 "
                                           r"\(channels-inner\), got 2"):
        ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True], 2)
    with pytest.raises(RuntimeError, match="mask_order 1 .channels-inner. only for a batched 2-d or 3-d"):
        ops.custom_conv_relu_add_backward(gy, mask, x[0], w, *args, [True, True, True, True], 1)


BN_OTHERS = {"per_channel": (3, 1, 1), "scalar_like": (1,), "full": (2, 3, 4, 2)}


def bn_call(mode, x, w, b, rm, rv, o, divisor=-1.5, momentum=0.1, eps=1e-5):
    if mode == "eval_op":
        return ops.custom_batch_norm_add_div_swish_eval(x, w, b, rm, rv, eps, o, divisor)
    # The stats are cloned: gradcheck calls this many times.
    return ops.custom_batch_norm_add_div_swish(
        x, w, b, rm.clone(), rv.clone(), mode == "train", momentum, eps, o, divisor
    )


@pytest.mark.parametrize("other", list(BN_OTHERS))
@pytest.mark.parametrize("affine", ["weight_bias", "weight", "none"])
@pytest.mark.parametrize("mode", ["train", "eval", "eval_op"])
def test_batch_norm_add_div_swish_gradcheck(mode, affine, other):
    x = signed(2, 3, 4, 2, requires_grad=True)
    o = signed(*BN_OTHERS[other], requires_grad=True)
    rm, rv = signed(3), positive(3)
    if affine == "weight_bias":
        w, b = signed(3, requires_grad=True), signed(3, requires_grad=True)
        gradcheck(lambda x, w, b, o: bn_call(mode, x, w, b, rm, rv, o), (x, w, b, o))
    elif affine == "weight":
        w = signed(3, requires_grad=True)
        gradcheck(lambda x, w, o: bn_call(mode, x, w, None, rm, rv, o), (x, w, o))
    else:
        gradcheck(lambda x, o: bn_call(mode, x, None, None, rm, rv, o), (x, o))


def test_batch_norm_add_div_swish_gradcheck_2d_input():
    x = signed(5, 3, requires_grad=True)
    w, b, o = signed(3, requires_grad=True), signed(3, requires_grad=True), signed(3, requires_grad=True)
    rm, rv = signed(3), positive(3)
    for mode in ("train", "eval", "eval_op"):
        gradcheck(lambda x, w, b, o: bn_call(mode, x, w, b, rm, rv, o, divisor=2), (x, w, b, o))


def test_relu_gradcheck():
    x = signed(4, 5, requires_grad=True)
    gradcheck(ops.custom_relu, (x,))


# -------------------------------------------------------------------- opcheck


def opcheck_samples():
    """(name, op, args) for each public op; tensors require grad where
    differentiable, so test_autograd_registration sees the Autograd kernel."""
    g = dict(requires_grad=True, dtype=torch.float32)
    return [
        ("linear_add_relu", ops.custom_linear_add_relu,
         (signed(3, 4, **g), signed(5, 4, **g), signed(5, **g), signed(3, 5, **g), 1)),
        ("linear_add_relu_no_bias", ops.custom_linear_add_relu,
         (signed(3, 4, **g), signed(5, 4, **g), None, signed(5, **g), 0.5)),
        ("conv_relu_add", ops.custom_conv_relu_add,
         (signed(2, 4, 5, 5, **g), signed(6, 4, 3, 3, **g), signed(6, **g), [1], [1], [1], 1,
          signed(6, 1, 1, **g), 1)),
        ("conv_relu_add_no_bias_1d", ops.custom_conv_relu_add,
         (signed(2, 4, 7, **g), signed(6, 2, 3, **g), None, [2], [0], [1], 2, signed(1, **g), 2)),
        ("batch_norm_add_div_swish_train", ops.custom_batch_norm_add_div_swish,
         (signed(4, 3, 2, **g), signed(3, **g), signed(3, **g), signed(3, dtype=torch.float32),
          positive(3, dtype=torch.float32), True, 0.1, 1e-5, signed(3, 1, **g), 2.0)),
        ("batch_norm_add_div_swish_eval_mode", ops.custom_batch_norm_add_div_swish,
         (signed(4, 3, 2, **g), signed(3, **g), None, signed(3, dtype=torch.float32),
          positive(3, dtype=torch.float32), False, 0.1, 1e-5, signed(1, **g), -2.0)),
        ("batch_norm_add_div_swish_eval", ops.custom_batch_norm_add_div_swish_eval,
         (signed(4, 3, 2, **g), signed(3, **g), signed(3, **g), signed(3, dtype=torch.float32),
          positive(3, dtype=torch.float32), 1e-5, signed(4, 3, 2, **g), 2.0)),
        ("relu", ops.custom_relu, (signed(4, 5, **g),)),
    ]


@pytest.mark.parametrize("index", range(len(opcheck_samples())),
                         ids=[s[0] for s in opcheck_samples()])
def test_opcheck(index):
    torch.manual_seed(index)
    _, op, args = opcheck_samples()[index]
    torch.library.opcheck(op, args)


def internal_opcheck_samples():
    """(name, op, args) for the forward and backward ops the Autograd kernels
    call; masks and saved statistics come from the forward ops.  NB: the
    forward ops have no Autograd kernel (the public ops' Autograd kernels
    call them below it), so their inputs do not require grad; the backward
    ops have one (double backward), so theirs do."""
    g = dict(requires_grad=True, dtype=torch.float32)
    with torch.no_grad():
        x = signed(4, 5, dtype=torch.float32)
        _, relu_mask = ops.custom_relu_forward_mask(x)
        conv = (signed(2, 4, 5, 5, dtype=torch.float32), signed(6, 4, 3, 3, dtype=torch.float32),
                signed(6, dtype=torch.float32), [1], [1], [1], 1, signed(6, 1, 1, dtype=torch.float32), 1)
        conv_out, conv_mask = ops.custom_conv_relu_add_forward(*conv)
        # stride 2 leaves a remainder (output_padding 1 in the transposed
        # convolution of the differentiable backward)
        conv_gs = (signed(2, 4, 8, 8, dtype=torch.float32), signed(6, 2, 3, 3, dtype=torch.float32),
                   None, [2], [1], [1], 2, signed(1, dtype=torch.float32), 1)
        conv_gs_out, conv_gs_mask = ops.custom_conv_relu_add_forward(*conv_gs)
        conv_1d = (signed(4, 9, dtype=torch.float32), signed(5, 4, 3, dtype=torch.float32),
                   signed(5, dtype=torch.float32), [1], [2], [2], 1, signed(5, 1, dtype=torch.float32), 1)
        conv_1d_out, conv_1d_mask = ops.custom_conv_relu_add_forward(*conv_1d)
        lin = (signed(3, 4, dtype=torch.float32), signed(5, 4, dtype=torch.float32))
        lin_out = ops.custom_linear_add_relu(*lin, None, signed(3, 5, dtype=torch.float32), 1)
        bn = (signed(4, 3, 2, dtype=torch.float32), signed(3, dtype=torch.float32), signed(3, dtype=torch.float32),
              signed(3, dtype=torch.float32), positive(3, dtype=torch.float32), True, 0.1, 1e-5,
              signed(3, 1, dtype=torch.float32), 2.0)
        _, mean, invstd = ops.custom_batch_norm_add_div_swish_forward(
            bn[0], bn[1], bn[2], bn[3].clone(), bn[4].clone(), *bn[5:])
    return [
        ("relu_forward_mask", ops.custom_relu_forward_mask, (signed(4, 5, dtype=torch.float32),)),
        ("relu_backward", ops.custom_relu_backward, (signed(4, 5, **g), relu_mask)),
        ("relu_backward_dim_order", ops.custom_relu_backward, (signed(4, 5, **g), relu_mask, [1, 0])),
        ("conv_relu_add_forward", ops.custom_conv_relu_add_forward, conv),
        ("conv_relu_add_backward", ops.custom_conv_relu_add_backward,
         (signed(*conv_out.shape, **g), conv_mask, conv[0].clone().requires_grad_(True),
          conv[1].clone().requires_grad_(True), [1], [1], [1], 1, [True, True, True, True])),
        ("conv_relu_add_backward_groups_stride", ops.custom_conv_relu_add_backward,
         (signed(*conv_gs_out.shape, **g), conv_gs_mask, conv_gs[0].clone().requires_grad_(True),
          conv_gs[1].clone().requires_grad_(True), [2], [1], [1], 2, [True, True, True, True])),
        ("conv_relu_add_backward_unbatched_1d", ops.custom_conv_relu_add_backward,
         (signed(*conv_1d_out.shape, **g), conv_1d_mask, conv_1d[0].clone().requires_grad_(True),
          conv_1d[1].clone().requires_grad_(True), [1], [2], [2], 1, [True, True, False, True])),
        ("linear_add_relu_backward", ops.custom_linear_add_relu_backward,
         (signed(3, 5, **g), lin[0].clone().requires_grad_(True), lin[1].clone().requires_grad_(True), lin_out,
          [True, True, True])),
        ("batch_norm_add_div_swish_forward", ops.custom_batch_norm_add_div_swish_forward,
         tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in bn)),
        ("batch_norm_add_div_swish_backward", ops.custom_batch_norm_add_div_swish_backward,
         (signed(4, 3, 2, **g), bn[0].clone().requires_grad_(True), bn[1].clone().requires_grad_(True),
          bn[2].clone().requires_grad_(True), mean, invstd, True, bn[8].clone().requires_grad_(True), 2.0,
          [True, True, True, True])),
    ]


# NB: every op, test_aot_dispatch_dynamic included: the backward ops'
# differentiable composites (their Autograd kernels' path with a graph)
# read only symbolic sizes.
@pytest.mark.parametrize("index", range(len(internal_opcheck_samples())),
                         ids=[s[0] for s in internal_opcheck_samples()])
def test_opcheck_internal_ops(index):
    torch.manual_seed(index)
    _, op, args = internal_opcheck_samples()[index]
    torch.library.opcheck(op, args)


# Every op of the library and the test file that runs torch.library.opcheck
# on it: an op added without an opcheck fails here.
OPCHECK_FILES = {
    "custom_add_layer_norm": "test_add_layer_norm.py",
    "custom_batch_norm_add_div_swish": "test_ops.py",
    "custom_batch_norm_add_div_swish_backward": "test_ops.py",
    "custom_batch_norm_add_div_swish_eval": "test_ops.py",
    "custom_batch_norm_add_div_swish_forward": "test_ops.py",
    "custom_conv_act_max_pool": "test_conv_act_max_pool.py",
    "custom_conv_add_act": "test_conv_add_act.py",
    "custom_conv_batch_norm_act": "test_conv_batch_norm_act.py",
    "custom_conv_output_size": "test_conv_batch_norm_act.py",
    "custom_conv_relu_add": "test_ops.py",
    "custom_conv_relu_add_backward": "test_ops.py",
    "custom_conv_relu_add_forward": "test_ops.py",
    "custom_gate_mul": "test_gate_mul.py",
    "custom_linear_act": "test_linear_act.py",
    "custom_linear_add_relu": "test_ops.py",
    "custom_linear_add_relu_backward": "test_ops.py",
    "custom_relu": "test_ops.py",
    "custom_relu_backward": "test_ops.py",
    "custom_relu_forward_mask": "test_ops.py",
    "custom_restore_layout": "test_layout.py",
    "custom_channels_last_weight": "test_layout_unfrozen.py",
    "custom_spatial_mean": "test_spatial_mean.py",
    "custom_unmasked_attention": "test_attention_masks.py",
}


def test_every_op_has_an_opcheck():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("torchfuse::")}
    assert registered == set(OPCHECK_FILES), registered ^ set(OPCHECK_FILES)
    here = pathlib.Path(__file__).parent
    for op, name in OPCHECK_FILES.items():
        text = (here / name).read_text()
        assert "opcheck(" in text and re.search(rf"\b{op}\b", text), (op, name)


# ------------------------------------------------- TorchScript and save/load


class Fused(torch.nn.Module):
    """Calls every public op once; the BN stats are buffers, as in nn.BatchNorm."""

    def __init__(self):
        super().__init__()
        self.lin_w = torch.nn.Parameter(signed(6, 4, dtype=torch.float32))
        self.lin_b = torch.nn.Parameter(signed(6, dtype=torch.float32))
        self.conv_w = torch.nn.Parameter(signed(3, 1, 3, 3, dtype=torch.float32))
        self.bn_w = torch.nn.Parameter(signed(3, dtype=torch.float32))
        self.register_buffer("running_mean", torch.zeros(3))
        self.register_buffer("running_var", torch.ones(3))

    def forward(self, x):
        y = ops.custom_linear_add_relu(x, self.lin_w, self.lin_b, x[:, :1].expand(-1, 6), 1)
        z = ops.custom_conv_relu_add(
            y.view(-1, 1, 2, 3), self.conv_w, None,
            [1], [1], [1], 1, torch.ones(1), 0.5)
        s = ops.custom_batch_norm_add_div_swish(
            z, self.bn_w, None, self.running_mean, self.running_var, self.training,
            0.1, 1e-5, z, 2.0)
        e = ops.custom_batch_norm_add_div_swish_eval(
            z, None, None, self.running_mean, self.running_var, 1e-5, s, 3.0)
        return ops.custom_relu(e - 0.1)


def test_scripted_function_calls_the_ops():
    @torch.jit.script
    def f(x, w, b, other):
        return torch.ops.torchfuse.custom_relu(
            torch.ops.torchfuse.custom_linear_add_relu(x, w, b, other, 2) - 1.0)

    x, w, b, o = signed(3, 4), signed(5, 4), signed(5), signed(5)
    assert "torchfuse::custom_linear_add_relu" in str(f.graph)
    torch.testing.assert_close(f(x, w, b, o), torch.relu(linear_add_relu_ref(x, w, b, o, 2) - 1))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_script_save_load_round_trip(tmp_path, training):
    module = Fused().train(training)
    # NB: scripting shares the module's tensors; each copy here runs one step
    # from the same state.
    scripted = torch.jit.script(copy.deepcopy(module))
    path = tmp_path / "fused.pt"
    torch.jit.save(scripted, str(path))
    loaded = torch.jit.load(str(path))
    assert "ops.torchfuse.custom_batch_norm_add_div_swish(" in loaded.code
    assert "ops.torchfuse.custom_batch_norm_add_div_swish_eval(" in loaded.code
    x = signed(2, 4, dtype=torch.float32)
    initial_mean = module.running_mean.clone()
    expected = module(x)
    scripted_out = scripted(x)
    loaded_out = loaded(x)
    torch.testing.assert_close(scripted_out, expected)
    torch.testing.assert_close(loaded_out, expected)
    for copy_ in (scripted, loaded):
        torch.testing.assert_close(copy_.running_mean, module.running_mean)
        torch.testing.assert_close(copy_.running_var, module.running_var)
    assert torch.equal(module.running_mean, initial_mean) != training
    # gradients flow through the loaded graph as through the eager module.
    loaded_out.sum().backward()
    expected.sum().backward()
    for name in ("lin_w", "lin_b", "conv_w", "bn_w"):
        torch.testing.assert_close(getattr(loaded, name).grad, getattr(module, name).grad)


# ------------------------------------------------------------- no-grad path


def no_grad_cases():
    rm, rv = signed(3), positive(3)
    return {
        "linear_add_relu": (ops.custom_linear_add_relu, linear_add_relu_ref,
                            (signed(3, 4), signed(5, 4), signed(5), signed(3, 5), 1)),
        "conv_relu_add": (ops.custom_conv_relu_add, conv_relu_add_ref,
                          (signed(2, 4, 5, 5), signed(6, 4, 3, 3), None, [1], [1], [1], 1,
                           signed(6, 1, 1), 1)),
        "batch_norm_add_div_swish": (
            ops.custom_batch_norm_add_div_swish, bn_swish_ref,
            (signed(4, 3, 2), signed(3), signed(3), rm, rv, True, 0.1, 1e-5, signed(3, 1), 2.0)),
        "batch_norm_add_div_swish_eval": (
            ops.custom_batch_norm_add_div_swish_eval,
            lambda x, w, b, rm, rv, eps, o, d: bn_swish_ref(x, w, b, rm, rv, False, 0.0, eps, o, d),
            (signed(4, 3, 2), signed(3), None, rm, rv, 1e-5, signed(4, 3, 2), -2.0)),
        "relu": (ops.custom_relu, torch.relu, (signed(4, 5),)),
    }


@pytest.mark.parametrize("name", list(no_grad_cases()))
def test_no_grad_gives_the_same_output(name):
    op, ref, args = no_grad_cases()[name]
    grad_args = [a.clone().requires_grad_(a.is_floating_point() and a.dim() > 0 and i < 3)
                 if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
    with_grad = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in grad_args])
    assert with_grad.requires_grad
    with torch.no_grad():
        without = op(*[a.clone() if isinstance(a, torch.Tensor) else a for a in grad_args])
        expected = ref(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    assert not without.requires_grad
    torch.testing.assert_close(without, with_grad.detach(), rtol=0, atol=0)
    torch.testing.assert_close(without, expected)


def test_inference_mode_gives_the_same_output():
    x, w, o = signed(3, 4), signed(5, 4), signed(5)
    with torch.inference_mode():
        out = ops.custom_linear_add_relu(x, w, None, o)
    torch.testing.assert_close(out, linear_add_relu_ref(x, w, None, o))


# ------------------------------------------------------ batch-norm statistics


@pytest.mark.parametrize("momentum", [0.1, 0.5, 1.0, 0.0])
def test_running_stats_follow_f_batch_norm_over_three_steps(momentum):
    rm, rv = signed(3), positive(3)
    rm_ref, rv_ref = rm.clone(), rv.clone()
    initial = rm.clone()
    w, b = signed(3, requires_grad=True), signed(3, requires_grad=True)
    for step in range(3):
        x = signed(4, 3, 5) * (step + 1) + step
        o = signed(3, 1)
        out = ops.custom_batch_norm_add_div_swish(x, w, b, rm, rv, True, momentum, 1e-5, o, 2.0)
        expected = bn_swish_ref(x, w, b, rm_ref, rv_ref, True, momentum, 1e-5, o, 2.0)
        torch.testing.assert_close(out, expected)
    torch.testing.assert_close(rm, rm_ref)
    torch.testing.assert_close(rv, rv_ref)
    assert torch.equal(rm, initial) == (momentum == 0.0)


def test_eval_leaves_running_stats_alone():
    rm, rv = signed(3), positive(3)
    before = rm.clone(), rv.clone()
    x, o = signed(4, 3, 2, requires_grad=True), signed(1)
    ops.custom_batch_norm_add_div_swish(x, None, None, rm, rv, False, 0.1, 1e-5, o, 2.0)
    ops.custom_batch_norm_add_div_swish_eval(x, None, None, rm, rv, 1e-5, o, 2.0)
    assert torch.equal(rm, before[0]) and torch.equal(rv, before[1])


def bn_swish_grads(fused, silu, mode, dtype, gy):
    """Gradients of x, weight, bias and other through the op (fused) or the
    eager chain with the given swish spelling, in dtype, with gy."""
    torch.manual_seed(1)
    x = signed(4, 3, 6).to(dtype).requires_grad_(True)
    # Weights of +-8 spread t over +-30: sigmoid rounds to 1 and to 0 there.
    w = (signed(3) * 8).to(dtype).requires_grad_(True)
    b, o = signed(3).to(dtype).requires_grad_(True), signed(3, 1).to(dtype).requires_grad_(True)
    rm, rv = signed(3).to(dtype), positive(3).to(dtype)
    training = mode == "train"
    if not fused:
        t = (F.batch_norm(x, rm, rv, w, b, training, 0.1, 1e-5) + o) / 0.75
        y = F.silu(t) if silu else t * torch.sigmoid(t)
    elif mode == "eval_op":
        y = ops.custom_batch_norm_add_div_swish_eval(x, w, b, rm, rv, 1e-5, o, 0.75, silu)
    else:
        y = ops.custom_batch_norm_add_div_swish(x, w, b, rm, rv, training, 0.1, 1e-5, o, 0.75, silu)
    y.backward(gy.to(dtype))
    return [v.grad for v in (x, w, b, o)]


def nonfinite(t):
    return torch.stack([t.isnan(), t.isposinf(), t.isneginf()])


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "mul-sigmoid"])
@pytest.mark.parametrize("mode", ["train", "eval", "eval_op"])
def test_infinite_grad_follows_the_swish_spelling(mode, silu, dtype):
    """Autograd through t * sigmoid(t) sums g*s + ((g*t)*(1-s))*s: NaN where
    g is infinite and t < 0 (inf - inf) or the sigmoid rounds to 1 or 0
    (inf * 0), where silu's backward mostly gives +-Inf.  The op's `silu`
    argument names the spelling, and NaN and Inf land where eager puts them."""
    gy = signed(4, 3, 6)
    gy.view(-1)[::3] = float("inf") * torch.sign(gy.view(-1)[::3])
    got = bn_swish_grads(True, silu, mode, dtype, gy)
    want = bn_swish_grads(False, silu, mode, dtype, gy)
    for name, g, r in zip(("x", "weight", "bias", "other"), got, want):
        assert torch.equal(nonfinite(g), nonfinite(r)), f"grad of {name}: NaN/Inf placement differs"
        if dtype != torch.bfloat16:  # bf16: eager rounds every intermediate
            torch.testing.assert_close(g, r, equal_nan=True, rtol=1e-4, atol=1e-5)
    if mode != "train":  # the case must tell the spellings apart
        other = bn_swish_grads(False, not silu, mode, dtype, gy)
        assert not torch.equal(nonfinite(want[0]), nonfinite(other[0]))


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "mul-sigmoid"])
def test_infinite_grad_where_the_float32_sigmoid_is_one(silu):
    """float32's 1 / (1 + exp(-t)) is exactly 1 from t > 16.64 (1 + exp(-t)
    rounds to 1), below t = 17.33 where the exact sigmoid rounds to 1; there
    an infinite gradient through t * sigmoid(t) meets inf * (1 - 1) = NaN."""
    t = torch.tensor([16.7, 17.0, 17.2, 17.5, 3.0, -0.5, -90.0]).view(-1, 1)
    gy = torch.full_like(t, float("inf"))
    ones, zeros = torch.ones(1), torch.zeros(1)
    got_x = t.clone().requires_grad_(True)
    ops.custom_batch_norm_add_div_swish_eval(got_x, None, None, zeros, ones - 1e-5, 1e-5, zeros, 1.0, silu).backward(gy)
    want_x = t.clone().requires_grad_(True)
    y = F.batch_norm(want_x, zeros, ones - 1e-5, None, None, False, 0.1, 1e-5)
    (F.silu(y) if silu else y * torch.sigmoid(y)).backward(gy)
    assert torch.equal(nonfinite(got_x.grad), nonfinite(want_x.grad)), (got_x.grad, want_x.grad)


def test_double_backward_matches_aten():
    x = signed(3, 4, requires_grad=True)
    w = signed(5, 4, requires_grad=True)
    o = signed(5)

    def second(out):
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), w)[0]

    torch.testing.assert_close(
        second(ops.custom_linear_add_relu(x, w, None, o)), second(torch.relu(F.linear(x, w) + o))
    )
    # the plain backward still works.
    (g,) = torch.autograd.grad(ops.custom_linear_add_relu(x, w, None, o).sum(), x)
    assert g.shape == x.shape
