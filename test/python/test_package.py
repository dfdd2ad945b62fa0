"""The installed CMake package: `cmake --install` of the build under test, the
cpp_inference example built out of tree against it, and the Config's Torch
version check."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchfuse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_apps import build_dir, build_example, cmake, write_passes_consumer  # noqa: E402

TORCH_VERSION = torch.__version__.split("+")[0]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    """The build under test, installed into a fresh prefix."""
    build = build_dir()
    prefix = tmp_path_factory.mktemp("prefix")
    proc = cmake("--install", build, "--prefix", prefix)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return prefix


@pytest.fixture(scope="module")
def example_app(prefix, tmp_path_factory):
    """examples/cpp_inference configured and built against the installed package."""
    return build_example("cpp_inference", f"{prefix};{torch.utils.cmake_prefix_path}",
                         tmp_path_factory.mktemp("cpp_inference"))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.fc = torch.nn.Linear(3 * 8 * 8, 3 * 8 * 8)

    def forward(self, x):
        y = torch.relu(self.conv(x)) + x
        f = torch.flatten(y, 1)
        return torch.relu(self.fc(f) + f)


def _optimized_model(tmp_path) -> Path:
    torch.manual_seed(0)
    scripted = torch.jit.script(Net().eval())
    path = tmp_path / "net.opt.pt"
    if hasattr(torchfuse, "optimize"):
        torchfuse.optimize(scripted, freeze=True).save(str(path))
    else:
        src = tmp_path / "net.pt"
        scripted.save(str(src))
        cli = build_dir() / "bin" / "optimize-model"
        if not cli.exists():
            pytest.skip("neither torchfuse.optimize nor optimize-model is built")
        subprocess.run([str(cli), str(src), str(path), "--freeze", "-q"], check=True)
    graph = str(torch.jit.load(str(path)).graph)
    assert "torchfuse::custom_" in graph, graph
    return path


def test_install_has_headers_libraries_and_package_files(prefix):
    for header in ("torchfuse.h", "ops.h", "optimize.h", "passes.h", "export.h"):
        assert (prefix / "include" / "torchfuse" / header).is_file(), header
    libs = {p.name for p in (prefix / "lib").iterdir()}
    assert "libtorchfuse_ops.so" in libs
    cmake_dir = prefix / "lib" / "cmake" / "torchfuse"
    for name in ("torchfuseConfig.cmake", "torchfuseConfigVersion.cmake",
                 "torchfuseTargets.cmake"):
        assert (cmake_dir / name).is_file(), name
    targets = (cmake_dir / "torchfuseTargets.cmake").read_text()
    assert "add_library(torchfuse::ops " in targets
    # the wrapper that keeps the library linked under --as-needed
    assert "--no-as-needed" in targets


@pytest.mark.parametrize("seed", [0, 7])
def test_example_runs_an_optimized_model_like_python(example_app, tmp_path, seed):
    model = _optimized_model(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run([str(example_app), str(model), "2x3x8x8", str(seed)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    shape = re.search(r"^output shape: \[(.*)\]$", proc.stdout, re.M)
    checksum = re.search(r"^checksum: (\S+)$", proc.stdout, re.M)
    assert shape and checksum, proc.stdout

    m = torch.jit.load(str(model))
    torch.manual_seed(seed)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        expected = m(x)
    assert [int(d) for d in shape.group(1).split(",")] == list(expected.shape)
    assert float(checksum.group(1)) == pytest.approx(expected.double().sum().item(), rel=1e-6)


def test_example_links_the_ops_library_without_referencing_it(example_app):
    readelf = shutil.which("readelf")
    if not readelf:
        pytest.skip("readelf is not installed")
    dynamic = subprocess.run([readelf, "-d", str(example_app)], capture_output=True,
                             text=True, check=True).stdout
    assert re.search(r"NEEDED.*\[libtorchfuse_ops\.so", dynamic), dynamic


def test_installed_cli_runs_from_the_prefix(prefix, tmp_path):
    cli = prefix / "bin" / "optimize-model"
    if not cli.exists():
        if (build_dir() / "bin" / "optimize-model").exists():
            pytest.fail("optimize-model is built but was not installed")
        pytest.skip("optimize-model is not built (no torchfuse_passes yet)")
    torch.manual_seed(0)
    src = tmp_path / "net.pt"
    torch.jit.script(Net().eval()).save(str(src))
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    proc = subprocess.run([str(cli), str(src), str(tmp_path / "out.pt"), "--freeze"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr


def test_config_gives_the_passes_component(prefix, tmp_path):
    if not list((prefix / "lib").glob("libtorchfuse_passes.so*")):
        pytest.skip("this build has no torchfuse_passes library yet")
    project = write_passes_consumer(tmp_path / "consumer")
    proc = cmake("-S", project, "-B", tmp_path / "build",
                  f"-DCMAKE_PREFIX_PATH={prefix};{torch.utils.cmake_prefix_path}")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fake_torch(tmp_path, version):
    fake = tmp_path / f"fake-torch-{version}"
    fake.mkdir()
    (fake / "TorchConfig.cmake").write_text(
        "set(TORCH_FOUND TRUE)\nset(TORCH_LIBRARIES torch)\n"
    )
    (fake / "TorchConfigVersion.cmake").write_text(
        f'set(PACKAGE_VERSION "{version}")\n'
        "set(PACKAGE_VERSION_COMPATIBLE TRUE)\n"
        'if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)\n'
        "  set(PACKAGE_VERSION_EXACT TRUE)\n"
        "endif()\n"
    )
    return fake


def _configure_with_torch_dir(prefix, tmp_path, torch_dir):
    project = tmp_path / "consumer"
    project.mkdir(exist_ok=True)
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.22)\n"
        "project(consumer LANGUAGES NONE)\n"
        "find_package(torchfuse REQUIRED)\n"
    )
    return cmake("-S", project, "-B", tmp_path / "build", f"-DCMAKE_PREFIX_PATH={prefix}",
                  f"-DTorch_DIR={torch_dir}")


@pytest.mark.parametrize("version", ["2.10.0", "2.11.1", "3.0.0"])
def test_config_rejects_another_torch_version(prefix, tmp_path, version):
    proc = _configure_with_torch_dir(prefix, tmp_path, _fake_torch(tmp_path, version))
    assert proc.returncode != 0
    message = re.sub(r"\s+", " ", proc.stderr)
    assert (
        f"was built against Torch {TORCH_VERSION}, but this project found Torch {version}"
        in message
    ), proc.stderr


def test_config_accepts_the_torch_version_it_was_built_with(prefix, tmp_path):
    # The same fake Torch, at the right version, passes the check and goes on
    # to import the targets.
    proc = _configure_with_torch_dir(prefix, tmp_path, _fake_torch(tmp_path, TORCH_VERSION))
    message = re.sub(r"\s+", " ", proc.stderr)
    assert "was built against Torch" not in message, proc.stderr
