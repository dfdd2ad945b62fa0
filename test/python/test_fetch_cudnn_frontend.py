"""tools/fetch_cudnn_frontend.py, which the CUDA build runs to get the pinned
header-only cudnn-frontend: offline from the source tree's .deps/wheels, its
include/ only, idempotent, and on a bad wheel one clear error with nothing
left half-written.  CPU only, no network: the wheels are made here."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "fetch_cudnn_frontend.py")


def tree_with_wheel(tmp_path, version, members):
    """A copy of the script in a source tree whose .deps/wheels holds a wheel
    of `version` with `members` ({name: text})."""
    root = tmp_path / "src"
    (root / "tools").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "tools")
    wheels = root / ".deps" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / f"nvidia_cudnn_frontend-{version}-py3-none-any.whl", "w") as z:
        for name, text in members.items():
            z.writestr(name, text)
    return root


def fetch(root, *args):
    return subprocess.run([sys.executable, str(root / "tools" / "fetch_cudnn_frontend.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_unpacks_the_include_directory_only(tmp_path):
    root = tree_with_wheel(tmp_path, "1.16.0", {
        "include/cudnn_frontend.h": "// top\n", "include/cudnn_frontend/graph_interface.h": "// graph\n",
        "cudnn/__init__.py": "", "nvidia_cudnn_frontend-1.16.0.dist-info/METADATA": ""})
    dest = tmp_path / "cache" / "cudnn-frontend-1.16.0"
    r = fetch(root, "1.16.0", dest)
    assert r.returncode == 0, r.stderr
    assert (dest / "include" / "cudnn_frontend.h").read_text() == "// top\n"
    assert (dest / "include" / "cudnn_frontend" / "graph_interface.h").exists()
    assert sorted(os.listdir(dest)) == ["include"]
    assert os.listdir(dest.parent) == [dest.name]  # no work directory left behind
    # a second run finds the headers and changes nothing
    (dest / "include" / "cudnn_frontend.h").write_text("// kept\n")
    assert fetch(root, "1.16.0", dest).returncode == 0
    assert (dest / "include" / "cudnn_frontend.h").read_text() == "// kept\n"


def test_a_wheel_without_the_header_fails_and_writes_nothing(tmp_path):
    root = tree_with_wheel(tmp_path, "1.16.0", {"include/other.h": ""})
    dest = tmp_path / "cache" / "cudnn-frontend-1.16.0"
    r = fetch(root, "1.16.0", dest)
    assert r.returncode != 0
    assert r.stderr.strip() == ("fetch_cudnn_frontend: nvidia_cudnn_frontend-1.16.0-py3-none-any.whl "
                                "has no include/cudnn_frontend.h")
    assert not dest.exists() and os.listdir(dest.parent) == []


@pytest.mark.parametrize("args", [[], ["1.16.0"], ["1.16.0", "a", "b"]])
def test_wrong_arguments(tmp_path, args):
    r = fetch(tree_with_wheel(tmp_path, "1.16.0", {}), *args)
    assert r.returncode != 0
    assert r.stderr.strip() == f"fetch_cudnn_frontend: expected arguments VERSION DEST, got {args}"
