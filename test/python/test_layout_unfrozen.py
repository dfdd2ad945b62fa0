"""The channels-last layout of unfrozen graphs (ConvertToChannelsLastUnfrozen):
torchfuse.optimize(m, layout=...) without freeze, in training and eval.

The weights are module attributes there: the region's first convolution
reads its weight through custom_channels_last_weight, which converts it on
each call where the input and every region weight suggest NCHW, and the
values leaving the region go through custom_restore_layout(v, weight,
converted).  Training steps (SGD with momentum) match eager: outputs,
parameter gradients and their strides, running statistics and
num_batches_tracked; outputs keep the original's strides for every input
layout.  layout="channels_last" converts on every call; "auto" inserts the
op for CUDA weights where the cost model says so, and on CUDA each call
site's measured choice decides (docs/passes.md)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse
from cuda_utils import floor_for, rel_err
from test_layout import SmallCnn, inputs, randomize_bn

torchvision = pytest.importorskip("torchvision")

ENTRY = "torchfuse::custom_channels_last_weight"
RESTORE = "torchfuse::custom_restore_layout"


def same_layout(a, b) -> bool:
    return a.shape == b.shape and all(
        sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n > 1)


def entry_count(m) -> int:
    return str(m.graph).count(ENTRY)


def unfrozen(model, layout="channels_last"):
    return torchfuse.optimize(torch.jit.script(model), layout=layout)


def train_steps(model, step_fn, x, steps=3, seed=0):
    """`steps` SGD steps of step_fn (model or its optimized module) on x,
    with signed random output gradients; returns the last outputs and the
    gradients of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # the model's own draws (stochastic depth) alike in both runs
    outs, grads = None, []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        y = step_fn(x)
        y.backward(torch.randn(y.shape, generator=g, dtype=y.dtype).to(y.device))
        grads.append([p.grad.clone() for p in model.parameters()])
        assert all(p.grad.stride() == q.stride() for p, q in zip(model.parameters(), grads[-1]))
        opt.step()
        outs = y.detach()
    return outs, grads


def assert_close_to_max(got, want, tol=1e-8, floor=0.0, what=""):
    """float64 rounding: |got - want| within tol of want's largest magnitude,
    or of `floor` where that is larger (gradients that are 0 up to rounding,
    as a convolution bias before a training BatchNorm).  A layout mistake
    moves values by their own size."""
    scale = max(want.double().abs().max().item(), floor)
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * scale + 1e-300, (what, err, scale)


def assert_same_training(model, x, steps=3):
    """Trains a copy through the optimized module and the model in eager,
    both in float64: they agree up to rounding at every step."""
    model = model.double().train()
    mine = copy.deepcopy(model)
    opt = unfrozen(mine)
    assert entry_count(opt) == 1 and RESTORE in str(opt.graph)
    x = x.double()
    want, want_grads = train_steps(model, model, x, steps)
    got, got_grads = train_steps(mine, opt, x, steps)
    assert got.stride() == want.stride()
    assert_close_to_max(got, want, what="output")
    for step, (gs, ws) in enumerate(zip(got_grads, want_grads)):
        largest = max(w.abs().max().item() for w in ws)
        for g, w in zip(gs, ws):
            assert g.stride() == w.stride()
            # NB: 1e-6: BatchNorm's division by small batch variances
            # amplifies float64 rounding (regnet: 2e-8 of the largest)
            assert_close_to_max(g, w, tol=1e-6, floor=1e-3 * largest, what=f"gradient, step {step}")
    for (name, b), (_, c) in zip(mine.named_buffers(), model.named_buffers()):
        if b.is_floating_point():  # running statistics (a mean may be 0 up to rounding)
            assert_close_to_max(b, c, floor=1e-3, what=name)
        else:  # num_batches_tracked
            assert torch.equal(b, c), name
    for p, q in zip(mine.parameters(), model.parameters()):
        assert_close_to_max(p, q, tol=1e-6, floor=1e-3, what="parameter")


@pytest.mark.parametrize("name,kwargs", [
    ("resnet18", {}),
    ("mobilenet_v3_small", {"dropout": 0.0}),  # residuals under `if self.use_res_connect`
    ("regnet_y_400mf", {}),  # squeeze-excitation gates
    ("vgg11_bn", {"dropout": 0.0}),
    # stochastic depth (p = 0.2): `if not training or p == 0: input else:
    # input * noise`, its noise a side computation of the branch
    ("efficientnet_b0", {"dropout": 0.0}),
])
def test_torchvision_training_steps_match_eager(name, kwargs):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None, **kwargs)
    assert_same_training(model, torch.randn(2, 3, 64, 64))


def test_in_place_dropout_after_the_region():
    """mobilenet_v3's classifier runs Dropout(p=0.2, inplace=True) on the
    flattened pool, the region's exit: the pool's one reader is the restore
    op, so the write reaches only the restore's result (as in the original
    only the pool's)."""
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v3_small(weights=None)
    assert "dropout_" in str(torch.jit.script(model).inlined_graph)
    assert_same_training(model, torch.randn(2, 3, 64, 64))


def test_small_cnn_training_steps_match_eager():
    torch.manual_seed(0)
    assert_same_training(randomize_bn(SmallCnn()), torch.randn(2, 3, 16, 16))


def test_float32_training_within_twice_eagers_error():
    """float32 against a float64 run of the same step: the error of the
    optimized module is at most 2x eager's (plus float32's resolution).
    Eager here is the worse of NCHW and channels-last: the CPU's NHWC
    convolutions (oneDNN) round differently, and the forced region runs
    them (measured: layer4's weight gradient 2.9x NCHW eager's error, equal
    to channels-last eager's)."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).train()
    mine = copy.deepcopy(model)
    nhwc = copy.deepcopy(model).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model).double()
    opt = unfrozen(mine)
    assert entry_count(opt) == 1
    x = torch.randn(2, 3, 64, 64)
    gy = torch.randn(2, 1000)

    def step(m, fn, dtype):
        y = fn(x.to(dtype))
        y.backward(gy.to(dtype))
        return [y.detach()] + [p.grad for p in m.parameters()]

    ref = step(reference, reference, torch.float64)
    eager = step(model, model, torch.float32)
    eager_nhwc = step(nhwc, nhwc, torch.float32)
    got = step(mine, opt, torch.float32)
    floor = floor_for(torch.float32)
    for r, e, n, g in zip(ref, eager, eager_nhwc, got):
        e_err = max(rel_err(t, r) for t in (e, n))
        g_err = rel_err(g, r)
        assert g_err <= 2 * e_err + floor, (g_err, e_err)


@pytest.mark.parametrize("kind", ["nchw", "channels_last", "batch1", "batch1_channels_last",
                                  "sliced", "transposed"])
@pytest.mark.parametrize("training", [True, False])
def test_outputs_keep_the_originals_strides(kind, training):
    model = randomize_bn(SmallCnn()).train(training)
    original = torch.jit.script(copy.deepcopy(model))
    opt = unfrozen(model)
    x = inputs(3)[kind]
    want, got = original(x), opt(x)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_channels_last_weights_run_as_the_original():
    """A model whose weights the user made channels-last: the original's
    convolutions run channels-last from the first, so the op leaves the
    weight alone and the restore op keeps what the region computed."""
    model = randomize_bn(SmallCnn()).eval().to(memory_format=torch.channels_last)
    original = torch.jit.script(copy.deepcopy(model))
    opt = unfrozen(model)
    assert entry_count(opt) == 1
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want, got = original(x), opt(x)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want)


def test_auto_leaves_cpu_graphs_and_keep_every_graph_alone():
    """auto's cost model is cuDNN's: CPU weights keep NCHW."""
    model = SmallCnn().train()
    assert entry_count(unfrozen(model, "auto")) == 0
    assert entry_count(unfrozen(model, "keep")) == 0


# ---- the rules that leave a graph unchanged (negative forms) ---------------


class AssignsAnAttribute(nn.Module):
    """weightLayoutsFixed: an attribute assigned in forward."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.c2(F.relu(self.c1(x)))


class RestridesAWeight(nn.Module):
    """weightLayoutsFixed: an in-place op that changes a tensor's strides."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3)

    def forward(self, x):
        y = self.c2(F.relu(self.c1(x)))
        self.c2.weight.data.transpose_(2, 3)
        return y


class UnknownOpInABranch(nn.Module):
    """admitIf: a branch computes its result with an op the region does not
    admit, so the next convolution reads a second entry."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3)
        self.flip = True

    def forward(self, x):
        y = F.relu(self.c1(x))
        if self.flip:
            y = torch.flip(y, [3])
        else:
            y = y + 1
        return self.c2(y)


class NoiseReadsTheRegion(UnknownOpInABranch):
    """sideComputation: a branch's noise made from a region value's data
    (empty_like reads its strides), not only its sizes."""

    def forward(self, x):
        y = F.relu(self.c1(x))
        if self.flip:
            y = y * torch.empty_like(y).bernoulli_(0.8)
        return self.c2(y)


class ChannelsLastNoise(UnknownOpInABranch):
    """sideComputation: a branch's fresh tensor in a memory format of its
    own, which would steer the product's layout."""

    def forward(self, x):
        y = F.relu(self.c1(x))
        if self.flip:
            noise = torch.empty(y.shape, dtype=y.dtype, memory_format=torch.channels_last)
            y = y * noise.bernoulli_(0.8)
        return self.c2(y)


class RegionReadsAfterAWrite(nn.Module):
    """exitPoints: a value leaves the region, is written through the exit
    (a view's in-place op), and a region convolution reads it afterwards:
    in the original it reads the written values."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 8, 3)

    def forward(self, x):
        y = F.relu(self.c1(x))
        flat = torch.flatten(y, 1)
        flat.mul_(2)
        return self.c2(y), flat


class ComputedWeight(nn.Module):
    """weightTensor: a weight that is not a module attribute read."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 3, 3, 3))

    def forward(self, x):
        return F.relu(F.conv2d(x, self.w * 2))


@pytest.mark.parametrize("cls", [AssignsAnAttribute, RestridesAWeight, UnknownOpInABranch, NoiseReadsTheRegion,
                                 ChannelsLastNoise, RegionReadsAfterAWrite, ComputedWeight])
def test_graphs_the_pass_leaves_alone(cls):
    torch.manual_seed(0)
    model = cls().train()
    opt = unfrozen(copy.deepcopy(model))
    assert entry_count(opt) == 0 and RESTORE not in str(opt.graph)
    x = torch.randn(2, 3, 12, 12)
    torch.manual_seed(1)  # the noise branches' draws alike
    got = opt(x)
    torch.manual_seed(1)
    torch.testing.assert_close(got, model(x))


def test_admitted_branches_convert():
    """The positive form of UnknownOpInABranch: both branches admitted."""

    class Branches(UnknownOpInABranch):
        def forward(self, x):
            y = F.relu(self.c1(x))
            if self.flip:
                y = y * 2
            else:
                y = y + 1
            return self.c2(y)

    torch.manual_seed(0)
    model = Branches().train()
    opt = unfrozen(copy.deepcopy(model))
    assert entry_count(opt) == 1
    x = torch.randn(2, 3, 12, 12)
    want, got = model(x), opt(x)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want)


# ---- the op -----------------------------------------------------------------


def test_channels_last_weight_op_semantics():
    op = torch.ops.torchfuse.custom_channels_last_weight
    w = torch.randn(8, 4, 3, 3)
    other = torch.randn(8, 8, 3, 3)
    x = torch.randn(2, 4, 9, 9)
    cl = torch.channels_last
    out = op(w, x, [w, other], True)
    assert out.is_contiguous(memory_format=cl) and torch.equal(out, w)
    # each condition that keeps the weight as it is
    assert op(w, x, [w, other], False) is w  # not CUDA
    assert op(w, x.contiguous(memory_format=cl), [w, other], True) is w  # input already NHWC
    assert op(w, x, [w, other.contiguous(memory_format=cl)], True) is w  # a weight NHWC
    assert op(w, x[0], [w], True).is_contiguous(memory_format=cl)  # unbatched input: converts
    flat = torch.randn(8, 1, 1, 1)  # channels-last strides do not suggest channels-last
    assert op(flat, x, [flat], True) is flat
    # the restore op reads the decision back
    restore = torch.ops.torchfuse.custom_restore_layout
    v = torch.randn(2, 8, 5, 5).contiguous(memory_format=cl)
    assert restore(v, w, out).stride() == torch.empty(v.shape).stride()
    assert restore(v, w, w) is v
    with pytest.raises(RuntimeError, match="custom_channels_last_weight.*weight"):
        op(None, x, [w], True)
    # measured: CPU calls are never measured and keep the weight
    before = len(torchfuse.measured_layouts())
    assert op(w, x, [w, other], True, True) is w
    assert op(w, x, [w, other], False, True) is w
    assert len(torchfuse.measured_layouts()) == before


def test_channels_last_weight_op_opcheck_and_autograd():
    op = torch.ops.torchfuse.custom_channels_last_weight
    x = torch.randn(2, 4, 9, 9, dtype=torch.float64)
    w = torch.randn(8, 4, 3, 3, dtype=torch.float64)
    for any_device in (True, False):
        torch.library.opcheck(op, (w, x, [w], any_device))
    torch.library.opcheck(op, (w, x, [w], False, True))
    meta = op(w.to("meta"), x.to("meta"), [w.to("meta")], True)
    assert meta.stride() == op(w, x, [w], True).stride()
    w = w.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: op(t, x, [t], True), (w,))
    assert torch.autograd.gradgradcheck(lambda t: op(t, x, [t], True) ** 2, (w,))


# ---- CUDA: the cost model's decision ------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_trains_resnet18_channels_last(dtype):
    """A training step (fp32, and bf16 autocast) with the region channels-
    last: outputs and gradients are within 2x eager's error against
    float64, in eager's dtypes and strides."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).cuda().train()
    mine = copy.deepcopy(model)
    nhwc = copy.deepcopy(model).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model).double()
    opt = unfrozen(mine)
    assert entry_count(opt) == 1
    x = torch.randn(8, 3, 64, 64, device="cuda")
    gy = torch.randn(8, 1000, device="cuda")

    def step(m, fn, autocast):
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            y = fn(x.double() if m is reference else x)
        y.backward(gy.to(y.dtype))
        return [y.detach()] + [p.grad for p in m.parameters()]

    ref = step(reference, reference, False)
    autocast = dtype != torch.float32
    eager = step(model, model, autocast)
    eager_nhwc = step(nhwc, nhwc, autocast)
    got = step(mine, opt, autocast)
    floor = floor_for(dtype)
    for r, e, g in zip(ref, eager, got):
        # NB: the layout contract of gradients: strides equal where a dim
        # has more than one element (a 1x1 weight's gradient may come back
        # with channels-last strides there, which AccumulateGrad keeps)
        assert g.dtype == e.dtype and same_layout(g, e)
        e_err, g_err = rel_err(e, r), rel_err(g, r)
        assert g_err <= 2 * e_err + floor, (g_err, e_err)
    # running statistics: the same rule against the worse of eager NCHW and
    # eager channels-last.  A batch mean is a sum that cancels, so the TF32
    # and 16-bit rounding of the convolution before it, which differs with
    # cuDNN's NHWC algorithms, is a larger part of it (measured: layer2's
    # downsample mean 4.3x NCHW eager's error in float32).
    for (name, r), e, n, g in zip(reference.named_buffers(), model.buffers(), nhwc.buffers(),
                                  mine.buffers()):
        if not r.is_floating_point():
            assert torch.equal(g, e), name  # num_batches_tracked
            continue
        e_err = max(rel_err(t, r) for t in (e, n))
        g_err = rel_err(g, r)
        assert g_err <= 2 * e_err + floor, (name, g_err, e_err)


# ---- CUDA: the measured choice of layout="auto" -------------------------------


def measured_site(sizes, grad):
    sites = [s for s in torchfuse.measured_layouts() if s["input_sizes"] == list(sizes) and s["grad"] == grad]
    return sites[-1] if sites else None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_auto_measures_each_site_and_every_call_matches_eager():
    """layout="auto" on CUDA weights: the entry op is measured; its trial's
    calls alternate the layouts, and every call (before, during and after
    the decision) gives eager's outputs and gradients under the float64
    rule, in eager's strides.  Training calls and no_grad calls are
    separate sites, each decided after the protocol's calls."""
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).cuda().train()
    mine = copy.deepcopy(model)
    nhwc = copy.deepcopy(model).to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model).double()
    opt = unfrozen(mine, "auto")
    assert entry_count(opt) == 1
    entry = next(n for n in opt.graph.findAllNodes(ENTRY))
    assert [i.toIValue() for i in list(entry.inputs())[3:]] == [False, True]  # CUDA only, measured
    x = torch.randn(4, 3, 48, 48, device="cuda")
    gy = torch.randn(4, 1000, device="cuda")

    def step(m, fn):
        for p in m.parameters():
            p.grad = None
        y = fn(x.double() if m is reference else x)
        y.backward(gy.to(y.dtype))
        return [y.detach()] + [p.grad for p in m.parameters()]

    ref = step(reference, reference)
    eager = step(model, model)
    # NB: eager's error in either layout (cuDNN's NHWC algorithms round
    # differently under TF32), as for the running statistics above
    eager_err = [max(rel_err(e, r), rel_err(n, r)) for r, e, n in zip(ref, eager, step(nhwc, nhwc))]
    floor = floor_for(torch.float32)
    calls = 32  # past the protocol's 2 + 4 + 20 + 1 with the default profiling runs
    for k in range(calls):
        got = step(mine, opt)
        for i, (r, e, g) in enumerate(zip(ref, eager, got)):
            assert g.dtype == e.dtype and same_layout(g, e), (k, i, g.stride(), e.stride())
            assert rel_err(g, r) <= 2 * eager_err[i] + floor, (k, i, rel_err(g, r), eager_err[i])
    site = measured_site(x.shape, True)
    assert site is not None and site["calls"] == calls and site["dtype"] == "Float"
    assert site["autocast"] is None
    assert site["channels_last"] in (True, False)
    assert site["nchw_ms"] > 0 and site["channels_last_ms"] > 0
    # inference calls: a site of their own
    with torch.no_grad():
        want = model(x)
        for k in range(calls):
            y = opt(x)
            assert same_layout(y, want), k
            assert rel_err(y, ref[0]) <= 2 * eager_err[0] + floor, (k, rel_err(y, ref[0]), eager_err[0])
    site = measured_site(x.shape, False)
    assert site is not None and site["channels_last"] in (True, False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_auto_keeps_nchw_under_deterministic_algorithms():
    """A timed choice differs from run to run: with deterministic
    algorithms asked for, auto runs the original's layout and measures
    nothing."""
    torch.manual_seed(1)
    model = SmallCnn().cuda().train()
    opt = unfrozen(model, "auto")
    assert entry_count(opt) == 1  # its convolutions are small: channels-last by the cost model
    x = torch.randn(3, 3, 20, 20, device="cuda")
    before = len(torchfuse.measured_layouts())
    with torch.no_grad():
        want = model(x)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(opt(x), want)
    finally:
        torch.use_deterministic_algorithms(was)
    assert len(torchfuse.measured_layouts()) == before
