"""The fusion registry is the one list of fusions: the pipeline, the report,
the CLI and the docs agree with it."""

import pathlib
import re

import torch

import torchfuse

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_pass_names_are_the_registry_names_in_order():
    names = [f["name"] for f in torchfuse.fusions()]
    assert names == torchfuse.pass_names()
    assert len(set(names)) == len(names)
    assert names[-1] == "relu", "ReplaceRelu runs last, after every chain fusion"


def test_every_registered_op_exists():
    for f in torchfuse.fusions():
        assert f["ops"], f
        for op in f["ops"]:
            ns, name = op.split("::")
            assert ns == "torchfuse" and name.startswith("custom_"), op
            assert hasattr(getattr(torch.ops, ns), name), op


def _docs_table():
    text = (ROOT / "docs" / "passes.md").read_text()
    body = text.split("<!-- registry-table: checked against torchfuse.fusions() -->", 1)[1]
    lines = body.strip().splitlines()
    rows = []
    for line in lines[2:]:  # after the header and the separator
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append(
            {
                "name": cells[0].strip("`"),
                "chain": cells[1],
                "ops": re.findall(r"`([^`]+)`", cells[2]),
                "by_default": {"yes": True, "no": False}[cells[3]],
            }
        )
    return rows


def test_docs_table_lists_the_registry():
    assert _docs_table() == torchfuse.fusions()


def test_readme_names_every_registered_op():
    readme = (ROOT / "README.md").read_text()
    for f in torchfuse.fusions():
        for op in f["ops"]:
            assert f"`{op.split('::')[1]}`" in readme, op


class _LinearAddRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, r):
        return torch.relu(self.fc(x) + r), torch.relu(r)


def test_reports_have_one_key_per_registry_entry():
    m = torch.jit.script(_LinearAddRelu())
    opt = torchfuse.optimize(m, passes=torchfuse.pass_names())
    counts = torchfuse.report(opt)
    assert counts == {"conv_relu_add": 0, "conv_act_max_pool": 0, "gate_mul": 0, "conv_add_act": 0, "conv_batch_norm_act": 0,
                      "linear_add_relu": 1, "batch_norm_add_div_swish": 0, "linear_act": 0, "add_layer_norm": 0,
                      "relu": 1}
    # the standalone relu removes no memory traffic: only when named
    assert torchfuse.report(torchfuse.optimize(m)) == {**counts, "relu": 0}
    assert [f["name"] for f in torchfuse.fusions() if not f["by_default"]] == ["relu"]
    assert set(torchfuse.report(m)) == set(torchfuse.pass_names())
    assert not any(torchfuse.report(m).values())


def test_fuse_graph_canonicalizes_and_follows_the_passes_argument():
    # NB: relu_ on the fresh linear+add output is made functional by
    # Canonicalize; without it the chain would not match.
    @torch.jit.script
    def f(x, w, b, r):
        return torch.add(torch.nn.functional.linear(x, w, b), r).relu_()

    g = f.graph.copy()
    torch._C._jit_pass_inline(g)
    only_relu = torchfuse.fuse_graph(g.copy(), passes=["relu"])
    # NB: the standalone relu pass leaves relu_ (isOutOfPlaceSpelling)
    assert only_relu["linear_add_relu"] == 0 and only_relu["relu"] == 0
    counts = torchfuse.fuse_graph(g)
    assert counts["linear_add_relu"] == 1 and counts["relu"] == 0
    assert counts["nodes_before"] > counts["nodes_after"]
    assert "torchfuse::custom_linear_add_relu" in str(g)


def test_unknown_pass_names_the_known_ones():
    m = torch.jit.script(_LinearAddRelu())
    try:
        torchfuse.optimize(m, passes=["no_such_pass"])
    except RuntimeError as e:
        msg = str(e)
    else:
        raise AssertionError("an unknown pass name must raise")
    assert "unknown pass 'no_such_pass'" in msg
    assert ", ".join(torchfuse.pass_names()) in msg
