"""custom_conv_relu_add on CUDA at the edges of its mask layouts.

The ReLU mask between the forward and the backward op is in one of two orders
(ops/conv_relu_add.h): positions-inner (the conv output's logical order, flat,
for NCHW outputs) or channels-inner (channels-last, each position's channels
padded to whole words, for channels-last outputs).  These tests check the
CUDA forward's mask bit for bit against that definition, written out again
here in Python, and the backward against the CPU composition, on the shapes
that stress the streaming NCHW passes: positions not a multiple of 32 or of a
16-byte vector, 1x1 outputs, channels not a multiple of 32, mask words that
span channels and images, rows split into several chunks, misaligned
grad_output, many images, and grad_output arriving in another memory format
than the forward's output.  An unbatched conv with a channels-last weight
gives a channels-last-strided output whose mask is positions-inner, a layout
neither CUDA pass takes: there the forward runs the composition's pointwise
part on the convolution it already computed, checked against eager too.

Exactness: small-integer inputs make every conv product and sum exact (in
TF32 and float16 too), so outputs, masks and bias gradients must equal the
definition or the CPU composition bit for bit in every dtype; input and
weight gradients (cuDNN's convolution backward) are checked to float32, or
float16/bfloat16, rounding.

The direct convolution for few channels, which would take the small float32
inference cases, is off for the tests that pin the other paths
(torchfuse.backends.conv.allow_direct = False) and on for its own; every
test starts from that and leaves the options as it found them.

Every test is marked `cuda` and skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import os
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_utils import (  # noqa: E402
    CUDA_ONLY, nbytes_of, poison_allocator, rel_err, run_memcheck, run_seed, signed_randn, tf32_flags)

import torchfuse  # noqa: E402  (registers torch.ops.torchfuse)

pytestmark = CUDA_ONLY

ops = torch.ops.torchfuse

SHAPES = {
    # name: (x shape, weight shape, padding); the comment gives the conv output
    "s99-c40": ((3, 2, 11, 13), (40, 2, 3, 3), 0),  # [3, 40, 9, 11]: 99 positions
    "s1x1-c7": ((5, 2, 3, 3), (7, 2, 3, 3), 0),  # [5, 7, 1, 1]: words span images
    "s5-c3": ((4, 2, 3, 7), (3, 2, 3, 3), 0),  # [4, 3, 1, 5]: 15 elements per image
    "s64-c16": ((2, 2, 8, 8), (16, 2, 3, 3), 1),  # [2, 16, 8, 8]: whole vectors and words
    "s16384-chunks": ((1, 2, 130, 130), (2, 2, 3, 3), 0),  # [1, 2, 128, 128]: rows in chunks
    "s16383-chunks": ((1, 2, 129, 131), (3, 2, 3, 3), 0),  # [1, 3, 127, 129]: odd rows in chunks
    # [3, 24, 8, 10]: channels and positions (in and out) in whole 16-byte
    # units, for the channels-last route's vector tiles, partly filled
    "vec-c8": ((3, 8, 10, 12), (24, 8, 3, 3), 0),
    "1d": ((3, 2, 37), (5, 2, 3), 0),  # [3, 5, 35]
    "3d": ((2, 2, 5, 6, 7), (6, 2, 3, 3, 3), 0),  # [2, 6, 3, 4, 5]
    "unbatched": ((2, 9, 10), (5, 2, 3, 3), 0),  # [5, 7, 8]
    "unbatched-3d": ((2, 5, 6, 7), (6, 2, 3, 3, 3), 0),  # [6, 3, 4, 5]
}
LAYOUTS = ["nchw", "channels-last", "weight-cl"]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}


def _channels_last_format(t):
    return torch.channels_last_3d if t.dim() == 5 else torch.channels_last


def _applies(name, layout):
    _, ws, _ = SHAPES[name]
    # no channels-last format for 1d convs; an unbatched input takes the
    # strides of its channels-last batch of one (_inputs)
    return layout == "nchw" or len(ws) >= 4


CASES = [(n, l) for n in SHAPES for l in LAYOUTS if _applies(n, l)]

options = torchfuse.backends.conv


@pytest.fixture(autouse=True)
def _direct_off():
    with options.flags(channels_last_route="auto", allow_implicit_gemm=True, allow_direct=False,
                       nchw_conversion="auto", conversion_lookahead=0):
        yield


def _ints(shape, lo, hi, gen, dtype):
    return torch.randint(lo, hi + 1, shape, generator=gen, device="cuda").to(dtype)


def _inputs(name, layout, dtype, seed):
    """Small integers: |x| <= 2, |w| <= 1, |b|, |other| <= 3, so every conv
    output is an integer of magnitude < 256, exact in every dtype."""
    xs, ws, padding = SHAPES[name]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    x = _ints(xs, -2, 2, gen, dtype)
    w = _ints(ws, -1, 1, gen, dtype)
    if layout == "channels-last":
        fmt = _channels_last_format(w)
        # NB: squeeze, not view: a view of a batch of one recomputes its
        # batch stride, which can turn channels-last strides ambiguous.
        x = x.unsqueeze(0).contiguous(memory_format=fmt).squeeze(0) if x.dim() < w.dim() \
            else x.contiguous(memory_format=fmt)
    if layout == "weight-cl":
        w = w.contiguous(memory_format=_channels_last_format(w))
    b = _ints((ws[0],), -3, 3, gen, dtype)
    other = _ints((ws[0],) + (1,) * (len(ws) - 2), -3, 3, gen, dtype)
    spatial = len(ws) - 2
    args = ([1] * spatial, [padding] * spatial, [1] * spatial, 1)
    return x, w, b, other, args


def _expected_order(x, w, layout):
    """The rule of ops/conv_relu_add.h: channels-inner exactly when the conv
    output is channels-last, i.e. a batched conv with a channels-last input
    or weight (no case here is ambiguous about its format); an unbatched
    one is positions-inner whatever strides its output has."""
    return "channels-inner" if x.dim() == w.dim() and layout != "nchw" else "positions-inner"


def _pack(keep, order):
    """The mask's bytes by the definition in ops/conv_relu_add.h."""
    if order == "positions-inner":
        bits = keep.reshape(-1)
    else:
        n, c = keep.shape[:2]
        k = keep.reshape(n, c, -1).transpose(1, 2)  # [N, S, C]
        padded = torch.zeros(n, k.shape[1], (c + 31) // 32 * 32, dtype=torch.bool, device=keep.device)
        padded[:, :, :c] = k
        bits = padded.reshape(-1)
    words = (bits.numel() + 31) // 32
    flat = torch.zeros(words * 32, dtype=torch.int64, device=keep.device)
    flat[: bits.numel()] = bits.long()
    w = (flat.view(words, 32) << torch.arange(32, device=keep.device)).sum(1)
    return torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], 1).reshape(-1).to(torch.uint8)


def _pre_activation(x, w, b, args):
    # float32 on CUDA with TF32 off: exact for these integers
    with tf32_flags(False, False):
        return _CONV[w.dim()](x.float(), w.float(), b.float(), *args)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name,layout", CASES)
def test_forward_mask_follows_the_documented_order(name, layout, dtype):
    x, w, b, other, args = _inputs(name, layout, DTYPES[dtype], seed=1)
    t = _pre_activation(x, w, b, args)
    keep = ~(t <= 0)
    assert keep.any() and (~keep).any()
    want = _pack(keep, _expected_order(x, w, layout))
    poison_allocator([t.numel() * x.element_size(), want.numel()])
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    assert mask.dtype == torch.uint8 and mask.shape == want.shape, (mask.shape, want.shape)
    assert torch.equal(mask, want), "mask bits differ from the documented order"
    ref = (torch.where(keep, t, torch.zeros((), device="cuda")) + other.float()).to(x.dtype)
    assert torch.equal(out, ref)
    # eager's out-of-place relu and add: over a 1x1 output their strides
    # are TensorIterator's, not the convolution's
    assert out.stride() == torch.add(torch.relu(_CONV[w.dim()](x, w, b, *args)), other).stride()
    # the composite (no mask) path writes the same output
    assert torch.equal(ops.custom_conv_relu_add(x, w, b, *args, other, 1.0), ref)


def _grad_like(shape, how, like, gen):
    """grad_output of `shape` in memory format `how`."""
    g = torch.randint(-3, 4, shape, generator=gen, device="cuda").to(like.dtype)
    if how == "nchw":
        return g.contiguous()
    if how == "channels-last":
        return g.contiguous(memory_format=_channels_last_format(g)) if g.dim() in (4, 5) else g
    if how == "misaligned":  # contiguous, 1 element past a 16-byte boundary
        buf = torch.empty(g.numel() + 1, dtype=g.dtype, device="cuda")
        buf[1:].copy_(g.reshape(-1))
        return buf[1:].view(shape)
    if how == "expanded":  # as from out.sum().backward()
        return g.reshape(-1)[:1].reshape((1,) * g.dim()).expand(shape)
    raise ValueError(how)


GRAD_FORMATS = ["nchw", "channels-last", "misaligned", "expanded"]


def _assert_grads_match(got, want, names=("input", "weight", "bias", "channels")):
    """The bias gradient and grad_output's channel sums (our float64 sums of
    exact values) equal the CPU's exactly; input and weight gradients come from cuDNN's convolution
    backward, whose algorithm (FFT and Winograd ones included) may round
    where the CPU's does not, so they get a float32-rounding tolerance, far
    below what a misread mask bit or a layout mix-up gives."""
    for what, g, r in zip(names, got, want):
        g = g.cpu()
        assert g.shape == r.shape, f"grad of {what}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        if what in ("bias", "other", "channels"):
            assert torch.equal(g, r), f"grad of {what} differs"
        else:
            err = (g - r).abs().max().item()
            assert err <= 1e-5 * max(1.0, r.abs().max().item()), f"grad of {what}: max error {err:.3e}"


@pytest.mark.parametrize("grad_format", GRAD_FORMATS)
@pytest.mark.parametrize("name,layout", CASES)
def test_backward_float32_matches_cpu(name, layout, grad_format):
    """Whatever memory format grad_output arrives in, the backward reads the
    mask in the order of the forward's conv output."""
    x, w, b, other, args = _inputs(name, layout, torch.float32, seed=2)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    out_cpu, mask_cpu = ops.custom_conv_relu_add_forward(x.cpu(), w.cpu(), b.cpu(), *args, other.cpu(), 1.0)
    assert torch.equal(out.cpu(), out_cpu)
    assert torch.equal(mask.cpu(), mask_cpu), "masks differ between CUDA and CPU"
    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)
    gy = _grad_like(out.shape, grad_format, out, gen)
    want = ops.custom_conv_relu_add_backward(gy.cpu(), mask_cpu, x.cpu(), w.cpu(), *args, [True, True, True, True])
    poison_allocator(nbytes_of(x, w, b, out))
    got = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
    _assert_grads_match(got, want)
    # a mask made on the CPU serves the CUDA backward: the order is the same
    _assert_grads_match(
        ops.custom_conv_relu_add_backward(gy, mask_cpu.cuda(), x, w, *args, [True, True, True, True]), want)


@pytest.mark.parametrize("grad_format", ["nchw", "channels-last", "misaligned"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name,layout", CASES)
def test_backward_16bit(name, layout, dtype, grad_format):
    """16-bit: the bias gradient (a float64 sum of exact values) is exact;
    input and weight gradients agree with float32 convolution_backward of the
    masked gradient to the dtype's rounding."""
    x, w, b, other, args = _inputs(name, layout, DTYPES[dtype], seed=4)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    keep = ~(_pre_activation(x, w, b, args) <= 0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(5)
    gy = _grad_like(out.shape, grad_format, out, gen)
    poison_allocator(nbytes_of(x, w, b, out))
    gx, gw, gb, gc = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
    g = torch.where(keep, gy.float(), torch.zeros((), device="cuda"))
    batched = x.dim() == w.dim()
    spatial = w.dim() - 2
    stride, padding, dilation, groups = args
    with tf32_flags(False, False):
        rx, rw, _ = torch.ops.aten.convolution_backward(
            g if batched else g.unsqueeze(0), (x if batched else x.unsqueeze(0)).float(), w.float(),
            None, stride, padding, dilation, False, [0] * spatial, groups, [True, True, False])
    if not batched:
        rx = rx.squeeze(0)
    not_channel = [d for d in range(g.dim()) if d != (1 if batched else 0)]
    assert torch.equal(gb, g.sum(dim=not_channel).to(gb.dtype))
    assert torch.equal(gc, gy.double().sum(dim=not_channel).to(gc.dtype))
    tol = 1e-2 if dtype == "bf16" else 2e-3
    for what, got, ref in (("input", gx, rx), ("weight", gw, rw)):
        err = (got.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1.0)
        assert err <= tol, f"grad of {what}: relative error {err:.2e}"


@pytest.mark.parametrize("images", [65535, 65536])
def test_many_images(images):
    """Up to the grad prologue's grid limit (one image per grid y index) the
    kernels run; beyond it the composition does."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(6)
    x = _ints((images, 2, 1, 3), -2, 2, gen, torch.float32)
    w = _ints((3, 2, 1, 2), -1, 1, gen, torch.float32)
    b = _ints((3,), -3, 3, gen, torch.float32)
    other = _ints((3, 1, 1), -3, 3, gen, torch.float32)
    args = ([1, 1], [0, 0], [1, 1], 1)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    out_cpu, mask_cpu = ops.custom_conv_relu_add_forward(x.cpu(), w.cpu(), b.cpu(), *args, other.cpu(), 1.0)
    assert torch.equal(out.cpu(), out_cpu) and torch.equal(mask.cpu(), mask_cpu)
    gy = _ints(tuple(out.shape), -3, 3, gen, torch.float32)
    got = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
    want = ops.custom_conv_relu_add_backward(gy.cpu(), mask_cpu, x.cpu(), w.cpu(), *args, [True, True, True, True])
    _assert_grads_match(got, want)


@pytest.mark.parametrize("name,layout", CASES)
def test_autograd_float32_matches_cpu(name, layout):
    """Through the Autograd kernel, with `other` per channel, grad_output
    contiguous (NCHW) whatever the output's format."""
    x, w, b, other, args = _inputs(name, layout, torch.float32, seed=7)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(8)

    def run(device):
        leaves = [t.detach().to(device).requires_grad_(True) for t in (x, w, b, other)]
        out = ops.custom_conv_relu_add(leaves[0], leaves[1], leaves[2], *args, leaves[3], 0.5)
        return out, leaves

    out, leaves = run("cuda")
    out_cpu, leaves_cpu = run("cpu")
    gy = torch.randint(-3, 4, out.shape, generator=gen, device="cuda").float()
    out.backward(gy)
    out_cpu.backward(gy.cpu())
    assert torch.equal(out.detach().cpu(), out_cpu.detach())
    _assert_grads_match([a.grad for a in leaves], [r.grad for r in leaves_cpu],
                        names=("input", "weight", "bias", "other"))


# The layouts neither CUDA pass takes (module doc).  An unbatched input with
# channels-last strides is not one: unsqueezed, its batch stride is C, so
# cuDNN takes it as NCHW and gives an NCHW output.
COMPOSITE_LAYOUTS = [("unbatched", "weight-cl"), ("unbatched-3d", "weight-cl")]


def _convolutions(fn) -> int:
    """How many convolutions fn() ran: aten::convolution calls, those inside
    our kernels included (profiler)."""
    # NB: the profiler warns that it clears events between cycles, which the
    # suite's filterwarnings=error would turn into a failure.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
    return sum(e.name == "aten::convolution" for e in prof.events())


@pytest.mark.parametrize("name,layout", COMPOSITE_LAYOUTS)
def test_composite_layouts_match_eager(name, layout):
    """Where neither CUDA pass takes the conv output, both forward ops run
    the convolution once, and the op gives eager's output, strides and
    gradients."""
    x, w, b, other, args = _inputs(name, layout, torch.float32, seed=9)
    assert not _CONV[w.dim()](x, w, b, *args).is_contiguous(), "not the layout under test"
    with torch.no_grad():
        assert _convolutions(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)) == 1
        assert _convolutions(lambda: ops.custom_conv_relu_add_forward(x, w, b, *args, other, 0.5)) == 1

    def run(fused):
        leaves = [t.detach().requires_grad_(True) for t in (x, w, b, other)]
        lx, lw, lb, lo = leaves
        if fused:
            out = ops.custom_conv_relu_add(lx, lw, lb, *args, lo, 0.5)
        else:
            out = torch.add(torch.relu(_CONV[w.dim()](lx, lw, lb, *args)), lo, alpha=0.5)
        return out, leaves

    out, leaves = run(fused=True)
    want, leaves_eager = run(fused=False)
    assert torch.equal(out, want)
    assert out.stride() == want.stride()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(10)
    gy = torch.randint(-3, 4, out.shape, generator=gen, device="cuda").float()
    out.backward(gy)
    want.backward(gy)
    _assert_grads_match([a.grad for a in leaves], [r.grad.cpu() for r in leaves_eager],
                        names=("input", "weight", "bias", "other"))


# The channels-last route for NCHW inputs by cuDNN (channels_last_cudnn.cpp),
# inference forward only: x converted to NHWC, cuDNN's channels-last
# convolution, one pass back to NCHW with the epilogue.  By default it runs
# only for large float32 convolutions that eager runs in TF32;
# channels_last_route = "always" forces it wherever its kernels apply, so
# the exact small-integer tests above check its output bit for bit.
ROUTE_CASES = [n for n, (xs, ws, _) in SHAPES.items() if len(xs) == 4 and len(ws) == 4]


def _kernels_run(fn) -> list[str]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            torch.cuda.synchronize()
    return [e.name for e in prof.events()]


def _route_ran(fn) -> bool:
    """Whether fn() ran the route: its NHWC-to-NCHW epilogue pass after
    cuDNN or the implicit-GEMM kernel (profiler)."""
    return any("BiasReluAdd" in k or "implicitGemmKernel" in k for k in _kernels_run(fn))


def _implicit_gemm_ran(fn) -> bool:
    return any("implicitGemmKernel" in k for k in _kernels_run(fn))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", ROUTE_CASES)
def test_channels_last_route_forward(name, dtype):
    """The route's output equals the definition; the forward that returns a
    mask (training) keeps eager's convolution for these shapes, which the
    implicit-GEMM kernel does not take (its training forward is tested
    below)."""
    options.channels_last_route = "always"
    x, w, b, other, args = _inputs(name, "nchw", DTYPES[dtype], seed=1)
    assert _route_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 1.0))
    assert not _route_ran(lambda: ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0))
    test_forward_mask_follows_the_documented_order(name, "nchw", dtype)


@pytest.mark.parametrize("name", ["s99-c40", "s16383-chunks"])
def test_channels_last_route_with_full_other(name):
    """A full-size `other` (not per channel) is added after the pass, with
    alpha, as eager adds it."""
    options.channels_last_route = "always"
    x, w, b, _, args = _inputs(name, "nchw", torch.float32, seed=12)
    t = _pre_activation(x, w, b, args)
    other = torch.randint(-3, 4, t.shape, device="cuda").float()
    poison_allocator([t.numel() * 4])
    with torch.no_grad():
        assert _route_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5))
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)
    assert torch.equal(out, torch.relu(t) + 0.5 * other)


def test_channels_last_route_not_in_training():
    """The route by cuDNN does not serve training: its mask would save
    nothing."""
    options.channels_last_route = "always"
    x, w, b, other, args = _inputs("s64-c16", "nchw", torch.float32, seed=1)
    w.requires_grad_(True)
    assert not _route_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 1.0))
    with torch.no_grad():
        assert _route_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 1.0))


def test_channels_last_route_never():
    options.channels_last_route = "never"
    x, w, b, other, args = _inputs("s64-c16", "nchw", torch.float32, seed=1)
    assert not _route_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 1.0))


def _masked_grad_ran(fn) -> bool:
    """Whether fn() ran the route's backward: its masking pass that writes g
    NHWC (profiler)."""
    return any("MaskedGrad" in k for k in _kernels_run(fn))


@pytest.mark.parametrize("grad_format", GRAD_FORMATS)
@pytest.mark.parametrize("name", ROUTE_CASES)
def test_channels_last_route_backward(name, grad_format):
    """The route's backward of an NCHW float32 convolution (g made NHWC by
    the masking pass, cuDNN's channels-last gradient convolutions, the input
    gradient back to NCHW) gives the CPU's gradients on small integers, in
    eager's memory formats, whatever grad_output's format."""
    options.channels_last_route = "always"
    x, w, b, other, args = _inputs(name, "nchw", torch.float32, seed=2)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    out_cpu, mask_cpu = ops.custom_conv_relu_add_forward(x.cpu(), w.cpu(), b.cpu(), *args, other.cpu(), 1.0)
    assert torch.equal(out.cpu(), out_cpu) and torch.equal(mask.cpu(), mask_cpu)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(3)
    gy = _grad_like(out.shape, grad_format, out, gen)
    want = ops.custom_conv_relu_add_backward(gy.cpu(), mask_cpu, x.cpu(), w.cpu(), *args, [True, True, True, True])
    assert _masked_grad_ran(lambda: ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True]))
    poison_allocator(nbytes_of(x, w, b, out))
    got = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
    assert got[0].is_contiguous() and got[1].is_contiguous()
    _assert_grads_match(got, want)


@pytest.mark.parametrize("output_mask", [[True, False, False, False], [False, True, True, False],
                                         [False, False, True, True], [False, False, False, True]])
def test_channels_last_route_backward_partial(output_mask):
    """Only the gradients asked for; the bias gradient alone needs no
    convolution, so it takes the NCHW pass."""
    options.channels_last_route = "always"
    x, w, b, other, args = _inputs("s99-c40", "nchw", torch.float32, seed=2)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(4)
    gy = _grad_like(out.shape, "nchw", out, gen)
    want = ops.custom_conv_relu_add_backward(gy.cpu(), mask.cpu(), x.cpu(), w.cpu(), *args, output_mask)
    ran = _masked_grad_ran(lambda: ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, output_mask))
    assert ran == (output_mask[0] or output_mask[1])
    got = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, output_mask)
    for asked, g, r, what in zip(output_mask, got, want, ("input", "weight", "bias", "channels")):
        assert (g is not None) == asked, what
        if asked:
            _assert_grads_match([g], [r], names=(what,))


def test_channels_last_route_backward_declines():
    """The NCHW backward stays for float16, channels-last inputs and
    channels_last_route = "never"."""
    options.channels_last_route = "always"
    for dtype, layout in ((torch.float16, "nchw"), (torch.float32, "channels-last")):
        x, w, b, other, args = _inputs("s99-c40", layout, dtype, seed=2)
        out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
        gy = torch.ones_like(out)
        assert not _masked_grad_ran(lambda: ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True]))
    options.channels_last_route = "never"
    x, w, b, other, args = _inputs("s99-c40", "nchw", torch.float32, seed=2)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    gy = torch.ones_like(out)
    assert not _masked_grad_ran(lambda: ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True]))


@pytest.mark.parametrize("name", ["s64-c16", "s99-c40"])
def test_channels_last_route_backward_nan_inf(name):
    """NaN and ±Inf in grad_output, where the relu passed and where it did
    not: the masking pass selects (a masked NaN gives 0, as eager's relu
    backward), and the gradients are the CPU's, NaN for NaN, on the vector
    (s64-c16) and the scalar (s99-c40) tiles."""
    options.channels_last_route = "always"
    x, w, b, other, args = _inputs(name, "nchw", torch.float32, seed=2)
    w = torch.where(w == 0, torch.ones_like(w), w)  # no 0 * Inf
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    keep = ~(_pre_activation(x, w, b, args) <= 0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(6)
    gy = _grad_like(out.shape, "nchw", out, gen)
    flat, kept = gy.view(-1), keep.reshape(-1).nonzero().flatten()
    dropped = (~keep).reshape(-1).nonzero().flatten()
    assert kept.numel() >= 2 and dropped.numel() >= 2
    flat[kept[0]], flat[kept[-1]] = float("nan"), float("inf")
    flat[dropped[0]], flat[dropped[-1]] = float("nan"), float("-inf")
    want = ops.custom_conv_relu_add_backward(gy.cpu(), mask.cpu(), x.cpu(), w.cpu(), *args, [True, True, True, True])
    assert _masked_grad_ran(lambda: ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True]))
    got = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
    assert want[0].isnan().any() and want[2].isnan().any()
    for g, r in zip(got, want):
        torch.testing.assert_close(g.cpu(), r, rtol=0, atol=1e-5 * max(1.0, r[r.isfinite()].abs().max().item()),
                                   equal_nan=True)


@pytest.mark.parametrize("cudnn_tf32", [True, False])
def test_channels_last_route_backward_random_signed(cudnn_tf32):
    """By default the route's backward runs where eager's gradient
    convolutions are TF32 (a 2^24-element output under the default flags,
    not with cuDNN TF32 off), and through autograd the gradients' errors
    against float64 are at most 2x eager's.  On sm_90 the forward and the
    input gradient are the implicit-GEMM kernel's, whose relu decisions near
    zero are its own: the float64 model is the judge, not eager."""
    options.channels_last_route = "auto"
    options.allow_implicit_gemm = True
    gen = torch.Generator(device="cuda")
    gen.manual_seed(run_seed())
    x = signed_randn(32, 64, 66, 66, dtype=torch.float32, generator=gen)
    w = signed_randn(128, 64, 3, 3, dtype=torch.float32, generator=gen) / 24
    b = signed_randn(128, dtype=torch.float32, generator=gen)
    other = signed_randn(128, 1, 1, dtype=torch.float32, generator=gen)
    gy = signed_randn(32, 128, 64, 64, dtype=torch.float32, generator=gen)
    args = ([1, 1], [0, 0], [1, 1], 1)

    def grads(fn, dtype):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w, b, other)]
        fn(*leaves).backward(gy.to(dtype))
        return [t.grad for t in leaves]

    model = lambda x_, w_, b_, o_: torch.relu(F.conv2d(x_, w_, b_)) + 0.5 * o_
    ref = grads(model, torch.float64)
    fused = lambda x_, w_, b_, o_: ops.custom_conv_relu_add(x_, w_, b_, *args, o_, 0.5)
    leaves = [t.detach().requires_grad_(True) for t in (x, w, b, other)]
    with tf32_flags(None, cudnn_tf32):
        eager = grads(model, torch.float32)
        kernels = _kernels_run(lambda: fused(*leaves).backward(gy))
        got = grads(fused, torch.float32)
    assert any("MaskedGrad" in k for k in kernels) == cudnn_tf32
    # the forward and the input gradient
    assert sum("implicitGemmKernel" in k for k in kernels) == (2 if cudnn_tf32 and SM90 else 0)
    for what, g, e, r in zip(("input", "weight", "bias", "other"), got, eager, ref):
        assert g.is_contiguous()
        err, eager_err = rel_err(g, r), rel_err(e, r)
        assert err <= 2 * eager_err + 1e-6, f"grad of {what}: error {err:.3e} vs eager's {eager_err:.3e}"


@pytest.mark.parametrize("xs", [(32, 64, 66, 66), (8, 64, 130, 130)], ids=["q64", "q128"])
@pytest.mark.parametrize("cudnn_tf32", [True, False])
def test_channels_last_route_only_where_eager_is_tf32(cudnn_tf32, xs):
    """By default the route runs exactly where eager's own NCHW convolution
    is TF32 (so both round alike) and cuDNN may use TF32, and then its error
    against float64 is at most 2x eager's.  Eager's precision is read off
    its error here, independently of the op's probe: float32 engines are
    near 1e-7, TF32 ones near 1e-4.  Both shapes are ones the implicit-GEMM
    kernel takes on sm_90 (output rows of 64 and of 128 positions)."""
    options.channels_last_route = "auto"
    gen = torch.Generator(device="cuda")
    gen.manual_seed(11)
    # 2^24-element outputs: the smallest the route takes
    x = torch.randn(*xs, generator=gen, device="cuda")
    w = torch.randn(128, 64, 3, 3, generator=gen, device="cuda") / 24
    b = torch.randn(128, generator=gen, device="cuda")
    other = torch.randn(128, 1, 1, generator=gen, device="cuda")
    args = ([1, 1], [0, 0], [1, 1], 1)
    ref = torch.relu(F.conv2d(x.double(), w.double(), b.double())) + other.double()
    with tf32_flags(None, cudnn_tf32), torch.no_grad():
        eager = torch.relu(F.conv2d(x, w, b)) + other
        poison_allocator([ref.numel() * 4])
        ran = _route_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 1.0))
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 1.0)
    eager_err, err = rel_err(eager, ref), rel_err(out, ref)
    eager_tf32 = eager_err > 1e-5
    assert ran == (cudnn_tf32 and eager_tf32), (ran, eager_err)
    assert err <= 2 * eager_err, f"error {err:.3e} vs eager's {eager_err:.3e}"
    assert out.is_contiguous()


# The route's convolution by our sm_90 implicit-GEMM kernel
# (kernels/conv/implicit_gemm_sm90.cu), where it takes the problem: float32,
# stride and dilation 1, one group, C a multiple of 32, K <= 128, rows of at
# most 128 output positions.  allow_implicit_gemm = False turns it off.
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU: the implicit-GEMM kernel is built for sm_90 only")

IG_SHAPES = {
    # name: (x shape, weight shape, padding); the output in the comment
    "q22-pad1": ((2, 64, 20, 22), (128, 64, 3, 3), (1, 1)),  # [2, 128, 20, 22]: 4 rows a tile
    "q64-c32": ((3, 32, 11, 66), (40, 32, 3, 3), (0, 0)),  # [3, 40, 9, 64]: k not a multiple of 8
    "q124": ((3, 64, 9, 126), (128, 64, 3, 3), (0, 0)),  # [3, 128, 7, 124]: odd rows, last tile half
    "q40-c128": ((2, 128, 7, 40), (100, 128, 3, 3), (1, 1)),  # [2, 100, 7, 40]: 4 chunks, k = 100
    "q124-3x5": ((2, 32, 6, 124), (16, 32, 3, 5), (1, 2)),  # [2, 16, 6, 124]: 3x5, uneven padding
    "q128-1x1": ((2, 64, 4, 128), (24, 64, 1, 1), (0, 0)),  # [2, 24, 4, 128]: one tap
    # rows in whole 16-byte vectors, as the benchmark's
    "q126-vec": ((2, 32, 6, 128), (48, 32, 3, 3), (0, 0)),  # [2, 48, 4, 126]: the benchmark's rows
    "q70-vec-pad4": ((2, 64, 6, 64), (128, 64, 3, 3), (1, 4)),  # [2, 128, 6, 70]
}


def _int_other(kind: str, out_shape, gen) -> torch.Tensor:
    """Small-integer `other` of each broadcast form the exact tests take."""
    k = out_shape[1]
    shape = {"channel": (k, 1, 1), "scalar": (1,), "full": tuple(out_shape), "none-bias": (1, k, 1, 1)}[kind]
    return _ints(shape, -3, 3, gen, torch.float32)


def _round_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 rounded to TF32, to nearest with ties away from zero, as the
    kernel's input conversion (cvt.rna) does: add half of the dropped 13
    bits to the magnitude's bits, then clear them."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


@needs_sm90
@pytest.mark.parametrize("other_kind", ["channel", "scalar", "full", "none-bias"])
@pytest.mark.parametrize("name", list(IG_SHAPES))
def test_implicit_gemm_exact(name, other_kind):
    """Small integers (exact in TF32 and in every float32 sum): the kernel's
    output equals relu(conv + b) + alpha * other bit for bit, over poisoned
    memory, for every tile shape, partial tile and channel count above."""
    options.channels_last_route = "always"
    options.allow_implicit_gemm = True
    xs, ws, padding = IG_SHAPES[name]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(5)
    x = _ints(xs, -2, 2, gen, torch.float32)
    w = _ints(ws, -1, 1, gen, torch.float32)
    b = None if other_kind == "none-bias" else _ints((ws[0],), -3, 3, gen, torch.float32)
    args = ([1, 1], list(padding), [1, 1], 1)
    with tf32_flags(None, False):
        t = F.conv2d(x, w, b, padding=padding)
    other = _int_other(other_kind, t.shape, gen)
    poison_allocator([t.numel() * 4])
    with torch.no_grad():
        assert _implicit_gemm_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5))
        poison_allocator([t.numel() * 4])
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)
    assert out.is_contiguous()
    assert torch.equal(out, torch.relu(t) + 0.5 * other)


@needs_sm90
def test_implicit_gemm_misaligned_input():
    """An input view 4 bytes past a 16-byte boundary: its conversion to NHWC
    takes the scalar tiles."""
    options.channels_last_route = "always"
    xs, ws, padding = IG_SHAPES["q126-vec"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(6)
    base = _ints((torch.Size(xs).numel() + 1,), -2, 2, gen, torch.float32)
    x = base[1:].view(xs)
    w = _ints(ws, -1, 1, gen, torch.float32)
    other = _ints((ws[0], 1, 1), -3, 3, gen, torch.float32)
    args = ([1, 1], list(padding), [1, 1], 1)
    with tf32_flags(None, False):
        want = torch.relu(F.conv2d(x, w, padding=padding)) + other
    with torch.no_grad():
        assert _implicit_gemm_ran(lambda: ops.custom_conv_relu_add(x, w, None, *args, other, 1.0))
        out = ops.custom_conv_relu_add(x, w, None, *args, other, 1.0)
    assert torch.equal(out, want)


def _ig_signed_inputs(name):
    """Random signed x, w / 24, b and a per-channel `other` of an IG_SHAPES
    problem, and the conv arguments."""
    xs, ws, padding = IG_SHAPES[name]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(run_seed())
    x = signed_randn(*xs, dtype=torch.float32, generator=gen)
    w = signed_randn(*ws, dtype=torch.float32, generator=gen) / 24
    b = signed_randn(ws[0], dtype=torch.float32, generator=gen)
    other = signed_randn(ws[0], 1, 1, dtype=torch.float32, generator=gen)
    return x, w, b, other, ([1, 1], list(padding), [1, 1], 1)


@needs_sm90
@pytest.mark.parametrize("name", ["q22-pad1", "q124", "q124-3x5", "q126-vec"])
def test_implicit_gemm_random_signed(name):
    """Random signed inputs: the output is the convolution of the inputs
    rounded to TF32, accumulated in float32: within 1e-5 of that product
    computed in float64 (relative to the largest output), NaN nowhere."""
    options.channels_last_route = "always"
    x, w, b, other, args = _ig_signed_inputs(name)
    padding = args[1]
    ref = torch.relu(F.conv2d(_round_tf32(x).double(), _round_tf32(w).double(), b.double(),
                              padding=padding)) + 0.75 * other.double()
    poison_allocator([ref.numel() * 4])
    with torch.no_grad():
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.75)
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)
    # and against the unrounded inputs, as TF32 allows: 2^-11 per product
    exact = torch.relu(F.conv2d(x.double(), w.double(), b.double(), padding=padding)) + 0.75 * other.double()
    assert rel_err(out, exact) <= 2e-3, rel_err(out, exact)


@needs_sm90
def test_implicit_gemm_nan_inf():
    """NaN and ±Inf in x and in `other` come out as eager's: relu(NaN) is
    NaN, relu(-Inf) + Inf is Inf, relu(Inf) - Inf is NaN."""
    options.channels_last_route = "always"
    xs, ws, padding = IG_SHAPES["q22-pad1"]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(8)
    x = _ints(xs, -2, 2, gen, torch.float32)
    x[0, 3, 2, 5] = float("nan")
    x[1, 7, 4, 9] = float("inf")
    x[0, 10, 6, 2] = float("-inf")
    w = _ints(ws, 0, 1, gen, torch.float32) * 2 - 1  # ±1: no 0 * Inf
    b = _ints((ws[0],), -3, 3, gen, torch.float32)
    other = _ints((ws[0], 1, 1), -3, 3, gen, torch.float32)
    other[0::4] = float("inf")
    other[1::4] = float("-inf")
    args = ([1, 1], list(padding), [1, 1], 1)
    want = torch.relu(F.conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), padding=padding))
    want = want + 0.5 * other.double().cpu()
    assert want.isnan().any() and want.isinf().any() and (want == float("inf")).any()
    poison_allocator([want.numel() * 4])
    with torch.no_grad():
        assert _implicit_gemm_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5))
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=0, equal_nan=True)


@needs_sm90
def test_implicit_gemm_never():
    """allow_implicit_gemm = False keeps cuDNN's channels-last convolution."""
    options.channels_last_route = "always"
    xs, ws, padding = IG_SHAPES["q22-pad1"]
    x = torch.randn(*xs, device="cuda")
    w = torch.randn(*ws, device="cuda")
    other = torch.randn(ws[0], 1, 1, device="cuda")
    args = ([1, 1], list(padding), [1, 1], 1)
    options.allow_implicit_gemm = False
    kernels = _kernels_run(lambda: ops.custom_conv_relu_add(x, w, None, *args, other, 1.0))
    assert any("BiasReluAdd" in k for k in kernels)
    assert not any("implicitGemmKernel" in k for k in kernels)


# The implicit-GEMM kernel converts x from NCHW itself, on the idle warps of
# its CTAs, ahead of the convolution (nchw_conversion "auto", with
# conversion_lookahead 0 or a lookahead in images), or a conversion pass of
# its own runs before the kernel (nchw_conversion "separate").


def _x_conversion_passes(fn) -> int:
    """The TF32-rounding transposes fn() ran besides the weight's."""
    return sum("RoundTf32" in k for k in _kernels_run(fn)) - 1


@needs_sm90
@pytest.mark.parametrize("conversion", [0, 1, 3, 64])
@pytest.mark.parametrize("name", ["q22-pad1", "q40-c128", "q124-3x5", "q128-1x1", "q126-vec", "q70-vec-pad4"])
def test_implicit_gemm_converts_in_kernel(name, conversion):
    """Random signed inputs: with x converted inside the kernel, the output
    (and, in training, the relu mask) equals the one with the separate
    conversion pass bit for bit, over poisoned memory; the rounding to TF32
    is the same (cvt.rna), so is every product.  Partial boxes: h * w is not
    a multiple of 32 for the first three; a lookahead of 1 makes the
    converters wait on the convolution most."""
    options.channels_last_route = "always"
    options.allow_implicit_gemm = True
    x, w, b, other, args = _ig_signed_inputs(name)
    options.nchw_conversion = "separate"
    assert _x_conversion_passes(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)) == 1
    with torch.no_grad():
        want = ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)
        want_out, want_mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 0.5)
    options.nchw_conversion, options.conversion_lookahead = "auto", conversion
    assert _x_conversion_passes(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)) == 0
    assert _x_conversion_passes(lambda: ops.custom_conv_relu_add_forward(x, w, b, *args, other, 0.5)) == 0
    sizes = [want.numel() * 4, x.numel() * 4, want_mask.numel()]
    with torch.no_grad():
        poison_allocator(sizes)
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)
        poison_allocator(sizes)
        out_t, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 0.5)
    assert torch.equal(out, want)
    assert torch.equal(out_t, want_out)
    assert torch.equal(mask, want_mask)


@needs_sm90
@pytest.mark.parametrize("case", ["hw-odd", "misaligned"])
def test_implicit_gemm_conversion_pass_where_kernel_cannot(case):
    """Where TMA cannot read x as NCHW (rows of h * w not in whole 16-byte
    units, or a start off a 16-byte boundary) the separate conversion pass
    runs, and the output is still exact."""
    options.channels_last_route = "always"
    options.nchw_conversion = "auto"
    xs, ws, padding = IG_SHAPES["q124" if case == "hw-odd" else "q126-vec"]  # 9 * 126 % 4 == 2
    gen = torch.Generator(device="cuda")
    gen.manual_seed(7)
    base = _ints((torch.Size(xs).numel() + 1,), -2, 2, gen, torch.float32)
    x = base[1:].view(xs) if case == "misaligned" else base[:-1].view(xs)
    w = _ints(ws, -1, 1, gen, torch.float32)
    other = _ints((ws[0], 1, 1), -3, 3, gen, torch.float32)
    args = ([1, 1], list(padding), [1, 1], 1)
    with tf32_flags(None, False):
        want = torch.relu(F.conv2d(x, w, padding=padding)) + other
    with torch.no_grad():
        assert _x_conversion_passes(lambda: ops.custom_conv_relu_add(x, w, None, *args, other, 1.0)) == 1
        out = ops.custom_conv_relu_add(x, w, None, *args, other, 1.0)
    assert torch.equal(out, want)


@needs_sm90
@pytest.mark.parametrize("case", ["fp16", "stride2", "dilation2", "groups2", "c48", "k160", "q130", "no-tf32"])
def test_implicit_gemm_declines(case):
    """Problems outside the kernel's contract take cuDNN's channels-last
    convolution or eager's convolution and the epilogue pass instead, in
    inference and in training."""
    options.channels_last_route = "always"
    xs, ws, stride, dilation, groups, dtype = (2, 64, 12, 20), (32, 64, 3, 3), 1, 1, 1, torch.float32
    if case == "fp16":
        dtype = torch.float16
    elif case == "stride2":
        stride = 2
    elif case == "dilation2":
        dilation = 2
    elif case == "groups2":
        ws, groups = (32, 32, 3, 3), 2
    elif case == "c48":
        xs, ws = (2, 48, 12, 20), (32, 48, 3, 3)
    elif case == "k160":
        ws = (160, 64, 3, 3)
    elif case == "q130":
        xs = (2, 64, 12, 132)
    x = torch.randn(*xs, device="cuda", dtype=dtype)
    w = torch.randn(*ws, device="cuda", dtype=dtype)
    other = torch.randn(ws[0], 1, 1, device="cuda", dtype=dtype)
    args = ([stride] * 2, [0, 0], [dilation] * 2, groups)
    with tf32_flags(None, case != "no-tf32"):
        assert not _implicit_gemm_ran(lambda: ops.custom_conv_relu_add(x, w, None, *args, other, 1.0))
        assert not _implicit_gemm_ran(lambda: ops.custom_conv_relu_add_forward(x, w, None, *args, other, 1.0))


# Training through the implicit-GEMM kernel: the forward with
# the relu mask, and the route's input gradient, a convolution of g with the
# flipped, transposed weight.
IG_TRAIN_SHAPES = {
    "q64-c32": IG_SHAPES["q64-c32"],  # [3, 40, 9, 64]: n = 64 MMAs
    "q128-1x1": IG_SHAPES["q128-1x1"],  # [2, 24, 4, 128]
    "q126-vec": IG_SHAPES["q126-vec"],  # [2, 48, 4, 126]: runs start mid-word
    "q22-pad1": IG_SHAPES["q22-pad1"],  # [2, 128, 20, 22]: 4 rows a tile, 16-bit groups across words
    "q124": IG_SHAPES["q124"],  # [3, 128, 7, 124]: odd rows, last tile half
    "q16-k3": ((1, 32, 3, 18), (3, 32, 3, 3), (0, 0)),  # [1, 3, 1, 16]: 48 bits, the last word half
    "q20-k5": ((1, 32, 5, 22), (5, 32, 3, 3), (0, 0)),  # [1, 5, 3, 20]: one tile, channels share words
    "q32-rows": ((2, 64, 9, 32), (128, 64, 3, 3), (1, 1)),  # [2, 128, 9, 32]: last tile 1 row of 4
    "q128-k96": ((2, 32, 5, 130), (96, 32, 3, 3), (0, 0)),  # [2, 96, 3, 128]: last tile 1 row of 2
}
IG_GRAD_SHAPES = {
    # the input gradient [2, 64, 20, 22]: n = 64 MMAs, padding 1
    "q22-pad1": IG_SHAPES["q22-pad1"],
    # [2, 128, 6, 64]: n = 128, padding 2 (the forward's 0)
    "k128-q64": ((2, 128, 6, 64), (64, 128, 3, 3), (0, 0)),
    # [2, 32, 6, 124]: 3x5, padding (1, 2)
    "q124-3x5": ((2, 32, 6, 124), (32, 32, 3, 5), (1, 2)),
}


def _ig_inputs(shapes, name, seed):
    xs, ws, padding = shapes[name]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    x = _ints(xs, -2, 2, gen, torch.float32)
    w = _ints(ws, -1, 1, gen, torch.float32)
    b = _ints((ws[0],), -3, 3, gen, torch.float32)
    other = _ints((ws[0], 1, 1), -3, 3, gen, torch.float32)
    return x, w, b, other, ([1, 1], list(padding), [1, 1], 1), gen


@needs_sm90
@pytest.mark.parametrize("name", list(IG_TRAIN_SHAPES))
def test_implicit_gemm_training_forward_exact(name):
    """The training forward by the implicit-GEMM kernel: on small integers
    its output and relu mask equal the CPU's bit for bit (t == 0 included,
    which the mask drops), over poisoned memory."""
    options.channels_last_route = "always"
    options.allow_implicit_gemm = True
    x, w, b, other, args, _ = _ig_inputs(IG_TRAIN_SHAPES, name, seed=21)
    want_out, want_mask = ops.custom_conv_relu_add_forward(x.cpu(), w.cpu(), b.cpu(), *args, other.cpu(), 0.5)
    assert _implicit_gemm_ran(lambda: ops.custom_conv_relu_add_forward(x, w, b, *args, other, 0.5))
    poison_allocator([want_out.numel() * 4, want_mask.numel()])
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 0.5)
    assert out.is_contiguous()
    assert torch.equal(out.cpu(), want_out)
    assert torch.equal(mask.cpu(), want_mask)


@needs_sm90
@pytest.mark.parametrize("name", list(IG_GRAD_SHAPES))
def test_implicit_gemm_input_gradient_exact(name):
    """The route's input gradient by the implicit-GEMM kernel: on small
    integers every gradient equals the CPU's, the input's NCHW, over
    poisoned memory; asked alone, it comes without the others."""
    options.channels_last_route = "always"
    options.allow_implicit_gemm = True
    x, w, b, other, args, gen = _ig_inputs(IG_GRAD_SHAPES, name, seed=22)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    _, mask_cpu = ops.custom_conv_relu_add_forward(x.cpu(), w.cpu(), b.cpu(), *args, other.cpu(), 1.0)
    assert torch.equal(mask.cpu(), mask_cpu)
    gy = _ints(tuple(out.shape), -3, 3, gen, torch.float32)
    want = ops.custom_conv_relu_add_backward(gy.cpu(), mask_cpu, x.cpu(), w.cpu(), *args, [True] * 4)
    backward = lambda output_mask: ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, output_mask)
    assert _implicit_gemm_ran(lambda: backward([True] * 4))
    poison_allocator([x.numel() * 4, out.numel() * 4])
    got = backward([True] * 4)
    assert got[0].is_contiguous()
    _assert_grads_match(got, want)
    alone = backward([True, False, False, False])
    assert all(g is None for g in alone[1:])
    assert torch.equal(alone[0].cpu(), want[0])


# The direct convolution for few channels (direct.cpp): the inference forward
# of small float32 NCHW convolutions with c * r * s * k (k rounded up to 8,
# 16 or 32) <= 2048, k <= 32.
DIRECT_SHAPES = {
    # name: (x shape, weight shape, stride, padding, dilation); output in the comment
    "bench-like": ((4, 3, 32, 32), (16, 3, 3, 3), 1, 0, 1),  # [4, 16, 30, 30]
    "k5-partial": ((3, 3, 17, 19), (5, 3, 3, 3), 1, 0, 1),  # [3, 5, 15, 17]: 255 positions
    "stride2-3x5": ((2, 2, 20, 21), (16, 2, 3, 5), 2, (1, 2), 1),  # [2, 16, 10, 11]
    "dilation2-k32": ((2, 1, 15, 15), (32, 1, 3, 3), 1, 1, 2),  # [2, 32, 13, 13]
    "1x1-c7": ((2, 7, 9, 40), (24, 7, 1, 1), 1, 0, 1),  # [2, 24, 9, 40]
    "5x5-c4-k16": ((3, 4, 12, 12), (12, 4, 5, 5), 1, 2, 1),  # [3, 12, 12, 12]: 1600 macs
    "many-images": ((300, 3, 6, 6), (8, 3, 3, 3), 1, 1, 1),  # [300, 8, 6, 6]
}


def _direct_ran(fn) -> bool:
    return any("directConvKernel" in k for k in _kernels_run(fn))


def _direct_args(st, pad, dil):
    pair = lambda v: list(v) if isinstance(v, tuple) else [v, v]  # noqa: E731
    return pair(st), pair(pad), pair(dil), 1


@pytest.mark.parametrize("other_kind", ["channel", "scalar", "full", "none-bias"])
@pytest.mark.parametrize("name", list(DIRECT_SHAPES))
def test_direct_exact(name, other_kind):
    """Small integers (exact in every float32 sum): the kernel's output
    equals relu(conv + b) + alpha * other bit for bit, over poisoned memory."""
    options.allow_direct = True
    xs, ws, st, pad, dil = DIRECT_SHAPES[name]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(9)
    x = _ints(xs, -3, 3, gen, torch.float32)
    w = _ints(ws, -2, 2, gen, torch.float32)
    b = None if other_kind == "none-bias" else _ints((ws[0],), -3, 3, gen, torch.float32)
    args = _direct_args(st, pad, dil)
    with tf32_flags(None, False):
        t = F.conv2d(x, w, b, args[0], args[1], args[2])
    other = _int_other(other_kind, t.shape, gen)
    with torch.no_grad():
        assert _direct_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5))
        poison_allocator([t.numel() * 4])
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)
    assert out.is_contiguous()
    assert torch.equal(out, torch.relu(t) + 0.5 * other)


@pytest.mark.parametrize("name", list(DIRECT_SHAPES))
def test_direct_random_signed(name):
    """Random signed inputs against float64: float32 accumulation, so within
    2x eager's error under the default flags (cuDNN TF32 allowed) and within
    1e-6 relative to the largest output."""
    options.allow_direct = True
    xs, ws, st, pad, dil = DIRECT_SHAPES[name]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(run_seed())
    x = signed_randn(*xs, dtype=torch.float32, generator=gen)
    w = signed_randn(*ws, dtype=torch.float32, generator=gen)
    b = signed_randn(ws[0], dtype=torch.float32, generator=gen)
    other = signed_randn(ws[0], 1, 1, dtype=torch.float32, generator=gen)
    args = _direct_args(st, pad, dil)
    ref = torch.relu(F.conv2d(x.double(), w.double(), b.double(), *args[:3])) + 0.75 * other.double()
    eager = torch.relu(F.conv2d(x, w, b, *args[:3])) + 0.75 * other
    poison_allocator([ref.numel() * 4])
    with torch.no_grad():
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.75)
    err = rel_err(out, ref)
    assert err <= 1e-6, err
    assert err <= 2 * max(rel_err(eager, ref), 1e-7), (err, rel_err(eager, ref))


def test_direct_nan_inf():
    """NaN and ±Inf in x and in `other` come out as in float64: relu(NaN) is
    NaN, relu(-Inf) + Inf is Inf, relu(Inf) - Inf is NaN, and padding
    multiplies an Inf weight into NaN as a zero input would."""
    options.allow_direct = True
    gen = torch.Generator(device="cuda")
    gen.manual_seed(10)
    x = _ints((2, 3, 11, 12), -2, 2, gen, torch.float32)
    x[0, 1, 2, 5] = float("nan")
    x[1, 2, 4, 9] = float("inf")
    x[0, 0, 6, 2] = float("-inf")
    w = _ints((16, 3, 3, 3), 0, 1, gen, torch.float32) * 2 - 1
    w[3, 1, 0, 0] = float("inf")
    b = _ints((16,), -3, 3, gen, torch.float32)
    other = _ints((16, 1, 1), -3, 3, gen, torch.float32)
    other[0::4] = float("inf")
    other[1::4] = float("-inf")
    args = ([1, 1], [1, 1], [1, 1], 1)
    want = torch.relu(F.conv2d(x.double().cpu(), w.double().cpu(), b.double().cpu(), padding=1))
    want = want + 0.5 * other.double().cpu()
    assert want.isnan().any() and (want == float("inf")).any() and (want == float("-inf")).any()
    with torch.no_grad():
        assert _direct_ran(lambda: ops.custom_conv_relu_add(x, w, b, *args, other, 0.5))
        out = ops.custom_conv_relu_add(x, w, b, *args, other, 0.5)
    torch.testing.assert_close(out.double().cpu(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", ["training", "fp16", "channels-last", "weight-cl", "groups2", "k33",
                                  "macs2304", "wide-rows", "large", "3d", "never"])
def test_direct_declines(case):
    """Problems outside the kernel's contract keep cuDNN's convolution."""
    options.allow_direct = True
    xs, ws, groups, dtype = (2, 4, 10, 10), (8, 4, 3, 3), 1, torch.float32
    if case == "fp16":
        dtype = torch.float16
    elif case == "groups2":
        ws, groups = (8, 2, 3, 3), 2
    elif case == "k33":
        ws = (33, 4, 3, 3)
    elif case == "macs2304":  # 16 * 9 * 16
        xs, ws = (2, 16, 10, 10), (16, 16, 3, 3)
    elif case == "wide-rows":  # 8 channels x 3 rows x 2000 columns: 192 KB of input rows
        xs, ws = (1, 8, 3, 2000), (8, 8, 3, 3)
    elif case == "large":  # 2^24 + 4 * 1026 output elements
        xs, ws = (1, 1, 4100, 4100), (1, 1, 1, 1)
    elif case == "3d":
        xs, ws = (2, 4, 5, 6, 7), (8, 4, 3, 3, 3)
    elif case == "never":
        options.allow_direct = False
    x = torch.randn(*xs, device="cuda", dtype=dtype)
    w = torch.randn(*ws, device="cuda", dtype=dtype)
    if case == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last)
    if case == "weight-cl":
        w = w.contiguous(memory_format=torch.channels_last)
    w.requires_grad_(case == "training")
    nd = len(ws) - 2
    other = torch.randn(ws[0], *([1] * nd), device="cuda", dtype=dtype)
    args = ([1] * nd, [0] * nd, [1] * nd, groups)
    assert not _direct_ran(lambda: ops.custom_conv_relu_add(x, w, None, *args, other, 1.0))


SANITIZER_CASE = textwrap.dedent(
    """
    import torch, torchfuse
    ops = torch.ops.torchfuse
    torchfuse.backends.conv.allow_direct = False  # the other paths first
    torch.manual_seed(0)
    shapes = [((3, 2, 11, 13), (40, 2, 3, 3)), ((5, 2, 3, 3), (7, 2, 3, 3)),
              ((4, 2, 3, 7), (3, 2, 3, 3)), ((2, 2, 10, 10), (16, 2, 3, 3)),
              ((1, 2, 66, 130), (3, 2, 3, 3)), ((2, 2, 5, 6, 7), (6, 2, 3, 3, 3))]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for xs, ws in shapes:
            for cl in (False, True):
                x = torch.randn(*xs, device="cuda", dtype=dtype)
                w = torch.randn(*ws, device="cuda", dtype=dtype)
                if cl:
                    x = x.contiguous(memory_format=torch.channels_last_3d if x.dim() == 5 else torch.channels_last)
                b = torch.randn(ws[0], device="cuda", dtype=dtype)
                o = torch.randn(ws[0], *([1] * (len(ws) - 2)), device="cuda", dtype=dtype)
                args = ([1] * (len(ws) - 2), [0] * (len(ws) - 2), [1] * (len(ws) - 2), 1)
                out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, o, 1.0)
                ops.custom_conv_relu_add(x, w, b, *args, o, 1.0)
                gy = torch.randn_like(out)
                buf = torch.empty(out.numel() + 1, device="cuda", dtype=dtype)
                buf[1:].copy_(gy.reshape(-1))
                for g in (gy, gy.contiguous(memory_format=torch.channels_last_3d if gy.dim() == 5
                                            else torch.channels_last), buf[1:].view(out.shape)):
                    ops.custom_conv_relu_add_backward(g, mask, x, w, *args, [True, True, True, True])
    # the channels-last route (NCHW 2-d inputs), forced
    torchfuse.backends.conv.channels_last_route = "always"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for xs, ws in shapes[:5] + [((3, 8, 10, 12), (24, 8, 3, 3))]:
            x = torch.randn(*xs, device="cuda", dtype=dtype)
            w = torch.randn(*ws, device="cuda", dtype=dtype)
            b = torch.randn(ws[0], device="cuda", dtype=dtype)
            o = torch.randn(ws[0], 1, 1, device="cuda", dtype=dtype)
            args = ([1, 1], [0, 0], [1, 1], 1)
            ops.custom_conv_relu_add(x, w, b, *args, o, 1.0)
            buf = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)  # scalar tiles
            buf[1:].copy_(x.reshape(-1))
            ops.custom_conv_relu_add(buf[1:].view(x.shape), w, b, *args, o, 1.0)
            if dtype == torch.float32:  # the route's backward
                out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, o, 1.0)
                ops.custom_conv_relu_add_backward(torch.randn_like(out), mask, x, w, *args, [True, True, True, True])
    # the direct convolution: partial blocks, stride, dilation, padding, k of 8, 16 and 32
    torchfuse.backends.conv.allow_direct = True
    for xs, ws, st, pad, dil in [((3, 3, 17, 19), (5, 3, 3, 3), 1, 0, 1), ((2, 2, 20, 21), (16, 2, 3, 5), 2, 2, 1),
                                 ((2, 1, 15, 15), (32, 1, 3, 3), 1, 1, 2)]:
        x = torch.randn(*xs, device="cuda")
        w = torch.randn(*ws, device="cuda")
        ops.custom_conv_relu_add(x, w, torch.randn(ws[0], device="cuda"), [st, st], [pad, pad], [dil, dil], 1,
                                 torch.randn(ws[0], 1, 1, device="cuda"), 1.0)
    # the implicit-GEMM kernel (sm_90): partial tiles, k < 128, padding
    for xs, ws, pad in [((2, 64, 9, 22), (40, 64, 3, 3), [1, 1]), ((3, 32, 9, 126), (128, 32, 3, 3), [0, 0])]:
        x = torch.randn(*xs, device="cuda")
        w = torch.randn(*ws, device="cuda")
        ops.custom_conv_relu_add(x, w, torch.randn(ws[0], device="cuda"), [1, 1], pad, [1, 1], 1,
                                 torch.randn(ws[0], 1, 1, device="cuda"), 1.0)
    # training through it: the forward with the mask (a half last word), the input gradient
    for xs, ws, pad in [((2, 64, 9, 32), (128, 64, 3, 3), 1), ((1, 32, 3, 18), (3, 32, 3, 3), 0)]:
        x = torch.randn(*xs, device="cuda")
        w = torch.randn(*ws, device="cuda")
        args = ([1, 1], [pad, pad], [1, 1], 1)
        out, mask = ops.custom_conv_relu_add_forward(x, w, torch.randn(ws[0], device="cuda"), *args,
                                                     torch.randn(ws[0], 1, 1, device="cuda"), 1.0)
        ops.custom_conv_relu_add_backward(torch.randn_like(out), mask, x, w, *args, [True] * 4)
    torch.cuda.synchronize()
    print("SANITIZER_CASE_DONE")
    """
)


def test_compute_sanitizer_memcheck_conv(tmp_path):
    """memcheck over the conv op's passes: both mask orders, vector and
    scalar paths, float32/float16/bfloat16, misaligned grad_output."""
    run_memcheck(SANITIZER_CASE, tmp_path / "sanitizer_conv_case.py")
