#!/usr/bin/env bash
# Runs the C++ (ctest) and Python (pytest) suites against a build, and (all)
# the format check of the changed C++/CUDA lines (tools/check_format.sh).
#   tools/run_tests.sh BUILD_DIR [all|cpp|python]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=$(cd "${1:-$root/build}" && pwd)
which=${2:-all}
export TORCHFUSE_BUILD_DIR=$build_dir
# shellcheck source=/dev/null
source "$root/env.sh"
cd "$root"

status=0
if [ "$which" = all ]; then
  "$root/tools/check_format.sh" || status=1
fi
if [ "$which" = all ] || [ "$which" = cpp ]; then
  if [ -x "$build_dir/bin/torchfuse_tests" ]; then
    echo "== C++ tests (ctest)"
    (cd "$build_dir" && ctest --output-on-failure -j "$(nproc)") || status=1
  else
    echo "== C++ tests NOT RUN: GoogleTest was not found when configuring" >&2
    status=1
  fi
fi
if [ "$which" = all ] || [ "$which" = python ]; then
  echo "== Python tests (pytest)"
  # shellcheck disable=SC2086
  python -m pytest test/python -q -rs ${PYTEST_ARGS:-} || status=1
fi
exit $status
