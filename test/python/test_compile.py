"""torch.compile (Inductor, fullgraph=True: any graph break raises) of
modules that call the torchfuse ops (the seed ops; the ops the passes put
into CNNs and transformers), on the CPU: in training (outputs, gradients,
BatchNorm running statistics) and in inference, against the same module run
eagerly."""

import copy

import pytest
import torch

ops = torch.ops.torchfuse


def signed(*sizes):
    t = torch.randn(*sizes)
    return torch.where(t.abs() < 0.05, torch.full_like(t, 0.5), t)


class AllOps(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_w = torch.nn.Parameter(signed(3, 3, 3, 3))
        self.conv_b = torch.nn.Parameter(signed(3))
        self.bn_w = torch.nn.Parameter(signed(3))
        self.bn_b = torch.nn.Parameter(signed(3))
        self.register_buffer("running_mean", signed(3) * 0.1)
        self.register_buffer("running_var", torch.rand(3) + 0.5)
        self.lin_w = torch.nn.Parameter(signed(6, 4))
        self.lin_b = torch.nn.Parameter(signed(6))

    def forward(self, x, y, o):
        h = ops.custom_conv_relu_add(x, self.conv_w, self.conv_b, [1], [1], [1], 1, x, 0.5)
        h = ops.custom_batch_norm_add_div_swish(
            h, self.bn_w, self.bn_b, self.running_mean, self.running_var, self.training, 0.1, 1e-5, x, 2.0)
        z = ops.custom_relu(ops.custom_linear_add_relu(y, self.lin_w, self.lin_b, o, -1.0) - 0.25)
        return h.square().mean() + z.square().mean()


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    eager = AllOps()
    compiled_src = copy.deepcopy(eager)
    return eager, compiled_src, torch.compile(compiled_src, fullgraph=True)


def test_compiled_training_matches_eager(models):
    eager, src, compiled = models
    eager.train()
    src.train()
    for step in range(2):
        torch.manual_seed(10 + step)
        x, y, o = signed(2, 3, 5, 5), signed(3, 4), signed(6)
        want = eager(x, y, o)
        got = compiled(x, y, o)
        torch.testing.assert_close(got, want)
        for m in (eager, src):
            m.zero_grad(set_to_none=True)
        want.backward()
        got.backward()
        for (name, a), (_, b) in zip(eager.named_parameters(), src.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=lambda m, name=name: f"grad of {name}: {m}")
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(src, name), getattr(eager, name), msg=lambda m, name=name: f"{name}: {m}")
    assert not torch.equal(src.running_mean, AllOps().running_mean)


def test_compiled_inference_matches_eager(models):
    eager, src, compiled = models
    eager.eval()
    src.eval()
    torch.manual_seed(1)
    x, y, o = signed(2, 3, 5, 5), signed(3, 4), signed(6)
    with torch.no_grad():
        want = eager(x, y, o)
        got = compiled(x, y, o)
    torch.testing.assert_close(got, want)


class NetworkOps(torch.nn.Module):
    """The ops the passes put into CNNs and transformers, chained: conv →
    add → silu, conv → relu → max_pool, conv → batch_norm (training: batch
    statistics and running-statistic updates) → hardswish, the SE squeeze and
    gate, linear → add → gelu, add → layer_norm (its sum written), and
    unmasked attention."""

    def __init__(self):
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(signed(4, 4, 3, 3)), torch.nn.Parameter(signed(4))
        self.w2, self.b2 = torch.nn.Parameter(signed(6, 4, 3, 3)), torch.nn.Parameter(signed(6))
        self.w3 = torch.nn.Parameter(signed(5, 6, 3, 3))
        self.bn_w, self.bn_b = torch.nn.Parameter(signed(5)), torch.nn.Parameter(signed(5))
        self.register_buffer("running_mean", signed(5) * 0.1)
        self.register_buffer("running_var", torch.rand(5) + 0.5)
        self.lin_w, self.lin_b = torch.nn.Parameter(signed(8, 8) * 0.3), torch.nn.Parameter(signed(8))
        self.ln_w, self.ln_b = torch.nn.Parameter(signed(8)), torch.nn.Parameter(signed(8))

    def forward(self, x, s):
        c = ops.custom_conv_add_act(x, self.w1, self.b1, [1], [1], [1], 1, x, 0.5, True, "silu", [])
        p = ops.custom_conv_act_max_pool(c, self.w2, self.b2, [1], [1], [1], 1, "relu", [], [2, 2], [2, 2],
                                         [0, 0], [1, 1], False)
        q = ops.custom_conv_batch_norm_act(p, self.w3, None, [1], [1], [1], 1, self.bn_w, self.bn_b,
                                           self.running_mean, self.running_var, self.training, 0.1, 1e-5, True,
                                           "hardswish", [])
        r = ops.custom_gate_mul(q, ops.custom_spatial_mean(q), "sigmoid", False)
        t = ops.custom_linear_act(s, self.lin_w, self.lin_b, "gelu", [], s, 1.0, True, False)
        n, total = ops.custom_add_layer_norm(t, s, 1.0, True, [8], self.ln_w, self.ln_b, 1e-5, True)
        a = ops.custom_unmasked_attention(n.unsqueeze(1), n.unsqueeze(1), n.unsqueeze(1))
        return r.square().mean() + a.square().mean() + total.sin().mean()


def step_matches_eager(eager, src, compiled, inputs, training):
    """One step of `compiled` (made from `src`, a copy of `eager`) against
    eager: the output, and in training every parameter's gradient (each
    one nonzero, so that none goes untested)."""
    with torch.set_grad_enabled(training):
        want = eager(*inputs)
        got = compiled(*inputs)
    torch.testing.assert_close(got, want)
    if training:
        for m in (eager, src):
            m.zero_grad(set_to_none=True)
        want.backward()
        got.backward()
        for (name, a), (_, b) in zip(eager.named_parameters(), src.named_parameters()):
            assert a.grad is not None and a.grad.abs().sum() > 0, name
            torch.testing.assert_close(b.grad, a.grad, msg=lambda m, name=name: f"grad of {name}: {m}")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_network_ops_compile_fullgraph_and_match_eager(training):
    """fullgraph=True over every op the passes insert into real networks:
    outputs, and in training the gradients and BatchNorm's running
    statistics, as the same module run eagerly, over two steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = NetworkOps().train(training)
    src = copy.deepcopy(eager)
    initial_mean = eager.running_mean.clone()
    compiled = torch.compile(src, fullgraph=True)
    for step in range(2):
        torch.manual_seed(30 + step)
        x, s = signed(2, 4, 8, 8), signed(2, 5, 8)
        step_matches_eager(eager, src, compiled, (x, s), training)
    for name in ("running_mean", "running_var"):
        torch.testing.assert_close(getattr(src, name), getattr(eager, name), msg=lambda m, name=name: f"{name}: {m}")
    assert torch.equal(src.running_mean, initial_mean) != training  # updated in training only


# ------------------------------------------------------------ dynamic shapes


class DynamicOps(torch.nn.Module):
    """Every op on inputs whose batch, spatial and row counts vary between
    calls; `other` comes from the inputs, per-channel and full-shaped."""

    def __init__(self):
        super().__init__()
        self.conv_w = torch.nn.Parameter(signed(4, 3, 3, 3))
        self.conv_b = torch.nn.Parameter(signed(4))
        self.conv_other = torch.nn.Parameter(signed(4, 1, 1))
        self.bn_w = torch.nn.Parameter(signed(4))
        self.bn_b = torch.nn.Parameter(signed(4))
        self.register_buffer("running_mean", signed(4) * 0.1)
        self.register_buffer("running_var", torch.rand(4) + 0.5)
        self.lin_w = torch.nn.Parameter(signed(6, 5))
        self.lin_b = torch.nn.Parameter(signed(6))

    def forward(self, x, y, o):
        h = ops.custom_conv_relu_add(x, self.conv_w, self.conv_b, [1], [1], [1], 1, self.conv_other, 0.5)
        g = ops.custom_conv_relu_add(x, self.conv_w, None, [2], [0], [1], 1, 1.5 * self.conv_other, 1)
        h = ops.custom_batch_norm_add_div_swish(
            h, self.bn_w, self.bn_b, self.running_mean, self.running_var, self.training, 0.1, 1e-5, h.cos(), 2.0)
        z = ops.custom_relu(ops.custom_linear_add_relu(y, self.lin_w, self.lin_b, o, -1.0) - 0.25)
        return h.square().mean() + g.sin().mean() + z.square().mean()


# (x, y, o) sizes: every dynamic dimension changes from one call to the next.
# NB: the first call's sizes differ from each other and from the parameters'
# (3, 4, 5, 6), or duck sizing gives them one symbol, which the parameters'
# sizes then specialise.
DYNAMIC_SIZES = [((2, 3, 7, 8), (9, 5), (9, 6)), ((3, 3, 9, 7), (10, 5), (10, 6)),
                 ((4, 3, 8, 10), (7, 5), (7, 6))]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_compiled_dynamic_shapes_match_eager_without_recompiling(training):
    """dynamic=True: one graph serves every size (the kernels and the
    Autograd kernels read symbolic sizes, so none is specialised), and
    outputs, gradients and running statistics match eager at each."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = DynamicOps().double().train(training)
    src = copy.deepcopy(eager)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(src, fullgraph=True, dynamic=True, backend=counter)
    for step, sizes in enumerate(DYNAMIC_SIZES):
        torch.manual_seed(20 + step)
        x, y, o = (signed(*s).double() for s in sizes)
        step_matches_eager(eager, src, compiled, (x, y, o), training)
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(src, name), getattr(eager, name), msg=lambda m, name=name: f"{name}: {m}")
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} graphs for {len(DYNAMIC_SIZES)} sizes"


def test_import_tags_the_compile_caches_with_the_ops_library():
    """The caches key graphs by the ops' schemas: the ops library's identity
    joins their key tag, after a tag the user set, and only once."""
    import os
    import subprocess
    import sys

    import torch.compiler.config as compiler_config

    import torchfuse

    st = os.stat(torchfuse.library_path())
    ident = f"torchfuse-{torchfuse.__version__}-{st.st_size}-{st.st_mtime_ns}"
    assert ident in compiler_config.cache_key_tag.split(";")
    code = ("import importlib, torch.compiler.config as c, torchfuse; "
            "importlib.reload(torchfuse); print(c.cache_key_tag)")
    env = dict(os.environ, TORCH_COMPILE_CACHE_KEY_TAG="mine")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == f"mine;{ident}", out


class NetworkAten(NetworkOps):
    """NetworkOps' chains as the ATen ops the passes replace."""

    def forward(self, x, s):
        F = torch.nn.functional
        c = F.silu(F.conv2d(x, self.w1, self.b1, 1, 1) + 0.5 * x)
        p = F.max_pool2d(F.relu(F.conv2d(c, self.w2, self.b2, 1, 1)), 2, 2)
        q = F.hardswish(F.batch_norm(F.conv2d(p, self.w3, None, 1, 1), self.running_mean, self.running_var,
                                     self.bn_w, self.bn_b, self.training, 0.1, 1e-5))
        r = q * torch.sigmoid(F.adaptive_avg_pool2d(q, 1))
        t = F.gelu(F.linear(s, self.lin_w, self.lin_b) + s)
        total = t + s
        n = F.layer_norm(total, [8], self.ln_w, self.ln_b, 1e-5)
        a = F.scaled_dot_product_attention(n.unsqueeze(1), n.unsqueeze(1), n.unsqueeze(1))
        return r.square().mean() + a.square().mean() + total.sin().mean()


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_network_ops_compile_with_dynamic_sizes_as_their_aten_chains(training):
    """dynamic=True over NetworkOps while batch, spatial sizes and token
    counts change from call to call: the results (and gradients) match
    eager at each size, and the ops cost no more compiles than the same
    network written in the ATen ops they replace (whose convolution's
    backward specializes spatial sizes in training on its own)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    sizes = [((3, 4, 10, 6), (2, 7, 8)), ((2, 4, 6, 12), (3, 5, 8)), ((5, 4, 8, 8), (4, 6, 8))]
    frames = {}
    for cls in (NetworkOps, NetworkAten):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = cls().double().train(training)
        src = copy.deepcopy(eager)
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(src, fullgraph=True, dynamic=True, backend=counter)
        for step, (xs, ss) in enumerate(sizes):
            torch.manual_seed(40 + step)
            x, s = signed(*xs).double(), signed(*ss).double()
            step_matches_eager(eager, src, compiled, (x, s), training)
        frames[cls.__name__] = counter.frame_count
    assert frames["NetworkOps"] <= frames["NetworkAten"], frames
    if not training:
        assert frames["NetworkOps"] == 1, frames


def test_network_ops_compute_their_aten_chains():
    """NetworkOps and NetworkAten are the same function (the comparison
    above is like for like), in float64, in training and in eval."""
    torch.manual_seed(0)
    ops_m = NetworkOps().double()
    aten_m = NetworkAten().double()
    aten_m.load_state_dict(ops_m.state_dict())
    x, s = signed(2, 4, 8, 8).double(), signed(2, 5, 8).double()
    for training in (True, False):
        ops_m.train(training)
        aten_m.train(training)
        torch.testing.assert_close(ops_m(x, s), aten_m(x, s))
    torch.testing.assert_close(ops_m.running_mean, aten_m.running_mean)
