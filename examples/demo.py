"""torchfuse demo.

1. The main job on a real model: a torchvision ResNet-18 (eval) is scripted
   and saved; `optimize-model --freeze --check` optimizes the file, runs the
   original and the result on the same random input and compares them; the
   demo prints the fused chains and the time per call of both files.
2. One line per fusion: a small model holding the chain, the chains fused,
   the largest difference from the original and the time per call of both.

Times are medians of 20 calls, the original's and the optimized model's in
alternation, after warm-up runs that include TorchScript's profiling runs, under TorchScript's default settings (NNC on); CUDA events on
a GPU.  Exits non-zero when an output differs beyond the tolerance.

    make demo            # or: source env.sh && python examples/demo.py
    python examples/demo.py --graphs   # also print the optimized graphs
"""

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchfuse

# TorchScript has warned on every entry point since torch 2.10.
warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=DeprecationWarning)


class LinearAddRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256, bias=False)
        self.bias = nn.Parameter(torch.randn(256))

    def forward(self, x):
        return F.relu(self.fc(x) + self.bias)


class ConvReluAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x)) + x


class BatchNormSwish(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.bn = nn.BatchNorm1d(256)
        self.bias = nn.Parameter(torch.randn(1))
        self.scale = 2.0

    def forward(self, x):
        t = (self.bn(self.fc(x)) + self.bias) / self.scale
        return t * torch.sigmoid(t)


def median_ms(fns, x, device, warmup=5, runs=20):
    """Median time per call of each of fns, timed in alternation (one call of
    each per round), so that a drift in the machine's speed affects them
    alike; the warm-up covers the profiling executor's profiling and
    optimizing runs."""
    times = [[] for _ in fns]
    with torch.no_grad():
        for fn in fns:
            for _ in range(warmup):
                fn(x)
        for _ in range(runs):
            for fn, t in zip(fns, times):
                if device.type == "cuda":
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn(x)
                    end.record()
                    end.synchronize()
                    t.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    fn(x)
                    t.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def fused_chains(report):
    chains = {name: n for name, n in report.items() if n}
    return ", ".join(f"{name} ×{n}" for name, n in chains.items()) or "none"


def real_model(device, show_graph):
    try:
        import torchvision
    except ImportError:
        print("1. ResNet-18: skipped, torchvision is not installed "
              "(pip install -r requirements-test.txt)")
        return True
    cli = shutil.which("optimize-model")
    if cli is None:
        print("1. ResNet-18: skipped, optimize-model is not on PATH (source env.sh)")
        return True
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    shape = (8, 3, 224, 224)
    with tempfile.TemporaryDirectory() as tmp:
        src, dst, rep = (os.path.join(tmp, n) for n in ("resnet18.pt", "resnet18-fused.pt", "report.json"))
        torch.jit.script(model).save(src)
        args = [cli, src, dst, "--freeze", "--check", f"--input-shape={'x'.join(map(str, shape))}",
                f"--device={device.type}", f"--report={rep}", "-q"]
        print("1. ResNet-18 (torchvision, eval), scripted and saved; then")
        print("   $ optimize-model resnet18.pt resnet18-fused.pt --freeze --check "
              f"--input-shape={'x'.join(map(str, shape))} --device={device.type}")
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"   FAILED (exit {proc.returncode}): {proc.stderr.strip()}")
            return False
        with open(rep) as f:
            report = json.load(f)
        fused = fused_chains(report.get("fused", {}))
        original = torch.jit.load(src, map_location=device)
        optimized = torch.jit.load(dst, map_location=device)
        x = torch.randn(*shape, device=device)
        with torch.no_grad():
            err = (optimized(x) - original(x)).abs().max().item()
        before, after = median_ms([original, optimized], x, device)
        print(f"   check passed; chains fused: {fused}; convolution weights stored channels-last: "
              f"{report.get('channels_last_weights', 0)}; max |difference| {err:.1e}")
        print(f"   time per call: {before:.2f} ms original, {after:.2f} ms optimized "
              f"({before / after:.2f}×)")
        if show_graph:
            print(optimized.graph)
    return True


def chains(device, show_graph):
    print("\n2. One small model per fusion (times per call, original → optimized)")
    torch.manual_seed(0)
    cases = [
        ("linear → add → relu", LinearAddRelu(), (64, 256), False),
        ("conv → relu → add", ConvReluAdd(), (8, 32, 16, 16), False),
        ("batch_norm → add → div → swish, train", BatchNormSwish(), (64, 256), False),
        ("batch_norm → add → div → swish, frozen", BatchNormSwish().eval(), (64, 256), True),
    ]
    ok = True
    for name, model, shape, freeze in cases:
        model = model.to(device)
        x = torch.randn(*shape, device=device)
        reference = torch.jit.script(copy.deepcopy(model))
        optimized = torchfuse.optimize(torch.jit.script(copy.deepcopy(model)), freeze=freeze)
        with torch.no_grad():
            want, got = reference(x), optimized(x)
        err = (got - want).abs().max().item()
        match = torch.allclose(got, want, rtol=1e-4, atol=1e-5)
        ok &= match
        # NB: training-mode BN updates its statistics on every call: time
        # identical copies.
        before, after = median_ms([torch.jit.script(copy.deepcopy(model)), optimized], x, device)
        print(f"   {name:40s} fused: {fused_chains(torchfuse.report(optimized)):22s} "
              f"max |diff| {err:.1e}{'' if match else ' MISMATCH'}   "
              f"{before:.3f} → {after:.3f} ms")
        if show_graph:
            print(optimized.graph)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", action="store_true", help="print the optimized graphs")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torchfuse {torchfuse.__version__}, torch {torch.__version__}, device "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}\n")
    ok = real_model(device, args.graphs)
    ok &= chains(device, args.graphs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
