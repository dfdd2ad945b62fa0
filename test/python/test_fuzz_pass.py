"""A bounded run of tools/fuzz_pass.py: a fixed seed and a few hundred
random programs, none of which may change meaning under torchfuse.optimize,
and enough of which must be fused to show the rewrites were exercised."""

import os
import re
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
PROGRAMS = 250
SEED = 0
MIN_PROGRAMS_PER_OP = 5


def test_fuzz_pass_bounded_run(tmp_path):
    # NB: a subprocess, so the tool's own warning filters and thread setting
    # apply and its compiled classes do not stay in this process.
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "fuzz_pass.py"), "--programs", str(PROGRAMS),
         "--seed", str(SEED), "--emit-regressions", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == f"{PROGRAMS} passed, 0 failed", proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0
    m = re.search(r"^nonfinite: (\d+) programs", proc.stdout, re.M)  # a quarter, drawn from each check seed
    assert m and int(m.group(1)) >= PROGRAMS // 8, proc.stdout[-4000:]
    for op in ("linear_add_relu", "conv_relu_add", "batch_norm_add_div_swish", "relu"):
        m = re.search(rf"^\s+{op}\s+(\d+) nodes in\s+(\d+) programs$", proc.stdout, re.M)
        assert m, proc.stdout
        assert int(m.group(2)) >= MIN_PROGRAMS_PER_OP, m.group(0)
