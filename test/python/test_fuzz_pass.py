"""A bounded run of tools/fuzz_pass.py: a fixed seed and a few hundred
random programs, none of which may change meaning under torchfuse.optimize,
and enough of which must be fused to show the rewrites were exercised."""

import os
import re
import subprocess
import sys

import pytest
import torch

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


def _fuzz(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fuzz_pass.py"), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_device_cuda_without_a_cuda_device_is_refused():
    proc = _fuzz("--programs", "1", "--device", "cuda")
    assert proc.returncode == 2
    assert "--device cuda: expected a CUDA device, but torch.cuda.is_available() is False" in proc.stderr
    assert "passed" not in proc.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
def test_fuzz_pass_bounded_run_on_cuda(tmp_path):
    """The same programs with their modules and inputs on the GPU: the ops'
    CUDA kernels (BatchNorm epilogues, cuBLASLt and cuDNN routes, the
    elementwise kernels) against the original's CUDA ops."""
    programs = 60
    proc = _fuzz("--programs", str(programs), "--seed", str(SEED), "--device", "cuda", "--modes",
                 "train,eval,frozen,autocast,double_backward", "--emit-regressions", str(tmp_path))
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == f"{programs} passed, 0 failed", proc.stdout[-4000:] + proc.stderr[-4000:]
    m = re.search(r"^programs with fused nodes: (\d+) of", proc.stdout, re.M)
    assert m and int(m.group(1)) >= programs // 2, proc.stdout[-4000:]
