"""torchfuse installed into an environment, as a user gets it.

`pip install .`: the wheel built from this tree (`pip wheel
--no-build-isolation`, against the build's torch; the isolated build's pins
are checked in pyproject.toml and the wheel's metadata, without downloading
torch), installed into a fresh virtual environment that reuses the build's
torch, and used from outside the repository with no env.sh: `import
torchfuse`, optimizing and running a model, `optimize-model` from the
environment's bin/, and `find_package(torchfuse)` building
examples/cpp_inference.  Also the Python package of `cmake --install`, and
`torchfuse.utils.cmake_prefix_path` of a development build.

The wheel is built in BUILD_DIR-wheel/ with the build's compiler, so that
ccache (requirements-test.txt installs it; the Makefile's CCACHE_DIR) serves
the objects `make build` compiled; without it the wheel compiles everything
again.
"""

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import torchfuse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_apps import build_dir, build_example, write_passes_consumer  # noqa: E402

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
TORCH_VERSION = torch.__version__.split("+")[0]
CUDA_LABEL = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")


def _project_version() -> str:
    cmake = (REPO / "CMakeLists.txt").read_text()
    return re.search(r"^project\(torchfuse VERSION ([0-9.]+)", cmake, re.M).group(1)


def _build_dir() -> Path:
    return build_dir().resolve()


def _cache_entry(build: Path, name: str) -> str:
    match = re.search(rf"^{name}:[A-Z]+=(.*)$", (build / "CMakeCache.txt").read_text(), re.M)
    return match.group(1) if match else ""


def _run(args, *, env=None, cwd=None, timeout=600):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)
    return proc


def _check(proc, what):
    assert proc.returncode == 0, (
        f"{what} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def wheel_root():
    """BUILD_DIR-wheel: scikit-build-core's CMake build directory, beside
    the build's so that ccache's paths relative to the source tree match; and
    in it, test-WORKER/ for the wheel, the environment and the example app."""
    return Path(f"{_build_dir()}-wheel")


def _work_dir(wheel_root) -> Path:
    work = wheel_root / f"test-{WORKER}"
    work.mkdir(parents=True, exist_ok=True)
    return work


# ---- the isolated build's pins (no build needed) ----------------------------


def test_pyproject_pins_torch_for_the_isolated_build_and_at_run_time():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    cmake_torch = re.search(r"set\(TORCHFUSE_REQUIRED_TORCH_VERSION ([0-9.]+)\)",
                            (REPO / "CMakeLists.txt").read_text()).group(1)
    setup_torch = re.search(r"^TORCH_VERSION=([0-9.]+)$",
                            (REPO / "tools" / "setup_python.sh").read_text(), re.M).group(1)
    assert cmake_torch == setup_torch == TORCH_VERSION
    pin = f"torch=={cmake_torch}"

    requires = pyproject["build-system"]["requires"]
    assert pin in requires, requires
    assert pyproject["build-system"]["build-backend"] == "scikit_build_core.build"
    # the build backend is pinned too, to the version the tests build with
    skbuild = [r for r in requires if r.startswith("scikit-build-core")]
    tested = re.search(r"^scikit-build-core==(\S+)$",
                       (REPO / "requirements-test.txt").read_text(), re.M).group(1)
    assert skbuild == [f"scikit-build-core=={tested}"], requires
    assert pyproject["project"]["dependencies"] == [pin]
    # kept beside the package metadata
    assert "pytest" in pyproject["tool"]


# ---- the wheel --------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(wheel_root):
    """`pip wheel --no-build-isolation .` of this tree, built in
    BUILD_DIR-wheel (incremental across runs)."""
    build = _build_dir()
    python = (build / "python-path").read_text().strip()
    if _run([python, "-c", "import scikit_build_core"]).returncode != 0:
        pytest.fail(f"{python} lacks scikit-build-core, the build backend: "
                    "pip install -r requirements-test.txt")
    wheel_root.mkdir(exist_ok=True)
    dist = _work_dir(wheel_root) / "dist"
    env = dict(os.environ)
    # NB: the build's compiler, not Python's (scikit-build-core's default),
    # and the same CUDA choice: then ccache has every object already.
    env["CXX"] = _cache_entry(build, "CMAKE_CXX_COMPILER") or env.get("CXX", "c++")
    env.setdefault("CCACHE_BASEDIR", str(REPO))
    env.setdefault("CCACHE_DIR", str(Path.home() / ".cache" / "torchfuse" / "ccache"))
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
    with_cuda = _cache_entry(build, "TORCHFUSE_WITH_CUDA") or "AUTO"
    # NB: pytest-xdist workers share the build directory.
    with open(wheel_root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(dist, ignore_errors=True)
        _check(_run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                     "--disable-pip-version-check", "-w", dist,
                     "-C", f"build-dir={wheel_root}",
                     "-C", f"cmake.define.TORCHFUSE_WITH_CUDA={with_cuda}", REPO],
                    env=env, timeout=3600), "pip wheel")
    wheels = list(dist.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _wheel_text(wheel, name):
    with zipfile.ZipFile(wheel) as z:
        (info,) = [n for n in z.namelist() if n.endswith(f".dist-info/{name}")]
        return z.read(info).decode()


def test_wheel_is_a_binary_wheel_that_requires_exactly_this_torch(wheel):
    metadata = _wheel_text(wheel, "METADATA")
    requires = re.findall(r"^Requires-Dist: (.*)$", metadata, re.M)
    assert requires == [f"torch=={TORCH_VERSION}"], requires
    version = re.search(r"^Version: (.*)$", metadata, re.M).group(1)
    # the local label names the torch (and CUDA) the wheel was built against
    assert version == f"{_project_version()}+torch{TORCH_VERSION}.{CUDA_LABEL}"
    assert wheel.name.startswith(f"torchfuse-{version}-")

    wheel_info = _wheel_text(wheel, "WHEEL")
    assert re.search(r"^Root-Is-Purelib: false$", wheel_info, re.M), wheel_info
    (tag,) = re.findall(r"^Tag: (.*)$", wheel_info, re.M)
    interpreter, abi, platform = tag.split("-")
    py = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert (interpreter, abi) == (py, py), tag
    assert platform == sysconfig.get_platform().replace("-", "_").replace(".", "_"), tag


def test_wheel_holds_package_libraries_headers_cmake_package_and_tool(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    sources = {
        "torchfuse/" + p.relative_to(REPO / "python" / "torchfuse").as_posix()
        for p in (REPO / "python" / "torchfuse").rglob("*.py")
    }
    assert sources <= names, sorted(sources - names)
    soabi = sysconfig.get_config_var("EXT_SUFFIX")
    headers = {f"torchfuse/include/torchfuse/{p.name}" for p in (REPO / "include" / "torchfuse").glob("*.h")}
    expected = {
        f"torchfuse/_C{soabi}",
        "torchfuse/_layout.py",
        "torchfuse/lib/libtorchfuse_ops.so",
        "torchfuse/lib/libtorchfuse_passes.so",
        "torchfuse/include/torchfuse/export.h",
        "torchfuse/lib/cmake/torchfuse/torchfuseConfig.cmake",
        "torchfuse/lib/cmake/torchfuse/torchfuseConfigVersion.cmake",
        "torchfuse/lib/cmake/torchfuse/torchfuseTargets.cmake",
        "torchfuse/bin/optimize-model",
        *headers,
    }
    assert expected <= names, sorted(expected - names)
    scripts = {n.split("/", 2)[2] for n in names if re.match(r"[^/]+\.data/scripts/", n)}
    assert scripts == {"optimize-model"}, scripts
    # a wheel stores symlinks as copies: one file per library
    assert not [n for n in names if re.search(r"\.so\.[0-9]", n)], names


# ---- the wheel installed into a fresh environment ---------------------------


@pytest.fixture(scope="module")
def venv(wheel, wheel_root):
    """A fresh virtual environment with the wheel installed; torch (and pip)
    come from the build's environment through a .pth file."""
    build = _build_dir()
    python = (build / "python-path").read_text().strip()
    venv = _work_dir(wheel_root) / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    _check(_run([python, "-m", "venv", "--without-pip", venv]), "python -m venv")
    site_dirs = json.loads(_check(_run([python, "-c",
        "import json, site, sys; print(json.dumps(site.getsitepackages()"
        " + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])))"]),
        "site dirs").stdout)
    purelib = _check(_run([venv / "bin" / "python", "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"]),
                     "venv site-packages").stdout.strip()
    # NB: addsitedir, not a bare path: it reads the .pth files there too.
    (Path(purelib) / "_torchfuse_test_base.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs if os.path.isdir(d))
    )
    # --no-index: the wheel's torch==2.11.0 must be met by the torch there.
    _check(_run([venv / "bin" / "python", "-m", "pip", "install", "--no-index",
                 "--disable-pip-version-check", wheel], env=_user_env(venv)),
           "pip install")
    return venv


def _user_env(venv):
    """A user's shell with the environment activated: no env.sh, no
    PYTHONPATH, the build tree and the build's Python off PATH."""
    build = _build_dir()
    build_python_bin = Path((build / "python-path").read_text().strip()).parent
    drop = {str(build / "bin"), str(build_python_bin)}
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TORCHFUSE_BUILD_DIR", "LD_LIBRARY_PATH",
                        "PYTHONHOME", "VIRTUAL_ENV")}
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p not in drop]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _script(*parts) -> str:
    return "".join(textwrap.dedent(p) for p in parts)


def _venv_python(venv, script, tmp_path, *args):
    # NB: a file, not -c: torch.jit.script reads the module's source.
    path = tmp_path / "script.py"
    path.write_text(script)
    return _check(_run([venv / "bin" / "python", "-W", "ignore::DeprecationWarning", path,
                        *args], env=_user_env(venv), cwd=tmp_path), "the environment's python")


NET = """
import torch

class Net(torch.nn.Module):
    # the three fused chains: conv-relu-add, batch_norm-add-div-swish, linear-add-relu
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(3)
        self.fc = torch.nn.Linear(3 * 8 * 8, 3 * 8 * 8)

    def forward(self, x):
        y = torch.relu(self.conv(x)) + x
        z = (self.bn(y) + x) / 2.0
        z = z * torch.sigmoid(z)
        f = torch.flatten(z, 1)
        return torch.relu(self.fc(f) + f)
"""


def test_installed_package_imports_from_the_environment(venv, tmp_path):
    out = _venv_python(venv, _script("""
        import json, sys, torch, torchfuse
        print(json.dumps({
            "package": torchfuse.__file__, "C": torchfuse._C.__file__,
            "library": torchfuse.library_path(), "cmake": torchfuse.utils.cmake_prefix_path,
            "version": torchfuse.__version__, "fusions": [f["name"] for f in torchfuse.fusions()],
            "path": sys.path}))
    """), tmp_path).stdout
    info = json.loads(out.splitlines()[-1])
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    package = site / "torchfuse"
    assert Path(info["package"]) == package / "__init__.py"
    assert Path(info["C"]).parent == package
    assert Path(info["library"]).resolve() == (package / "lib" / "libtorchfuse_ops.so").resolve()
    assert Path(info["cmake"]) == package / "lib" / "cmake"
    assert (Path(info["cmake"]) / "torchfuse" / "torchfuseConfig.cmake").is_file()
    assert info["version"] == _project_version()
    assert info["fusions"] == [f["name"] for f in torchfuse.fusions()]
    # not the development tree's package (env.sh)
    assert not {str(REPO / "python"), str(_build_dir() / "python")} & set(info["path"])


def test_installed_package_checks_the_running_torch(venv, tmp_path):
    # NB: a torch of another version, as _check_build sees it.
    proc = _run([venv / "bin" / "python", "-c",
                 "import torch; torch.__version__ = '2.10.0'; import torchfuse"],
                env=_user_env(venv), cwd=tmp_path)
    assert proc.returncode != 0
    assert (f"torchfuse was built against torch {TORCH_VERSION}, but torch 2.10.0 is installed"
            in proc.stderr), proc.stderr


def test_installed_package_optimizes_and_runs_a_model(venv, tmp_path):
    out = _venv_python(venv, _script(NET, """
        import torchfuse

        torch.manual_seed(0)
        x = torch.randn(4, 3, 8, 8)
        expected_counts = {"conv_relu_add": 1, "batch_norm_add_div_swish": 1,
                           "linear_add_relu": 1}
        # training: outputs and gradients against the float64 original
        model = Net()
        reference = Net().double()
        reference.load_state_dict(model.state_dict())
        opt = torchfuse.optimize(torch.jit.script(model))
        report = torchfuse.report(opt)
        assert {k: report[k] for k in expected_counts} == expected_counts, report
        y = opt(x)
        y_ref = reference(x.double())
        torch.testing.assert_close(y.double(), y_ref, rtol=1e-4, atol=1e-4)
        g = torch.randn_like(y)
        y.backward(g)
        y_ref.backward(g.double())
        for (name, p), p_ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.double(), p_ref.grad, rtol=1e-3, atol=1e-3,
                                       msg=lambda m: name + ": " + m)
        # inference: frozen
        model.eval()
        reference.eval()
        frozen = torchfuse.optimize(torch.jit.script(model), freeze=True)
        assert "torchfuse::custom_" in str(frozen.graph)
        with torch.no_grad():
            torch.testing.assert_close(frozen(x).double(), reference(x.double()),
                                       rtol=1e-4, atol=1e-4)
        print("ok", report)
    """), tmp_path).stdout
    assert out.startswith("ok"), out


def test_optimize_model_runs_from_the_environments_bin(venv, tmp_path):
    env = _user_env(venv)
    cli = shutil.which("optimize-model", path=env["PATH"])
    assert cli and Path(cli) == venv / "bin" / "optimize-model", cli
    proc = _check(_run(["optimize-model", "--version"], env=env, cwd=tmp_path), "--version")
    assert proc.stdout.strip() == (
        f"optimize-model (torchfuse {_project_version()}, torch {TORCH_VERSION})"
    ), proc.stdout

    _venv_python(venv, _script(NET, """
        import sys
        torch.manual_seed(0)
        torch.jit.script(Net().eval()).save(sys.argv[1])
    """), tmp_path, tmp_path / "net.pt")
    proc = _check(_run(["optimize-model", "net.pt", "net.opt.pt", "--freeze", "--check",
                        "--input-shape", "2x3x8x8"], env=env, cwd=tmp_path), "optimize-model")
    assert (tmp_path / "net.opt.pt").is_file(), proc.stdout
    # a tolerance violation would have exited 5; the optimized model is fused
    # and computes what the original does
    out = _venv_python(venv, _script("""
        import sys, torch, torchfuse
        original = torch.jit.load(sys.argv[1])
        optimized = torch.jit.load(sys.argv[2])
        assert "torchfuse::custom_" in str(optimized.graph), optimized.graph
        torch.manual_seed(1)
        x = torch.randn(2, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(optimized(x), original(x), rtol=1e-4, atol=1e-4)
        print("ok", torchfuse.report(optimized))
    """), tmp_path, tmp_path / "net.pt", tmp_path / "net.opt.pt").stdout
    assert out.startswith("ok"), out


def test_find_package_from_the_environment_builds_the_example(venv, wheel_root, tmp_path):
    out = _venv_python(venv, _script(NET, """
        import sys, torchfuse
        torch.manual_seed(0)
        opt = torchfuse.optimize(torch.jit.script(Net().eval()), freeze=True)
        opt.save(sys.argv[1])
        print(torchfuse.utils.cmake_prefix_path)
        print(torch.utils.cmake_prefix_path)
        for seed in (0, 7):
            torch.manual_seed(seed)
            x = torch.randn(2, 3, 8, 8)
            with torch.no_grad():
                print(repr(opt(x).double().sum().item()))
    """), tmp_path, tmp_path / "net.opt.pt").stdout.splitlines()
    torchfuse_prefix, torch_prefix, *checksums = out[-4:]
    assert Path(torchfuse_prefix).is_relative_to(venv)

    env = _user_env(venv)
    build = _work_dir(wheel_root) / "cpp_inference"
    shutil.rmtree(build, ignore_errors=True)
    app = build_example("cpp_inference", f"{torchfuse_prefix};{torch_prefix}", build, env=env)
    ldd = _check(_run(["ldd", app], env=env), "ldd").stdout
    ops = re.search(r"libtorchfuse_ops\.so => (\S+)", ldd)
    assert ops and Path(ops.group(1)).resolve().is_relative_to(venv.resolve()), ldd
    for seed, checksum in zip((0, 7), checksums):
        proc = _check(_run([app, tmp_path / "net.opt.pt", "2x3x8x8", seed], env=env),
                      "cpp_inference")
        printed = re.search(r"^checksum: (\S+)$", proc.stdout, re.M)
        assert printed, proc.stdout
        assert float(printed.group(1)) == pytest.approx(float(checksum), rel=1e-6)


# ---- cmake --install and the development build ------------------------------


def test_cmake_install_installs_the_python_package(tmp_path):
    build = _build_dir()
    prefix = tmp_path / "prefix"
    _check(_run(["cmake", "--install", build, "--prefix", prefix]), "cmake --install")
    site = prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    script = tmp_path / "script.py"
    script.write_text(_script(NET, """
        import json, torchfuse
        torch.manual_seed(0)
        model = Net().eval()
        opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
        x = torch.randn(2, 3, 8, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)
        print(json.dumps({"package": torchfuse.__file__, "C": torchfuse._C.__file__,
                          "library": torchfuse.library_path(),
                          "cmake": torchfuse.utils.cmake_prefix_path,
                          "report": torchfuse.report(opt)}))
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHFUSE_BUILD_DIR", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(site)
    python = (build / "python-path").read_text().strip()
    out = _check(_run([python, "-W", "ignore::DeprecationWarning", script], env=env,
                      cwd=tmp_path), "python").stdout
    info = json.loads(out.splitlines()[-1])
    assert Path(info["package"]) == site / "torchfuse" / "__init__.py"
    assert Path(info["C"]).parent == site / "torchfuse"
    assert Path(info["library"]).resolve().parent == (prefix / "lib").resolve()
    assert Path(info["cmake"]) == prefix / "lib" / "cmake"
    assert info["report"]["conv_relu_add"] == 1, info


def test_development_build_cmake_prefix_path_is_the_build_tree(tmp_path):
    build = _build_dir()
    assert Path(torchfuse.utils.cmake_prefix_path) == build
    project = write_passes_consumer(tmp_path / "consumer",
                                    "get_target_property(lib torchfuse::ops_shared LOCATION)\n"
                                    "message(STATUS \"ops library: ${lib}\")\n")
    proc = _check(_run(["cmake", "-S", project, "-B", tmp_path / "out",
                        f"-DCMAKE_PREFIX_PATH={torchfuse.utils.cmake_prefix_path};"
                        f"{torch.utils.cmake_prefix_path}"]), "cmake configure")
    lib = re.search(r"ops library: (\S+)", proc.stdout).group(1)
    assert Path(lib).resolve() == (build / "lib" / "libtorchfuse_ops.so").resolve()
