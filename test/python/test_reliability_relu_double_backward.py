"""custom_relu's double backward is eager's, non-finite values included.

Eager's relu saves its result, and threshold_backward's double backward
gives that result an explicit zero gradient, which flows back through relu
into the input's graph: behind `x / 0` it meets the division's backward,
where 0 / 0 is NaN.  custom_relu's Autograd kernel saves a 1-bit mask; an
empty second output of its node carries that zero gradient instead (fuzz
seed 20261124, program 3292: a gradient penalty's gradient was 0 where
eager's is NaN).
"""

import pytest
import torch

import torchfuse  # noqa: F401  (registers the ops)

ops = torch.ops.torchfuse
F64 = torch.float64


def signed(*sizes, dtype=F64, device="cpu"):
    """Standard-normal values pushed away from zero (never 0, both signs)."""
    t = torch.randn(sizes, dtype=F64)
    t = torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)
    return t.to(device=device, dtype=dtype).requires_grad_(True)


def penalty_gradients(relu, x, w, c, r):
    """y = relu(num / 0) with num = [x * w; x*w - x*w] (+-inf and NaN);
    g = dy/dx with create_graph; returns g and d(g . r)/d(x, w)."""
    num = x * w
    y = relu(torch.cat([num, num - num]) / 0)
    (g,) = torch.autograd.grad((y * c).sum(), x, create_graph=True)
    return (g,) + torch.autograd.grad((g * r).sum(), (x, w))


def third_order(relu, x, w, c, r):
    """The gradient of d(g . r)/dw . r[0] w.r.t. x, g as above."""
    num = x * w
    y = relu(torch.cat([num, num - num]) / 0)
    (g,) = torch.autograd.grad((y * c).sum(), x, create_graph=True)
    (gw,) = torch.autograd.grad((g * r).sum(), w, create_graph=True)
    return torch.autograd.grad((gw * r[0]).sum(), x)


def inputs(dtype, device):
    torch.manual_seed(3292)
    x, w = signed(3, 5, dtype=dtype, device=device), signed(5, dtype=dtype, device=device)
    c = signed(6, 5, dtype=dtype, device=device).detach()
    r = signed(3, 5, dtype=dtype, device=device).detach()
    return x, w, c, r


def assert_same(got, want):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def check_matches_eager(dtype, device):
    x, w, c, r = inputs(dtype, device)
    want = penalty_gradients(torch.relu, x, w, c, r)
    got = penalty_gradients(ops.custom_relu, x, w, c, r)
    # NB: eager's second-order gradients are NaN (0 / 0 in the division's
    # backward); without the zero gradient to relu's result they are 0.
    assert want[1].isnan().all() and want[2].isnan().all()
    assert_same(got, want)
    assert_same(third_order(ops.custom_relu, x, w, c, r), third_order(torch.relu, x, w, c, r))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_relu_double_backward_through_division_by_zero_matches_eager(dtype):
    check_matches_eager(dtype, "cpu")


def test_relu_double_backward_of_finite_inputs_matches_eager():
    """Away from the non-finite values the zero gradient changes nothing:
    gradients of a penalty through relu(x * w) are eager's."""
    x, w, c, r = inputs(F64, "cpu")
    got, want = [], []
    for relu, out in ((ops.custom_relu, got), (torch.relu, want)):
        y = relu(x * w) * c[:3]
        (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        out.extend((g,) + torch.autograd.grad((g * r).sum(), (x, w)))
    assert_same(got, want)


def test_relu_keeps_no_reference_to_its_output():
    """The saved mask and the empty second output do not keep the output's
    storage alive, as eager's saved result does: once the caller drops the
    output, its memory is free while the graph lives."""
    from torch.multiprocessing.reductions import StorageWeakRef

    x = signed(64, 64)
    for relu, kept in ((ops.custom_relu, False), (torch.relu, True)):
        y = relu(x * 2)
        storage = StorageWeakRef(y.untyped_storage())
        node = y.grad_fn
        del y
        assert storage.expired() != kept, relu
        del node


def test_relu_gradient_after_an_in_place_write_to_its_output():
    """The backward reads the mask, not the output: a later in-place write
    to the output (where eager's relu raises "modified by an inplace
    operation") gives the chain rule's gradient, in both backwards."""
    x = signed(4, 5)
    y = ops.custom_relu(x)
    y.mul_(3)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    torch.testing.assert_close(g, 3.0 * (x > 0).to(F64), rtol=0, atol=0)
    (gg,) = torch.autograd.grad((g * g).sum(), x, allow_unused=True, materialize_grads=True)
    torch.testing.assert_close(gg, torch.zeros_like(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z = torch.relu(x)
        z.mul_(3)
        z.sum().backward()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_relu_double_backward_through_division_by_zero_matches_eager_cuda(dtype):
    check_matches_eager(dtype, "cuda")
