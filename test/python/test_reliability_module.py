"""Module-level reliability of torchfuse.optimize (issue 24, items 1, 2, 8 and
11): the result shares its parameters and buffers with the input module (tied
stays tied, an optimizer built on the original keeps working), repeated
optimize calls free what they allocate, preserved_attrs keeps exported methods
and attributes through freezing, a frozen result can be optimized again, and a
bare string for passes is refused clearly."""

import copy
import ctypes
import gc
import io
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.testing import FileCheck

import torchfuse
from test_cli import EXIT_OK, EXIT_OPTIMIZE, EXIT_USAGE, cli, run  # noqa: F401 (fixture)


# ---- tied weights and shared buffers -------------------------------------------


class Tied(nn.Module):
    """fc2 reuses fc1's weight; bn2 reuses bn1's running mean."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 6)
        self.fc2 = nn.Linear(6, 6)
        self.fc2.weight = self.fc1.weight
        self.bn1 = nn.BatchNorm1d(6)
        self.bn2 = nn.BatchNorm1d(6)
        self.bn2.running_mean = self.bn1.running_mean

    def forward(self, x):
        h = self.bn1(torch.relu(self.fc1(x) + x))
        return self.bn2(torch.relu(self.fc2(h) + h))


def _tied_model():
    m = Tied().double()
    m.bn2.running_mean = m.bn1.running_mean  # .double() converts each buffer apart
    with torch.no_grad():
        m.bn1.running_mean.uniform_(-1, 1)
        m.bn1.running_var.uniform_(0.5, 2)
        m.bn2.running_var.uniform_(0.5, 2)
    return m


def _assert_tied(m):
    assert len(list(m.parameters())) == 7  # 8 when untied
    assert len(list(m.buffers())) == 5  # 6 when untied
    assert m.fc1.weight.data_ptr() == m.fc2.weight.data_ptr()
    assert m.bn1.running_mean.data_ptr() == m.bn2.running_mean.data_ptr()


def _reload(m):
    buf = io.BytesIO()
    torch.jit.save(m, buf)
    buf.seek(0)
    return torch.jit.load(buf)


def _tensor_constants(graph):
    return [n.t("value") for n in graph.findAllNodes("prim::Constant") if n.kindOf("value") == "t"]


def test_optimize_keeps_tied_parameters_and_shared_buffers():
    src = torch.jit.script(_tied_model())
    opt = torchfuse.optimize(src)
    assert torchfuse.report(opt)["linear_add_relu"] == 2
    _assert_tied(opt)
    # The very tensors of the input module: no copy.
    for name, p in src.named_parameters():
        assert dict(opt.named_parameters())[name] is p
    for name, b in src.named_buffers():
        assert dict(opt.named_buffers())[name] is b
    _assert_tied(_reload(opt))


def test_an_optimizer_on_the_original_trains_the_optimized_module():
    """3 SGD steps in train mode, the optimizer built on the ORIGINAL module's
    parameters, match the unoptimized scripted module stepped the same way."""
    model = _tied_model()
    ref = torch.jit.script(copy.deepcopy(model))
    src = torch.jit.script(model)
    opt = torchfuse.optimize(src)
    sgd_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    sgd_src = torch.optim.SGD(src.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(8, 6, dtype=torch.float64)
        for module, sgd in ((ref, sgd_ref), (opt, sgd_src)):
            sgd.zero_grad()
            (module(x) * torch.linspace(-1, 1, 6, dtype=torch.float64)).sum().backward()
            sgd.step()
    for name, b in ref.named_buffers():
        torch.testing.assert_close(dict(opt.named_buffers())[name], b)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(dict(src.named_parameters())[name], p)
    ref.eval()
    opt.eval()
    x = torch.randn(8, 6, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), ref(x))


def test_frozen_result_uses_the_inputs_tensors():
    src = torch.jit.script(_tied_model().eval())
    opt = torchfuse.optimize(src, freeze=True)
    assert torchfuse.report(opt)["linear_add_relu"] == 2
    for m in (opt, _reload(opt)):
        fused = m.graph.findAllNodes("torchfuse::custom_linear_add_relu")
        assert len(fused) == 2
        weights = [n.inputsAt(1).node().t("value") for n in fused]
        # Tied stays tied: both fused ops read one tensor.
        assert weights[0].data_ptr() == weights[1].data_ptr()
    ptrs = {t.data_ptr() for t in _tensor_constants(opt.graph)}
    assert src.fc1.weight.data_ptr() in ptrs
    assert src.bn1.running_mean.data_ptr() in ptrs


class WritesBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(3))
        self.register_buffer("alias", self.count)

    def forward(self, x):
        self.count.add_(1.0)
        return torch.relu(self.fc(x) + self.alias)


@pytest.mark.parametrize("freeze", [False, True])
def test_buffers_the_forward_writes_stay_shared(freeze):
    src = torch.jit.script(WritesBuffer().eval())
    opt = torchfuse.optimize(src, freeze=freeze)
    x = torch.randn(2, 3)
    with torch.no_grad():
        opt(x)
        opt(x)
    torch.testing.assert_close(src.count, torch.full((3,), 2.0))
    assert opt.count.data_ptr() == src.count.data_ptr()
    reloaded = _reload(opt)
    assert reloaded.count.data_ptr() == reloaded.alias.data_ptr()


@pytest.mark.parametrize("freeze", [False, True])
def test_the_input_modules_methods_are_unchanged(freeze):
    src = torch.jit.script(_tied_model().train(not freeze))
    x = torch.randn(8, 6, dtype=torch.float64)
    src(x)
    graph, code, inlined = str(src.graph), src.code, str(src.inlined_graph)
    sibling = torch.jit.script(_tied_model())
    opt = torchfuse.optimize(src, freeze=freeze)
    opt(x)
    assert (str(src.graph), src.code, str(src.inlined_graph)) == (graph, code, inlined)
    FileCheck().check_not("torchfuse::").run(src.inlined_graph)
    FileCheck().check_not("torchfuse::").run(sibling.inlined_graph)
    assert all(p.is_leaf and p.requires_grad for p in src.parameters())


# ---- memory held after optimize ---------------------------------------------------


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _allocated_bytes():
    """Bytes malloc has handed out and not taken back (heap and mmap): unlike
    RSS, not inflated by freed memory that malloc keeps for reuse."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        pytest.skip("needs glibc's mallinfo2 to measure allocated memory")
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


class Convs(nn.Module):
    """About 9 MB of parameters."""

    def __init__(self):
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(256, 256, 3, padding=1) for _ in range(4)])

    def forward(self, x):
        y = torch.relu(self.convs[0](x)) + x
        y = torch.relu(self.convs[1](y)) + y
        return self.convs[3](self.convs[2](y))


@pytest.mark.parametrize("freeze", [False, True])
def test_repeated_optimize_does_not_accumulate_memory(freeze):
    """Each call optimizes a new model; neither input nor result is kept.
    Before, every frozen result's forward stayed registered (with its
    constants) in the shared compilation unit: one parameter copy per call."""
    param_bytes = sum(p.numel() * p.element_size() for p in Convs().parameters())

    def once():
        src = torch.jit.script(Convs().eval())
        opt = torchfuse.optimize(src, freeze=freeze)
        assert torchfuse.report(opt)["conv_relu_add"] == 2

    for _ in range(3):
        once()
    gc.collect()
    before = _allocated_bytes()
    calls = 30
    for _ in range(calls):
        once()
    gc.collect()
    growth = _allocated_bytes() - before
    # The bug grows by ~calls copies; allow 3 for allocator noise.
    assert growth < 3 * param_bytes, f"{growth / param_bytes:.1f} parameter copies after {calls} calls"


_CLASS_OF_A_DELETED_INPUT = r"""
import gc, io, torch, torchfuse, torch.nn as nn

@torch.jit.script
class Acc:
    def __init__(self, t: torch.Tensor):
        self.t = t

    def add(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.t + x)

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return Acc(self.fc(x)).add(x)

buf = io.BytesIO()
torch.jit.save(torch.jit.script(M()), buf)
x = torch.randn(2, 4)
for freeze in (False, True):
    buf.seek(0)
    loaded = torch.jit.load(buf)  # the class lives in this module's compilation unit
    if freeze:
        loaded.eval()
    want = loaded(x)
    opt = torchfuse.optimize(loaded, freeze=freeze)
    assert "prim::CreateObject" in str(opt.graph)
    del loaded
    gc.collect()
    torch.testing.assert_close(opt(x), want)
    saved = io.BytesIO()
    torch.jit.save(opt, saved)
    saved.seek(0)
    torch.testing.assert_close(torch.jit.load(saved)(x), want)
print("ok")
"""


def test_result_outlives_the_input_whose_classes_it_uses(tmp_path):
    """The result's types live in a compilation unit of their own, which
    keeps the input's alive: a graph that creates an object of the input's
    TorchScript class must run and save after the input is gone (a crash
    otherwise, hence the fresh process)."""
    script = tmp_path / "outlives.py"  # torch.jit.script needs the source in a file
    script.write_text(_CLASS_OF_A_DELETED_INPUT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# ---- preserved_attrs ---------------------------------------------------------------


class Exported(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 2.0

    @torch.jit.export
    def embed(self, x):
        return torch.relu(self.fc(x) + x) * self.scale

    def forward(self, x):
        return torch.relu(self.fc(x) + x) * self.scale


def test_preserved_attrs_keeps_exported_methods_and_attributes():
    ref = torch.jit.script(Exported().eval().double())
    src = torch.jit.script(copy.deepcopy(ref))
    x = torch.randn(3, 4, dtype=torch.float64)
    # torch.jit.freeze's behaviour without preserved_attrs: both are gone.
    plain = torchfuse.optimize(src, freeze=True)
    assert not plain._c._has_method("embed")
    assert not plain._c.hasattr("scale")
    opt = torchfuse.optimize(src, freeze=True, preserved_attrs=["embed", "scale"])
    assert torchfuse.report(opt)["linear_add_relu"] == 1
    with torch.no_grad():
        torch.testing.assert_close(opt.embed(x), ref.embed(x))
        torch.testing.assert_close(opt(x), ref(x))
        # scale stays an attribute that forward reads, not a folded constant
        opt.scale = -3.0
        ref.scale = -3.0
        torch.testing.assert_close(opt(x), ref(x))
        torch.testing.assert_close(opt.embed(x), ref.embed(x))
    reloaded = _reload(opt)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.embed(x), ref.embed(x))


def test_preserved_attrs_without_freeze_keeps_everything():
    src = torch.jit.script(Exported())
    opt = torchfuse.optimize(src, preserved_attrs=["embed"])
    x = torch.randn(3, 4)
    torch.testing.assert_close(opt.embed(x), src.embed(x))


@pytest.mark.parametrize("freeze", [False, True])
def test_preserved_attrs_rejects_unknown_names(freeze):
    src = torch.jit.script(Exported().eval())
    with pytest.raises(RuntimeError, match=r"preserved_attrs.*'nope'.*no attribute or method"):
        torchfuse.optimize(src, freeze=freeze, preserved_attrs=["embed", "nope"])
    with pytest.raises(RuntimeError, match=r"'fc\.nope'"):
        torchfuse.optimize(src, freeze=freeze, preserved_attrs=["fc.nope"])
    with pytest.raises(TypeError, match=r"preserved_attrs.*list of names.*str 'embed'"):
        torchfuse.optimize(src, freeze=freeze, preserved_attrs="embed")


def test_preserved_attrs_names_submodule_attributes():
    ref = torch.jit.script(Exported().eval())
    src = torch.jit.script(copy.deepcopy(ref))
    opt = torchfuse.optimize(src, freeze=True, preserved_attrs=["fc.weight"])
    assert opt.fc.weight.data_ptr() == src.fc.weight.data_ptr()
    x = torch.randn(3, 4)
    with torch.no_grad():
        src.fc.weight.mul_(-1.0)
        ref.fc.weight.mul_(-1.0)
        torch.testing.assert_close(opt(x), ref(x))


# ---- re-optimizing, passes given as a string ------------------------------------


def test_reoptimizing_a_frozen_result_with_freeze():
    ref = torch.jit.script(Exported().eval())
    once = torchfuse.optimize(torch.jit.script(copy.deepcopy(ref)), freeze=True)
    assert not once._c.hasattr("training")
    twice = torchfuse.optimize(once, freeze=True)
    assert torchfuse.report(twice)["linear_add_relu"] == 1
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(twice(x), ref(x))


def test_freeze_still_refuses_a_training_module():
    with pytest.raises(RuntimeError, match="eval mode"):
        torchfuse.optimize(torch.jit.script(Exported()), freeze=True)


@pytest.mark.parametrize(
    "value,message",
    [("relu", r"passes to be a list of pass names, got the str 'relu'; write passes=\['relu'\]"),
     (b"relu", r"passes to be a list of pass names, got the bytes b'relu'")],
    ids=["str", "bytes"],
)
def test_passes_as_a_bare_string_is_refused(value, message):
    src = torch.jit.script(Exported())
    with pytest.raises(TypeError, match=message):
        torchfuse.optimize(src, passes=value)


def test_passes_with_a_non_string_name_is_refused():
    src = torch.jit.script(Exported())
    with pytest.raises(TypeError, match=r"passes.*pass names.*int"):
        torchfuse.optimize(src, passes=["relu", 3])


# ---- the CLI's --preserve-attr -------------------------------------------------------


def _save_exported(tmp_path, train=False):
    path = tmp_path / "exported.pt"
    torch.jit.script(Exported().train(train)).save(str(path))
    return path


@pytest.mark.parametrize(
    "args", [["--preserve-attr", "embed", "--preserve-attr=scale"], ["--preserve-attr", "embed,scale"]],
    ids=["repeated", "comma-list"],
)
def test_cli_preserve_attr(cli, tmp_path, args):
    src = _save_exported(tmp_path)
    out = tmp_path / "out.pt"
    proc = run(cli, src, out, "--freeze", *args)
    assert proc.returncode == EXIT_OK, proc.stderr
    ref, opt = torch.jit.load(str(src)), torch.jit.load(str(out))
    assert torchfuse.report(opt)["linear_add_relu"] == 1
    assert opt._c.hasattr("scale")
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(opt.embed(x), ref.embed(x))
    # without the option freezing drops both
    proc = run(cli, src, out, "--freeze")
    assert proc.returncode == EXIT_OK, proc.stderr
    opt = torch.jit.load(str(out))
    assert not opt._c._has_method("embed") and not opt._c.hasattr("scale")


def test_cli_preserve_attr_unknown_name(cli, tmp_path):
    src = _save_exported(tmp_path)
    out = tmp_path / "out.pt"
    proc = run(cli, src, out, "--freeze", "--preserve-attr", "embed,nope")
    assert proc.returncode == EXIT_OPTIMIZE
    assert proc.stderr.count("\n") == 1
    assert "'nope'" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--preserve-attr", "embed"], "--preserve-attr is only used with --freeze"),
        (["--freeze", "--preserve-attr", "embed,"], "--preserve-attr 'embed,' has an empty name"),
        (["--freeze", "--preserve-attr="], "--preserve-attr '' has an empty name"),
        (["--freeze", "--preserve-attr"], "--preserve-attr needs a value"),
    ],
)
def test_cli_preserve_attr_usage_errors(cli, tmp_path, args, message):
    src = _save_exported(tmp_path)
    out = tmp_path / "out.pt"
    proc = run(cli, src, out, *args)
    assert proc.returncode == EXIT_USAGE
    assert message in proc.stderr
    assert not out.exists()


def test_cli_freeze_of_a_frozen_model(cli, tmp_path):
    src = _save_exported(tmp_path)
    once, twice = tmp_path / "once.pt", tmp_path / "twice.pt"
    assert run(cli, src, once, "--freeze").returncode == EXIT_OK
    proc = run(cli, once, twice, "--freeze")
    assert proc.returncode == EXIT_OK, proc.stderr
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(torch.jit.load(str(twice))(x), torch.jit.load(str(src))(x))
