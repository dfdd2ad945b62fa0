"""The example apps (examples/*) configured and built against an installed
torchfuse, as a user builds them: the tests of the CMake package, the wheel
and the AOTInductor package share this."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cmake(*args, env=None, cwd=None, timeout=900):
    return subprocess.run(["cmake", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


def launcher_args():
    # ccache keeps the repeated example builds fast.
    return ["-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"] if shutil.which("ccache") else []


def build_example(name: str, prefix_path: str, build: Path, env=None) -> Path:
    """examples/<name> built in `build` with CMAKE_PREFIX_PATH `prefix_path`;
    the app's path."""
    proc = cmake("-S", REPO / "examples" / name, "-B", build, f"-DCMAKE_PREFIX_PATH={prefix_path}",
                 "-DCMAKE_BUILD_TYPE=Release", *launcher_args(), env=env)
    assert proc.returncode == 0, f"cmake configure of {name} failed:\n{proc.stdout}\n{proc.stderr}"
    proc = cmake("--build", build, "-j", "2", env=env)
    assert proc.returncode == 0, f"cmake --build of {name} failed:\n{proc.stdout}\n{proc.stderr}"
    return build / name
