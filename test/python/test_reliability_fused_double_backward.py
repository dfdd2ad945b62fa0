"""Double (and third-order) backward through the fused ops is eager's,
non-finite values and unused inputs included.

Eager's relu saves its result, and threshold_backward's double backward
gives that result an explicit zero gradient, which flows back through relu
into whatever produced relu's input: in `relu(conv(x, w, b)) + o` into the
conv's x, w and b (not into o), in `relu(linear(x, w, b) + o)` through the
add into the linear and o.  Behind `x / 0` that zero meets an infinite
derivative and gives NaN; a gradient that reaches an input only that way is
0 rather than "not used in the graph".  custom_conv_relu_add saves a 1-bit
mask and custom_linear_add_relu read its mask off the output without that
zero gradient: a penalty's gradient w.r.t. w was None where eager's is 0,
and finite or ±inf where eager's is NaN.

custom_batch_norm_add_div_swish has no relu; its double backward
recomputes t and sigmoid(t) from the saved inputs with ATen ops, which eager
also differentiates: the checks below hold for it as for the others.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

import torchfuse  # noqa: F401  (registers the ops)
from cuda_utils import CUDA_ONLY

ops = torch.ops.torchfuse
F64 = torch.float64
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA_ONLY)]


def signed(*sizes, device="cpu", grad=True):
    """Standard-normal float64 values pushed away from zero (never 0, both signs)."""
    t = torch.randn(sizes, dtype=F64)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)
    return t.to(device).requires_grad_(grad)


def nonfinite_rows(x):
    """x with its first slice along dim 0 kept, the second divided by 0
    (±inf) and the third (x - x) / 0 (NaN): the divisions' backwards turn a
    zero gradient into NaN."""
    return torch.cat([x[:1], x[1:2] / 0, (x[2:3] - x[2:3]) / 0, x[3:]])


# ----------------------------------------------------------------- the ops
# Each case: (fused, eager, sizes of x, w, b, o); b or o None where absent.


def conv_case(dims, x, w, b, o, stride=1, padding=1, groups=1, alpha=1.0, channels_last=False):
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    n = dims

    def layout(x):
        return x.contiguous(memory_format=torch.channels_last) if channels_last else x

    def fused(x, w, b, o):
        return ops.custom_conv_relu_add(
            layout(x), w, b, [stride] * n, [padding] * n, [1] * n, groups, o, alpha)

    def eager(x, w, b, o):
        return torch.add(torch.relu(conv(layout(x), w, b, stride, padding, 1, groups)), o, alpha=alpha)

    return fused, eager, (x, w, b, o)


def linear_case(x, w, b, o, alpha=1.0):
    def fused(x, w, b, o):
        return ops.custom_linear_add_relu(x, w, b, o, alpha)

    def eager(x, w, b, o):
        return torch.relu(torch.add(F.linear(x, w, b), o, alpha=alpha))

    return fused, eager, (x, w, b, o)


def bn_case(x, training, silu, o, divisor=1.5):
    channels = x[1]

    def stats(device):
        torch.manual_seed(7)
        mean = torch.randn(channels, dtype=F64, device=device)
        return mean, torch.rand(channels, dtype=F64, device=device) + 0.5

    def fused(x, w, b, o):
        mean, var = stats(x.device)
        return ops.custom_batch_norm_add_div_swish(
            x, w, b, mean, var, training, 0.1, 1e-5, o, divisor, silu)

    def eager(x, w, b, o):
        mean, var = stats(x.device)
        t = (F.batch_norm(x, mean, var, w, b, training, 0.1, 1e-5) + o) / divisor
        return F.silu(t) if silu else t * torch.sigmoid(t)

    return fused, eager, (x, (channels,), (channels,), o)


CASES = {
    "conv2d": conv_case(2, (4, 3, 5, 5), (4, 3, 3, 3), (4,), (4, 4, 5, 5)),
    "conv2d_channel_other": conv_case(2, (4, 3, 5, 5), (4, 3, 3, 3), (4,), (4, 1, 1), alpha=0.5),
    "conv2d_scalar_other": conv_case(2, (4, 3, 5, 5), (4, 3, 3, 3), None, (1,)),
    "conv2d_other_adds_dims": conv_case(2, (4, 3, 5, 5), (4, 3, 3, 3), (4,), (2, 1, 4, 1, 5)),
    "conv2d_strided_groups": conv_case(
        2, (4, 4, 6, 6), (6, 2, 3, 3), (6,), (4, 6, 3, 3), stride=2, groups=2, alpha=-2.0),
    "conv2d_channels_last": conv_case(
        2, (4, 3, 5, 5), (4, 3, 3, 3), (4,), (4, 4, 5, 5), channels_last=True),
    "conv1d_unbatched": conv_case(1, (4, 7), (5, 4, 3), (5,), (5, 7)),
    "conv3d": conv_case(3, (4, 2, 3, 4, 3), (3, 2, 2, 2, 2), (3,), (3, 1, 1, 1), padding=0),
    "linear": linear_case((4, 5), (3, 5), (3,), (4, 3)),
    "linear_per_feature_other": linear_case((4, 5), (3, 5), (3,), (3,), alpha=0.5),
    "linear_no_bias_3d": linear_case((4, 2, 5), (3, 5), None, (4, 2, 3)),
    "linear_other_adds_dims": linear_case((4, 5), (3, 5), (3,), (2, 4, 3), alpha=-1.5),
    "bn_train_silu": bn_case((4, 3, 2, 3), True, True, (3, 1, 1)),
    "bn_eval_silu": bn_case((4, 3, 2, 3), False, True, (4, 3, 2, 3)),
    "bn_eval_product": bn_case((4, 3, 5), False, False, (1,)),
    "bn_train_product": bn_case((4, 3, 5), True, False, (4, 3, 5)),
}
RELU_CASES = [name for name in CASES if not name.startswith("bn")]
# NB: eager's third order through a training-mode batch_norm is not the
# derivative: batchnorm_double_backward reads the forward's saved batch
# statistics, native_batch_norm's non-differentiable outputs, as constants
# (eager fails gradgradcheck of its gradient).  The fused op recomputes them
# from the input; its third order is checked against finite differences.
EAGER_THIRD_ORDER_WRONG = {"bn_train_silu", "bn_train_product"}


# ------------------------------------------------------------ the harness


def leaves(sizes, device):
    return [None if s is None else signed(*s, device=device) for s in sizes]


def gradients(outputs, wrt, create_graph):
    """torch.autograd.grad of the sum of `outputs` w.r.t. the tensors of
    `wrt` (None where absent), None where unused; () where the sum does not
    require grad."""
    total = sum(outputs)
    if not torch.is_tensor(total) or not total.requires_grad:
        return None
    present = [t for t in wrt if t is not None]
    got = iter(torch.autograd.grad(total, present, allow_unused=True, create_graph=create_graph))
    return [None if t is None else next(got) for t in wrt]


def orders(op, args, nonfinite, loss, penalty_on, weights):
    """out = op(x', w, b, o) with x' = nonfinite_rows(x) or x; first order:
    g = d loss(out) / d(x, w, b, o) with create_graph; second order: the
    gradients of sum(g_k . r_k) over penalty_on; third order: of the second
    order's gradients dotted with s.  Returns the three lists (each None
    where its sum needs no graph)."""
    x, w, b, o = args
    xin = nonfinite_rows(x) if nonfinite else x
    out = op(xin, w, b, o)
    c, r, s = weights
    # linear: out's gradient is a constant (the second order's gradient of
    # out is then undefined: only relu's zero reaches the op); square:
    # it depends on out.
    value = (out * c).sum() if loss == "linear" else (out * out * c).sum()
    first = gradients([value], args, create_graph=True)
    picked = [(g * rk).sum() for k, (g, rk) in enumerate(zip(first, r))
              if g is not None and "xwbo"[k] in penalty_on]
    second = gradients(picked, args, create_graph=True)
    third = None
    if second is not None:
        third = gradients(
            [(g * sk).sum() for g, sk in zip(second, s) if g is not None and g.requires_grad],
            args, create_graph=False)
    return first, second, third


def assert_same(got, want, what):
    if want is None or got is None:
        assert got is None and want is None, f"{what}: fused {got is None}, eager {want is None}"
        return
    for name, a, e in zip("xwbo", got, want):
        if e is None or a is None:
            assert a is None and e is None, f"{what} d/d{name}: fused {a}, eager {e}"
            continue
        torch.testing.assert_close(
            a, e, rtol=1e-10, atol=1e-10, equal_nan=True, msg=lambda m: f"{what} d/d{name}: {m}")


def check(name, device, nonfinite, loss, penalty_on):
    fused, eager, sizes = CASES[name]
    torch.manual_seed(20261142)
    args = leaves(sizes, device)
    out_shape = eager(*[a.detach() if a is not None else None for a in args]).shape
    c = signed(*out_shape, device=device, grad=False)
    r = [None if a is None else signed(*a.shape, device=device, grad=False) for a in args]
    s = [None if a is None else signed(*a.shape, device=device, grad=False) for a in args]
    want = orders(eager, args, nonfinite, loss, penalty_on, (c, r, s))
    got = orders(fused, args, nonfinite, loss, penalty_on, (c, r, s))
    for order, a, e in zip(("first", "second", "third"), got, want):
        if order == "third" and name in EAGER_THIRD_ORDER_WRONG:
            continue
        assert_same(a, e, f"{name} {order} order")
    return want


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("loss", ["linear", "square"])
@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "div0"])
def test_double_backward_matches_eager(name, device, loss, nonfinite):
    """Penalties on each first-order gradient alone and on all together."""
    for penalty_on in ("x", "w", "b", "o", "xwbo"):
        check(name, device, nonfinite, loss, penalty_on)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", RELU_CASES)
def test_weight_penalty_reaches_weight_and_bias_as_eager(name, device):
    """The issue's case: a penalty on d out / d w, whose gradient w.r.t. w
    (and b) comes only through relu's zero gradient when the loss is linear
    in out: eager's is 0 (NaN behind x / 0), the fused op's was None."""
    for nonfinite in (False, True):
        _, second, _ = check(name, device, nonfinite, "linear", "w")
        dw = second[1]
        assert dw is not None
        if nonfinite:
            assert dw.isnan().any()
        else:
            assert (dw == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in RELU_CASES if n.startswith("conv")])
def test_conv_zero_gradient_does_not_reach_other(name, device):
    """In relu(conv(...)) + o relu's zero gradient flows into the conv, not
    into o: o stays unused (None), as in eager."""
    _, second, _ = check(name, device, True, "linear", "xwb")
    assert second[3] is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", [n for n in RELU_CASES if n.startswith("linear")])
def test_linear_zero_gradient_reaches_other(name, device):
    """In relu(linear(...) + o) relu's zero gradient flows through the add
    into o too: 0, as in eager."""
    _, second, _ = check(name, device, False, "linear", "xwb")
    assert second[3] is not None and (second[3] == 0).all()


def test_conv_keeps_no_reference_to_relu_result_or_output():
    """The empty second output carries the zero gradient: neither the output
    nor a relu result is kept alive by the node (eager's relu keeps its
    result), and the saved mask stays 1 bit an element."""
    from torch.multiprocessing.reductions import StorageWeakRef

    torch.manual_seed(0)
    x, w = signed(2, 3, 8, 8), signed(4, 3, 3, 3)
    o = signed(2, 4, 8, 8)
    y = ops.custom_conv_relu_add(x, w, None, [1, 1], [1, 1], [1, 1], 1, o, 1)
    storage = StorageWeakRef(y.untyped_storage())
    node = y.grad_fn
    del y
    assert storage.expired()
    del node


@pytest.mark.parametrize("name", RELU_CASES)
def test_plain_backward_unchanged(name):
    """Without create_graph the gradients are eager's (the fast kernels)."""
    fused, eager, sizes = CASES[name]
    torch.manual_seed(1)
    args = leaves(sizes, "cpu")
    present = [a for a in args if a is not None]
    c = signed(*eager(*args).shape, grad=False)
    want = torch.autograd.grad((eager(*args) * c).sum(), present)
    got = torch.autograd.grad((fused(*args) * c).sum(), present)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["conv2d_channel_other", "conv2d_other_adds_dims", "linear"])
def test_gradgradcheck(name):
    fused, _, sizes = CASES[name]
    torch.manual_seed(2)
    args = leaves(sizes, "cpu")
    present = [i for i, a in enumerate(args) if a is not None]

    def fn(*ts):
        full = list(args)
        for i, t in zip(present, ts):
            full[i] = t
        return fused(*full)

    assert torch.autograd.gradgradcheck(
        fn, tuple(args[i] for i in present), eps=1e-6, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(EAGER_THIRD_ORDER_WRONG))
def test_bn_train_third_order_matches_finite_differences(name):
    """gradgradcheck of the (create_graph) gradient: the third order of the
    training-mode op is the derivative, where eager's is not."""
    fused, _, sizes = CASES[name]
    torch.manual_seed(3)
    args = leaves(sizes, "cpu")
    c = signed(*sizes[0], grad=False)

    def gradient(*ts):
        return torch.autograd.grad((fused(*ts) * c).sum(), ts, create_graph=True)

    assert torch.autograd.gradgradcheck(gradient, tuple(args), eps=1e-6, atol=1e-5, rtol=1e-4)
