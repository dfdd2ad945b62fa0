#!/usr/bin/env python3
"""Where a model's time goes, per variant: the CUDA kernels of one eval
forward (torch.profiler), summed per kernel name and per kind (convolution,
GEMM, pooling, layout conversion, elementwise, other), in one run.

    python bench/profile_kernels.py --models vgg16,resnet50 --dtypes fp32 \
        --variants freeze_cl,compile,torchfuse_freeze

The models are bench/models.py's (random-initialised, same batch and
resolution); the variants are its eval variants.  Times are per forward,
averaged over --runs profiled runs after --warmup runs (which include the
profiling executor's runs and torch.compile's compile).
"""
import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

KINDS = [  # (kind, substrings of the kernel name), first match wins
    ("layout", ("nchwtonhwc", "nhwctonchw", "nchwtoNhwc", "transpose", "copy_kernel", "convertTensor")),
    ("pool", ("pool",)),
    ("gemm", ("gemm", "cublas", "cutlass", "ampere_s", "sm90_xmma_gemm", "splitk")),
    ("conv", ("conv", "xmma", "implicit", "cudnn", "dgrad", "wgrad", "fprop", "winograd", "fft")),
    ("torchfuse", ("torchfuse",)),
    ("triton", ("triton",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def build(spec, variant: str, dtype: torch.dtype, device):
    torch.manual_seed(1234)
    m = spec.build().to(device=device, dtype=dtype).eval()
    x = torch.randn(spec.input_shape, device=device).to(dtype)
    if variant.endswith("_cl") or variant == "eager_cl":
        m = m.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if variant in ("eager", "eager_cl"):
        return m, x
    if variant == "compile":
        torch._dynamo.reset()
        return torch.compile(m), x
    s = torch.jit.script(m)
    if variant in ("freeze", "freeze_cl"):
        return torch.jit.freeze(s), x
    if variant == "ofi":
        return torch.jit.optimize_for_inference(s), x
    if variant in ("torchfuse", "torchfuse_freeze"):
        import torchfuse

        return torchfuse.optimize(s, freeze=variant == "torchfuse_freeze"), x
    raise ValueError(f"profile_kernels: unknown variant {variant!r}")


def profile(fn, x, warmup: int, runs: int):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    with torch.no_grad():
        for _ in range(warmup):
            fn(x)
        torch.cuda.synchronize()
        with prof(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(runs):
                fn(x)
            torch.cuda.synchronize()
    per_kernel = collections.Counter()
    calls = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time_total / runs
            calls[e.name] += 1 / runs
    return per_kernel, calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="vgg16,resnet50")
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--variants", default="freeze_cl,compile,torchfuse_freeze")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_kernels: needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    specs = models.specs(False)
    for name in args.models.split(","):
        for dt in args.dtypes.split(","):
            dtype = models.DTYPES[dt]
            for v in args.variants.split(","):
                fn, x = build(specs[name], v, dtype, device)
                per_kernel, calls = profile(fn, x, args.warmup, args.runs)
                total = sum(per_kernel.values())
                by_kind = collections.Counter()
                for k, us in per_kernel.items():
                    by_kind[kind_of(k)] += us
                kinds = ", ".join(f"{k} {us:.0f}" for k, us in by_kind.most_common())
                print(f"== {name} {dt} {v}: {total:.0f} us of kernels per forward ({kinds})")
                for k, us in per_kernel.most_common(args.top):
                    print(f"   {us:8.1f} us {calls[k]:5.1f}x  {kind_of(k):11s} {k[:110]}")
                del fn, x
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
