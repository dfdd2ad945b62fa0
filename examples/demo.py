"""torchfuse demo: scripts a small model per pattern, optimizes it, prints the
fused graph and the fusion report, checks the outputs against the original
and times both.  Exits non-zero on a mismatch.

    make demo        # or: source env.sh && python examples/demo.py
"""

import copy
import sys
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


class Relu(nn.Module):
    def forward(self, x):
        return torch.relu(x * 2.0)


def timeit(fn, x, device, iters=50):
    with torch.no_grad():
        for _ in range(3):  # profiling executor: run 1 profiles, run 2 optimizes
            fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> int:
    torch._C._jit_set_texpr_fuser_enabled(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torchfuse {torchfuse.__version__}, torch {torch.__version__}, device {device}")
    torch.manual_seed(0)
    cases = [
        ("linear_add_relu", LinearAddRelu(), (64, 256), False),
        ("conv_relu_add", ConvReluAdd(), (8, 32, 16, 16), False),
        ("batch_norm_add_div_swish (train)", BatchNormSwish(), (64, 256), False),
        ("batch_norm_add_div_swish (frozen eval)", BatchNormSwish().eval(), (64, 256), True),
        ("relu", Relu(), (64, 256), False),
    ]
    failed = False
    for name, model, shape, freeze in cases:
        model = model.to(device)
        x = torch.randn(*shape, device=device)
        reference = torch.jit.script(copy.deepcopy(model))
        optimized = torchfuse.optimize(torch.jit.script(model), freeze=freeze)
        print(f"\n=== {name}")
        print(optimized.graph)
        print("report:", torchfuse.report(optimized))
        with torch.no_grad():
            want, got = reference(x), optimized(x)
        try:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            print("outputs match")
        except AssertionError as e:
            print(f"MISMATCH: {e}")
            failed = True
        if model.training:
            # BN in training mode updates running statistics on each call:
            # time both from identical copies.
            reference = torch.jit.script(copy.deepcopy(model))
        before = timeit(reference, x, device)
        after = timeit(optimized, x, device)
        print(f"time per call: {before:.1f} us before, {after:.1f} us after")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
