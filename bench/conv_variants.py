#!/usr/bin/env python3
"""custom_conv_relu_add's variants and their pieces on the conv_relu_bias
workload, in one run (docs/kernels/conv_relu_add.md records the results).

    python bench/conv_variants.py [--reps 25] [--json OUT.json]

x[128, 64, 128, 128] float32 NCHW, Conv2d 64->128 3x3 with bias, relu, +
b2[128, 1, 1], under PyTorch's default flags (cuDNN TF32 allowed).  Times are
CUDA-event medians of --reps runs after 3 warm-ups.  Variants of the op:
C (torchfuse.backends.conv.channels_last_route = "never": eager's NCHW
convolution and one streaming pass), E ("always" with allow_implicit_gemm =
False: the channels-last route with cuDNN's convolution), F ("always": the
route with the sm_90 implicit-GEMM kernel, x converted by a pass before it,
nchw_conversion = "separate") and J (F with x converted inside the kernel by
its CTAs' idle warps; also with each conversion_lookahead in images).  fwd+bwd: C (=never); H (the
settings of E: C's forward, the route's backward through cuDNN's
channels-last gradient convolutions); I (the settings of F: F's forward
with the relu mask, the input gradient by the implicit-GEMM kernel, the
weight gradient by cuDNN), whose longest kernels are listed; I with J's
forward.  Errors are
against a float64 reference computed on the GPU, next to eager's; for
fwd+bwd, the worst over the gradients of x, w, b1 and b2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import torchfuse  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import median_ms  # noqa: E402

ops = torch.ops.torchfuse
# torchfuse.backends.conv settings: (channels_last_route, allow_implicit_gemm,
# nchw_conversion), each forcing its strategy
VARIANTS = {"C": ("never", False, "auto"), "E": ("always", False, "auto"),
            "F": ("always", True, "separate"), "J": ("always", True, "auto")}
LOOKAHEADS = (1, 2, 8, 64)


def select(variant: str, lookahead: int = 0) -> None:
    conv = torchfuse.backends.conv
    conv.channels_last_route, conv.allow_implicit_gemm, conv.nchw_conversion = VARIANTS[variant]
    conv.conversion_lookahead = lookahead


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.reps < 20:
        ap.error("--reps must be at least 20")
    torch.manual_seed(0)
    dev = "cuda"
    x = torch.randn(128, 64, 128, 128, device=dev)
    w = torch.randn(128, 64, 3, 3, device=dev) / 24
    b1 = torch.randn(128, device=dev)
    b2 = torch.randn(128, 1, 1, device=dev)
    conv_args = ([1, 1], [0, 0], [1, 1], 1)
    gy = torch.randn(128, 128, 126, 126, device=dev)
    rows: dict[str, float] = {}
    errors: dict[str, float] = {}

    def op(variant: str, with_grad: bool, lookahead: int = 0):
        select(variant, lookahead)
        if not with_grad:
            return lambda: ops.custom_conv_relu_add(x, w, b1, *conv_args, b2, 1.0)
        leaves = [t.detach().requires_grad_(True) for t in (x, w, b1, b2)]

        def run():
            for t in leaves:
                t.grad = None
            ops.custom_conv_relu_add(leaves[0], leaves[1], leaves[2], *conv_args, leaves[3], 1.0).backward(gy)
        return run

    def eager_fwdbwd():
        leaves = [t.detach().requires_grad_(True) for t in (x, w, b1, b2)]

        def run():
            for t in leaves:
                t.grad = None
            (torch.relu(F.conv2d(leaves[0], leaves[1], leaves[2])) + leaves[3]).backward(gy)
        return run

    with torch.no_grad():
        ref = torch.relu(F.conv2d(x.double(), w.double(), b1.double())) + b2.double()
        eager = torch.relu(F.conv2d(x, w, b1)) + b2
        errors["eager"] = rel_err(eager, ref)
        del eager
        for name in VARIANTS:
            select(name)
            errors[name] = rel_err(ops.custom_conv_relu_add(x, w, b1, *conv_args, b2, 1.0), ref)
        del ref
        torch.cuda.empty_cache()
        xl = x.contiguous(memory_format=torch.channels_last)
        wl = w.contiguous(memory_format=torch.channels_last)
        yl = F.conv2d(xl, wl)
        out = torch.empty(128, 128, 126, 126, device=dev)
        src = torch.empty_like(out)
        rows["eager fwd"] = median_ms(lambda: torch.relu(F.conv2d(x, w, b1)) + b2, args.reps)
        rows["conv2d NCHW (no bias)"] = median_ms(lambda: F.conv2d(x, w), args.reps)
        rows["conv2d channels-last (no bias)"] = median_ms(lambda: F.conv2d(xl, wl), args.reps)
        rows["x to channels-last, ATen"] = median_ms(lambda: x.contiguous(memory_format=torch.channels_last), args.reps)
        rows["output copy, same layout (copy speed)"] = median_ms(lambda: out.copy_(src), args.reps)
        rows["output channels-last to NCHW, ATen"] = median_ms(lambda: out.copy_(yl), args.reps)
        for name in VARIANTS:
            rows[f"op fwd, {name}"] = median_ms(op(name, False), args.reps)
        for ahead in LOOKAHEADS:
            rows[f"op fwd, J converting at most {ahead} images ahead"] = median_ms(op("J", False, ahead), args.reps)
    del xl, wl, yl, out, src
    torch.cuda.empty_cache()

    def grads(fn, dtype=torch.float32):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x, w, b1, b2)]
        fn(*leaves).backward(gy.to(dtype))
        return [t.grad for t in leaves]

    model = lambda x_, w_, b_, o_: torch.relu(F.conv2d(x_, w_, b_)) + o_
    ref = grads(model, torch.float64)
    torch.cuda.empty_cache()
    fwdbwd = {"C": "op fwd+bwd, C", "E": "op fwd+bwd, H (C + channels-last backward)",
              "F": "op fwd+bwd, I (F with mask + implicit-GEMM input gradient)",
              "J": "op fwd+bwd, I with J's forward"}
    worst = lambda got: max(rel_err(g, r) for g, r in zip(got, ref))
    errors["eager fwd+bwd"] = worst(grads(model))
    for variant, row in fwdbwd.items():
        select(variant)
        errors[row] = worst(grads(lambda *a: ops.custom_conv_relu_add(*a[:3], *conv_args, a[3], 1.0)))
    del ref
    torch.cuda.empty_cache()
    rows["eager fwd+bwd"] = median_ms(eager_fwdbwd(), args.reps)
    for variant, row in fwdbwd.items():
        rows[row] = median_ms(op(variant, True), args.reps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        op("J", True)()
        torch.cuda.synchronize()
    steps = sorted(((e.time_range.elapsed_us() / 1e3, e.name) for e in prof.events() if e.device_type.name == "CUDA"),
                   reverse=True)

    # the routes' own kernels, from the profiler
    names = {"Identity": "kernel: x to NHWC (E)",
             "BiasReluAdd": "kernel: NHWC output to NCHW with epilogue (E)",
             "RoundTf32": "kernel: x to NHWC rounded to TF32 (F; also the weight)",
             "implicitGemmKernel": "kernel: implicit-GEMM conv with epilogue (F)"}
    kernels: dict[str, list[float]] = {}
    for variant in ("E", "F", "J"):
        with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                op(variant, False)()
            torch.cuda.synchronize()
        for e in prof.events():
            for key in names:
                if key in e.name:
                    key = key + " J" if variant == "J" and key in ("RoundTf32", "implicitGemmKernel") else key
                    kernels.setdefault(key, []).append(e.time_range.elapsed_us() / 1e3)
    names["RoundTf32 J"] = "kernel: the weight to [k][r][s][c] rounded to TF32 (J)"
    names["implicitGemmKernel J"] = "kernel: implicit-GEMM conv with epilogue, x converted inside (J)"
    conv = torchfuse.backends.conv  # back to the defaults
    conv.channels_last_route, conv.allow_implicit_gemm, conv.nchw_conversion = "auto", True, "auto"
    conv.conversion_lookahead = 0
    for key, ts in kernels.items():
        # RoundTf32 runs twice per call (x, then the small weight): the max
        # of each pair is x's
        rows[names[key]] = statistics.median(max(ts[i:i + 2]) for i in range(0, len(ts), 2)) \
            if key == "RoundTf32" else statistics.median(ts)

    width = max(map(len, rows))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for k, v in rows.items():
        print(f"  {k:{width}s} {v:8.3f} ms")
    print("  fwd+bwd, I, its longest kernels:")
    for t, name in steps[:10]:
        print(f"    {t:8.3f} ms  {name[:100]}")
    print("  error vs float64: " + ", ".join(f"{k} {v:.3e}" for k, v in errors.items()))
    print("  fwd speed-up vs eager: " + ", ".join(f"{v} {rows['eager fwd'] / rows[f'op fwd, {v}']:.2f}x" for v in VARIANTS)
          + "; fwd+bwd: " + ", ".join(f"{v} {rows['eager fwd+bwd'] / rows[row]:.2f}x"
                                      for v, row in zip(("C", "H", "I", "I+J"), fwdbwd.values())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "reps": args.reps, "statistic": "median", "ms": rows, "rel_err_vs_float64": errors}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
