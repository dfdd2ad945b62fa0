"""The example apps (examples/*) configured and built against an installed
torchfuse, as a user builds them: the tests of the CMake package, the wheel
and the AOTInductor package share this."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def cmake(*args, env=None, cwd=None, timeout=900):
    # NB: the cmake of the test's own PATH: a user's environment (env) may
    # not list where it is installed (e.g. pip's cmake in another venv).
    return subprocess.run([shutil.which("cmake") or "cmake", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def launcher_args():
    # ccache keeps the repeated example builds fast.  NB: by its path: the
    # user environment an example builds in may not have it on its PATH
    # (requirements-test.txt puts it beside the build's Python).
    ccache = shutil.which("ccache")
    return [f"-DCMAKE_CXX_COMPILER_LAUNCHER={ccache}"] if ccache else []


def build_example(name: str, prefix_path: str, build: Path, env=None) -> Path:
    """examples/<name> built in `build` with CMAKE_PREFIX_PATH `prefix_path`;
    the app's path."""
    proc = cmake("-S", REPO / "examples" / name, "-B", build, f"-DCMAKE_PREFIX_PATH={prefix_path}",
                 "-DCMAKE_BUILD_TYPE=Release", *launcher_args(), env=env)
    assert proc.returncode == 0, f"cmake configure of {name} failed:\n{proc.stdout}\n{proc.stderr}"
    proc = cmake("--build", build, "-j", "2", env=env)
    assert proc.returncode == 0, f"cmake --build of {name} failed:\n{proc.stdout}\n{proc.stderr}"
    return build / name


def build_dir() -> Path:
    """The build under test (TORCHFUSE_BUILD_DIR, which env.sh sets)."""
    build = os.environ.get("TORCHFUSE_BUILD_DIR")
    if not build:
        pytest.skip("TORCHFUSE_BUILD_DIR is not set; source env.sh after `make build`")
    return Path(build)


def write_passes_consumer(project: Path, extra: str = "") -> Path:
    """A CMake project that finds torchfuse with its passes component and
    fails unless both targets exist; `extra` is appended."""
    project.mkdir(parents=True, exist_ok=True)
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.22)\n"
        "project(consumer LANGUAGES CXX)\n"
        "find_package(torchfuse 0.1 REQUIRED COMPONENTS passes)\n"
        "foreach(t torchfuse::ops torchfuse::passes)\n"
        "  if(NOT TARGET ${t})\n"
        "    message(FATAL_ERROR \"missing ${t}\")\n"
        "  endif()\n"
        "endforeach()\n" + extra
    )
    return project
