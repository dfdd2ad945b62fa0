"""The fuzzer's linear_act vocabulary: the programs draw linear -> [add ->]
act and linear -> add chains (and their near-misses), and the checked
programs fuse some."""

import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz  # noqa: E402

ACT = r"(F\.(relu6?|hardtanh|silu|hardswish|hardsigmoid|gelu|leaky_relu)\(|torch\.relu\(|torch\.sigmoid\(|\.relu_?\(\)|self\.act\d+\()"
SPELLINGS = {
    "linear -> act": r"(v\d+) = (self\.fc\d+\(|F\.linear\().*\n\s+v\d+ = " + ACT + r"\1\b",
    "module linear -> act": r"(v\d+) = self\.fc\d+\(.*\n\s+v\d+ = " + ACT + r"\1\b",
    "functional linear -> act": r"(v\d+) = F\.linear\(.*\n\s+v\d+ = " + ACT + r"\1\b",
    "linear -> gelu": r"(v\d+) = (self\.fc\d+\(|F\.linear\().*\n\s+v\d+ = F\.gelu\(\1\b",
    "linear -> add": r"(v\d+) = (self\.fc\d+\(|F\.linear\().*\n\s+v\d+ = (\1 \+ |torch\.add\(\1,|\1\.add_\()",
    "linear -> add, residual first": r"(v\d+) = (self\.fc\d+\(|F\.linear\().*\n\s+v\d+ = (\w+) \+ \1\b",
    "linear -> add -> act": r"(v\d+) = (self\.fc\d+\(|F\.linear\().*\n\s+(v\d+) = \1 \+ .*\n\s+v\d+ = " + ACT + r"\3\b",
}


def test_vocabulary_draws_linear_act_chains():
    text = "\n".join(fuzz.generate(3, i * 100).source() for i in range(400))
    missing = [name for name, pattern in SPELLINGS.items() if not re.search(pattern, text)]
    assert missing == []


def test_linear_act_chains_are_fused():
    counts = []
    for i in range(40):
        prog = fuzz.generate(20261126, i * 100)
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64",), modes=("frozen",), round_trip=False)
        except fuzz.Invalid:
            continue
        assert out.failures == [], (i, out.failures)
        counts.append(out.fused["linear_act"])
    assert sum(n > 0 for n in counts) >= 5, counts
