# Source after `make build`: puts the build's Python, `import torchfuse` and
# the command-line tools on the environment.  TORCHFUSE_BUILD_DIR picks the
# build tree (default build/); several trees can share one source tree.
# `import torchfuse` takes the Python sources from python/ and _C from the
# build tree's python/ (both on PYTHONPATH; python/torchfuse/__init__.py).
_tf_root=$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")" && pwd)
_tf_build=${TORCHFUSE_BUILD_DIR:-$_tf_root/build}
if [ ! -f "$_tf_build/python-path" ]; then
  echo "env.sh: $_tf_build/python-path is missing; run 'make build' first" >&2
else
  _tf_python=$(cat "$_tf_build/python-path")
  export PATH="$(dirname "$_tf_python"):$_tf_build/bin:$PATH"
  export PYTHONPATH="$_tf_root/python:$_tf_build/python${PYTHONPATH:+:$PYTHONPATH}"
  export TORCHFUSE_BUILD_DIR="$_tf_build"  # the tests find the build's binaries by it
  hash -r 2>/dev/null
fi
unset _tf_root _tf_build _tf_python
