"""Helpers for the CUDA tests (test_cuda_ops.py).

The accuracy criterion: a fused op's output is compared, with an eager
PyTorch composition of the same unfused ops run under the same precision
flags, against a float64 reference computed from the same (upcast) inputs:

    rel_err(x, ref) = max|x - ref| / max|ref|     (over the finite elements)
    rel_err(fused, ref) <= 2 * rel_err(eager, ref) + floor(dtype)

with floor(dtype) = 2 * torch.finfo(dtype).eps.  Non-finite values are
compared separately: NaN, +Inf and -Inf must appear exactly where eager puts
them.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
from typing import Iterable, Optional

import pytest
import torch

#: how many copies of each size poison_allocator leaves in the cache
POISON_COPIES = 4


# pytestmark of the GPU test modules: marked `cuda`, skipped with the reason
# where torch sees no CUDA device.
CUDA_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no CUDA device: torch.cuda.is_available() is False (CPU-only machine or torch build)",
    ),
]


def run_seed() -> int:
    """The seed of this run; TORCHFUSE_TEST_SEED=<n> reproduces one."""
    env = os.environ.get("TORCHFUSE_TEST_SEED")
    if env:
        return int(env)
    return random.SystemRandom().randrange(2**31)


def floor_for(dtype: torch.dtype) -> float:
    return 2.0 * torch.finfo(dtype).eps


def nonfinite_pattern(t: torch.Tensor) -> torch.Tensor:
    """0 finite, 1 NaN, 2 +Inf, 3 -Inf, per element."""
    t = t.detach()
    out = torch.zeros(t.shape, dtype=torch.uint8, device=t.device)
    if not t.is_floating_point():
        return out
    out[torch.isnan(t)] = 1
    out[torch.isposinf(t)] = 2
    out[torch.isneginf(t)] = 3
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor, mask: Optional[torch.Tensor] = None) -> float:
    """max|x - ref| / max|ref| over the elements where mask (default: ref is
    finite) holds; inf where x is not finite there.  When every reference
    value is zero the absolute error is returned."""
    x = x.detach().to(torch.float64)
    ref = ref.detach().to(torch.float64)
    if mask is None:
        mask = torch.isfinite(ref)
    if x.numel() == 0 or not bool(mask.any()):
        return 0.0
    xs, rs = x[mask], ref[mask]
    if not bool(torch.isfinite(xs).all()):
        return float("inf")
    err = (xs - rs).abs().max().item()
    scale = rs.abs().max().item()
    return err / scale if scale > 0 else err


def assert_close_to_reference(
    fused: torch.Tensor,
    eager: torch.Tensor,
    ref: torch.Tensor,
    *,
    what: str,
    floor: Optional[float] = None,
    any_nonfinite: bool = False,
) -> None:
    """fused vs eager vs a float64 reference, as described in the module doc.
    The reference may live on another device (a float64 CPU run).
    any_nonfinite: only finite vs non-finite must match eager, not which of
    NaN, +Inf, -Inf (see check_against_eager's `state`)."""
    ref = ref.detach().to(fused.device)
    assert fused.shape == eager.shape, f"{what}: shape {tuple(fused.shape)} != eager {tuple(eager.shape)}"
    assert fused.dtype == eager.dtype, f"{what}: dtype {fused.dtype} != eager {eager.dtype}"
    assert fused.device == eager.device, f"{what}: device {fused.device} != eager {eager.device}"
    pf, pe = nonfinite_pattern(fused), nonfinite_pattern(eager)
    if any_nonfinite:
        pf, pe = (pf != 0).to(torch.uint8), (pe != 0).to(torch.uint8)
    if not torch.equal(pf, pe):
        bad = (pf != pe).nonzero()[:5].tolist()
        raise AssertionError(
            f"{what}: NaN/Inf placement differs from eager at {int((pf != pe).sum())} "
            f"elements, e.g. {bad} (fused codes {[int(pf[tuple(i)]) for i in bad]}, "
            f"eager codes {[int(pe[tuple(i)]) for i in bad]}; 0 finite 1 NaN 2 +Inf 3 -Inf)"
        )
    finite = (pe == 0) & torch.isfinite(ref)
    e_fused = rel_err(fused, ref, finite)
    e_eager = rel_err(eager, ref, finite)
    if floor is None:
        floor = floor_for(fused.dtype) if fused.is_floating_point() else 0.0
    bound = 2.0 * e_eager + floor
    assert e_fused <= bound, (
        f"{what}: relative error {e_fused:.3e} vs float64 exceeds 2 x eager's "
        f"{e_eager:.3e} + floor {floor:.1e} = {bound:.3e}"
    )


@contextlib.contextmanager
def tf32_flags(matmul: Optional[bool], cudnn: Optional[bool]):
    """Sets torch.backends.cuda.matmul.allow_tf32 / cudnn.allow_tf32 (None:
    leave as is) and restores both afterwards."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        if matmul is not None:
            torch.backends.cuda.matmul.allow_tf32 = matmul
        if cudnn is not None:
            torch.backends.cudnn.allow_tf32 = cudnn
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def poison_allocator(nbytes: Iterable[int], device: torch.device | str = "cuda", copies: int = POISON_COPIES) -> None:
    """Leaves blocks filled with 0xFF bytes (NaN in every float dtype, -1 in
    signed ints) in the caching allocator, `copies` of each size, so that the
    next allocations of those sizes start out as NaN rather than as stale
    results of an earlier run.  Call right before the op under test; an
    element the op fails to write then shows up as NaN."""
    blocks = []
    for n in nbytes:
        n = int(n)
        if n <= 0:
            continue
        for _ in range(copies):
            blocks.append(torch.empty(n, dtype=torch.uint8, device=device).fill_(0xFF))
    del blocks  # freed back to the cache, still holding 0xFF


def nbytes_of(*tensors: Optional[torch.Tensor]) -> list[int]:
    return [t.numel() * t.element_size() for t in tensors if t is not None]


def signed_randn(*shape, dtype, device="cuda", generator=None, scale=1.0) -> torch.Tensor:
    """Random signed values, drawn in float32 and rounded to dtype."""
    t = torch.randn(*shape, dtype=torch.float32, device=device, generator=generator) * scale
    return t.to(dtype)


def inject_nonfinite(t: torch.Tensor, generator: torch.Generator, count: int = 3) -> torch.Tensor:
    """A copy of t with `count` NaN, +Inf and -Inf each at random positions."""
    t = t.clone()
    flat = t.view(-1)
    n = flat.numel()
    idx = torch.randperm(n, generator=generator, device="cpu")[: 3 * count].to(t.device)
    flat[idx[:count]] = float("nan")
    flat[idx[count : 2 * count]] = float("inf")
    flat[idx[2 * count :]] = float("-inf")
    return t


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory exactly once, in some
    order of its dimensions (what ATen's is_non_overlapping_and_dense
    computes)."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def compute_sanitizer() -> Optional[str]:
    """compute-sanitizer on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "compute-sanitizer"), os.X_OK):
            return os.path.join(home, "bin", "compute-sanitizer")
    return None


def run_memcheck(case_source: str, script_path) -> None:
    """Runs case_source (a Python script that prints SANITIZER_CASE_DONE at
    its end) under compute-sanitizer memcheck, without the caching
    allocator, and asserts that it finished with 0 errors.  Skips
    (pytest.skip) where compute-sanitizer is missing."""
    tool = compute_sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin")
    script_path.write_text(case_source)
    cmd = [tool, "--tool", "memcheck", "--leak-check", "no", "--error-exitcode", "99",
           sys.executable, str(script_path)]
    # NB: one cudaMalloc per tensor, so that a read past a tensor's end is
    # outside every allocation: inside a cached block memcheck sees none.
    # The suite's own cached blocks go back first: the case and the
    # sanitizer need device memory beside this process.
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    torch.cuda.empty_cache()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                              timeout=float(os.environ.get("TORCHFUSE_SANITIZER_TIMEOUT", 180)))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"compute-sanitizer timed out after {e.timeout} s")
    out = proc.stdout + proc.stderr
    # memcheck's own report first: a failing case's traceback can push it out
    # of the tail
    report = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("========="))
    tail = report[:3000] + "\n...\n" + out[-2000:]
    assert "SANITIZER_CASE_DONE" in out, f"the case did not finish (rc {proc.returncode}):\n{tail}"
    assert "ERROR SUMMARY: 0 errors" in out, f"memcheck reported errors (rc {proc.returncode}):\n{tail}"
    assert proc.returncode == 0, f"rc {proc.returncode}:\n{tail}"
