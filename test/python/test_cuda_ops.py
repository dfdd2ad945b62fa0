"""The torchfuse ops on CUDA against the unfused eager compositions.

Every test is marked `cuda` and skipped, with the reason, where torch sees no
CUDA device.  Accuracy criterion (cuda_utils.py): the fused result's relative
error against a float64 reference must be at most twice eager PyTorch's error
under the same precision flags, plus a floor of two ulps of the dtype; NaN and
Inf must land where eager puts them.  Outputs are poisoned (NaN-filled blocks
left in the caching allocator) right before every fused call, forward and
backward, so an element the op never writes shows up as NaN.

TORCHFUSE_TEST_SEED=<n> reproduces a run; the seed is in every failure
message.
"""

from __future__ import annotations

import os
import sys
import textwrap
import zlib

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_utils import (  # noqa: E402
    CUDA_ONLY,
    assert_close_to_reference,
    inject_nonfinite,
    is_non_overlapping_and_dense,
    nbytes_of,
    poison_allocator,
    run_memcheck,
    run_seed,
    signed_randn,
    tf32_flags,
)

import torchfuse  # noqa: E402,F401  (registers torch.ops.torchfuse)

pytestmark = CUDA_ONLY

ops = torch.ops.torchfuse
SEED = run_seed()

# (dtype, matmul allow_tf32, cudnn allow_tf32); None = leave PyTorch's default.
# "fp32-default" sets PyTorch's documented defaults explicitly (matmul TF32
# off, cuDNN TF32 on) in case an earlier test changed them.
PRECISIONS = {
    "fp32-default": (torch.float32, False, True),
    "fp32-tf32": (torch.float32, True, True),
    "fp32-notf32": (torch.float32, False, False),
    "fp16": (torch.float16, None, None),
    "bf16": (torch.bfloat16, None, None),
}


@pytest.fixture(params=list(PRECISIONS))
def precision(request):
    dtype, mm, cudnn = PRECISIONS[request.param]
    with tf32_flags(mm, cudnn):
        yield dtype


@pytest.fixture
def gen(request):
    # One generator per test, seeded from the run seed and the test id, so
    # every case draws its own inputs and a failure can be replayed.
    g = torch.Generator(device="cuda")
    g.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))
    return g


def _cpu_gen(gen: torch.Generator) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda").item()))
    return g


def check_against_eager(
    fused_fn,
    eager_fn,
    inputs: dict,
    *,
    grad: tuple = (),
    state: tuple = (),
    gen: torch.Generator,
    label: str,
    backward: bool = True,
    relu_undecided=None,
):
    """Runs eager_fn in float64 (reference), eager_fn in the inputs' dtype
    and fused_fn, all on copies of `inputs`; compares the outputs, the
    gradients of the inputs named in `grad` (backward of a fixed random
    grad_output) and the final values of the tensors named in `state`
    (mutated in place, e.g. running statistics).

    relu_undecided(**float64 inputs): a bool tensor broadcasting to the
    output, true where the relu's input is within the rounding error bound
    of zero.  There the relu's decision, and with it a whole row of an input
    gradient, is not determined by the float64 reference (eager and fused
    may each round either way), so grad_output is zero there for all three
    runs."""
    label = f"{label} [seed {SEED}]"

    def copies(dtype=None):
        out = {}
        for k, v in inputs.items():
            if isinstance(v, torch.Tensor):
                c = v.detach().clone()
                if dtype is not None and c.is_floating_point():
                    c = c.to(dtype)
                out[k] = c.requires_grad_(backward and k in grad)
            else:
                out[k] = v
        return out

    ref_in, eager_in, fused_in = copies(torch.float64), copies(), copies()
    ref_out = eager_fn(**ref_in)
    eager_out = eager_fn(**eager_in)
    gy = signed_randn(*eager_out.shape, dtype=eager_out.dtype, generator=gen) if backward else None

    poison_allocator(nbytes_of(eager_out))
    fused_out = fused_fn(**fused_in)
    torch.cuda.synchronize()
    assert_close_to_reference(fused_out, eager_out, ref_out, what=f"{label}: output")

    # NB: a channel holding an Inf gets a non-finite running statistic, but
    # whether a Welford reduction yields +-Inf or NaN depends on where the Inf
    # falls in its merge order, which differs between any two launch
    # configurations; only finite vs non-finite is specified.
    for k in state:
        assert_close_to_reference(fused_in[k], eager_in[k], ref_in[k],
                                  what=f"{label}: {k} after the call", any_nonfinite=True)

    if backward and grad:
        if relu_undecided is not None:
            with torch.no_grad():
                undecided = relu_undecided(**{k: v.detach() if isinstance(v, torch.Tensor) else v
                                              for k, v in ref_in.items()})
            gy = gy.masked_fill(undecided.to(gy.device).expand(gy.shape), 0)
        ref_out.backward(gy.to(torch.float64))
        eager_out.backward(gy)
        poison_allocator(nbytes_of(*(eager_in[k] for k in grad)))
        fused_out.backward(gy)
        torch.cuda.synchronize()
        for k in grad:
            assert fused_in[k].grad is not None, f"{label}: no gradient for {k}"
            assert_close_to_reference(
                fused_in[k].grad, eager_in[k].grad, ref_in[k].grad, what=f"{label}: grad of {k}"
            )


def test_built_with_cuda():
    assert torchfuse._C.built_with_cuda, (
        "a CUDA device is present but torchfuse was built without its CUDA kernels "
        "(TORCHFUSE_WITH_CUDA / nvcc not found at configure time)"
    )


# ---------------------------------------------------------------- linear ----

LINEAR_CASES = {
    # name: (x shape, N, bias, other shape, alpha)
    "full-other": ((64, 96), 80, True, (64, 80), 1.0),
    "row-other-alpha": ((64, 96), 80, True, (80,), -0.5),
    "nobias-3d": ((4, 16, 96), 80, False, (4, 16, 80), 1.0),
    "odd-sizes": ((33, 17), 7, True, (33, 7), 2.0),
}


def _linear_eager(x, w, b, other, alpha):
    return torch.relu(torch.add(F.linear(x, w, b), other, alpha=alpha))


def _linear_fused(x, w, b, other, alpha):
    return ops.custom_linear_add_relu(x, w, b, other, alpha)


def _unit_roundoff(dtype, tf32: bool) -> float:
    """Of the inputs' rounding in the op's arithmetic: the dtype's, or TF32's
    for float32 where TF32 is allowed."""
    if dtype == torch.float32:
        return 2.0**-11 if tf32 else 2.0**-24
    return {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]


def _undecided(z, mag, k: int, u: float):
    """|z| within the error bound of a k-term float32-accumulated dot product
    of operands rounded to unit roundoff u (a few roundings of the result
    included): (4u + k 2^-24) times the sum of the terms' magnitudes."""
    return z.abs() <= (4 * u + k * 2.0**-24) * mag


def _linear_undecided(dtype):
    def undecided(x, w, b, other, alpha):
        u = _unit_roundoff(dtype, torch.backends.cuda.matmul.allow_tf32)
        z = torch.add(F.linear(x, w, b), other, alpha=alpha)
        mag = F.linear(x.abs(), w.abs(), None if b is None else b.abs()) + abs(alpha) * other.abs()
        return _undecided(z, mag, x.shape[-1], u)

    return undecided


def _linear_inputs(case, dtype, gen):
    xs, n, has_bias, os_, alpha = LINEAR_CASES[case]
    k = xs[-1]
    return {
        "x": signed_randn(*xs, dtype=dtype, generator=gen),
        "w": signed_randn(n, k, dtype=dtype, generator=gen, scale=k**-0.5),
        "b": signed_randn(n, dtype=dtype, generator=gen) if has_bias else None,
        "other": signed_randn(*os_, dtype=dtype, generator=gen),
        "alpha": alpha,
    }


def _check_chain(op, case, inputs, fused, eager, undecided, gen):
    """check_against_eager of the op on `inputs`, with the gradients of the
    tensors among x, w, b and other."""
    grad = tuple(k for k in ("x", "w", "b", "other") if inputs[k] is not None)
    check_against_eager(fused, eager, inputs, grad=grad, gen=gen, label=f"{op} {case}", relu_undecided=undecided)


@pytest.mark.parametrize("case", list(LINEAR_CASES))
def test_linear_add_relu(case, precision, gen):
    _check_chain("linear_add_relu", case, _linear_inputs(case, precision, gen), _linear_fused, _linear_eager,
                 _linear_undecided(precision), gen)


# ------------------------------------------------------------------ conv ----

CONV_CASES = {
    # name: (x shape, weight shape, bias, stride, padding, dilation, groups, other shape, alpha,
    #        channels-last: True (input and weight), "x" or "w" (that one only), False)
    "2d-basic": ((4, 8, 17, 19), (16, 8, 3, 3), True, [1, 1], [0, 0], [1, 1], 1, (16, 1, 1), 1.0, False),
    "2d-stride-pad-dil": ((3, 8, 20, 15), (12, 8, 3, 3), True, [2, 1], [1, 2], [2, 1], 1, None, 0.5, False),
    "2d-groups-nobias": ((2, 8, 11, 13), (16, 4, 3, 3), False, [1, 1], [1, 1], [1, 1], 2, (1, 16, 1, 1), -1.0, False),
    "2d-channels-last": ((4, 8, 17, 19), (16, 8, 3, 3), True, [1, 1], [1, 1], [1, 1], 1, (16, 1, 1), 1.0, True),
    "2d-input-cl": ((4, 8, 17, 19), (16, 8, 3, 3), True, [1, 1], [1, 1], [1, 1], 1, (16, 1, 1), 1.0, "x"),
    "2d-weight-cl": ((4, 8, 17, 19), (16, 8, 3, 3), False, [1, 1], [0, 0], [1, 1], 1, (1,), 1.0, "w"),
    "2d-c40-scalar-other": ((3, 5, 9, 10), (40, 5, 3, 3), True, [1, 1], [1, 1], [1, 1], 1, (1,), 2.0, False),
    "2d-many-positions": ((2, 16, 70, 66), (48, 16, 3, 3), True, [1, 1], [0, 0], [1, 1], 1, (48, 1, 1), 1.0, False),
    "2d-stride-groups-cl": ((3, 12, 21, 18), (24, 4, 3, 3), True, [2, 2], [1, 0], [1, 2], 3, (24, 1, 1), -0.5, True),
    "2d-other-per-position": ((2, 8, 12, 13), (16, 8, 3, 3), True, [1, 1], [0, 0], [1, 1], 1, (10, 11), 1.0, False),
    "2d-other-beyond-output": ((2, 8, 12, 13), (16, 8, 3, 3), True, [1, 1], [0, 0], [1, 1], 1, (3, 1, 16, 1, 1), 1.0, False),
    "1d": ((4, 8, 33), (12, 8, 5), True, [1], [2], [1], 1, (12, 1), 1.0, False),
    "3d": ((2, 4, 6, 7, 8), (8, 4, 3, 3, 3), True, [1, 1, 1], [0, 1, 0], [1, 1, 1], 1, (8, 1, 1, 1), 1.0, False),
}

_CONV_FN = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def _conv_eager(x, w, b, stride, padding, dilation, groups, other, alpha):
    c = _CONV_FN[x.dim() - 2](x, w, b, stride, padding, dilation, groups)
    return torch.add(torch.relu(c), other, alpha=alpha)


def _conv_fused(x, w, b, stride, padding, dilation, groups, other, alpha):
    return ops.custom_conv_relu_add(x, w, b, stride, padding, dilation, groups, other, alpha)


def _conv_undecided(dtype):
    def undecided(x, w, b, stride, padding, dilation, groups, other, alpha):
        u = _unit_roundoff(dtype, torch.backends.cudnn.allow_tf32)
        conv = _CONV_FN[x.dim() - 2]
        z = conv(x, w, b, stride, padding, dilation, groups)
        mag = conv(x.abs(), w.abs(), None if b is None else b.abs(), stride, padding, dilation, groups)
        return _undecided(z, mag, w[0].numel(), u)

    return undecided


def _conv_inputs(case, dtype, gen):
    xs, ws, has_bias, stride, padding, dilation, groups, os_, alpha, cl = CONV_CASES[case]
    fan_in = ws[1] * int(torch.tensor(ws[2:]).prod())
    x = signed_randn(*xs, dtype=dtype, generator=gen)
    w = signed_randn(*ws, dtype=dtype, generator=gen, scale=fan_in**-0.5)
    if cl in (True, "x"):
        x = x.contiguous(memory_format=torch.channels_last)
    if cl in (True, "w"):
        w = w.contiguous(memory_format=torch.channels_last)
    if os_ is None:  # a full-size residual
        with torch.no_grad():
            os_ = tuple(_CONV_FN[len(xs) - 2](x.float(), w.float(), None, stride, padding, dilation, groups).shape)
    return {
        "x": x,
        "w": w,
        "b": signed_randn(ws[0], dtype=dtype, generator=gen) if has_bias else None,
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "groups": groups,
        "other": signed_randn(*os_, dtype=dtype, generator=gen),
        "alpha": alpha,
    }


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_relu_add(case, precision, gen):
    _check_chain("conv_relu_add", case, _conv_inputs(case, precision, gen), _conv_fused, _conv_eager,
                 _conv_undecided(precision), gen)


@pytest.mark.parametrize("case", ["2d-basic", "2d-input-cl", "2d-weight-cl", "2d-stride-groups-cl"])
def test_conv_relu_add_memory_format(case, gen):
    """The output has the strides eager's gives (NCHW in, NCHW out; a
    channels-last input or weight gives channels-last)."""
    inputs = _conv_inputs(case, torch.float32, gen)
    with torch.no_grad():
        assert _conv_fused(**inputs).stride() == _conv_eager(**inputs).stride()


def _small_integers(*shape, gen, memory_format=torch.contiguous_format):
    # |values| <= 3: every product and sum is exact in TF32 and float32, so
    # CUDA and CPU agree bit for bit, zeros of the pre-activation included.
    t = torch.randint(-3, 4, shape, generator=gen, device="cuda").float()
    return t.contiguous(memory_format=memory_format)


@pytest.mark.parametrize("layout", ["nchw", "channels-last"])
@pytest.mark.parametrize("channels", [16, 40, 64])
def test_conv_relu_add_mask_and_backward_match_cpu(layout, channels, gen):
    """The forward op's mask and the backward op's gradients on CUDA equal
    the CPU composition's exactly on inputs where the conv is exact."""
    fmt = torch.channels_last if layout == "channels-last" else torch.contiguous_format
    x = _small_integers(3, 8, 11, 9, gen=gen, memory_format=fmt)
    w = _small_integers(channels, 8, 3, 3, gen=gen)
    b = _small_integers(channels, gen=gen)
    other = _small_integers(channels, 1, 1, gen=gen)
    args = ([1, 1], [1, 1], [1, 1], 1)
    out, mask = ops.custom_conv_relu_add_forward(x, w, b, *args, other, 1.0)
    out_cpu, mask_cpu = ops.custom_conv_relu_add_forward(x.cpu(), w.cpu(), b.cpu(), *args, other.cpu(), 1.0)
    assert torch.equal(out.cpu(), out_cpu)
    assert torch.equal(mask.cpu(), mask_cpu), "masks differ"
    # the pre-activation is zero in places: the boundary is exercised
    pre = F.conv2d(x.cpu(), w.cpu(), b.cpu(), padding=1)
    assert (pre == 0).any() and (pre > 0).any() and (pre < 0).any()
    gy = _small_integers(*out.shape, gen=gen)
    got = ops.custom_conv_relu_add_backward(gy, mask, x, w, *args, [True, True, True, True])
    want = ops.custom_conv_relu_add_backward(gy.cpu(), mask_cpu, x.cpu(), w.cpu(), *args, [True, True, True, True])
    for name, g, r in zip(("input", "weight", "bias", "channels"), got, want):
        assert torch.equal(g.cpu(), r), f"grad of {name} differs"


# ------------------------------------------------------------- batch norm ----

BN_CASES = {
    # name: (x shape, affine, other shape, divisor, training)
    "2d-train": ((64, 32), True, (1,), 1.0, True),
    "2d-train-div": ((64, 32), True, (32,), 2.5, True),
    "4d-train": ((8, 16, 5, 5), True, (16, 1, 1), 1.0, True),
    "2d-train-noaffine": ((64, 32), False, (1,), 0.75, True),
    "2d-eval": ((64, 32), True, (1,), 1.0, False),
    "4d-eval": ((8, 16, 5, 5), True, (16, 1, 1), 2.0, False),
}
BN_MOMENTUM, BN_EPS = 0.1, 1e-5


def _bn_eager(x, w, b, rm, rv, training, other, divisor):
    t = (F.batch_norm(x, rm, rv, w, b, training, BN_MOMENTUM, BN_EPS) + other) / divisor
    return t * torch.sigmoid(t)


def _bn_fused(x, w, b, rm, rv, training, other, divisor):
    return ops.custom_batch_norm_add_div_swish(x, w, b, rm, rv, training, BN_MOMENTUM, BN_EPS, other, divisor)


def _bn_eval_fused(x, w, b, rm, rv, training, other, divisor):
    assert not training
    return ops.custom_batch_norm_add_div_swish_eval(x, w, b, rm, rv, BN_EPS, other, divisor)


def _bn_inputs(case, dtype, gen):
    xs, affine, os_, divisor, training = BN_CASES[case]
    c = xs[1]
    return {
        # an offset mean, as after a Linear layer
        "x": (signed_randn(*xs, dtype=torch.float32, generator=gen) * 2.0 + 0.5).to(dtype),
        "w": signed_randn(c, dtype=dtype, generator=gen) if affine else None,
        "b": signed_randn(c, dtype=dtype, generator=gen) if affine else None,
        "rm": signed_randn(c, dtype=dtype, generator=gen, scale=0.1),
        "rv": (torch.rand(c, device="cuda", generator=gen) + 0.5).to(dtype),
        "training": training,
        "other": signed_randn(*os_, dtype=dtype, generator=gen),
        "divisor": divisor,
    }


@pytest.mark.parametrize("case", list(BN_CASES))
def test_batch_norm_add_div_swish(case, precision, gen):
    inputs = _bn_inputs(case, precision, gen)
    grad = tuple(k for k in ("x", "w", "b", "other") if inputs[k] is not None)
    state = ("rm", "rv") if inputs["training"] else ()
    check_against_eager(
        _bn_fused, _bn_eager, inputs, grad=grad, state=state, gen=gen, label=f"batch_norm_add_div_swish {case}"
    )
    if not inputs["training"]:
        check_against_eager(
            _bn_eval_fused, _bn_eager, inputs, grad=grad, gen=gen, label=f"batch_norm_add_div_swish_eval {case}"
        )


# ----------------------------------------------------------- NaN and Inf ----

def _with_nonfinite(inputs, gen, keys=("x",)):
    cg = _cpu_gen(gen)
    return {k: (inject_nonfinite(v, cg) if k in keys else v) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_nonfinite_linear_add_relu(dtype, gen):
    with tf32_flags(False, True):
        inputs = _with_nonfinite(_linear_inputs("full-other", dtype, gen), gen, keys=("x", "other"))
        check_against_eager(_linear_fused, _linear_eager, inputs, grad=("x", "w", "b", "other"), gen=gen,
                            label="linear_add_relu NaN/Inf")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_nonfinite_conv_relu_add(dtype, gen):
    with tf32_flags(False, True):
        inputs = _with_nonfinite(_conv_inputs("2d-basic", dtype, gen), gen)
        check_against_eager(_conv_fused, _conv_eager, inputs, grad=("x", "w", "b", "other"), gen=gen,
                            label="conv_relu_add NaN/Inf")


@pytest.mark.parametrize("case", ["2d-train", "2d-eval"])
def test_nonfinite_batch_norm_add_div_swish(case, gen):
    inputs = _with_nonfinite(_bn_inputs(case, torch.float32, gen), gen)
    check_against_eager(_bn_fused, _bn_eager, inputs, grad=("x", "w", "b", "other"),
                        state=("rm", "rv") if inputs["training"] else (), gen=gen,
                        label=f"batch_norm_add_div_swish NaN/Inf {case}")


# ------------------------------------------------------------------ relu ----
# relu is exact, so here fused and eager must agree bit for bit (NaN for
# NaN), which implies the relative-error criterion.

FLOAT_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# layout: (shape of the contiguous base tensor, base -> the tensor under test)
RELU_LAYOUT_DEFS = {
    "contiguous-odd": ((37, 129), lambda t: t),  # n = 4773: not a multiple of 4, 8 or 32
    "contiguous-aligned": ((64, 256), lambda t: t),  # a multiple of every vector width
    "single": ((1,), lambda t: t),
    "transposed": ((129, 37), lambda t: t.t()),  # dense, not contiguous
    "channels-last": ((4, 6, 7, 5), lambda t: t.contiguous(memory_format=torch.channels_last)),
    "misaligned": ((4774,), lambda t: t[1:]),  # data pointer one element past a 16-byte boundary
    "strided": ((37, 258), lambda t: t[:, ::2]),  # not dense: the composite fallback
    "expanded": ((37, 1), lambda t: t.expand(37, 64)),  # overlapping: the composite fallback
    "empty": ((0,), lambda t: t),
    "empty-2d": ((0, 5), lambda t: t),
}


def _relu_base(layout, dtype, gen):
    """Signed random values with NaN and +-Inf sprinkled in."""
    t = signed_randn(*RELU_LAYOUT_DEFS[layout][0], dtype=dtype, generator=gen)
    return inject_nonfinite(t, _cpu_gen(gen), count=2) if t.numel() >= 6 else t


def _relu_input(layout, dtype, gen):
    return RELU_LAYOUT_DEFS[layout][1](_relu_base(layout, dtype, gen))


RELU_LAYOUTS = list(RELU_LAYOUT_DEFS)


def _assert_relu_equal(fused, eager, what):
    what = f"{what} [seed {SEED}]"
    assert fused.shape == eager.shape and fused.dtype == eager.dtype and fused.device == eager.device, what
    assert torch.equal(torch.isnan(fused), torch.isnan(eager)), f"{what}: NaN placement differs from eager"
    assert torch.equal(torch.nan_to_num(fused, nan=0.0), torch.nan_to_num(eager, nan=0.0)), (
        f"{what}: values differ from eager at {int((fused != eager).logical_and(~torch.isnan(eager)).sum())} elements"
    )


@pytest.mark.parametrize("layout", RELU_LAYOUTS)
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES.values()), ids=list(FLOAT_DTYPES))
def test_relu_forward(layout, dtype, gen):
    x = _relu_input(layout, dtype, gen)
    eager = torch.relu(x)
    poison_allocator(nbytes_of(eager))
    fused = ops.custom_relu(x)
    torch.cuda.synchronize()
    _assert_relu_equal(fused, eager, f"custom_relu {layout}")
    if is_non_overlapping_and_dense(x):
        assert fused.stride() == eager.stride(), f"custom_relu {layout}: strides {fused.stride()} vs eager {eager.stride()}"


@pytest.mark.parametrize("layout", RELU_LAYOUTS)
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES.values()), ids=list(FLOAT_DTYPES))
def test_relu_backward(layout, dtype, gen):
    """Through autograd: a contiguous input takes the 1-bit mask kernels,
    others the composite path.  NaN outputs pass their gradient, as eager's
    threshold_backward does."""
    base = _relu_base(layout, dtype, gen)
    view = RELU_LAYOUT_DEFS[layout][1]
    b_e = base.clone().requires_grad_(True)
    b_f = base.clone().requires_grad_(True)
    x_e, x_f = view(b_e), view(b_f)
    assert x_f.stride() == view(base).stride()
    y_e = torch.relu(x_e)
    poison_allocator(nbytes_of(y_e) + [max(1, (y_e.numel() + 31) // 32 * 4)])
    y_f = ops.custom_relu(x_f)
    _assert_relu_equal(y_f.detach(), y_e.detach(), f"custom_relu (grad mode) {layout}")
    gy = signed_randn(*y_e.shape, dtype=dtype, generator=gen)
    y_e.backward(gy)
    poison_allocator(nbytes_of(x_e, b_e))
    y_f.backward(gy)
    torch.cuda.synchronize()
    _assert_relu_equal(b_f.grad, b_e.grad, f"custom_relu backward {layout}")


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 4096 * 3 + 7])
@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES.values()), ids=list(FLOAT_DTYPES))
def test_relu_mask_ops(n, dtype, gen):
    """custom_relu_forward_mask / custom_relu_backward called directly: the
    mask bits are !(y <= 0) in logical order, little-endian 32-bit words."""
    x = signed_randn(n, dtype=dtype, generator=gen)
    if n >= 6:
        x = inject_nonfinite(x, _cpu_gen(gen), count=2)
    words = (n + 31) // 32
    poison_allocator(nbytes_of(x) + [words * 4])
    y, mask = ops.custom_relu_forward_mask(x)
    torch.cuda.synchronize()
    _assert_relu_equal(y, torch.relu(x), f"custom_relu_forward_mask n={n}")
    assert mask.dtype == torch.uint8 and mask.numel() == words * 4, (mask.dtype, mask.numel())
    bits = (mask.view(-1, 1).int() >> torch.arange(8, device=mask.device).int()) & 1
    keep = bits.view(-1)[:n].bool()
    assert torch.equal(keep, ~(y <= 0)), f"mask bits differ from !(y <= 0), n={n} [seed {SEED}]"
    gy = signed_randn(n, dtype=dtype, generator=gen)
    poison_allocator(nbytes_of(gy))
    dx = ops.custom_relu_backward(gy, mask)
    torch.cuda.synchronize()
    _assert_relu_equal(dx, torch.where(keep, gy, torch.zeros_like(gy)), f"custom_relu_backward n={n}")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8], ids=["int32", "int64", "int8"])
def test_relu_integer_fallback(dtype, gen):
    x = torch.randint(-100, 100, (37, 129), dtype=dtype, device="cuda", generator=gen)
    assert torch.equal(ops.custom_relu(x), torch.relu(x))
    assert torch.equal(ops.custom_relu(x.t()), torch.relu(x.t()))


def test_relu_more_than_2_31_elements(gen):
    """64-bit indexing: n = 2^31 + 37 half-precision elements (4.3 GB a
    tensor), through the vectorized, tail, mask and backward kernels."""
    n = 2**31 + 37
    free, _ = torch.cuda.mem_get_info()
    if free < 24 * 2**30:
        pytest.skip(f"needs 24 GiB of free device memory, {free / 2**30:.1f} GiB free")
    x = signed_randn(n, dtype=torch.float16, generator=gen)
    y = ops.custom_relu(x)
    assert torch.equal(y, torch.relu(x)), "custom_relu differs from eager beyond 2^31 elements"
    del y
    y, mask = ops.custom_relu_forward_mask(x)
    assert torch.equal(y, torch.relu(x)), "custom_relu_forward_mask differs from eager beyond 2^31 elements"
    del y, x
    gy = signed_randn(n, dtype=torch.float16, generator=gen)
    dx = ops.custom_relu_backward(gy, mask)
    # bit i of the mask, read back in chunks to bound the temporaries
    for start in range(0, n, 2**28):
        stop = min(n, start + 2**28)
        bytes_ = mask[start // 8 : (stop + 7) // 8]
        bits = ((bytes_.view(-1, 1).int() >> torch.arange(8, device="cuda").int()) & 1).view(-1).bool()
        bits = bits[: stop - start]
        expect = torch.where(bits, gy[start:stop], torch.zeros_like(gy[start:stop]))
        assert torch.equal(dx[start:stop], expect), f"custom_relu_backward wrong in [{start}, {stop})"


# ------------------------------------------------------- compute-sanitizer ----

SANITIZER_CASE = textwrap.dedent(
    """
    import torch, torchfuse
    ops = torch.ops.torchfuse
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.float64, torch.bfloat16):
        for n in (1, 33, 1003):
            x = torch.randn(n + 1, device="cuda", dtype=dtype)
            for t in (x[:n], x[1:]):  # aligned (vector + tail kernels) and misaligned (tail only)
                assert torch.equal(ops.custom_relu(t), torch.relu(t))
            xt = torch.randn(7, n, device="cuda", dtype=dtype).t()
            assert torch.equal(ops.custom_relu(xt), torch.relu(xt))
            y, mask = ops.custom_relu_forward_mask(x[:n].contiguous())
            dx = ops.custom_relu_backward(torch.randn_like(y), mask)
            xg = x[:n].clone().requires_grad_(True)
            ops.custom_relu(xg).backward(torch.randn_like(xg))
    # the other ops (CUDA kernels or ATen compositions), forward and backward,
    # with odd sizes
    for dtype in (torch.float32, torch.float16):
        def leaf(*shape):
            return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(True)
        x, w, b, o = leaf(5, 33), leaf(7, 33), leaf(7), leaf(5, 7)
        ops.custom_linear_add_relu(x, w, b, o, 1.0).sum().backward()
        x, w, b, o = leaf(2, 3, 9, 11), leaf(36, 3, 3, 3), leaf(36), leaf(36, 1, 1)
        ops.custom_conv_relu_add(x, w, b, [1, 1], [1, 1], [1, 1], 1, o, 1.0).sum().backward()
        xc = x.detach().contiguous(memory_format=torch.channels_last).requires_grad_(True)
        ops.custom_conv_relu_add(xc, w, None, [2, 1], [0, 1], [1, 1], 1, leaf(1), 1.0).sum().backward()
        for shape in ((37, 19), (3, 19, 5, 7)):
            x, g, bb, o = leaf(*shape), leaf(19), leaf(19), leaf(1)
            rm = torch.zeros(19, device="cuda", dtype=dtype)
            rv = torch.ones(19, device="cuda", dtype=dtype)
            ops.custom_batch_norm_add_div_swish(x, g, bb, rm, rv, True, 0.1, 1e-5, o, 2.0).sum().backward()
            ops.custom_batch_norm_add_div_swish_eval(x, g, bb, rm, rv, 1e-5, o, 2.0).sum().backward()
    torch.cuda.synchronize()
    print("SANITIZER_CASE_DONE")
    """
)


def test_compute_sanitizer_memcheck(tmp_path):
    """memcheck over small cases of every op on CUDA: the custom_relu
    forward, forward-with-mask and backward kernels on all their paths, and
    each other op forward and backward, whatever runs it."""
    run_memcheck(SANITIZER_CASE, tmp_path / "sanitizer_case.py")
