#!/usr/bin/env python3
"""Benchmarks torchfuse against eager PyTorch, TorchScript,
optimize_for_inference and torch.compile on the reference workloads, in
float32 under PyTorch's default precision flags (matmul TF32 off, cuDNN TF32
on; gemm_add_relu_tf32 runs under torch.set_float32_matmul_precision('high'))
and the TorchScript executor's default settings (NNC on), and measures the
device's ceilings in the same run.

    python bench/benchmark.py                      # everything, on CUDA
    python bench/benchmark.py --workloads relu --variants eager,torchfuse
    python bench/benchmark.py --dry-run            # tiny shapes on the CPU

Timing: CUDA events around each run (perf_counter on the CPU), after
warm-up; median, min and max of >= 20 runs.  Every variant's output (and, for
fwdbwd, its gradients) is compared once with eager's; a variant whose
relative error exceeds the workload's tolerance is flagged "wrong".  The
TF32 workloads are judged against float64 instead (two TF32 engines round
differently, and a relu decision near zero that differs from eager's moves a
gradient far more than either's error): "wrong" when an error against the
float64 model exceeds twice eager's, plus 1e-6.

Results: bench/results/<gpu>.json (and $OUT/results.json when $OUT is set),
rewritten after every measurement so that an interrupted run keeps what it
measured.  bench/report.py turns it into docs/performance.md.

Exit status: 0; 3 when a torchfuse or eager measurement failed or a
torchfuse result was flagged wrong; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ["eager", "bare_gemm", "torchscript", "optimize_for_inference", "compile", "compile_max_autotune", "torchfuse"]
FWDBWD_VARIANTS = {"eager", "bare_gemm", "torchscript", "compile", "torchfuse"}
PASSES = ["fwd", "fwdbwd"]
# Variants run in phases, cheapest first, so that a run cut short by its
# budget still has every workload's core numbers.
PHASES = [
    ["eager", "bare_gemm", "torchscript", "torchfuse", "optimize_for_inference"],
    ["compile"],
    ["compile_max_autotune"],
]
# Do no harm: torchfuse and the modules it is measured against, timed in
# alternating rounds within one unit, so that drift of the machine between
# units (host load, clocks) falls on all of them alike.
INTERLEAVED = ("eager", "torchscript", "torchfuse")
INTERLEAVED_ROUNDS = 6
# Seconds a unit needs at least before it is started (compile time).
MIN_SECONDS = {"compile": 45.0, "compile_max_autotune": 90.0}
DEFAULT_MIN_SECONDS = 5.0

FLOOR_FORMULA = (
    "floor = max(FLOPs / P, bytes / B), with B the measured device-to-device copy bandwidth "
    "(bytes read + written per second) and P the measured 8192^3 matmul rate in the precision "
    "PyTorch's default flags give the workload's main op: fp32 (matmul TF32 off) for the "
    "Linear workloads and relu, TF32 (cuDNN TF32 on) for the convolution. "
    "Bytes count each input read once and each output written once (float32, 4 B); "
    "fwdbwd also counts the gradients read and written, a 1-bit ReLU mask written and read, "
    "and for matmul_bn_swish the saved BatchNorm input written and read. "
    "FLOPs: 2*M*N*K per GEMM (3 GEMMs fwdbwd), 2*N*Cout*Ho*Wo*Cin*k*k per convolution "
    "(3 fwdbwd), plus a few per output element for the elementwise tails. "
    "Workloads run with matmul TF32 allowed (gemm_add_relu_tf32) take P in TF32."
)


# ------------------------------------------------------------------ models ----

class GemmAddRelu(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.linear = nn.Linear(k, n, bias=False)
        self.bias = nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.relu(self.linear(x) + self.bias)


class ConvReluBias(nn.Module):
    def __init__(self, cin: int, cout: int, k: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k)
        self.bias = nn.Parameter(torch.randn(cout, 1, 1))

    def forward(self, x):
        return torch.relu(self.conv(x)) + self.bias


class MatmulBnSwish(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.linear = nn.Linear(k, n)
        self.bn = nn.BatchNorm1d(n)
        self.bias = nn.Parameter(torch.randn(1))
        self.divide_value = 1.0
        with torch.no_grad():  # non-trivial affine and running statistics
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.normal_(0.0, 0.1)
            self.bn.running_mean.normal_(0.0, 0.1)
            self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        x = self.bn(self.linear(x))
        x = (x + self.bias) / self.divide_value
        return x * torch.sigmoid(x)


class Relu(nn.Module):
    def forward(self, x):
        return torch.relu(x)


# --------------------------------------------------------------- workloads ----

@dataclass
class Workload:
    name: str
    kind: str  # gemm | conv | bn | relu
    dims: dict
    tol: float  # max relative error against eager before a result is flagged
    grad_exclude: tuple = ()  # parameters whose gradient is exactly 0 in exact arithmetic
    desc: str = ""
    tf32: bool = False  # run under torch.set_float32_matmul_precision("high")
    # flagged by errors against float64 (at most 2x eager's + F64_FLOOR), not by tol
    float64_check: bool = False

    def input_shape(self):
        d = self.dims
        if self.kind in ("gemm", "bn"):
            return (d["M"], d["K"])
        if self.kind == "conv":
            return (d["N"], d["C"], d["H"], d["W"])
        return (d["rows"], d["cols"])

    def build(self) -> nn.Module:
        d = self.dims
        if self.kind == "gemm":
            return GemmAddRelu(d["K"], d["N_out"])
        if self.kind == "conv":
            return ConvReluBias(d["C"], d["Cout"], d["k"])
        if self.kind == "bn":
            return MatmulBnSwish(d["K"], d["N_out"])
        return Relu()

    def weight(self, model: nn.Module) -> Optional[torch.Tensor]:
        return model.linear.weight if self.kind in ("gemm", "bn") else None

    def precision(self) -> str:
        """The matmul ceiling that bounds this workload under default flags."""
        return "tf32" if self.kind == "conv" or self.tf32 else "fp32"

    def cost(self, pass_: str) -> tuple[float, float]:
        """(FLOPs, bytes) of one run; see FLOOR_FORMULA."""
        d, f = self.dims, 4.0
        if self.kind in ("gemm", "bn"):
            M, K, N = d["M"], d["K"], d["N_out"]
            gemm = 2.0 * M * K * N
            tail = (2 if self.kind == "gemm" else 12) * M * N
            fwd_bytes = f * (M * K + N * K + N + M * N) + (f * 5 * N if self.kind == "bn" else 0)
            if pass_ == "fwd":
                return gemm + tail, fwd_bytes
            saved = M * N / 8 * 2 if self.kind == "gemm" else f * M * N * 2
            bwd_bytes = f * (M * N + M * K + N * K + M * K + N * K + N) + (f * 4 * N if self.kind == "bn" else 0)
            return 3 * gemm + (2 if self.kind == "gemm" else 3) * tail, fwd_bytes + saved + bwd_bytes
        if self.kind == "conv":
            N, C, H, W, Co, k = d["N"], d["C"], d["H"], d["W"], d["Cout"], d["k"]
            Ho, Wo = H - k + 1, W - k + 1
            y = N * Co * Ho * Wo
            conv = 2.0 * y * C * k * k
            x, w = N * C * H * W, Co * C * k * k
            fwd_bytes = f * (x + w + 2 * Co + y)
            if pass_ == "fwd":
                return conv + 3 * y, fwd_bytes
            bwd_bytes = f * (y + x + w + x + w + 2 * Co) + y / 8 * 2
            return 3 * conv + 6 * y, fwd_bytes + bwd_bytes
        n = d["rows"] * d["cols"]
        if pass_ == "fwd":
            return float(n), f * 2 * n
        return 2.0 * n, f * 4 * n + n / 8 * 2


def workloads(dry_run: bool) -> dict[str, Workload]:
    if dry_run:
        g, gs = dict(M=16, K=64, N_out=32), dict(M=8, K=32, N_out=16)
        c, cs = dict(N=2, C=4, H=12, W=12, Cout=8, k=3), dict(N=2, C=3, H=8, W=8, Cout=4, k=3)
        r = dict(rows=64, cols=257)
    else:
        g, gs = dict(M=1024, K=8192, N_out=8192), dict(M=128, K=1024, N_out=512)
        c, cs = dict(N=128, C=64, H=128, W=128, Cout=128, k=3), dict(N=128, C=3, H=32, W=32, Cout=16, k=3)
        r = dict(rows=4096, cols=393216)
    # cuDNN TF32 on by default: two TF32 implementations may round
    # differently, so these are judged against float64 (module doc); conv_tol
    # stays as the informational bound against eager
    conv_tol = 5e-3
    out = [
        Workload("gemm_add_relu", "gemm", g, 1e-4, desc="Linear {K}->{N_out} (no bias) + bias + relu, x[{M}, {K}]"),
        Workload("gemm_add_relu_small", "gemm", gs, 1e-4, desc="Linear {K}->{N_out} (no bias) + bias + relu, x[{M}, {K}]"),
        Workload("gemm_add_relu_tf32", "gemm", g, conv_tol, tf32=True, float64_check=True,
                 desc="Linear {K}->{N_out} (no bias) + bias + relu, x[{M}, {K}], matmul TF32 ('high')"),
        Workload("conv_relu_bias", "conv", c, conv_tol, float64_check=True,
                 desc="Conv2d {C}->{Cout} k={k} + relu + bias[{Cout},1,1], x[{N}, {C}, {H}, {W}]"),
        Workload("conv_relu_bias_small", "conv", cs, conv_tol, float64_check=True,
                 desc="Conv2d {C}->{Cout} k={k} + relu + bias[{Cout},1,1], x[{N}, {C}, {H}, {W}]"),
        Workload("matmul_bn_swish", "bn", g, 1e-4, grad_exclude=("linear.bias",),
                 desc="Linear {K}->{N_out} + BatchNorm1d (training) + bias[1] + /1.0 + swish, x[{M}, {K}]"),
        Workload("matmul_bn_swish_small", "bn", gs, 1e-4, grad_exclude=("linear.bias",),
                 desc="Linear {K}->{N_out} + BatchNorm1d (training) + bias[1] + /1.0 + swish, x[{M}, {K}]"),
        Workload("relu", "relu", r, 0.0, desc="relu, x[{rows}, {cols}]"),
    ]
    for w in out:
        w.desc = w.desc.format(**w.dims)
    return {w.name: w for w in out}


# ----------------------------------------------------------------- helpers ----

class UnitTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises UnitTimeout in the main thread after `seconds` (between Python
    bytecodes: a long C++ call is interrupted only when it returns)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum, frame):
        raise UnitTimeout(f"unit time limit of {seconds:.0f} s reached")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# errors against float64 below this are never flagged (float32 rounding)
F64_FLOOR = 1e-6


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """max|a - ref| / max|ref|, in chunks (the relu tensors are 6.4 GB);
    inf when a and ref differ in shape or a has a non-finite value where ref
    has none."""
    if a.shape != ref.shape:
        return float("inf")
    a, ref = a.detach().reshape(-1), ref.detach().reshape(-1)
    err, scale, chunk = 0.0, 0.0, 1 << 26
    for s in range(0, a.numel(), chunk):
        x, r = a[s : s + chunk].double(), ref[s : s + chunk].double()
        fin = torch.isfinite(r)
        if not bool(torch.equal(torch.isfinite(x), fin)) or not bool(torch.equal(torch.isnan(x), torch.isnan(r))):
            return float("inf")
        if bool(fin.any()):
            err = max(err, (x[fin] - r[fin]).abs().max().item())
            scale = max(scale, r[fin].abs().max().item())
    return err / scale if scale > 0 else err


@contextlib.contextmanager
def matmul_tf32(on: bool):
    """torch.set_float32_matmul_precision("high") (TF32 matmuls) while on."""
    if not on:
        yield
        return
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-") or "unknown"


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True, timeout=30).returncode != 0
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        # NB: cuBLAS's and cuBLASLt's workspaces (32 MiB and more on sm_90)
        # stay allocated once a unit's GEMMs created them; released here,
        # each unit allocates its own again, so that a peak or a memory
        # baseline taken after this does not depend on the units before it.
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def strip_prefix(name: str) -> str:
    return name[len("_orig_mod."):] if name.startswith("_orig_mod.") else name


# ------------------------------------------------------------------ timing ----

class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, step: Callable[[int], None], reset: Callable[[], None], warmup: int, reps: int,
                target_s: float) -> list[float]:
        """Runs step(i) warmup times, then >= reps times (more, up to 10x,
        while a run is short enough to fit target_s); returns milliseconds."""
        t0 = time.perf_counter()
        for i in range(warmup):
            reset()
            step(i)
        self.sync()
        per_run = max((time.perf_counter() - t0) / max(warmup, 1), 1e-6)
        n = int(min(10 * reps, max(reps, target_s / per_run)))
        times = []
        if self.cuda:
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for i, (s, e) in enumerate(ev):
                reset()
                s.record()
                step(i)
                e.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) for s, e in ev]
        else:
            for i in range(n):
                reset()
                t = time.perf_counter()
                step(i)
                times.append((time.perf_counter() - t) * 1e3)
        return times

    def host_times(self, step: Callable[[int], None], reset: Callable[[], None], n: int) -> Optional[list[float]]:
        """The host's time to launch step(i), in milliseconds, with the device
        idle before each call (synchronized): where it comes near the
        device's time per step, the GPU waits for the launches (host-bound),
        and a ratio of two such variants measures the host.  None on the CPU,
        where the step's time is the host's."""
        if not self.cuda:
            return None
        times = []
        for i in range(n):
            reset()
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(i)
            times.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
        return times


# --------------------------------------------------------------- ceilings ----

def measure_ceilings(device: torch.device, timer: Timer, dry_run: bool) -> dict:
    out = {}
    reps = 5 if dry_run else 20
    n_copy = (1 << 22) if dry_run else (1 << 28)  # floats: 16 MiB / 1 GiB
    src = torch.randn(n_copy, device=device)
    dst = torch.empty_like(src)
    t = statistics.median(timer.measure(lambda i: dst.copy_(src), lambda: None, 3, reps, 0.5))
    out["copy_GBps"] = 2 * src.numel() * 4 / (t * 1e-3) / 1e9
    del src, dst
    n = 256 if dry_run else 8192
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    c = torch.empty(n, n, device=device)
    for key, tf32 in (("fp32_matmul_TFLOPs", False), ("tf32_matmul_TFLOPs", True)):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            t = statistics.median(timer.measure(lambda i: torch.mm(a, b, out=c), lambda: None, 3, reps, 0.5))
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        out[key] = 2.0 * n**3 / (t * 1e-3) / 1e12
    ah, bh = a.bfloat16(), b.bfloat16()
    t = statistics.median(timer.measure(lambda i: torch.mm(ah, bh), lambda: None, 3, reps, 0.5))
    out["bf16_matmul_TFLOPs"] = 2.0 * n**3 / (t * 1e-3) / 1e12
    out["matmul_n"] = n
    out["copy_bytes"] = 2 * n_copy * 4
    del a, b, c, ah, bh
    free_memory()
    return out


def floors(wl: Workload, ceilings: dict) -> dict:
    res = {}
    peak = ceilings["tf32_matmul_TFLOPs" if wl.precision() == "tf32" else "fp32_matmul_TFLOPs"] * 1e12
    bw = ceilings["copy_GBps"] * 1e9
    for p in PASSES:
        flops, nbytes = wl.cost(p)
        c_ms, m_ms = flops / peak * 1e3, nbytes / bw * 1e3
        res[p] = {"flops": flops, "bytes": nbytes, "compute_ms": c_ms, "memory_ms": m_ms,
                  "floor_ms": max(c_ms, m_ms), "bound": "compute" if c_ms >= m_ms else "memory",
                  "peak": wl.precision()}
    return res


# ------------------------------------------------------------------ units ----

@dataclass
class Unit:
    wl: Workload
    variant: str
    pass_: str


@dataclass
class Bench:
    args: argparse.Namespace
    device: torch.device
    timer: Timer
    results: dict
    paths: list
    deadline: float
    failures: list = field(default_factory=list)
    # the last float64 reference (float64_reference) and its key
    _ref64: dict | None = None
    _ref64_key: tuple | None = None

    # -- bookkeeping
    def save(self):
        data = json.dumps(self.results, indent=1, sort_keys=False)
        for p in self.paths:
            os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
            tmp = p + ".tmp"
            with open(tmp, "w") as f:
                f.write(data)
            os.replace(tmp, p)

    def skip(self, u: Unit, reason: str, failure: bool = False):
        self.results["skipped"].append({"workload": u.wl.name, "variant": u.variant, "pass": u.pass_,
                                        "reason": reason, "failure": failure})
        print(f"  SKIP {u.wl.name:22s} {u.variant:24s} {u.pass_:6s} {reason}", flush=True)
        if failure:
            self.failures.append(f"{u.wl.name}/{u.variant}/{u.pass_}: {reason}")
        self.save()

    # -- inputs
    def seeded_model(self, wl: Workload) -> nn.Module:
        torch.manual_seed(1234)
        with torch.device(self.device):
            m = wl.build()
        return m

    def inputs(self, wl: Workload, pass_: str) -> list[torch.Tensor]:
        shape = wl.input_shape()
        nbytes = math.prod(shape) * 4
        l2 = 8 << 20
        if self.device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 50 << 20)
        # rotate among several inputs so that small workloads do not run from L2
        count = 1 if nbytes >= 2 * l2 else min(8, math.ceil(2 * l2 / nbytes))
        g = torch.Generator(device=self.device)
        xs = []
        for i in range(count):
            g.manual_seed(100 + i)
            x = torch.randn(shape, device=self.device, generator=g)
            xs.append(x.requires_grad_(pass_ == "fwdbwd"))
        return xs

    def memory_check(self, wl: Workload, pass_: str, n_inputs: int) -> Optional[str]:
        if self.device.type != "cuda":
            return None
        x = math.prod(wl.input_shape()) * 4
        if wl.kind == "relu":
            need = x * (5 if pass_ == "fwd" else 7)
        else:
            params = sum(p.numel() for p in self.seeded_model(wl).parameters()) * 4
            out = wl.cost("fwd")[1]
            need = n_inputs * x * 2 + params * 4 + out * (4 if pass_ == "fwd" else 8)
        free_memory()
        free, _ = torch.cuda.mem_get_info(self.device)
        if free < need:
            return f"needs about {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free"
        return None

    # -- variants
    def make_variant(self, u: Unit, model: nn.Module):
        """The callable for u.variant built from `model`, plus notes."""
        notes = {}
        v = u.variant
        if v == "eager":
            return model, notes
        if v == "bare_gemm":
            # NB: fwdbwd also times the GEMM's backward (dX and dW), so that
            # the model minus it is the tail's time (report.py).
            w = u.wl.weight(model)
            return (lambda x: x @ w.t()), notes
        if v == "torchscript":
            return torch.jit.script(model), notes
        if v == "optimize_for_inference":
            frozen = torch.jit.freeze(torch.jit.script(model.eval()))
            return torch.jit.optimize_for_inference(frozen), notes
        if v in ("compile", "compile_max_autotune"):
            torch._dynamo.reset()
            mode = "max-autotune-no-cudagraphs" if v == "compile_max_autotune" else None
            return torch.compile(model, mode=mode), notes
        if v == "torchfuse":
            import torchfuse
            if not hasattr(torchfuse, "optimize"):
                raise RuntimeError("torchfuse.optimize is not available in this build")
            m = torchfuse.optimize(torch.jit.script(model), freeze=False)
            graph = str(getattr(m, "inlined_graph", getattr(m, "graph", "")))
            notes["fused_ops"] = sorted(set(re.findall(r"torchfuse::(\w+)", graph)))
            return m, notes
        raise ValueError(v)

    def run_unit(self, u: Unit) -> None:
        wl, v, p = u.wl, u.variant, u.pass_
        remaining = self.deadline - time.monotonic()
        need = MIN_SECONDS.get(v, DEFAULT_MIN_SECONDS)
        if remaining < need:
            self.skip(u, f"budget: {remaining:.0f} s left of --budget-s, this variant needs about {need:.0f} s")
            return
        xs = self.inputs(wl, p)
        why = self.memory_check(wl, p, len(xs))
        if why:
            self.skip(u, why)
            return
        critical = v in ("eager", "torchfuse")
        limit = min(self.args.unit_timeout_s, remaining - 1.0)
        t_setup = time.perf_counter()
        try:
            with time_limit(limit), matmul_tf32(wl.tf32):
                row = self._measure(u, xs)
        except UnitTimeout as e:
            self.skip(u, str(e), failure=False)
            if v.startswith("compile"):
                torch._dynamo.reset()
            return
        except Exception as e:  # noqa: BLE001 - record and go on
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            self.skip(u, f"failed: {last[:400]}", failure=critical)
            if self.args.verbose:
                traceback.print_exc()
            return
        finally:
            xs = None
            free_memory()
        row["setup_and_measure_s"] = round(time.perf_counter() - t_setup, 2)
        if row.get("wrong") and v in ("eager", "bare_gemm", "torchscript", "torchfuse"):
            if "errors_vs_float64" in row:
                self.failures.append(f"{wl.name}/{v}/{p}: errors against float64 {row['errors_vs_float64']} "
                                     f"above 2x eager's {row['eager_errors_vs_float64']} + {F64_FLOOR:g}")
            else:
                self.failures.append(f"{wl.name}/{v}/{p}: max rel err {row['max_rel_err']:.3g} > tol {row['tol']:.3g}")
        self.results["rows"].append(row)
        self.save()
        flag = " WRONG" if row.get("wrong") else ""
        err = row.get("max_rel_err")
        err_s = "-" if err is None else f"{err:.1e}"
        if "errors_vs_float64" in row:  # the worst ratio to eager's error against float64
            ratios = [e / max(row["eager_errors_vs_float64"].get(k, 0.0), 1e-30)
                      for k, e in row["errors_vs_float64"].items()]
            err_s += f", vs float64 {max(ratios):.2g}x eager's"
        print(f"  {wl.name:22s} {v:24s} {p:6s} median {row['median_ms']:10.4f} ms "
              f"(min {row['min_ms']:.4f}, max {row['max_ms']:.4f}, n={row['reps']}) err {err_s}{flag}", flush=True)

    def run_interleaved(self, wl: Workload, p: str) -> None:
        """torchfuse against eager and TorchScript (do no harm), all three
        alive and warmed up alike (the profiling executor's runs included),
        timed in INTERLEAVED_ROUNDS rounds whose order rotates."""
        remaining = self.deadline - time.monotonic()
        if remaining < 3 * DEFAULT_MIN_SECONDS:
            self.results["skipped"].append({"workload": wl.name, "variant": "interleaved", "pass": p,
                                            "reason": f"budget: {remaining:.0f} s left", "failure": False})
            return
        xs = self.inputs(wl, p)
        t0 = time.perf_counter()
        try:
            with time_limit(min(self.args.unit_timeout_s, remaining - 1.0)), matmul_tf32(wl.tf32):
                runs = {}
                gy = None
                for v in INTERLEAVED:
                    model = self.seeded_model(wl).train(True)
                    fn, _ = self.make_variant(Unit(wl, v, p), model)
                    if p == "fwdbwd" and gy is None:
                        gy = self.grad_output(model, xs[0])
                    runs[v] = self.stepper(fn, fn if isinstance(fn, nn.Module) else model, xs, p, gy)
                warm = max(self.args.warmup, torch._C._jit_get_num_profiled_runs() + 2)
                for step, reset in runs.values():
                    self.timer.measure(step, reset, warm, 0, 0.0)
                times: dict = {v: [] for v in INTERLEAVED}
                rounds = 2 if self.args.dry_run else INTERLEAVED_ROUNDS
                for r in range(rounds):
                    for k in range(len(INTERLEAVED)):
                        v = INTERLEAVED[(r + k) % len(INTERLEAVED)]
                        step, reset = runs[v]
                        times[v] += self.timer.measure(step, reset, 1, max(1, self.args.reps // 2),
                                                       self.args.target_s / 2)
        except Exception as e:  # noqa: BLE001 - record and go on
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            self.results["skipped"].append({"workload": wl.name, "variant": "interleaved", "pass": p,
                                            "reason": f"failed: {last[:400]}", "failure": True})
            self.failures.append(f"{wl.name}/interleaved/{p}: {last[:400]}")
            self.save()
            return
        finally:
            runs = xs = None
            free_memory()
        med = {v: statistics.median(t) for v, t in times.items()}
        row = {"workload": wl.name, "pass": p, "rounds": rounds, "median_ms": med,
               "reps": {v: len(t) for v, t in times.items()},
               "torchfuse_speedup": {v: med[v] / med["torchfuse"] for v in INTERLEAVED if v != "torchfuse"},
               "setup_and_measure_s": round(time.perf_counter() - t0, 2)}
        self.results["interleaved"].append(row)
        self.save()
        print(f"  {wl.name:22s} {'interleaved':24s} {p:6s} " +
              ", ".join(f"{v} {med[v]:.4f}" for v in INTERLEAVED) + " ms; torchfuse " +
              ", ".join(f"{s:.3f}x {v}" for v, s in row["torchfuse_speedup"].items()), flush=True)

    def grad_output(self, model: nn.Module, x0: torch.Tensor) -> torch.Tensor:
        """The fixed random gradient that fwdbwd feeds the output."""
        g = torch.Generator(device=self.device)
        g.manual_seed(7)
        with torch.no_grad():
            shape = model(x0.detach()).shape
        return torch.randn(shape, device=self.device, generator=g)

    @staticmethod
    def stepper(fn, owner, xs: list[torch.Tensor], p: str, gy):
        """step(i) runs fn on the i-th rotated input (forward, or forward and
        backward of gy); reset() drops the gradients the last step left."""
        params = [q for q in owner.parameters() if q.requires_grad]

        def reset():
            if p == "fwdbwd":
                for q in params:
                    q.grad = None
                for x in xs:
                    x.grad = None

        if p == "fwd":
            def step(i):
                with torch.no_grad():
                    fn(xs[i % len(xs)])
        else:
            def step(i):
                fn(xs[i % len(xs)]).backward(gy)
        return step, reset

    def _measure(self, u: Unit, xs: list[torch.Tensor]) -> dict:
        wl, v, p = u.wl, u.variant, u.pass_
        train = v != "optimize_for_inference"
        # reference: eager on an identically initialised model
        ref_model = self.seeded_model(wl).train(train)
        model = self.seeded_model(wl).train(train)
        fn, notes = self.make_variant(u, model)
        x0 = xs[0]
        gy = self.grad_output(ref_model, x0) if p == "fwdbwd" else None
        owner = fn if isinstance(fn, nn.Module) else model
        step, reset = self.stepper(fn, owner, xs, p, gy)

        # warm-up (compiles, profiles: the profiling executor needs 2 calls)
        warmup = self.args.warmup
        t0 = time.perf_counter()
        reset()
        step(0)
        self.timer.sync()
        first_call_s = time.perf_counter() - t0

        # verify once against eager, after the first (compiling) call
        reset()
        errs = self.verify(u, ref_model, fn, owner, x0, gy)
        times = self.timer.measure(step, reset, warmup, self.args.reps, self.args.target_s)
        row = {"workload": wl.name, "variant": v, "pass": p,
               "median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
               "reps": len(times), "inputs_rotated": len(xs), "first_call_s": round(first_call_s, 3)}
        row["mode"] = "train" if train else "eval"
        if wl.tf32:
            row["matmul_tf32"] = True
        row.update(errs)
        row.update(notes)
        if v == "optimize_for_inference":
            row["note"] = "eval mode (frozen); compared against eager in eval mode"
        return row

    def verify(self, u: Unit, ref_model, fn, model, x0, gy) -> dict:
        wl, p = u.wl, u.pass_
        if u.variant == "bare_gemm":
            return {"max_rel_err": None, "tol": None, "wrong": False}
        # new leaves sharing x0's storage (nothing writes to the input)
        xr = x0.detach().requires_grad_(p == "fwdbwd")
        xv = x0.detach().requires_grad_(p == "fwdbwd")
        ctx = torch.no_grad() if p == "fwd" else contextlib.nullcontext()
        with ctx:
            ref = ref_model(xr)
            out = fn(xv)
        errs = {"out": rel_err(out, ref)}
        if p == "fwdbwd":
            ref.backward(gy)
            out.backward(gy)
            errs["grad_input"] = rel_err(xv.grad, xr.grad)
            ref_grads = {n: q.grad for n, q in ref_model.named_parameters()}
            for n, q in (model.named_parameters() if isinstance(model, nn.Module) else []):
                n = strip_prefix(n)
                if n in wl.grad_exclude or n not in ref_grads or ref_grads[n] is None:
                    continue
                errs[f"grad_{n}"] = rel_err(q.grad, ref_grads[n]) if q.grad is not None else float("inf")
        result = {"max_rel_err": max(errs.values()), "errors": errs, "tol": wl.tol}
        if wl.float64_check:
            ref64 = self.float64_reference(u, ref_model.training, x0, gy)
            mine = {"out": out, "grad_input": xv.grad if p == "fwdbwd" else None}
            eager = {"out": ref, "grad_input": xr.grad if p == "fwdbwd" else None}
            if p == "fwdbwd":
                ref_params = dict(ref_model.named_parameters())
                for n, q in (model.named_parameters() if isinstance(model, nn.Module) else []):
                    n = strip_prefix(n)
                    if f"grad_{n}" in ref64 and n in ref_params:
                        mine[f"grad_{n}"], eager[f"grad_{n}"] = q.grad, ref_params[n].grad
            f64 = {k: rel_err(t, ref64[k]) if t is not None else float("inf")
                   for k, t in mine.items() if k in ref64}
            eager64 = {k: rel_err(t, ref64[k]) for k, t in eager.items() if k in ref64 and t is not None}
            result.update({"errors_vs_float64": f64, "eager_errors_vs_float64": eager64,
                           "wrong": any(not (f64[k] <= 2 * eager64.get(k, 0.0) + F64_FLOOR) for k in f64)})
        else:
            result["wrong"] = not (result["max_rel_err"] <= wl.tol)
        if p == "fwdbwd":
            for q in model.parameters():
                q.grad = None
        del ref, out, xr, xv
        return result

    def float64_reference(self, u: Unit, training: bool, x0, gy) -> dict:
        """The workload's model in float64 on the same parameters and input:
        its output and, for fwdbwd, the gradients of the input and of each
        parameter.  The last one is kept for the next variant."""
        key = (u.wl.name, u.pass_, training)
        if self._ref64_key != key:
            self._ref64, self._ref64_key = None, None
            free_memory()
            m64 = self.seeded_model(u.wl).train(training).double()
            x64 = x0.detach().double().requires_grad_(u.pass_ == "fwdbwd")
            ctx = torch.no_grad() if u.pass_ == "fwd" else contextlib.nullcontext()
            with ctx:
                out64 = m64(x64)
            ref = {"out": out64.detach()}
            if u.pass_ == "fwdbwd":
                out64.backward(gy.double())
                ref["grad_input"] = x64.grad
                for n, q in m64.named_parameters():
                    if strip_prefix(n) not in u.wl.grad_exclude and q.grad is not None:
                        ref[f"grad_{strip_prefix(n)}"] = q.grad
            self._ref64, self._ref64_key = ref, key
        return self._ref64


# ------------------------------------------------------------------- main ----

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="all", help="comma-separated names (default: all)")
    ap.add_argument("--variants", default="all", help=f"comma-separated, of {','.join(VARIANTS)}")
    ap.add_argument("--passes", default="fwd,fwdbwd", help="fwd, fwdbwd or both")
    ap.add_argument("--budget-s", type=float, default=1800.0, help="total time budget; later units are skipped")
    ap.add_argument("--unit-timeout-s", type=float, default=240.0, help="time limit of one measurement incl. compiling")
    ap.add_argument("--reps", type=int, default=None, help="timed runs at least (default 20; 5 with --dry-run)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 3; 2 with --dry-run)")
    ap.add_argument("--target-s", type=float, default=None, help="aim for this much timed work per unit (default 1.0)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, perf_counter timing")
    ap.add_argument("--output", default=None, help="results JSON (default bench/results/<gpu>.json)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failed units")
    a = ap.parse_args(argv)
    a.reps = a.reps or (5 if a.dry_run else 20)
    a.warmup = a.warmup or (2 if a.dry_run else 3)
    a.target_s = a.target_s if a.target_s is not None else (0.05 if a.dry_run else 1.0)
    if not a.dry_run and a.reps < 20:
        ap.error("--reps must be >= 20 outside --dry-run")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    deadline = start + args.budget_s
    # PyTorch's default precision flags, set explicitly.  The TorchScript
    # executor keeps its defaults (NNC on), as users run it: the TorchScript,
    # optimize_for_inference and torchfuse variants are measured that way.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True

    if args.dry_run:
        torch.set_num_threads(1)  # steadier CPU timings; they only check the script
        device = torch.device("cpu")
        gpu = "dry-run-cpu"
    else:
        if not torch.cuda.is_available():
            print("benchmark: no CUDA device; use --dry-run to check the script on the CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        gpu = torch.cuda.get_device_name(device)

    wls = workloads(args.dry_run)
    names = list(wls) if args.workloads == "all" else args.workloads.split(",")
    variants = VARIANTS if args.variants == "all" else args.variants.split(",")
    passes = args.passes.split(",")
    for bad, known, what in ((names, wls, "workload"), (variants, VARIANTS, "variant"), (passes, PASSES, "pass")):
        unknown = [n for n in bad if n not in known]
        if unknown:
            print(f"benchmark: unknown {what} {unknown}; known: {list(known)}", file=sys.stderr)
            return 2

    if args.output:
        out_path = args.output
    elif args.dry_run:
        out_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "torchfuse-bench-dry-run.json")
    else:
        out_path = os.path.join(ROOT, "bench", "results", slug(gpu) + ".json")
    paths = [out_path]
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], "results.json"))

    timer = Timer(device)
    props = {}
    if device.type == "cuda":
        pr = torch.cuda.get_device_properties(device)
        props = {"sm_count": pr.multi_processor_count, "memory_GiB": round(pr.total_memory / 2**30, 1),
                 "L2_MiB": round(getattr(pr, "L2_cache_size", 0) / 2**20, 1),
                 "capability": f"{pr.major}.{pr.minor}", "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version()}
    results = {
        "gpu": gpu,
        "torch": torch.__version__,
        "commit": args.commit or os.environ.get("TORCHFUSE_COMMIT") or git_commit(),
        "date": datetime.datetime.now().strftime("%Y-%m-%dT%H:%M"),
        "dry_run": args.dry_run,
        "command": "python bench/benchmark.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": props,
        "flags": {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                  "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                  "texpr_fuser": torch._C._jit_texpr_fuser_enabled()},
        "timing": {"method": "CUDA events per run" if device.type == "cuda" else "perf_counter per run",
                   "warmup": args.warmup, "min_reps": args.reps, "statistic": "median, min, max"},
        "floor_formula": FLOOR_FORMULA,
        "ceilings": {},
        "workloads": {},
        "rows": [],
        "interleaved": [],
        "skipped": [],
    }
    bench = Bench(args, device, timer, results, paths, deadline)
    print(f"benchmark: {gpu}, torch {torch.__version__}, budget {args.budget_s:.0f} s -> {', '.join(paths)}", flush=True)

    t = time.perf_counter()
    results["ceilings"] = measure_ceilings(device, timer, args.dry_run)
    c = results["ceilings"]
    print(f"ceilings ({time.perf_counter() - t:.1f} s): copy {c['copy_GBps']:.0f} GB/s, fp32 matmul "
          f"{c['fp32_matmul_TFLOPs']:.1f} TFLOP/s, tf32 {c['tf32_matmul_TFLOPs']:.1f}, bf16 {c['bf16_matmul_TFLOPs']:.1f}",
          flush=True)
    for n in names:
        wl = wls[n]
        results["workloads"][n] = {"desc": wl.desc, "dims": wl.dims, "tol": wl.tol,
                                   "float64_check": wl.float64_check,
                                   # eval mode computes something else here (BatchNorm running stats)
                                   "mode_sensitive": wl.kind == "bn", **floors(wl, c)}
    bench.save()

    for phase in PHASES:
        for n in names:
            for v in phase:
                if v not in variants:
                    continue
                if v == "bare_gemm" and wls[n].kind not in ("gemm", "bn"):
                    continue
                for p in passes:
                    if p == "fwdbwd" and v not in FWDBWD_VARIANTS:
                        continue
                    bench.run_unit(Unit(wls[n], v, p))
            free_memory()
        if phase is PHASES[0] and all(v in variants for v in INTERLEAVED):
            for n in names:
                for p in passes:
                    bench.run_interleaved(wls[n], p)

    results["elapsed_s"] = round(time.monotonic() - start, 1)
    results["failures"] = bench.failures
    bench.save()
    print(f"benchmark: {len(results['rows'])} measurements, {len(results['skipped'])} skipped, "
          f"{results['elapsed_s']:.0f} s; results in {out_path}", flush=True)
    if bench.failures:
        print("benchmark: FAILURES:\n  " + "\n  ".join(bench.failures), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
