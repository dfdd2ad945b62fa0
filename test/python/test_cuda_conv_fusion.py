"""custom_conv_add_act on CUDA as one cuDNN graph (kernels/cudnn/conv_fusion.h,
ops/cuda/conv/cudnn_fusion.h; torchfuse.backends.conv.cudnn_fusion).

With cudnn_fusion='always' the graph runs wherever it applies; the tests
check that it did (no ATen convolution in the profile), its error against a
float64 reference (at most 2x eager's under the same flags), NaN/Inf as
eager, float32 without TF32, and that every case outside cudnnFusionApplies
runs the unfused path.  'auto' (the default) times the
fused plans against the unfused path; its result is checked too.  CUDA only
(marked `cuda`)."""

import pytest
import torch
import torch.nn.functional as F

import torchfuse

from cuda_utils import CUDA_ONLY, assert_close_to_reference, poison_allocator, tf32_flags
from test_conv_add_act import ACTS, eager, op, signed

pytestmark = CUDA_ONLY
conv_options = torchfuse.backends.conv
CL = torch.channels_last
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def unfused_ran(fn) -> bool:
    """Whether fn ran the unfused path: ATen's convolution (the fused graph
    calls cuDNN directly)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        fn()
        torch.cuda.synchronize()
    return any("convolution" in e.name for e in prof.events())


def case(dtype, cin=16, cout=24, size=10, kernel=3, groups=1, batch=2, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(batch, cin, size, size, dtype=dtype, device="cuda", generator=g).to(memory_format=CL)
    w = (torch.randn(cout, cin // groups, kernel, kernel, dtype=dtype, device="cuda", generator=g)
         * (cin // groups * kernel * kernel) ** -0.5).to(memory_format=CL)
    b = torch.randn(cout, dtype=dtype, device="cuda", generator=g)
    return x, w, b


def check(x, w, b, stride, padding, dilation, groups, other, alpha, act, what, fused=True):
    """fused: whether the fused graph must run (None: either; cuDNN may have no plan)."""
    args = ACTS[act.rstrip("_")][0]
    want = eager(x, w, b, stride, padding, dilation, groups, other, alpha, True, act.rstrip("_"))
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ref = eager(d(x), d(w), d(b), stride, padding, dilation, groups, d(other), alpha, True, act.rstrip("_"))
    poison_allocator([want.numel() * want.element_size()])
    out = {}
    launched = unfused_ran(
        lambda: out.setdefault("y", op(x, w, b, stride, padding, dilation, groups, other, alpha, True, act, args)))
    got = out["y"]
    if fused is not None:
        assert launched != fused, f"{what}: the {'fused graph' if fused else 'unfused path'} was expected to run"
    assert got.stride() == want.stride(), f"{what}: strides {got.stride()} != eager's {want.stride()}"
    assert_close_to_reference(got, want, ref, what=what)
    return got


@pytest.fixture
def always():
    with conv_options.flags(cudnn_fusion="always"):
        yield


# every activation the graph expresses; gelu_tanh is not one (see expressible)
FUSED_ACTS = [a for a in ACTS if a != "gelu_tanh"] + ["relu_"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", FUSED_ACTS)
@pytest.mark.parametrize("form", ["none", "add"])
def test_fused_against_float64(always, dtype, act, form):
    x, w, b = case(dtype, seed=len(act))
    other = None
    if form == "add":
        other = torch.randn(F.conv2d(x, w, None, 1, 1).shape, dtype=dtype, device="cuda").to(memory_format=CL)
    check(x, w, b, [1], [1], [1], 1, other, 1, act, f"{act} {form} {dtype}")


@pytest.mark.parametrize("act", ["gelu_tanh", "relu"])
def test_unexpressed_forms_are_not_fused(always, act):
    """An activation the graph does not express, and an alpha other than 1."""
    x, w, b = case(torch.float32, seed=2)
    other = torch.randn(F.conv2d(x, w, None, 1, 1).shape, device="cuda").to(memory_format=CL)
    alpha = 1 if act == "gelu_tanh" else -0.5
    check(x, w, b, [1], [1], [1], 1, other, alpha, act, f"{act} alpha={alpha}", fused=False)


# stride, padding, dilation, groups, kernel, bias: the real networks' forms
# (strided stems, 1x1 projections, dilated, grouped and depthwise convs).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stride, padding, dilation, groups, kernel, bias", [
    ([2, 2], [3, 3], [1, 1], 1, 7, True),
    ([1, 1], [0, 0], [1, 1], 1, 1, True),
    ([1, 1], [0, 0], [1, 1], 1, 1, False),
    ([2, 1], [2, 1], [2, 1], 2, 3, True),
    ([1, 1], [1, 1], [1, 1], 16, 3, True),
])
def test_fused_conv_forms(always, dtype, stride, padding, dilation, groups, kernel, bias):
    cout = 16 if groups == 16 else 24
    x, w, b = case(dtype, cout=cout, kernel=kernel, groups=groups, size=13, seed=groups + kernel)
    # NB: cuDNN 9.19 has no fused plan for some depthwise problems (bfloat16)
    check(x, w, b if bias else None, stride, padding, dilation, groups, None, 1, "silu",
          f"{dtype} s{stride} p{padding} d{dilation} g{groups} k{kernel} bias={bias}",
          fused=None if groups == 16 else True)


@pytest.mark.parametrize("act", FUSED_ACTS)
def test_nan_and_inf_as_eager(always, act):
    x, w, b = case(torch.float32, seed=3)
    x[0, 2, 4, 4] = float("nan")
    x[1, 5, 2, 7] = float("inf")
    x[1, 6, 8, 1] = -float("inf")
    check(x, w, b, [1], [1], [1], 1, None, 1, act, f"{act} with NaN/Inf")


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_float32_never_takes_tf32(always, allow_tf32):
    """float32 plans are IEEE whatever cuDNN's TF32 flag: eager's IEEE error
    bounds the fused graph's (a TF32 plan is ~1000x off)."""
    x, w, b = case(torch.float32, cin=64, cout=64, size=16, seed=5)
    with tf32_flags(matmul=None, cudnn=False):
        ieee = eager(x, w, b, [1], [1], [1], 1, None, 1, True, "relu")
    with tf32_flags(matmul=None, cudnn=allow_tf32):
        got = check(x, w, b, [1], [1], [1], 1, None, 1, "relu", f"allow_tf32={allow_tf32}")
    d = lambda t: t.double()  # noqa: E731
    assert_close_to_reference(got, ieee, eager(d(x), d(w), d(b), [1], [1], [1], 1, None, 1, True, "relu"),
                              what=f"IEEE, allow_tf32={allow_tf32}")


# cudnnFusionApplies' negative forms: each runs the unfused path, correctly.
def test_nchw_input_is_not_fused(always):
    x, w, b = case(torch.float16)
    check(x.contiguous(), w.contiguous(), b, [1], [1], [1], 1, None, 1, "relu", "nchw", fused=False)


def test_other_in_another_layout_is_not_fused(always):
    x, w, b = case(torch.float16)
    other = torch.randn(F.conv2d(x, w, None, 1, 1).shape, dtype=torch.float16, device="cuda")
    check(x, w, b, [1], [1], [1], 1, other, 1, "relu", "nchw other", fused=False)


def test_one_output_position_is_not_fused(always):
    x, w, b = case(torch.float16, size=3)
    check(x, w, b, [1], [0], [1], 1, None, 1, "relu", "1x1 output", fused=False)


def test_deterministic_algorithms_are_not_fused(always):
    x, w, b = case(torch.float16)
    with torch.backends.cudnn.flags(deterministic=True):
        check(x, w, b, [1], [1], [1], 1, None, 1, "relu", "deterministic", fused=False)


def test_disabled_cudnn_is_not_fused(always):
    x, w, b = case(torch.float16)
    with torch.backends.cudnn.flags(enabled=False):
        check(x, w, b, [1], [1], [1], 1, None, 1, "relu", "cudnn disabled", fused=False)


def test_never_is_not_fused():
    x, w, b = case(torch.float16)
    with conv_options.flags(cudnn_fusion="never"):
        check(x, w, b, [1], [1], [1], 1, None, 1, "relu", "never", fused=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_keeps_one_choice_and_is_correct(dtype):
    """'auto' times the plans on the first call; every call is correct and
    later calls run what the first chose."""
    x, w, b = case(dtype, cin=64, cout=64, size=28, batch=8, seed=11)
    with conv_options.flags(cudnn_fusion="auto"):
        op(x, w, b, [1], [1], [1], 1, None, 1, True, "relu", [])  # the timed first call
        fused = not unfused_ran(lambda: op(x, w, b, [1], [1], [1], 1, None, 1, True, "relu", []))
        first = check(x, w, b, [1], [1], [1], 1, None, 1, "relu", f"auto {dtype}", fused=fused)
        again = op(x, w, b, [1], [1], [1], 1, None, 1, True, "relu", [])
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_auto_leaves_float32_unfused_where_cudnn_may_use_tf32(allow_tf32):
    """autoLeavesTf32ConvUnfused: under 'auto', a float32 problem runs
    eager's convolution and one epilogue pass while cuDNN may use TF32, and
    is timed as any other where it may not."""
    x, w, b = case(torch.float32, cin=64, cout=64, size=28, batch=8, seed=17 + allow_tf32)
    with conv_options.flags(cudnn_fusion="auto"), tf32_flags(matmul=None, cudnn=allow_tf32):
        op(x, w, b, [1], [1], [1], 1, None, 1, True, "relu", [])  # the first call, timed where allowed
        fused = not unfused_ran(lambda: op(x, w, b, [1], [1], [1], 1, None, 1, True, "relu", []))
        check(x, w, b, [1], [1], [1], 1, None, 1, "relu", f"auto, allow_tf32={allow_tf32}",
              fused=False if allow_tf32 else fused)
    with conv_options.flags(cudnn_fusion="always"), tf32_flags(matmul=None, cudnn=True):
        # the rule is auto's alone: 'always' fuses the same problem
        check(x, w, b, [1], [1], [1], 1, None, 1, "relu", "always, allow_tf32=True", fused=True)


def test_capture_before_the_choice_runs_unfused():
    """A CUDA graph captured on a problem's first call runs the unfused path
    (no timing while capturing) and replays correctly."""
    x, w, b = case(torch.float16, cin=32, cout=40, size=12, seed=13)
    with conv_options.flags(cudnn_fusion="auto"):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            y = op(x, w, b, [1], [1], [1], 1, None, 1, True, "relu", [])
        torch.cuda.current_stream().wait_stream(stream)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
    want = eager(x, w, b, [1], [1], [1], 1, None, 1, True, "relu")
    d = lambda t: t.double()  # noqa: E731
    assert_close_to_reference(y, want, eager(d(x), d(w), d(b), [1], [1], [1], 1, None, 1, True, "relu"),
                              what="captured")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [8, 32])
def test_auto_in_a_whole_network_is_correct(dtype, batch):
    """'auto' in resnet50's convolutions: each problem's plans are checked
    against the unfused path on its first call, so the network stays within
    2x eager's error against float64 whichever plans win the timing (a plan
    that left its output partly unwritten once passed that check on an
    earlier plan's values)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(batch)
    model = torchvision.models.resnet50().eval()
    x = torch.randn(batch, 3, 224, 224)
    with torch.no_grad():
        ref = model.double()(x.double())
        model = model.to("cuda", dtype)
        xc = x.to("cuda", dtype)
        want = model(xc)
        with conv_options.flags(cudnn_fusion="auto"):
            opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
            assert torchfuse.report(opt)["conv_add_act"] > 0
            for _ in range(3):  # the profiling runs, then the optimized graph
                got = opt(xc)
    assert_close_to_reference(got, want, ref, what=f"resnet50 {dtype} batch {batch}")
