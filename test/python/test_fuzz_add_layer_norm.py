"""The fuzzer's add_layer_norm vocabulary: the programs draw add ->
layer_norm chains (post- and pre-LN, and their near-misses), and the checked
programs fuse some."""

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz  # noqa: E402

NORM = r"(self\.ln\d+\(|F\.layer_norm\()"
SPELLINGS = {
    "add -> module LayerNorm": r"(v\d+) = .*\+.*\n\s+v\d+ = self\.ln\d+\(\1\)",
    "add -> F.layer_norm": r"(v\d+) = .*\+.*\n\s+v\d+ = F\.layer_norm\(\1, ",
    "add_ -> layer_norm": r"(v\d+) = (v\d+)\.add_\(.*\n\s+v\d+ = " + NORM + r"\1\b",
    "pre-LN residual": r"(v\d+) = .*\+.*\n\s+(v\d+) = " + NORM + r"\1\b.*\n\s+v\d+ = \1 \+ \2\n",
    "runtime eps": r"F\.layer_norm\(v\d+, \([\d, ]+\), None, None, self\.k\d+\)",
    "sum written after the norm": r"(v\d+) = " + NORM + r"(v\d+)\b.*\n\s+\3\.mul_\(0\.5\)",
}


def test_vocabulary_draws_add_layer_norm_chains():
    text = "\n".join(fuzz.generate(3, i * 100).source() for i in range(400))
    missing = [name for name, pattern in SPELLINGS.items() if not re.search(pattern, text)]
    assert missing == []


def test_add_layer_norm_chains_are_fused():
    counts = []
    for i in range(40):
        prog = fuzz.generate(20261127, i * 100)
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64",), modes=("frozen",), round_trip=False)
        except fuzz.Invalid:
            continue
        assert out.failures == [], (i, out.failures)
        counts.append(out.fused["add_layer_norm"])
    assert sum(n > 0 for n in counts) >= 5, counts
