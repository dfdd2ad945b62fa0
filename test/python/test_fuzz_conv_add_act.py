"""The fuzzer's conv_add_act vocabulary and its frozen mode's channels_last
variant: the programs draw the chain's forms and activations, the variant
runs, and a stride difference in it fails."""

import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz  # noqa: E402
from fuzz import modes as fuzz_modes  # noqa: E402

SPELLINGS = {
    "relu6": r"F\.relu6\(|nn\.ReLU6\(|F\.hardtanh\(\w+, 0\.0, 6\.0",
    "hardtanh": r"F\.hardtanh\(|nn\.Hardtanh\(",
    "hardtanh in place": r"F\.hardtanh\([^)]*inplace=True",
    "hardtanh bound from an attribute": r"F\.hardtanh\(\w+, self\.k\d+",
    "hardtanh bound from a tensor": r"F\.hardtanh\([^\n]*float\(",
    "silu": r"F\.silu\(|nn\.SiLU\(",
    "hardswish": r"F\.hardswish\(",
    "hardsigmoid": r"F\.hardsigmoid\(",
    "sigmoid_": r"\.sigmoid_\(\)",
    "gelu tanh": r"approximate='tanh'",
    "gelu none": r"F\.gelu\(\w+\)|approximate='none'",
    "leaky_relu slope": r"F\.leaky_relu\(\w+, -?[\d.]+",
    "leaky_relu slope from an attribute": r"F\.leaky_relu\(\w+, self\.k\d+",
    "residual add": r"= torch\.add\(v\d+, x\d+, alpha=",
}


def test_vocabulary_draws_conv_add_act_forms():
    text = "\n".join(fuzz.generate(3, i * 100).source() for i in range(400))
    missing = [name for name, pattern in SPELLINGS.items() if not re.search(pattern, text)]
    assert missing == []


def test_conv_add_act_chains_are_fused():
    counts = []
    for i in range(40):
        prog = fuzz.generate(20261125, i * 100)
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64",), modes=("frozen",), round_trip=False)
        except fuzz.Invalid:
            continue
        counts.append(out.fused["conv_add_act"])
    assert sum(n > 0 for n in counts) >= 5, counts


SOURCE = """\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv2d(3, 4, 3, stride=1, padding=1, dilation=1, groups=1, bias=True)
        self.p1 = nn.Parameter(torch.randn(4, 1, 1))
    def forward(self, x0):
        v1 = self.conv0(x0)
        v2 = v1 + self.p1
        return F.hardswish(v2)
"""


def test_channels_last_variant_runs_and_passes():
    for variant in ("contiguous", "channels_last"):
        out = fuzz.check_source(SOURCE, [(2, 3, 5, 5)], 0, channels_last=variant)
        # the train and frozen modes' variants, in float64 and float32
        assert out.failures == [] and out.channels_last == 4, (variant, out.failures)
        assert out.fused["conv_add_act"] == 4  # the variant's own fused nodes are not counted
    assert fuzz.check_source(SOURCE, [(2, 3, 5, 5)], 0, channels_last="none").channels_last == 0


class _ChannelsLastOutput(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).contiguous(memory_format=torch.channels_last)


def test_channels_last_variant_stride_difference_fails(monkeypatch):
    # Planted fault: in the channels_last variant alone, the optimized
    # module's output made channels-last (equal values).
    optimize = fuzz_modes._optimize

    def planted(module, freeze, preserved, *layout):
        result = optimize(module, freeze, preserved, *layout)
        return _ChannelsLastOutput(result) if layout else result

    monkeypatch.setattr(fuzz_modes, "_optimize", planted)
    out = fuzz.check_source(SOURCE, [(2, 3, 5, 5)], 0, dtypes=("float64",), modes=("frozen",), round_trip=False,
                            channels_last="contiguous")
    assert out.failures == ["float64 channels_last frozen: output 0: strides (100, 1, 20, 4) vs (100, 25, 5, 1) "
                            "(shape (2, 4, 5, 5))"], out.failures


def test_strides_mismatch():
    a = torch.randn(2, 3, 4, 4)
    assert fuzz_modes._strides_mismatch(a, a.clone()) is None
    b = a.contiguous(memory_format=torch.channels_last)
    assert fuzz_modes._strides_mismatch(a, b) == "strides (48, 1, 12, 3) vs (48, 16, 4, 1) (shape (2, 3, 4, 4))"
    # size-1 dims count (suggest_memory_format reads them)
    c = torch.randn(2, 3, 1, 1)
    d = torch.empty_strided((2, 3, 1, 1), (3, 1, 3, 3)).copy_(c)
    assert fuzz_modes._strides_mismatch(c, d) == "strides (3, 1, 3, 3) vs (3, 1, 1, 1) (shape (2, 3, 1, 1))"
