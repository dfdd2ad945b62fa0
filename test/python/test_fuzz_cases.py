"""The regression file tools/fuzz_pass.py --emit-regressions writes is a
pytest module that collects its one case and passes on a program that
keeps its meaning."""

import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from fuzz import emit_regression, generate  # noqa: E402


def test_emitted_regression_runs(tmp_path):
    path = emit_regression(str(tmp_path), generate(0, 3), 0, 3)
    # NB: a subprocess, as a user runs the file; -p no:cacheprovider keeps
    # tmp_path clean.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", path, "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "1 passed" in proc.stdout, proc.stdout[-4000:]
