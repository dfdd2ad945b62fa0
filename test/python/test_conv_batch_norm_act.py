"""FuseConvBatchNormAct and custom_conv_batch_norm_act: conv -> batch_norm ->
[activation] of unfrozen graphs, where BatchNorm reads its statistics,
affine parameters and `training` flag at run time.  In eval the op applies
BatchNorm per call (on CUDA in the conv's epilogue, elsewhere folded into
the conv's weight and bias).  In training it runs the original ops, but
for a 16-bit NCHW batch_norm -> silu (planes of 512 or more elements) on
CUDA, which runs custom_batch_norm_add_div_swish's kernels.  Outputs,
gradients, double gradients, running statistics and num_batches_tracked
stay the original's.  Each rule that keeps a chain has a negative test
here."""

import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse

from cuda_utils import assert_close_to_reference, floor_for, poison_allocator

OP = torch.ops.torchfuse.custom_conv_batch_norm_act


def signed(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def bn_state(c, seed, dtype=torch.float32, affine=True):
    g = torch.Generator().manual_seed(seed)
    gamma = torch.randn(c, generator=g, dtype=dtype) if affine else None
    beta = torch.randn(c, generator=g, dtype=dtype) if affine else None
    mean = torch.randn(c, generator=g, dtype=dtype)
    var = torch.rand(c, generator=g, dtype=dtype) + 0.5
    return gamma, beta, mean, var


# The op's activations as ATen's, with their activation_args.
ACTIVATIONS = {
    "none": (lambda t: t, []),
    "relu": (F.relu, []),
    "hardswish": (F.hardswish, []),
    "silu": (F.silu, []),
    "hardtanh": (lambda t: F.hardtanh(t, 0.0, 6.0), [0.0, 6.0]),
    "hardsigmoid": (F.hardsigmoid, []),
    "sigmoid": (torch.sigmoid, []),
    "gelu": (F.gelu, []),
    "gelu_tanh": (lambda t: F.gelu(t, approximate="tanh"), []),
    "leaky_relu": (lambda t: F.leaky_relu(t, 0.1), [0.1]),
}


def reference(x, w, b, stride, padding, dilation, groups, gamma, beta, mean, var, training, momentum, eps, act):
    conv = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}[w.dim()]
    y = conv(x, w, b, stride, padding, dilation, groups)
    y = F.batch_norm(y, mean, var, gamma, beta, training, momentum, eps)
    return ACTIVATIONS[act][0](y)


CASES = [  # (input shape, weight shape, stride, padding, dilation, groups)
    ((2, 4, 9), (6, 4, 3), [1], [1], [1], 1),
    ((2, 4, 7, 6), (6, 2, 3, 3), [2, 1], [1, 0], [1, 2], 2),
    ((2, 4, 5, 5), (4, 1, 3, 3), [1, 1], [1, 1], [1, 1], 4),  # depthwise
    ((1, 3, 4, 5, 4), (5, 3, 1, 3, 1), [1, 1, 1], [0, 1, 0], [1, 1, 1], 1),
    # 16 channels of 8x8: a vector of the CUDA epilogue is one channel (nchw)
    # or 4 or 8 consecutive ones (channels-last), its operands read as vectors
    ((2, 8, 8, 8), (16, 8, 3, 3), [1, 1], [1, 1], [1, 1], 1),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_eval_folds_as_batch_norm_computes(case, act, bias, affine):
    xs, ws, stride, padding, dilation, groups = case
    x = signed(*xs, seed=1, dtype=torch.float64)
    w = signed(*ws, seed=2, dtype=torch.float64)
    b = signed(ws[0], seed=3, dtype=torch.float64) if bias else None
    gamma, beta, mean, var = bn_state(ws[0], 4, torch.float64, affine)
    got = OP(x, w, b, stride, padding, dilation, groups, gamma, beta, mean, var, False, 0.1, 1e-5, True, act,
             ACTIVATIONS[act][1])
    want = reference(x, w, b, stride, padding, dilation, groups, gamma, beta, mean, var, False, 0.1, 1e-5, act)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.1, 0.0])
def test_training_runs_the_original_ops_and_updates_the_statistics(momentum):
    x, w, b = signed(3, 4, 6, 6, seed=1), signed(5, 4, 3, 3, seed=2), signed(5, seed=3)
    gamma, beta, mean, var = bn_state(5, 4)
    mean2, var2 = mean.clone(), var.clone()
    got = OP(x, w, b, [1, 1], [1, 1], [1, 1], 1, gamma, beta, mean, var, True, momentum, 1e-5, True, "relu", [])
    want = reference(x, w, b, [1, 1], [1, 1], [1, 1], 1, gamma, beta, mean2, var2, True, momentum, 1e-5, "relu")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(mean, mean2, rtol=0, atol=0)
    torch.testing.assert_close(var, var2, rtol=0, atol=0)


def test_no_running_statistics_in_eval_raise_as_batch_norm():
    x, w = signed(3, 4, 6, 6, seed=1), signed(5, 4, 3, 3, seed=2)
    with pytest.raises(RuntimeError, match="running_mean must be defined in evaluation mode"):
        OP(x, w, None, [1, 1], [0, 0], [1, 1], 1, None, None, None, None, False, 0.1, 1e-5, True, "none", [])


@pytest.mark.parametrize("training", [False, True])
def test_gradients_and_double_gradients(training):
    x = signed(2, 3, 5, 5, seed=1, dtype=torch.float64).requires_grad_()
    w = signed(4, 3, 3, 3, seed=2, dtype=torch.float64).requires_grad_()
    b = signed(4, seed=3, dtype=torch.float64).requires_grad_()
    gamma, beta, mean, var = bn_state(4, 4, torch.float64)
    gamma.requires_grad_()
    beta.requires_grad_()

    def f(x, w, b, gamma, beta):
        return OP(x, w, b, [1, 1], [1, 1], [1, 1], 1, gamma, beta, mean.clone(), var.clone(), training, 0.0, 1e-5,
                  True, "silu", [])

    assert torch.autograd.gradcheck(f, (x, w, b, gamma, beta))
    assert torch.autograd.gradgradcheck(f, (x, w, b, gamma, beta))


@pytest.mark.parametrize("training", [False, True])
def test_opcheck(training):
    """Schema, autograd registration, fake tensors and AOT dispatch (dynamic
    shapes included), in eval and in training, where the running statistics
    are updated."""
    x, w, b = signed(2, 4, 6, 6, seed=1), signed(6, 4, 3, 3, seed=2), signed(6, seed=3)
    gamma, beta, mean, var = bn_state(6, 4)
    for t in (x, w, b, gamma, beta):
        t.requires_grad_()
    torch.library.opcheck(OP, (x, w, b, [1, 1], [1, 1], [1, 1], 1, gamma, beta, mean, var, training, 0.1, 1e-5, True,
                               "relu", []))


def _eval_args(xs, ws, seed=1):
    x, w, b = signed(*xs, seed=seed), signed(*ws, seed=seed + 1), signed(ws[0], seed=seed + 2)
    gamma, beta, mean, var = bn_state(ws[0], seed + 3)
    return [x, w, b, [1, 1], [0, 0], [1, 1], 1, gamma, beta, mean, var, False, 0.1, 1e-5, True, "relu", []]


def _calls(fn):
    with torch.autograd.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.function_events}


def test_cpu_fold_pays_only_where_the_weight_is_the_smaller():
    """Off CUDA the fold is a pass over the weight instead of BatchNorm's pass
    over the conv output: it runs where the weight has fewer elements, else
    the original ops, bit for bit."""
    big_output = _eval_args((4, 3, 16, 16), (8, 3, 1, 1))  # weight 24, output 8192
    big_weight = _eval_args((1, 64, 2, 2), (64, 64, 1, 1))  # weight 4096, output 256
    with torch.no_grad():
        assert "torchfuse::custom_conv_add_act" in _calls(lambda: OP(*big_output))
        calls = _calls(lambda: OP(*big_weight))
        assert "torchfuse::custom_conv_add_act" not in calls and "aten::batch_norm" in calls
        a = big_weight
        torch.testing.assert_close(OP(*a), reference(*a[:11], False, 0.1, 1e-5, "relu"), rtol=0, atol=0)


def test_recording_runs_the_original_ops_for_an_input_gradient():
    """Eval with only the input requiring grad (a saliency map): the original
    ops, so the input's gradient is the original's."""
    a = _eval_args((2, 3, 8, 8), (4, 3, 3, 3))
    x = a[0].clone().requires_grad_()
    got = OP(x, *a[1:])
    x2 = a[0].clone().requires_grad_()
    want = reference(x2, *a[1:11], False, 0.1, 1e-5, "relu")
    gy = signed(*got.shape, seed=9)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, x, gy)[0], torch.autograd.grad(want, x2, gy)[0],
                               rtol=0, atol=0)


def test_fake_cuda_tensors_take_the_original_ops():
    """Fake tensors (torch.compile, torch.export) have no data for a kernel:
    CUDA ones run the original ATen ops, without a device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.no_grad():
        a = [t.to("cuda") if isinstance(t, torch.Tensor) else t for t in _eval_args((2, 4, 6, 6), (6, 4, 3, 3))]
        y = OP(*a)
    assert y.device.type == "cuda" and y.shape == (2, 6, 4, 4)


def test_a_tracer_records_the_original_ops():
    """make_fx (a dispatch mode) records the original's ATen ops, not a
    kernel it cannot see."""
    from torch.fx.experimental.proxy_tensor import make_fx

    a = _eval_args((2, 3, 16, 16), (8, 3, 1, 1))  # the fold would run untraced
    with torch.no_grad():
        gm = make_fx(lambda x: OP(x, *a[1:]))(a[0])
        torch.testing.assert_close(gm(a[0]), OP(*a))
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("batch_norm" in t for t in targets), targets
    assert not any("torchfuse" in t for t in targets), targets


def test_unknown_activation_names_the_argument():
    x, w = signed(1, 2, 4, 4), signed(3, 2, 1, 1)
    gamma, beta, mean, var = bn_state(3, 1)
    with pytest.raises(RuntimeError, match="activation"):
        OP(x, w, None, [1, 1], [0, 0], [1, 1], 1, gamma, beta, mean, var, False, 0.1, 1e-5, True, "tanhh", [])


def test_autocast_keeps_the_original_dtype():
    x, w = signed(2, 3, 6, 6, seed=1), signed(4, 3, 3, 3, seed=2)
    gamma, beta, mean, var = bn_state(4, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = OP(x, w, None, [1, 1], [1, 1], [1, 1], 1, gamma, beta, mean, var, False, 0.1, 1e-5, True, "relu", [])
        want = reference(x, w, None, [1, 1], [1, 1], [1, 1], 1, gamma, beta, mean, var, False, 0.1, 1e-5, "relu")
    assert got.dtype == want.dtype


# ---- the pass ----------------------------------------------------------------------


class ConvBnAct(nn.Module):
    def __init__(self, act=None):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.act = act if act is not None else nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def _randomize_statistics(m):
    g = torch.Generator().manual_seed(7)
    for mod in m.modules():
        if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
            mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g))
            mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
    return m


def fused_count(module):
    return torchfuse.report(module)["conv_batch_norm_act"]


def test_scripted_eval_chain_fuses_and_keeps_its_outputs():
    torch.manual_seed(0)
    m = _randomize_statistics(ConvBnAct(nn.Hardswish())).eval()
    opt = torchfuse.optimize(torch.jit.script(m))
    assert fused_count(opt) == 1
    x = signed(2, 3, 8, 8, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), rtol=1e-5, atol=1e-6)


def _train_steps(model, x, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outs = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        out.square().mean().backward()
        opt.step()
        outs.append(out.detach().clone())
    return outs


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("affine", [True, False])
def test_training_steps_keep_outputs_gradients_and_statistics(momentum, affine):
    torch.manual_seed(0)
    m = ConvBnAct()
    m.bn = nn.BatchNorm2d(6, momentum=momentum, affine=affine)
    ref = copy.deepcopy(m)
    opt = torchfuse.optimize(torch.jit.script(m.train()))
    assert fused_count(opt) == 1
    x = signed(4, 3, 8, 8, seed=5)
    got, want = _train_steps(opt, x), _train_steps(ref.train(), x)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)
    for (name, p), q in zip(m.named_buffers(), ref.buffers()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6, msg=name)
    # and eval afterwards, of the same modules
    opt.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x), rtol=1e-5, atol=1e-5)


def test_track_running_stats_false_normalizes_by_the_batch_in_eval():
    torch.manual_seed(0)
    m = ConvBnAct()
    m.bn = nn.BatchNorm2d(6, track_running_stats=False)
    m.eval()
    opt = torchfuse.optimize(torch.jit.script(m))
    x = signed(4, 3, 8, 8, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("conv, size", [
    (nn.Conv2d(3, 4, 3), 3),                                        # 1x4x1x1
    (nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2), 3),       # (3 + 2 - 4 - 1) // 2 + 1 = 1
    (nn.Conv1d(3, 4, 2, stride=3), 4),                              # (4 - 1 - 1) // 3 + 1 = 1
])
def test_batch_size_one_per_channel_raises_as_the_original(conv, size):
    """BatchNorm's check reads the conv output's sizes, which the pass
    computes from the conv's input and weight."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4) if isinstance(conv, nn.Conv2d) else nn.BatchNorm1d(4)
    m = nn.Sequential(conv, bn).train()
    scripted = torch.jit.script(m)
    opt = torchfuse.optimize(scripted)
    assert fused_count(opt) == 1
    x = signed(1, 3, *([size] * (conv.weight.dim() - 2)))  # one value per channel
    errors = []
    for module in (scripted, opt):
        with pytest.raises(Exception) as e:
            module(x)
        errors.append(str(e.value).splitlines()[-1])
    assert errors[0] == errors[1] and "more than 1 value per channel" in errors[0]
    assert int(m[1].num_batches_tracked) == 2  # each call counted before raising, as the original
    # one size larger: more than one value, and the same training step
    x = signed(1, 3, *([size + 2] * (conv.weight.dim() - 2)))
    torch.testing.assert_close(opt(x), scripted(x), rtol=1e-6, atol=1e-6)


class OneElementLists(nn.Module):
    """conv2d with one-element stride/padding/dilation lists, which ATen
    expands; F.batch_norm reads the conv output's sizes in training."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(signed(4, 3, 3, 3, seed=1))
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = F.conv2d(x, self.w, None, [2], [1], [1], 1)
        return F.batch_norm(y, self.bn.running_mean, self.bn.running_var, None, None, self.training, 0.1, 1e-5)


def test_one_element_conv_lists_keep_the_size_check():
    m = OneElementLists().train()
    scripted = torch.jit.script(m)
    opt = torchfuse.optimize(scripted)
    assert fused_count(opt) == 1
    x = signed(2, 3, 7, 5, seed=2)
    torch.testing.assert_close(opt(x), scripted(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="more than 1 value per channel"):
        opt(signed(1, 3, 2, 2))  # (2 + 2 - 2 - 1) // 2 + 1 = 1 per dimension


SIZE_OP = torch.ops.torchfuse.custom_conv_output_size.default

# (input size, weight size, stride, padding, dilation): batched and
# unbatched, 1-, 2- and 3-d, one-element lists, grouped weights, a 1x1
# output.
CONV_SIZES = [
    ((2, 3, 9, 7), (4, 3, 3, 2), [2, 1], [1, 0], [1, 2]),
    ((3, 9, 7), (4, 3, 3, 3), [1], [2], [1]),
    ((2, 4, 11), (6, 2, 4), [3], [1], [2]),
    ((4, 11), (6, 4, 1), [1], [0], [1]),
    ((1, 2, 5, 6, 7), (3, 2, 2, 3, 1), [1, 2, 3], [0, 1, 0], [2, 1, 1]),
    ((2, 3, 2, 2), (5, 3, 2, 2), [3], [0], [1]),
]


@pytest.mark.parametrize("xs, ws, stride, padding, dilation", CONV_SIZES)
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_conv_output_size_is_the_conv_outputs(xs, ws, stride, padding, dilation, device):
    """custom_conv_output_size, which the pass puts where BatchNorm read its
    input's sizes, gives the conv's output sizes (on meta tensors too)."""
    x, w = signed(*xs, seed=1).to(device), signed(*ws, seed=2).to(device)
    groups = xs[-len(ws) + 1] // ws[1]
    want = list(F.__dict__[f"conv{len(ws) - 2}d"](x, w, None, stride, padding, dilation, groups).shape)
    assert SIZE_OP(x, w, stride, padding, dilation) == want


def test_conv_output_size_opcheck():
    torch.library.opcheck(SIZE_OP, (signed(2, 3, 9, 7, seed=1), signed(4, 3, 3, 2, seed=2), [2, 1], [1], [1, 2]))


@pytest.mark.parametrize("xs, stride, padding, dilation", [
    ((1, 3, 5, 5), [1, 1, 1], [0], [1]),   # a list too long
    ((1, 3, 5, 5), [0], [0], [1]),         # a zero stride
    ((1, 3, 5, 5), [1], [0], []),          # an empty list
    ((1, 3, 3, 3), [1], [0], [0]),         # a zero dilation: (3 - 0 - 1) // 1 + 1 = 3
    ((1, 3, 3, 3), [1], [-1], [1]),        # a negative padding
    ((1, 3, 2, 2), [2], [0], [1]),         # (2 - 2 - 1) // 2 + 1: 0 by floor, 1 by truncation
    ((3, 5, 5), [1], [0], [1, 1, 1]),      # unbatched, a list too long
])
def test_conv_output_size_of_a_shape_the_conv_rejects_leaves_the_error_to_the_conv(xs, stride, padding, dilation):
    """Where the conv raises, the sizes do not hold one value per channel:
    BatchNorm's check passes and the fused op's conv raises its own error,
    as the original's conv did before its sizes were read."""
    x, w = signed(*xs, seed=1), signed(4, 3, 3, 3, seed=2)
    with pytest.raises(RuntimeError):
        F.conv2d(x, w, None, stride, padding, dilation)
    sizes = SIZE_OP(x, w, stride, padding, dilation)
    assert len(sizes) >= 2
    assert math.prod([sizes[0]] + sizes[2:]) != 1, sizes  # BatchNorm's _verify_batch_size


def test_training_graph_reads_the_conv_output_size_in_one_call():
    """The training graph's BatchNorm size check reads one
    custom_conv_output_size per chain: no size arithmetic is interpreted
    (aten::floordiv, aten::append), in the optimized graph as in the
    scripted one."""
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
                      nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4)).train()
    scripted = torch.jit.script(copy.deepcopy(m))
    opt = torchfuse.optimize(torch.jit.script(m))
    graph = opt.inlined_graph
    assert len(graph.findAllNodes("torchfuse::custom_conv_output_size", recurse=True)) == 2
    assert len(graph.findAllNodes("torchfuse::custom_conv_batch_norm_act", recurse=True)) == 2

    def count(g):
        return sum(1 for _ in g.findAllNodes("aten::floordiv", recurse=True)) + \
            sum(1 for _ in g.findAllNodes("aten::append", recurse=True))
    assert count(graph) == count(scripted.inlined_graph) == 0
    x = signed(2, 3, 9, 9, seed=3)
    torch.testing.assert_close(opt(x), scripted(x), rtol=1e-6, atol=1e-6)


def test_wrong_rank_raises():
    # NB: the scripted original raises BatchNorm's channel-count error,
    # eager and the optimized module BatchNorm2d's rank check
    m = ConvBnAct().eval()
    scripted = torch.jit.script(m)
    opt = torchfuse.optimize(scripted)
    x = signed(3, 8, 8)  # unbatched: conv2d takes it, BatchNorm2d does not
    for module in (m, scripted, opt):
        with pytest.raises((ValueError, RuntimeError, torch.jit.Error)):
            module(x)


def _fuse(fn_or_module):
    graph = fn_or_module.graph.copy()
    torch._C._jit_pass_inline(graph)
    return graph, torchfuse.fuse_graph(graph)["conv_batch_norm_act"]


def test_not_training_constant_negative_a_traced_training_batch_norm_stays():
    m = ConvBnAct().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(m, (signed(2, 3, 8, 8),), check_trace=False)
    graph, n = _fuse(traced)
    assert n == 0 and len(graph.findAllNodes("aten::batch_norm")) == 1


def test_traced_eval_chain_fuses():
    m = _randomize_statistics(ConvBnAct()).eval()
    traced = torch.jit.trace(m, (signed(2, 3, 8, 8),))
    opt = torchfuse.optimize(traced)
    assert fused_count(opt) == 1
    x = signed(2, 3, 8, 8, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x), rtol=1e-5, atol=1e-6)


class ConvOutputReadTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_has_single_use_negative_a_conv_output_read_again_stays():
    m = torch.jit.script(ConvOutputReadTwice().eval())
    graph, n = _fuse(m)
    assert n == 0 and len(graph.findAllNodes("aten::batch_norm")) == 1


class StatisticsWrittenBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        self.conv.weight.data.mul_(2.0)  # the op would read the written weight
        return torch.relu(self.bn(y))


def test_no_intervening_writes_negative_a_conv_weight_written_before_the_batch_norm():
    m = torch.jit.script(StatisticsWrittenBetween().eval())
    graph, n = _fuse(m)
    assert n == 0


def _activations(graph):
    """The `activation` argument of each custom_conv_batch_norm_act in graph."""
    return [n.inputsAt(15).toIValue() for n in graph.findAllNodes("torchfuse::custom_conv_batch_norm_act")]


@pytest.mark.parametrize("act, name", [(nn.ReLU(inplace=True), "relu_"), (nn.SiLU(), "silu"),
                                       (nn.Hardswish(inplace=True), "hardswish_"),
                                       (nn.ReLU6(inplace=True), "hardtanh_")])
@pytest.mark.parametrize("training", [True, False])
def test_the_activation_joins_where_training_is_a_run_time_flag(act, name, training):
    """The chain's batch_norm writes its running statistics wherever
    `training` is not the constant false (AliasDb's view); that write is the
    op's own, so the activation after it joins the op, in training and in
    eval, and the outputs stay the original's."""
    torch.manual_seed(0)
    m = _randomize_statistics(ConvBnAct(act)).train(training)
    ref = copy.deepcopy(m)
    graph, n = _fuse(torch.jit.script(m))
    assert n == 1 and _activations(graph) == [name]
    opt = torchfuse.optimize(torch.jit.script(m))
    x = signed(2, 3, 8, 8, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x), rtol=1e-5, atol=1e-6)


class WeightWrittenAfterTheBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.bn(self.conv(x))
        self.conv.weight.data.mul_(2.0)  # an op at the activation would read the written weight
        return torch.relu(y)


def test_no_intervening_writes_negative_a_conv_weight_written_between_batch_norm_and_activation():
    """A write of the conv's weight after the batch_norm keeps the activation
    out: the chain ends at the batch_norm, before the write."""
    m = WeightWrittenAfterTheBatchNorm().eval()
    graph, n = _fuse(torch.jit.script(m))
    assert n == 1 and _activations(graph) == ["none"]
    assert len(graph.findAllNodes("aten::relu")) == 1


def test_torchvision_resnet18_unfrozen_eval_and_training():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = _randomize_statistics(torchvision.models.resnet18(num_classes=10))
    ref = copy.deepcopy(model)
    opt = torchfuse.optimize(torch.jit.script(model.eval()))
    assert fused_count(opt) == 20
    x = signed(2, 3, 64, 64, seed=9)
    with torch.no_grad():
        got, want = opt(x), ref.eval()(x)
        ref64 = copy.deepcopy(ref).double()(x.double())
    assert_close_to_reference(got, want, ref64, what="resnet18 eval", floor=1e-5)
    opt.train(), ref.train()
    got, want = _train_steps(opt, x, 2), _train_steps(ref, x, 2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=name)


CUDA_CASES = [  # (input shape, weight shape, stride, padding, dilation, groups)
    ((4, 16, 14, 14), (32, 16, 3, 3), [1, 1], [1, 1], [1, 1], 1),
    ((4, 16, 14, 14), (16, 1, 3, 3), [2, 2], [1, 1], [1, 1], 16),  # depthwise, strided
    ((3, 8, 33), (12, 8, 5), [1], [2], [2], 1),  # conv1d: no channels-last
    ((2, 6, 5, 6, 7), (10, 6, 3, 3, 3), [1, 1, 1], [1, 1, 1], [1, 1, 1], 1),
    ((2, 8, 4, 4), (12, 8, 4, 4), [1, 1], [0, 0], [1, 1], 1),  # 1x1 output: the original ops
]


def _cuda_case(case, dtype, channels_last, seed=11):
    xs, ws, stride, padding, dilation, groups = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*xs, generator=g)
    w = torch.randn(*ws, generator=g) * 0.1
    b = torch.randn(ws[0], generator=g)
    gamma, beta, mean, var = bn_state(ws[0], seed + 1)
    host = (x, w, b, gamma, beta, mean, var)
    dev = [t.to("cuda", dtype) for t in host]
    if channels_last and x.dim() in (4, 5):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        dev[0] = dev[0].contiguous(memory_format=fmt)
        dev[1] = dev[1].contiguous(memory_format=fmt)
    return host, dev, (stride, padding, dilation, groups)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("case", CUDA_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("act", [a for a in ACTIVATIONS if a != "none"])
def test_cuda_eval_against_float64(case, dtype, channels_last, act):
    """No gradient recorded: the conv, then BatchNorm's affine map and the
    activation in its epilogue (every activation the op takes: the pass
    gives it each one FuseConvAddAct matches); the output keeps the
    original's strides."""
    host, dev, (stride, padding, dilation, groups) = _cuda_case(case, dtype, channels_last)
    args64 = [t.double() for t in host]
    ref = reference(args64[0], args64[1], args64[2], stride, padding, dilation, groups, *args64[3:], False, 0.1,
                    1e-5, act)
    poison_allocator([ref.numel() * dtype.itemsize, host[1].numel() * dtype.itemsize])
    with torch.no_grad():
        got = OP(dev[0], dev[1], dev[2], stride, padding, dilation, groups, *dev[3:], False, 0.1, 1e-5, True, act,
                 ACTIVATIONS[act][1])
        want = reference(dev[0], dev[1], dev[2], stride, padding, dilation, groups, *dev[3:], False, 0.1, 1e-5, act)
    assert got.stride() == want.stride()
    assert_close_to_reference(got, want, ref, what=f"conv_batch_norm_act {case[1]} {dtype} cl={channels_last} {act}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("channels_last", [False, True])
def test_cuda_eval_allocates_only_the_output(channels_last):
    """The BatchNorm is applied in the conv's epilogue: no folded weight and no
    second activation-sized tensor.  The weight is larger than the output, so
    a folded copy would show."""
    case = ((2, 256, 8, 8), (512, 256, 3, 3), [1, 1], [1, 1], [1, 1], 1)
    _, dev, (stride, padding, dilation, groups) = _cuda_case(case, torch.float32, channels_last)
    with torch.no_grad():
        OP(dev[0], dev[1], dev[2], stride, padding, dilation, groups, *dev[3:], False, 0.1, 1e-5, True, "relu", [])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = OP(dev[0], dev[1], dev[2], stride, padding, dilation, groups, *dev[3:], False, 0.1, 1e-5, True, "relu",
                 [])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        # the conv's output and cuDNN's workspace, which eager's conv takes as well
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        conv = F.conv2d(dev[0], dev[1], None, stride, padding, dilation, groups)
        torch.cuda.synchronize()
        conv_peak = torch.cuda.max_memory_allocated() - before
    weight_bytes = dev[1].numel() * dev[1].element_size()
    assert out.numel() * out.element_size() < weight_bytes
    assert peak <= conv_peak + 4096, (peak, conv_peak)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_eval_under_autocast_keeps_the_original_dtype_and_values():
    """float32 BatchNorm tensors with a float16 convolution (autocast): the
    affine map reads them in their own dtype."""
    case = CUDA_CASES[0]
    host, dev, (stride, padding, dilation, groups) = _cuda_case(case, torch.float32, True)
    args64 = [t.double() for t in host]
    ref = reference(args64[0], args64[1], args64[2], stride, padding, dilation, groups, *args64[3:], False, 0.1,
                    1e-5, "relu")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        got = OP(dev[0], dev[1], dev[2], stride, padding, dilation, groups, *dev[3:], False, 0.1, 1e-5, True, "relu",
                 [])
        want = reference(dev[0], dev[1], dev[2], stride, padding, dilation, groups, *dev[3:], False, 0.1, 1e-5, "relu")
    assert got.dtype == want.dtype == torch.float16
    assert_close_to_reference(got, want, ref, what="conv_batch_norm_act under autocast")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_eval_recording_runs_the_original_ops():
    """Autograd recording in eval: the original ops, so the gradients of the
    input, the conv and the BatchNorm parameters are the original's."""
    host, dev, (stride, padding, dilation, groups) = _cuda_case(CUDA_CASES[0], torch.float64, False)
    # NB: the running statistics are buffers: no gradient
    leaves = [t.clone().requires_grad_(i < 5) for i, t in enumerate(dev)]
    got = OP(leaves[0], leaves[1], leaves[2], stride, padding, dilation, groups, *leaves[3:], False, 0.1, 1e-5, True,
             "silu", [])
    gy = torch.randn_like(got)
    grads = torch.autograd.grad(got, [leaves[i] for i in (0, 1, 2, 3, 4)], gy)
    leaves2 = [t.clone().requires_grad_(i < 5) for i, t in enumerate(dev)]
    want = reference(leaves2[0], leaves2[1], leaves2[2], stride, padding, dilation, groups, *leaves2[3:], False, 0.1,
                     1e-5, "silu")
    grads2 = torch.autograd.grad(want, [leaves2[i] for i in (0, 1, 2, 3, 4)], gy)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b)


TRAIN_SILU_CASES = [  # (input shape, weight shape, stride, padding, dilation, groups); planes >= 512
    ((4, 16, 24, 24), (32, 16, 3, 3), [1, 1], [1, 1], [1, 1], 1),
    ((4, 16, 48, 46), (16, 1, 3, 3), [2, 2], [1, 1], [1, 1], 16),  # depthwise, strided: 24x23
    ((3, 8, 600), (12, 8, 5), [1], [2], [2], 1),  # conv1d
    ((2, 6, 8, 8, 10), (10, 6, 3, 3, 3), [1, 1, 1], [1, 1, 1], [1, 1, 1], 1),
]


def _train_silu(fn, tensors, conv_args, gy, momentum=0.1):
    """fn's output, the gradients of (x, w, b, gamma, beta) for gy, and the
    running statistics fn updated (fn takes copies)."""
    leaves = [t.detach().clone().requires_grad_(i < 5) for i, t in enumerate(tensors)]
    out = fn(*leaves[:3], *conv_args, *leaves[3:], True, momentum, 1e-5, "silu")
    grads = torch.autograd.grad(out, leaves[:5], gy)
    return out, grads, leaves[5], leaves[6]


def _op(x, w, b, stride, padding, dilation, groups, gamma, beta, mean, var, training, momentum, eps, act):
    return OP(x, w, b, stride, padding, dilation, groups, gamma, beta, mean, var, training, momentum, eps, True, act,
              [])


def _grad_fn_names(t):
    """The autograd nodes behind t, by name."""
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        todo.extend(f for f, _ in node.next_functions)
    return names


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("case", TRAIN_SILU_CASES)
@pytest.mark.parametrize("dtype, bn_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.float16)])
def test_cuda_training_silu_runs_fused_against_float64(case, dtype, bn_dtype):
    """conv -> batch_norm (training) -> silu, 16-bit, NCHW planes of 512
    elements or more: the BatchNorm and silu by
    custom_batch_norm_add_div_swish's kernels, forward and backward.  Output,
    the gradients of input, conv and BatchNorm parameters, and the running
    statistics: within 2x eager's error against float64."""
    host, dev, conv_args = _cuda_case(case, dtype, False)
    dev = dev[:3] + [t.to(bn_dtype) for t in dev[3:]]
    gy_host = torch.randn(reference(*host[:3], *conv_args, *host[3:], False, 0.1, 1e-5, "none").shape,
                          generator=torch.Generator().manual_seed(5))
    ref = _train_silu(reference, [t.double() for t in host], conv_args, gy_host.double())
    gy = gy_host.to("cuda", dtype)
    poison_allocator([ref[0].numel() * dtype.itemsize])
    got = _train_silu(_op, dev, conv_args, gy)
    want = _train_silu(reference, dev, conv_args, gy)
    assert any("BatchNormAddDivSwish" in n for n in _grad_fn_names(got[0]))
    assert not any("BatchNormAddDivSwish" in n for n in _grad_fn_names(want[0]))
    assert got[0].dtype == want[0].dtype and got[0].stride() == want[0].stride()
    what = f"train silu {case[1]} {dtype} bn {bn_dtype}"
    assert_close_to_reference(got[0], want[0], ref[0], what=what + " out")
    for i, name in enumerate(["x", "w", "b", "gamma", "beta"]):
        assert got[1][i].dtype == want[1][i].dtype
        assert_close_to_reference(got[1][i], want[1][i], ref[1][i], what=f"{what} grad {name}")
    for i, name in ((2, "running_mean"), (3, "running_var")):
        assert_close_to_reference(got[i], want[i], ref[i], what=f"{what} {name}")


def _second_derivatives(fn, dev, conv_args):
    leaves = [t.detach().clone().requires_grad_(i < 5) for i, t in enumerate(dev)]
    out = fn(*leaves[:3], *conv_args, *leaves[3:], True, 0.1, 1e-5, "silu")
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    gx = torch.autograd.grad(out, leaves[0], gy, create_graph=True)[0]
    return out, torch.autograd.grad(gx.float().square().sum(), leaves[:5])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_training_silu_double_backward_is_the_original():
    """A backward with create_graph through the fused training chain: the
    second derivatives of the original, within 2x eager's error against
    float64.  (The conv bias's is zero: a training BatchNorm removes it;
    both sides give rounding noise there, which is not compared.)"""
    host, dev, conv_args = _cuda_case(TRAIN_SILU_CASES[0], torch.float16, False)
    dev = dev[:3] + [t.float() for t in dev[3:]]
    out, got = _second_derivatives(_op, dev, conv_args)
    assert any("BatchNormAddDivSwish" in n for n in _grad_fn_names(out))
    _, want = _second_derivatives(reference, dev, conv_args)
    _, ref = _second_derivatives(reference, [t.double() for t in host], conv_args)
    for i, name in ((0, "x"), (1, "w"), (3, "gamma"), (4, "beta")):
        assert_close_to_reference(got[i], want[i], ref[i], what=f"second derivative {name}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_training_silu_keeps_less_alive_for_the_backward():
    """The fused chain saves the conv output only, not BatchNorm's output as
    well: less memory alive between forward and backward."""
    _, dev, conv_args = _cuda_case(TRAIN_SILU_CASES[0], torch.float16, False)
    dev = dev[:3] + [t.float() for t in dev[3:]]
    alive = []
    for fn in (_op, reference):
        leaves = [t.detach().clone().requires_grad_(i < 5) for i, t in enumerate(dev)]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fn(*leaves[:3], *conv_args, *leaves[3:], True, 0.1, 1e-5, "silu")
        torch.cuda.synchronize()
        alive.append(torch.cuda.memory_allocated() - before)
        del out
    assert alive[0] < alive[1], alive


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("what", ["float32", "channels_last", "short_planes", "float64", "no_running_statistics",
                                  "relu"])
def test_cuda_training_keeps_the_original_ops_outside_the_fused_silu(what):
    """trainSiluPays and batchNormAddDivSwishCudaTakes negatives: float32
    and channels-last conv outputs and planes under 512 elements (where
    cuDNN's BatchNorm and silu were the faster), float64, BatchNorm without
    running statistics, and an activation other than silu run the original
    ops."""
    dtype = {"float32": torch.float32, "float64": torch.float64}.get(what, torch.float16)
    case = ((4, 16, 22, 23), (32, 16, 3, 3), [1, 1], [1, 1], [1, 1], 1) if what == "short_planes" \
        else TRAIN_SILU_CASES[0]
    _, dev, conv_args = _cuda_case(case, dtype, what == "channels_last")
    dev = dev[:3] + [t.float() if dtype == torch.float16 else t for t in dev[3:]]
    leaves = [t.detach().clone().requires_grad_(i < 5) for i, t in enumerate(dev)]
    if what == "no_running_statistics":
        leaves[5] = leaves[6] = None
    act = "relu" if what == "relu" else "silu"
    out = _op(*leaves[:3], *conv_args, *leaves[3:], True, 0.1, 1e-5, act)
    want = reference(*leaves[:3], *conv_args, *leaves[3:], True, 0.1, 1e-5, act)
    assert not any("BatchNormAddDivSwish" in n for n in _grad_fn_names(out))
    torch.testing.assert_close(out, want)
    assert out.stride() == want.stride()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("autocast", [False, True])
def test_cuda_scripted_silu_training_steps_keep_outputs_and_statistics(autocast):
    """A scripted conv -> BatchNorm -> SiLU trained 3 SGD steps through
    torchfuse, against eager: outputs, parameters and running statistics.
    Under float16 autocast the BatchNorm and silu run fused (24x24 planes),
    in float32 they run the original ops."""
    torch.manual_seed(0)
    m = ConvBnAct(nn.SiLU()).cuda()
    ref = copy.deepcopy(m)
    opt = torchfuse.optimize(torch.jit.script(m.train()), layout="keep")
    assert fused_count(opt) == 1
    x = signed(4, 3, 24, 24, seed=5).cuda()
    ctx = (lambda: torch.autocast("cuda", dtype=torch.float16)) if autocast else contextlib.nullcontext
    with ctx():
        got, want = _train_steps(opt, x), _train_steps(ref.train(), x)
    tol = 2e-2 if autocast else 1e-4
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    for (name, p), q in zip(m.named_buffers(), ref.buffers()):
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=name)
    with ctx():
        out = opt(x)
    assert any("BatchNormAddDivSwish" in n for n in _grad_fn_names(out)) == autocast


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_torchvision_efficientnet_b0_training_step_under_autocast():
    """efficientnet_b0 (torchvision) trained one step under float16 autocast
    through torchfuse, NCHW: its conv -> BatchNorm -> SiLU chains run fused,
    and the output, every parameter gradient and every buffer are within 2x
    eager's error against a float64 run (the floor: float16's, the dtype the
    chains compute in)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0(num_classes=10, dropout=0.0, stochastic_depth_prob=0.0).cuda()
    ref, ref64 = copy.deepcopy(model), copy.deepcopy(model).double()
    opt = torchfuse.optimize(torch.jit.script(model.train()), layout="keep")
    assert fused_count(opt) > 0
    x = signed(4, 3, 64, 64, seed=9).cuda()
    gy = signed(4, 10, seed=10).cuda()

    def step(m, inp, autocast):
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            out = m(inp)
        out.backward(gy.to(out.dtype))
        return out

    got = step(opt, x, True)
    assert any("BatchNormAddDivSwish" in n for n in _grad_fn_names(got))
    want = step(ref.train(), x, True)
    want64 = step(ref64.train(), x.double(), False)
    floor = floor_for(torch.float16)
    assert_close_to_reference(got, want, want64, what="efficientnet_b0 output", floor=floor)
    for (name, p), q, q64 in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        assert_close_to_reference(p.grad, q.grad, q64.grad, what=f"efficientnet_b0 grad {name}", floor=floor)
    for (name, b), c, c64 in zip(model.named_buffers(), ref.buffers(), ref64.buffers()):
        if b.is_floating_point():
            assert_close_to_reference(b, c, c64, what=f"efficientnet_b0 {name}", floor=floor)
        else:
            assert torch.equal(b, c), name


def test_fuzzer_programs_with_the_chain_keep_their_meaning():
    """The fuzzer's vocabulary draws conv -> batch_norm -> [act]; the programs
    it fuses keep their meaning in training, eval and frozen."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
    import fuzz
    from fuzz.modes import load_class

    fused = checked = 0
    for i in range(150):
        prog = fuzz.generate(20261128, i * 100)
        if "BatchNorm" not in prog.source() and "batch_norm" not in prog.source():
            continue
        torch.manual_seed(0)
        try:
            module = torch.jit.script(load_class(prog.source())().train())
        except Exception:
            continue
        n = fused_count(torchfuse.optimize(module))
        if n == 0:
            continue
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64",), modes=("train", "frozen"), round_trip=False)
        except fuzz.Invalid:
            continue
        assert out.failures == [], (i, out.failures)
        fused += n
        checked += 1
        if checked >= 6:
            break
    assert checked >= 4 and fused >= 4, (checked, fused)
