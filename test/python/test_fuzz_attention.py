"""The fuzzer's attention vocabulary: the programs draw
scaled_dot_product_attention with the mask transformers traces (and the
near-misses that keep the call), the checked programs keep their meaning,
and DropAllTrueAttentionMasks takes some."""

import os
import re
import sys

import torch

import torchfuse

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz  # noqa: E402
from fuzz.modes import load_class  # noqa: E402

SPELLINGS = {
    "all-true mask": r"m\d+ = \(torch\.arange\(\d+\) \+ 0\)\[None, None, :, None\] >= 0\n",
    "bound below the threshold": r"m\d+ = \(torch\.arange\(\d+\) \+ 0\)\[None, None, :, None\] (>= 1|> 0)\n",
    "narrow dtype": r"torch\.arange\(\d+, dtype=torch\.int8\)",
    "mask written": r"m\d+\[0, 0, 0, 0\] = False",
    "dropout": r"attn_mask=m\d+\.expand\([\d, ]+\), dropout_p=0\.5\)",
}


def test_vocabulary_draws_attention_masks():
    text = "\n".join(fuzz.generate(3, i * 100).source() for i in range(1200))
    missing = [name for name, pattern in SPELLINGS.items() if not re.search(pattern, text)]
    assert missing == []


def test_attention_programs_keep_their_meaning_and_some_lose_the_mask():
    dropped = 0
    checked = 0
    for i in range(80):
        prog = fuzz.generate(20261128, i * 100)
        if "scaled_dot_product_attention" not in prog.source():
            continue
        try:
            out = fuzz.check_program(prog, i, dtypes=("float64",), modes=("frozen",), round_trip=False)
        except fuzz.Invalid:
            continue
        assert out.failures == [], (i, out.failures)
        checked += 1
        torch.manual_seed(0)
        module = torch.jit.script(load_class(prog.source())().eval())
        graph = torchfuse.optimize(module, freeze=True).graph
        dropped += len(graph.findAllNodes("torchfuse::custom_unmasked_attention"))
    assert checked >= 5 and dropped >= 3, (checked, dropped)
