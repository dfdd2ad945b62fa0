"""bench/models.py's torchfuse_compile variant (torch.compile with
torchfuse.fx's backend) in the CPU dry run: measured against its baseline,
the compile variant, with what the backend fused recorded."""

import json

import torchfuse
from test_bench_models import load_models_module, no_out_dir  # noqa: F401  (fixture)


def test_torchfuse_compile_variant_dry_run(tmp_path):
    models = load_models_module()
    out = str(tmp_path / "m.json")
    assert models.main(["--dry-run", "--budget-s", "3000", "--output", out, "--models", "mlp",
                        "--modes", "eval_fp32", "--variants", "torchfuse_compile"]) == 0
    with open(out) as f:
        data = json.load(f)
    # selecting the variant selects its baseline, and eager is the reference
    assert set(data["rows"]) == {"mlp/eval_fp32/eager", "mlp/eval_fp32/compile", "mlp/eval_fp32/torchfuse_compile"}
    row = data["rows"]["mlp/eval_fp32/torchfuse_compile"]
    assert row["vs_baseline"]["baseline"] == "compile" and row["vs_baseline"]["speedup"] > 0
    assert row["interleaved"]["speedup"] > 0
    assert set(row["fused"]) == set(torchfuse.pass_names())  # the MLP block has no chain: all 0
    assert not row["wrong"]
