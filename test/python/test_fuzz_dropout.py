"""The fuzzer's dropout vocabulary: the programs draw dropouts of probability
0 or with train=False (and the near-misses that stay), the checked programs keep their meaning
in training and eval, and RemoveZeroDropouts takes some."""

import os
import re
import sys

import torch

import torchfuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz  # noqa: E402
from fuzz.modes import load_class  # noqa: E402

SPELLINGS = {
    "zero in training": r"F\.dropout\(v\d+, 0\.0, True\)",
    "zero in the module's mode": r"F\.dropout\(v\d+, p=0\.0, training=self\.training\)",
    "zero in place": r"F\.dropout\(v\d+, 0\.0, True, inplace=True\)",
    "other kinds": r"torch\.(feature_dropout|alpha_dropout|feature_alpha_dropout)\(v\d+, 0\.0",
    "nonzero in eval": r"F\.dropout\(v\d+, 0\.5, False\)",
    "rate from an attribute": r"F\.dropout\(v\d+, self\.rate\d+, True\)",
}


def test_vocabulary_draws_dropouts():
    text = "\n".join(fuzz.generate(5, i * 100).source() for i in range(600))
    missing = [name for name, pattern in SPELLINGS.items() if not re.search(pattern, text)]
    assert missing == []


def _dropouts(graph):
    kinds = ["dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout"]
    return sum(len(graph.findAllNodes(f"aten::{k}")) + len(graph.findAllNodes(f"aten::{k}_")) for k in kinds)


def test_dropout_programs_keep_their_meaning_and_some_lose_the_dropout():
    removed = 0
    checked = 0
    for i in range(60):
        prog = fuzz.generate(20261128, i * 100)
        if "dropout(" not in prog.source():
            continue
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64",), modes=("train",), round_trip=False)
        except fuzz.Invalid:
            continue
        assert out.failures == [], (i, out.failures)
        checked += 1
        torch.manual_seed(0)
        module = torch.jit.script(load_class(prog.source())().train())
        graph = module.graph.copy()
        torch._C._jit_pass_inline(graph)
        before = _dropouts(graph)
        removed += torchfuse.fuse_graph(graph)["zero_dropouts_removed"]
        assert _dropouts(graph) <= before
    assert checked >= 5 and removed >= 3, (checked, removed)
