"""The CUDA kernels of torchfuse::custom_batch_norm_add_div_swish (training and
eval), custom_batch_norm_add_div_swish_eval and the internal _forward /
_backward ops, against a float64 reference: the CPU composition
(ops/cpu/batch_norm_add_div_swish_kernel.cpp) run on float64 copies.

Criterion (cuda_utils.py): rel_err = max|a - ref| / max|ref| of the CUDA op
must be at most 2 x that of eager PyTorch (the unfused batch_norm -> add ->
div -> swish on CUDA, same dtype) plus a floor (FLOORS); NaN and +-Inf must
land where eager puts them.  Checked: outputs, gradients of input, weight,
bias and other, running statistics after several steps, saved statistics.
Outputs are poisoned (NaN-filled blocks left in the caching allocator) right
before every call under test, so an element the kernels never write shows up
as NaN.

Layouts cover the kernels' fast path (dense (N, C) and (N, C, *) inputs:
contiguous, channels-last, transposed; scalar or per-channel `other`) and
cases that must fall back to the composition (gapped input, full-size or
differently broadcast `other`, mixed dtypes, float64); test_fused_path checks
with the profiler which of the two ran.  Every test is marked `cuda` and
skipped, with the reason, where torch sees no CUDA device.
TORCHFUSE_TEST_SEED=<n> reproduces a run; the seed is in every failure
message.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
import zlib
from typing import Optional

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_utils import (  # noqa: E402
    CUDA_ONLY,
    assert_close_to_reference,
    inject_nonfinite,
    nonfinite_pattern,
    poison_allocator,
    rel_err,
    run_seed,
)

import torchfuse  # noqa: E402,F401  (registers torch.ops.torchfuse)

pytestmark = CUDA_ONLY

ops = torch.ops.torchfuse
SEED = run_seed()
EPS = 1e-5

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# Error floors, relative to max|ref|.
FLOORS = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 2e-3, torch.float64: 1e-12}


@dataclasses.dataclass(frozen=True)
class Layout:
    shape: tuple
    other: tuple  # shape of `other`
    affine: bool = True
    memory: str = "contiguous"  # "contiguous" | "channels_last" | "transposed" | "sliced"
    mean: float = 0.5  # offset of x; large values test |mean| >> std
    std: float = 2.0
    fast: bool = True  # expected to take the CUDA kernels (test_fused_path)


LAYOUTS = {
    # --- the kernels' fast path
    "2d": Layout((64, 32), (1,)),
    "2d-per-channel": Layout((256, 1024), (1024,)),
    "2d-odd-c": Layout((37, 13), (13,)),  # scalar (unvectorized) column path
    "2d-tall-0dim-other": Layout((4096, 24), ()),
    "2d-noaffine": Layout((64, 32), (32,), affine=False),
    "2d-large-mean": Layout((512, 64), (64,), mean=1000.0, std=0.5),
    "3d-odd-l": Layout((8, 16, 33), (16, 1)),  # scalar plane path
    "4d": Layout((8, 16, 8, 8), (1, 16, 1, 1)),  # vectorized plane path
    "4d-large-plane": Layout((2, 4, 96, 96), (1,)),
    "4d-large-mean": Layout((4, 8, 16, 16), (8, 1, 1), mean=-300.0, std=0.25),
    "4d-hw1": Layout((32, 24, 1, 1), (24, 1, 1)),  # L == 1: column path
    "n1": Layout((1, 16, 40), (16, 1)),
    "w3": Layout((1024, 8192), (1,)),  # the reference workload's BN tail
    # more splits than the per-channel kernels merge one by one (> 16): a
    # narrow column input gets up to one per reduction block
    "2d-narrow-many-splits": Layout((65536, 16), (16,)),
    "4d-many-splits": Layout((64, 2, 48, 48), (2, 1, 1)),
    # dense, other memory orders: channels-last is the column path with
    # N * H * W rows, transposed (N, C) the plane path with one plane
    "channels-last": Layout((8, 16, 5, 5), (16, 1, 1), memory="channels_last"),
    "channels-last-odd-c": Layout((4, 13, 6, 6), (1,), memory="channels_last"),
    "3d-channels-last": Layout((8, 24, 40), (24, 1), memory="channels_last"),
    "transposed": Layout((64, 32), (32,), memory="transposed"),
    # --- must fall back to the composition
    "sliced": Layout((64, 32), (1,), memory="sliced", fast=False),
    "full-other": Layout((8, 16, 5), (8, 16, 5), fast=False),
    "other-on-last-dim": Layout((4, 8, 8), (8,), fast=False),  # numel C, but broadcast along dim 2
    "other-more-dims": Layout((16, 8), (1, 1, 1), fast=False),  # result is 3-D
}

MODES = ["train", "eval", "eval-op"]


@pytest.fixture
def gen(request):
    g = torch.Generator(device="cuda")
    g.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))
    return g


def poison(*nbytes: int) -> None:
    """NaN-filled blocks of the outputs' sizes, plus whole small-pool (1 MiB)
    and large-pool (64 MiB) blocks, so workspaces start out as NaN too."""
    poison_allocator([n for n in nbytes if n > 0] + [1 << 20] * 4 + [64 << 20], copies=2)


def nbytes(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def randn(shape, *, gen, dtype=torch.float32, scale=1.0, mean=0.0):
    t = torch.randn(tuple(shape), generator=gen, device="cuda", dtype=torch.float32) * scale + mean
    return t.to(dtype)


def make_x(lay: Layout, dtype, gen) -> torch.Tensor:
    if lay.memory == "transposed":
        base = randn(lay.shape[::-1], gen=gen, scale=lay.std, mean=lay.mean).to(dtype)
        x = base.t()
    elif lay.memory == "sliced":
        base = randn((lay.shape[0], 2 * lay.shape[1]), gen=gen, scale=lay.std, mean=lay.mean).to(dtype)
        x = base[:, ::2]
    else:
        x = randn(lay.shape, gen=gen, scale=lay.std, mean=lay.mean).to(dtype)
        if lay.memory == "channels_last":
            # C innermost, the other dims in order (torch.channels_last for 4-D)
            perm = (0, *range(2, x.dim()), 1)
            x = x.permute(perm).contiguous().permute(torch.argsort(torch.tensor(perm)).tolist())
    assert x.shape == lay.shape
    return x


def make_inputs(lay: Layout, dtype, param_dtype, gen) -> dict:
    c = lay.shape[1]
    return {
        "x": make_x(lay, dtype, gen),
        "w": randn((c,), gen=gen, mean=1.0, scale=0.5).to(param_dtype) if lay.affine else None,
        "b": randn((c,), gen=gen).to(param_dtype) if lay.affine else None,
        "rm": randn((c,), gen=gen, scale=0.1).to(param_dtype),
        "rv": (torch.rand(c, device="cuda", generator=gen) + 0.5).to(param_dtype),
        "other": randn(lay.other, gen=gen).to(dtype),
    }


def with_nonfinite(t: torch.Tensor, cg: torch.Generator) -> torch.Tensor:
    """inject_nonfinite for any layout (it views its input as 1-D), keeping
    t's strides."""
    return torch.empty_like(t).copy_(inject_nonfinite(t.contiguous(), cg, count=2))


def clone_to(v, dtype=None, device=None, grad=False):
    if v is None:
        return None
    c = v.detach().clone()  # clone keeps the strides (channels-last, transposed)
    if dtype is not None and c.is_floating_point():
        c = c.to(dtype)
    if device is not None:
        c = c.to(device)
    return c.requires_grad_(grad)


def eager_fn(x, w, b, rm, rv, training, momentum, other, divisor, silu=False):
    # NB: torch.batch_norm, not F.batch_norm: the latter refuses one value per
    # channel in training, which the aten op (and so the composite) allows.
    t = (torch.batch_norm(x, w, b, rm, rv, training, momentum, EPS, True) + other) / divisor
    return torch.nn.functional.silu(t) if silu else t * torch.sigmoid(t)


def fused_fn(mode, silu=False):
    """The op with `silu` naming eager_fn's spelling of the swish."""

    def f(x, w, b, rm, rv, training, momentum, other, divisor):
        if mode == "eval-op":
            return ops.custom_batch_norm_add_div_swish_eval(x, w, b, rm, rv, EPS, other, divisor, silu)
        return ops.custom_batch_norm_add_div_swish(x, w, b, rm, rv, training, momentum, EPS, other, divisor, silu)

    return f


def check(fused, eager, ref, *, what, dtype, loose_nonfinite=False):
    """assert_close_to_reference with FLOORS; loose_nonfinite: NaN and +-Inf
    may differ, only finite vs non-finite placement must match."""
    floor = FLOORS.get(fused.dtype, FLOORS[dtype])
    if not loose_nonfinite:
        assert_close_to_reference(fused, eager, ref, what=what, floor=floor)
        return
    assert fused.shape == eager.shape and fused.dtype == eager.dtype, what
    nf_f = nonfinite_pattern(fused) != 0
    nf_e = nonfinite_pattern(eager) != 0
    assert torch.equal(nf_f, nf_e), f"{what}: finite/non-finite placement differs from eager"
    finite = ~nf_e & torch.isfinite(ref)
    bound = 2.0 * rel_err(eager, ref, finite) + floor
    err = rel_err(fused, ref, finite)
    assert err <= bound, f"{what}: relative error {err:.3e} exceeds {bound:.3e}"


def run_and_compare(
    lay: Layout,
    mode: str,
    dtype,
    param_dtype,
    gen,
    *,
    momentum=0.1,
    divisor=1.0,
    steps=None,
    nonfinite=(),
    silu=False,
    label="",
):
    """`steps` training (or eval) steps through fused (CUDA op), eager (CUDA,
    dtype) and reference (CPU op, float64), each with its own running
    statistics; compares outputs and gradients at every step and the running
    statistics at the end.  nonfinite names the inputs that get NaN and
    +-Inf; "gy" puts +-Inf in an eighth of grad_output."""
    training = mode == "train"
    steps = steps if steps is not None else (3 if training else 1)
    label = f"{label} mode={mode} dtype={dtype} params={param_dtype} [seed {SEED}]"
    inputs = make_inputs(lay, dtype, param_dtype, gen)
    cg = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen, device="cuda")))
    for k in nonfinite:
        if k != "gy":
            inputs[k] = with_nonfinite(inputs[k], cg)
    grads = [k for k in ("x", "w", "b", "other") if inputs[k] is not None]

    # Persistent state per implementation: weight, bias, other, running stats.
    def state(dtype_=None, device=None):
        return {k: clone_to(inputs[k], dtype_, device, grad=k in grads) for k in ("w", "b", "other", "rm", "rv")}

    s_fused, s_eager, s_ref = state(), state(), state(torch.float64, "cpu")
    fused = fused_fn(mode, silu)
    ref_fn = fused_fn(mode, silu)  # the CPU op = the composite

    for step in range(steps):
        x0 = inputs["x"] if step == 0 else make_x(lay, dtype, gen)
        if step > 0 and "x" in nonfinite:
            x0 = with_nonfinite(x0, cg)
        xs = {
            "fused": clone_to(x0, grad=True),
            "eager": clone_to(x0, grad=True),
            "ref": clone_to(x0, torch.float64, "cpu", grad=True),
        }
        for s in (s_fused, s_eager, s_ref):
            for k in grads:
                if k != "x":
                    s[k].grad = None
        args = lambda s, x: (x, s["w"], s["b"], s["rm"], s["rv"], training, momentum, s["other"], divisor)  # noqa: E731

        ref_out = ref_fn(*args(s_ref, xs["ref"]))
        eager_out = eager_fn(*args(s_eager, xs["eager"]), silu=silu)
        poison(nbytes(eager_out), lay.shape[1] * 4)
        fused_out = fused(*args(s_fused, xs["fused"]))
        torch.cuda.synchronize()
        what = f"{label} step {step}"
        check(fused_out, eager_out, ref_out, what=f"{what}: output", dtype=dtype)

        gy = randn(eager_out.shape, gen=gen).to(eager_out.dtype)
        if "gy" in nonfinite:
            pick = torch.rand(gy.shape, device="cuda", generator=gen) < 0.125
            pick &= decided_for_inf(xs["ref"], s_ref, training, divisor, dtype, silu)
            gy = torch.where(pick, torch.sign(gy) * float("inf"), gy)
        if gy.shape == x0.shape:  # in x's memory order: channels-last reads it as it is
            gy = torch.empty_like(x0, dtype=gy.dtype).copy_(gy)
        ref_out.backward(gy.double().cpu())
        eager_out.backward(gy)
        poison(nbytes(xs["eager"]) * 2, nbytes(eager_out) * 2, lay.shape[1] * 4)
        fused_out.backward(gy)
        torch.cuda.synchronize()
        for k in grads:
            f_t = xs["fused"] if k == "x" else s_fused[k]
            e_t = xs["eager"] if k == "x" else s_eager[k]
            r_t = xs["ref"] if k == "x" else s_ref[k]
            assert f_t.grad is not None, f"{what}: no gradient for {k}"
            check(f_t.grad, e_t.grad, r_t.grad.to(f_t.grad.device), what=f"{what}: grad of {k}", dtype=dtype)

    if training:
        for k in ("rm", "rv"):
            # NB: a channel holding +-Inf gets a non-finite mean, but whether
            # NaN or Inf depends on the order of the Welford merges, which
            # differs between any two implementations.
            check(
                s_fused[k].detach(), s_eager[k].detach(), s_ref[k].detach().cuda(),
                what=f"{label}: {k} after {steps} steps", dtype=dtype,
                loose_nonfinite=bool(nonfinite) and k == "rm",
            )
    else:
        for k in ("rm", "rv"):
            assert torch.equal(s_fused[k], inputs[k]), f"{label}: eval changed {k}"


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}


def inf_grad_outcome(t, dtype, silu):
    """NaN/+-Inf pattern of eager's swish gradient at t for an incoming +Inf,
    with t rounded to dtype as eager's is."""
    tt = t.to(device="cuda", dtype=dtype).requires_grad_(True)
    y = torch.nn.functional.silu(tt) if silu else tt * torch.sigmoid(tt)
    (g,) = torch.autograd.grad(y, tt, torch.full_like(y, float("inf")))
    return nonfinite_pattern(g)


def decided_for_inf(x, s, training, divisor, dtype, silu):
    """Where an infinite grad_output's outcome (NaN, +Inf or -Inf) does not
    hang on rounding: eager's is the same at t and at t -+ tol, tol a
    generous bound on the error of eager's t.  Elsewhere (t near 0 for the
    product's inf - inf, near silu's zero derivative at t = -1.28 for its
    sign, near where the sigmoid rounds to 1) the outcome is a coin toss
    between any two implementations, as a relu's decision is near 0."""
    d = lambda v: None if v is None else v.detach()  # noqa: E731
    with torch.no_grad():
        bn = torch.batch_norm(
            d(x), d(s["w"]), d(s["b"]), s["rm"].clone(), s["rv"].clone(), training, 0.0, EPS, True
        )
        t = (bn + d(s["other"])) / divisor
        tol = 16 * UNIT_ROUNDOFF[dtype] * ((bn.abs() + d(s["other"]).abs()) / abs(divisor) + t.abs())
    lo, mid, hi = (inf_grad_outcome(v, dtype, silu) for v in (t - tol, t, t + tol))
    return ((lo == mid) & (mid == hi)).to("cuda")


def param_dtypes(dtype):
    # float32 parameters with 16-bit inputs (the autocast / mixed-precision
    # setup), and parameters in the input's own dtype.
    return [torch.float32] if dtype == torch.float32 else [torch.float32, dtype]


# ------------------------------------------------------------------ tests ----


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts(layout, dtype, mode, gen):
    lay = LAYOUTS[layout]
    for pd in param_dtypes(dtype):
        run_and_compare(lay, mode, dtype, pd, gen, divisor=1.0, label=layout)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("divisor", [2.5, -0.75, 3], ids=["2.5", "-0.75", "int3"])
@pytest.mark.parametrize("layout", ["2d-per-channel", "4d", "2d-odd-c"])
def test_divisor(layout, divisor, mode, gen):
    run_and_compare(LAYOUTS[layout], mode, torch.float32, torch.float32, gen, divisor=divisor, label=layout)
    run_and_compare(LAYOUTS[layout], mode, torch.bfloat16, torch.float32, gen, divisor=divisor, label=layout)


@pytest.mark.parametrize("momentum", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["2d-per-channel", "4d", "3d-odd-l"])
def test_running_stats_momentum(layout, dtype, momentum, gen):
    for pd in param_dtypes(dtype):
        run_and_compare(LAYOUTS[layout], "train", dtype, pd, gen, momentum=momentum, steps=4, divisor=1.5, label=layout)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["2d", "2d-per-channel", "4d", "3d-odd-l", "channels-last"])
def test_nonfinite_input(layout, dtype, mode, gen):
    run_and_compare(LAYOUTS[layout], mode, dtype, torch.float32, gen, nonfinite=("x",), label=f"{layout} NaN/Inf in x")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["2d-per-channel", "4d"])
def test_nonfinite_other(layout, mode, gen):
    # NB: not in the weight: where a weight is +-Inf, eager's NaN placement
    # depends on how its BN implementation (native or cuDNN) folds the affine
    # transform, which no fused formula can match everywhere.
    run_and_compare(
        LAYOUTS[layout], mode, torch.float32, torch.float32, gen, nonfinite=("other",),
        label=f"{layout} NaN/Inf in other",
    )


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "mul-sigmoid"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["2d-per-channel", "4d", "3d-odd-l"])
def test_infinite_grad_output(layout, dtype, mode, silu, gen):
    """Autograd through t * sigmoid(t) sums g*s + ((g*t)*(1-s))*s, NaN where
    g is infinite and t < 0; silu's backward, one product, gives +-Inf
    there.  The op must follow the spelling its `silu` argument names."""
    run_and_compare(
        LAYOUTS[layout], mode, dtype, torch.float32, gen, nonfinite=("gy",), silu=silu,
        label=f"{layout} +-Inf in grad_output, silu={silu}",
    )


@pytest.mark.parametrize("silu", [True, False], ids=["silu", "mul-sigmoid"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_infinite_grad_where_the_sigmoid_is_one(dtype, silu):
    """Eager's sigmoid is exactly 1 (float32: from t > 16.64, where 1 +
    exp(-t) rounds to 1, below 17.33 where the exact value rounds to 1;
    16-bit: from where it rounds to 1) or 0: an infinite gradient through
    t * sigmoid(t) meets inf * 0 = NaN there."""
    t = torch.tensor([5.0, 6.0, 6.5, 7.0, 8.0, 9.0, 16.7, 17.0, 17.2, 17.5, 3.0, -0.5, -90.0], device="cuda")
    t = t.to(dtype).view(-1, 1)
    gy = torch.full_like(t, float("inf"))
    zeros = torch.zeros(1, device="cuda")
    ones = torch.ones(1, device="cuda") - EPS
    got_x = t.clone().requires_grad_(True)
    ops.custom_batch_norm_add_div_swish_eval(got_x, None, None, zeros, ones, EPS, zeros.to(dtype), 1.0, silu).backward(gy)
    want_x = t.clone().requires_grad_(True)
    y = torch.batch_norm(want_x, None, None, zeros, ones, False, 0.1, EPS, True)
    (torch.nn.functional.silu(y) if silu else y * torch.sigmoid(y)).backward(gy)
    assert torch.equal(nonfinite_pattern(got_x.grad), nonfinite_pattern(want_x.grad)), (got_x.grad, want_x.grad)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_one_value_per_channel(dtype, gen):
    """M = 1 in training: the unbiased variance is 0/0 = NaN, as in aten."""
    run_and_compare(Layout((1, 16), (16,)), "train", dtype, torch.float32, gen, steps=1, label="M=1")


@pytest.mark.parametrize("mode", MODES)
def test_float64_falls_back(mode, gen):
    run_and_compare(LAYOUTS["4d"], mode, torch.float64, torch.float64, gen, label="float64")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_float32_per_channel_other_promotes(dtype, mode, gen):
    """A float32 per-channel `other` with a 16-bit input makes the result
    float32 (type promotion): the composition runs it."""
    lay = LAYOUTS["2d-per-channel"]
    inputs = make_inputs(lay, dtype, torch.float32, gen)
    other = inputs["other"].float()
    f = fused_fn(mode)
    e = eager_fn(inputs["x"], inputs["w"], inputs["b"], inputs["rm"].clone(), inputs["rv"].clone(),
                 mode == "train", 0.1, other, 2.0)
    o = f(inputs["x"], inputs["w"], inputs["b"], inputs["rm"].clone(), inputs["rv"].clone(),
          mode == "train", 0.1, other, 2.0)
    assert o.dtype == e.dtype == torch.float32
    r = f(*(clone_to(v, torch.float64, "cpu") for v in (inputs["x"], inputs["w"], inputs["b"], inputs["rm"], inputs["rv"])),
          mode == "train", 0.1, clone_to(other, torch.float64, "cpu"), 2.0)
    check(o, e, r.cuda(), what=f"float32 other with {dtype} input, {mode}", dtype=torch.float32)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["2d-per-channel", "4d", "2d-odd-c"])
def test_forward_op_contract(layout, dtype, training, gen):
    """custom_batch_norm_add_div_swish_forward returns (out, save_mean,
    save_invstd): float32 statistics of C elements in training, empty (0,)
    in eval, as the CPU composite."""
    lay = LAYOUTS[layout]
    inp = make_inputs(lay, dtype, torch.float32, gen)
    args = lambda d, dev: (  # noqa: E731
        clone_to(inp["x"], d, dev), clone_to(inp["w"], d, dev), clone_to(inp["b"], d, dev),
        clone_to(inp["rm"], d, dev), clone_to(inp["rv"], d, dev), training, 0.1, EPS,
        clone_to(inp["other"], d, dev), 1.5,
    )
    poison(nbytes(inp["x"]), lay.shape[1] * 4)
    out, mean, invstd = ops.custom_batch_norm_add_div_swish_forward(*args(None, None))
    torch.cuda.synchronize()
    r_out, r_mean, r_invstd = ops.custom_batch_norm_add_div_swish_forward(*args(torch.float64, "cpu"))
    n = lay.shape[1] if training else 0
    assert out.dtype == dtype and out.shape == lay.shape
    assert mean.dtype == invstd.dtype == torch.float32
    assert mean.shape == invstd.shape == (n,)
    if training:
        x = inp["x"].float()
        dims = [d for d in range(x.dim()) if d != 1]
        e_mean = x.mean(dims)
        e_invstd = torch.rsqrt(x.var(dims, unbiased=False) + EPS)
        check(mean, e_mean, r_mean.cuda(), what=f"{layout} {dtype}: save_mean", dtype=torch.float32)
        check(invstd, e_invstd, r_invstd.cuda(), what=f"{layout} {dtype}: save_invstd", dtype=torch.float32)


MASKS = {
    "all": (True, True, True, True),
    "input-only": (True, False, False, False),
    "params-only": (False, True, True, False),
    "other-only": (False, False, False, True),
    "none": (False, False, False, False),
}


@pytest.mark.parametrize("mask", list(MASKS.values()), ids=list(MASKS))
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", ["2d", "2d-per-channel", "4d", "3d-odd-l", "channels-last", "3d-channels-last"])
def test_backward_op_contract(layout, dtype, training, mask, gen):
    """custom_batch_norm_add_div_swish_backward called directly: (grad_input,
    grad_weight, grad_bias, grad_other) with None where output_mask is false,
    grad_input in the input's dtype and shape, the others in the dtypes of
    weight, bias and other (batchNormParamGradTypes), grad_other of other's
    shape; values against the float64 CPU op given the same
    statistics, with eager autograd's error as the bound.  grad_output is
    contiguous whatever the input's memory order."""
    lay = LAYOUTS[layout]
    inp = make_inputs(lay, dtype, torch.float32, gen)
    x, w, b, other = inp["x"], inp["w"], inp["b"], inp["other"]
    divisor = 1.5
    gy = randn(lay.shape, gen=gen).to(dtype)

    # eager: autograd through the unfused composition (in training through
    # the batch statistics too), in float32 up to the BN output
    xe, we, be, oe = (clone_to(v, grad=True) for v in (x, w, b, other))
    dims = [d for d in range(x.dim()) if d != 1]
    if training:
        e_mean = xe.float().mean(dims)
        e_invstd = torch.rsqrt(xe.float().var(dims, unbiased=False) + EPS)
        mean, invstd = e_mean.detach(), e_invstd.detach()
    else:
        mean = inp["rm"]
        invstd = torch.rsqrt(inp["rv"].float() + EPS)
        e_mean, e_invstd = mean, invstd
    shape = [1] * x.dim()
    shape[1] = -1
    xhat = (xe.float() - e_mean.view(shape)) * e_invstd.view(shape)
    z = (xhat * we.float().view(shape) + be.float().view(shape)).to(dtype) + oe
    t = z / divisor
    (t * torch.sigmoid(t)).backward(gy)

    args = lambda d, dev, g: (  # noqa: E731
        clone_to(g, d, dev), clone_to(x, d, dev), clone_to(w, d, dev), clone_to(b, d, dev),
        clone_to(mean, d, dev), clone_to(invstd, d, dev), training, clone_to(other, d, dev), divisor, list(mask),
    )
    poison(nbytes(x), x.numel() * 4, lay.shape[1] * 8)
    got_all = ops.custom_batch_norm_add_div_swish_backward(*args(None, None, gy))
    torch.cuda.synchronize()
    r = ops.custom_batch_norm_add_div_swish_backward(*args(torch.float64, "cpu", gy))
    what = f"{layout} {dtype} training={training} mask={mask} [seed {SEED}]"
    names = ("grad_input", "grad_weight", "grad_bias", "grad_other")
    ct = torch.float64 if dtype == torch.float32 else torch.float32  # the sums'
    dtypes = (dtype, ct if w is None else w.dtype, ct if b is None else b.dtype, other.dtype)
    eager_grads = (xe.grad, we.grad, be.grad, oe.grad)
    shapes = (lay.shape, (lay.shape[1],), (lay.shape[1],), tuple(other.shape))
    for got, want, ref, on, name, shp, dt in zip(got_all, eager_grads, r, mask, names, shapes, dtypes):
        if not on:
            assert got is None, f"{what}: {name} should be None"
            continue
        assert got is not None, f"{what}: {name} missing"
        assert got.dtype == dt, f"{what}: {name} dtype {got.dtype}, expected {dt}"
        assert tuple(got.shape) == shp, f"{what}: {name} shape {tuple(got.shape)}"
        check(got.float(), want.float(), ref.cuda().float(), what=f"{what}: {name}", dtype=dtype)


@pytest.mark.parametrize("layout", ["2d", "4d", "4d-large-mean"])
def test_backward_op_uses_given_mean(layout, gen):
    """A float32 training backward recentres x on the recomputed float64 batch
    mean only where the given mean is that mean's float32 rounding; any other
    mean is used as given, as the CPU op (and native_batch_norm_backward)
    does.  A shift of a tenth of a standard deviation moves the result by far
    more than the 1e-5 tolerance."""
    lay = LAYOUTS[layout]
    inp = make_inputs(lay, torch.float32, torch.float32, gen)
    x, w, b, other = inp["x"], inp["w"], inp["b"], inp["other"]
    dims = [d for d in range(x.dim()) if d != 1]
    std = x.double().std(dims)
    mean = (x.double().mean(dims) + 0.1 * std).float()
    invstd = torch.rsqrt(x.double().var(dims, unbiased=False) + EPS).float()
    gy = randn(lay.shape, gen=gen)
    args = lambda d, dev: tuple(  # noqa: E731
        clone_to(v, d, dev) for v in (gy, x, w, b, mean, invstd)) + (True, clone_to(other, d, dev), 1.5, [True] * 4)
    poison(nbytes(x), x.numel() * 4, lay.shape[1] * 8)
    got = ops.custom_batch_norm_add_div_swish_backward(*args(None, None))
    ref = ops.custom_batch_norm_add_div_swish_backward(*args(torch.float64, "cpu"))
    for name, g, r in zip(("grad_input", "grad_weight", "grad_bias", "grad_other"), got, ref):
        err = rel_err(g.double().cpu(), r, torch.isfinite(r))
        assert err <= 1e-5, f"{layout} {name}: relative error {err:.3e} with a shifted mean [seed {SEED}]"


def ran_composite(fn) -> bool:
    """Whether fn() ran the reference composition: its forward calls
    aten::native_batch_norm or aten::batch_norm, its backward aten::sigmoid;
    the kernels' path calls none of them."""
    # NB: the profiler warns that it clears events between cycles, which the
    # suite's filterwarnings=error would turn into a failure.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            fn()
            torch.cuda.synchronize()
    names = {"aten::native_batch_norm", "aten::batch_norm", "aten::sigmoid"}
    return any(e.name in names for e in prof.events())


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fused_path(layout, dtype, training, gen):
    """The fast-path layouts run the kernels, forward (_forward op) and
    backward (_backward op, every output wanted); the others run the
    composition."""
    lay = LAYOUTS[layout]
    inp = make_inputs(lay, dtype, torch.float32, gen)
    x, w, b, rm, rv, other = (inp[k] for k in ("x", "w", "b", "rm", "rv", "other"))
    fwd = lambda: ops.custom_batch_norm_add_div_swish_forward(  # noqa: E731
        x, w, b, rm, rv, training, 0.1, EPS, other, 2.0)
    out, mean, invstd = fwd()
    if not training:
        mean, invstd = rm, torch.rsqrt(rv.double() + EPS)
    gy = torch.empty_like(x).copy_(randn(out.shape, gen=gen)) if out.shape == x.shape else randn(out.shape, gen=gen)
    bwd = lambda: ops.custom_batch_norm_add_div_swish_backward(  # noqa: E731
        gy.to(dtype), x, w, b, mean, invstd, training, other, 2.0, [True] * 4)
    for what, fn in (("forward", fwd), ("backward", bwd)):
        used = ran_composite(fn)
        fast = lay.fast
        assert used == (not fast), (
            f"{layout} {dtype} training={training} {what}: expected the "
            f"{'kernels' if fast else 'composition'}, but the composition {'ran' if used else 'did not run'}"
        )


# The float32 backward's gradient of a one-element `other` sums g_bn over
# every element and cancels heavily; more draws than test_layouts makes.
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["2d", "2d-per-channel", "2d-tall-0dim-other", "4d", "4d-large-plane", "3d-channels-last"])
def test_float32_backward_draws(layout, mode, gen):
    for draw in range(6):
        divisor = (1.0, 2.5, -0.75)[draw % 3]
        run_and_compare(LAYOUTS[layout], mode, torch.float32, torch.float32, gen, steps=1, divisor=divisor,
                        label=f"{layout} draw {draw} divisor {divisor}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(0, 8), (0, 8, 3), (4, 8, 0)], ids=["0x8", "0x8x3", "4x8x0"])
def test_empty_input(shape, mode, gen):
    x = torch.empty(shape, device="cuda")
    w, b = torch.rand(8, device="cuda"), torch.rand(8, device="cuda")
    rm, rv = torch.zeros(8, device="cuda"), torch.ones(8, device="cuda")
    other = torch.ones(1, device="cuda")
    out = fused_fn(mode)(x, w, b, rm, rv, mode == "train", 0.1, other, 2.0)
    assert out.shape == shape
    assert torch.equal(rm, torch.zeros(8, device="cuda")) and torch.equal(rv, torch.ones(8, device="cuda"))
