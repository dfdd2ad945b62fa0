"""torch.export → torchfuse.fx.optimize_exported → AOTInductor: the CLI
(python -m torchfuse.export_cli) on saved programs, its errors, and one
small model compiled into a .pt2 package that Python and the
examples/aoti_inference C++ app (built against the installed package,
linking torchfuse::ops) run as eager does."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse.fx as tfx
from torchfuse import export_cli

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_apps import build_dir, build_example, cmake  # noqa: E402

# NB: torch.export.load of a saved program warns (torch's own
# frombuffer of its read-only archive), which the suite's "error" filter
# would turn into a failure
LOAD_WARNING = "ignore:The given buffer is not writable:UserWarning"


class Net(nn.Module):
    """One chain of each default fusion."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        h = F.relu(self.conv(x)) + x.mean(1, keepdim=True)
        t = (self.bn(h) + h) / 2.0
        h = t * torch.sigmoid(t)
        return F.relu(self.lin(h.mean((2, 3))) + 0.5 * h.amax((1, 2, 3)).unsqueeze(1))


def net():
    torch.manual_seed(0)
    m = Net().eval()
    with torch.no_grad():  # non-trivial statistics
        m.bn.running_mean.uniform_(-0.2, 0.2)
        m.bn.running_var.uniform_(0.5, 1.5)
    return m


def saved_program(tmp_path, x=None) -> Path:
    x = torch.randn(2, 3, 8, 8) if x is None else x
    path = tmp_path / "net.pt2"
    torch.export.save(torch.export.export(net(), (x,)), str(path))
    return path


def cli(*args):
    proc = subprocess.run([sys.executable, "-m", "torchfuse.export_cli", *map(str, args)],
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.filterwarnings(LOAD_WARNING)
def test_cli_rewrites_a_saved_program(tmp_path):
    src = saved_program(tmp_path)
    out = tmp_path / "net.opt.pt2"
    assert export_cli.main([str(src), str(out), "--check-accuracy", "-q"]) == 0
    ep = torch.export.load(str(out))
    assert tfx.report(ep) == {"conv_relu_add": 1, "conv_act_max_pool": 0, "gate_mul": 0, "conv_add_act": 0, "conv_batch_norm_act": 0,
                              "linear_add_relu": 1, "batch_norm_add_div_swish": 1, "linear_act": 0,
                              "add_layer_norm": 0, "relu": 0}
    x = torch.randn(2, 3, 8, 8)  # the exported (static) shape
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), net()(x))


@pytest.mark.filterwarnings(LOAD_WARNING)
def test_cli_passes_select_the_fusions(tmp_path, capsys):
    src = saved_program(tmp_path)
    out = tmp_path / "net.opt.pt2"
    assert export_cli.main([str(src), str(out), "--passes", "linear_add_relu"]) == 0
    assert "fused: conv_relu_add=0, linear_add_relu=1, batch_norm_add_div_swish=0, conv_act_max_pool=0, gate_mul=0, conv_add_act=0, conv_batch_norm_act=0, linear_act=0, add_layer_norm=0, relu=0" in capsys.readouterr().out


@pytest.mark.filterwarnings(LOAD_WARNING)
@pytest.mark.parametrize("case", ["missing", "torchscript", "unknown_pass", "no_directory"])
def test_cli_errors(tmp_path, capsys, case):
    src = saved_program(tmp_path)
    out = tmp_path / "out.pt2"
    if case == "missing":
        argv, code, text = [str(tmp_path / "nope.pt2"), str(out)], 1, "cannot read .*nope.pt2: no such file"
    elif case == "torchscript":
        ts = tmp_path / "net.pt"
        torch.jit.script(net()).save(str(ts))
        argv, code, text = [str(ts), str(out)], 1, "is not a program saved with torch.export.save"
    elif case == "unknown_pass":
        argv, code, text = [str(src), str(out), "--passes", "relu,nope"], 2, r"unknown pass name\(s\) \['nope'\]"
    else:
        argv, code, text = [str(src), str(tmp_path / "no" / "out.pt2")], 1, "directory .* does not exist"
    assert export_cli.main(argv) == code
    err = capsys.readouterr().err
    assert re.search(r"^python -m torchfuse.export_cli: error: .*" + text, err), err
    assert not out.exists()


@pytest.mark.filterwarnings(LOAD_WARNING)
def test_cli_check_accuracy_fails_on_a_difference(tmp_path, capsys, monkeypatch):
    """--check-accuracy compares with the original: a rewrite that changed
    the result (simulated: the conv's other scaled) exits 3."""
    src = saved_program(tmp_path)
    real = tfx.optimize_exported

    def broken(ep, passes=None):
        out = real(ep, passes=passes)
        for n in out.graph_module.graph.nodes:
            if n.target is torch.ops.torchfuse.custom_conv_relu_add.default:
                n.args = n.args[:-1] + (2.0,)
        out.graph_module.recompile()
        return out

    monkeypatch.setattr(tfx, "optimize_exported", broken)
    assert export_cli.main([str(src), str(tmp_path / "out.pt2"), "--check-accuracy"]) == 3
    assert "--check-accuracy: output 0 differs" in capsys.readouterr().err


# ---------------------------------------------------------- AOTInductor


@pytest.fixture(scope="module")
def aoti_app(tmp_path_factory):
    """examples/aoti_inference built against the installed package."""
    prefix = tmp_path_factory.mktemp("prefix")
    proc = cmake("--install", build_dir(), "--prefix", prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build_example("aoti_inference", f"{prefix};{torch.utils.cmake_prefix_path}",
                         tmp_path_factory.mktemp("aoti_inference"))


def test_aoti_package_runs_in_python_and_cpp_as_eager(tmp_path, aoti_app):
    """The CLI's --aoti package of the rewritten program: its compiled code
    calls the torchfuse ops, and Python and C++ both run it as eager.
    NB: one small model (the compile takes most of this test's time)."""
    shape = (2, 3, 8, 8)
    src = saved_program(tmp_path, torch.randn(*shape))
    package = tmp_path / "net.aoti.pt2"
    start = time.monotonic()
    code, out, err = cli(src, package, "--aoti")
    elapsed = time.monotonic() - start
    assert code == 0, err
    assert "wrote AOTInductor package" in out
    print(f"AOTInductor compile (CLI, CPU): {elapsed:.1f} s")
    # the ops are called by name from the compiled package
    import zipfile

    names = zipfile.ZipFile(package).namelist()
    wrappers = [n for n in names if n.endswith(".wrapper.json")]
    assert wrappers, names
    called = zipfile.ZipFile(package).read(wrappers[0]).decode()
    for op in ("custom_conv_relu_add", "custom_linear_add_relu", "custom_batch_norm_add_div_swish_eval"):
        assert f"torchfuse::{op}" in called, called

    loaded = torch._inductor.aoti_load_package(str(package))
    model = net()
    for seed in (0, 7):
        torch.manual_seed(seed)
        x = torch.randn(*shape)
        with torch.no_grad():
            want = model(x)
            torch.testing.assert_close(loaded(x), want)
        env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
        proc = subprocess.run([str(aoti_app), str(package), "x".join(map(str, shape)), str(seed)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        got_shape = re.search(r"^output shape: \[(.*)\]$", proc.stdout, re.M)
        checksum = re.search(r"^checksum: (\S+)$", proc.stdout, re.M)
        abs_checksum = re.search(r"^abs checksum: (\S+)$", proc.stdout, re.M)
        assert got_shape and checksum and abs_checksum, proc.stdout
        assert [int(v) for v in got_shape.group(1).split(", ")] == list(want.shape)
        want64 = want.double()
        assert float(checksum.group(1)) == pytest.approx(want64.sum().item(), rel=1e-5, abs=1e-5)
        assert float(abs_checksum.group(1)) == pytest.approx(want64.abs().sum().item(), rel=1e-5)


def test_aoti_app_without_a_package_fails_clearly(aoti_app, tmp_path):
    proc = subprocess.run([str(aoti_app), str(tmp_path / "nope.pt2"), "1x3x8x8"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.startswith("aoti_inference: "), proc.stderr
