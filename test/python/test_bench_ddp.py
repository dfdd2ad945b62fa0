"""bench/ddp.py, the DDP training benchmark, in its CPU dry run (tiny shapes,
gloo, one and two processes), so that the script cannot rot; its report,
short table, chart and section of docs/performance.md."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "ddp.py")

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch built without gloo")


def load_script(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def ddp():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    return load_script(SCRIPT, "bench_ddp")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ddp") / "ddp.json")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # the GPU check's $OUT gets no copy
    proc = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--output", out], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return {"path": out, "data": json.load(f), "stdout": proc.stdout}


def test_every_world_size_and_variant_measured(results, ddp):
    data = results["data"]
    assert data["dry_run"] is True and data["backend"] == "gloo"
    assert data["model"] == "resnet18" and data["batch_per_gpu"] == 2
    assert set(data["rows"]) == {"1", "2"}
    assert data["flags"]["texpr_fuser"] is True  # TorchScript's defaults
    for w, row in data["rows"].items():
        assert set(row) == set(ddp.VARIANTS)
        for v, r in row.items():
            assert len(r["rank_medians_ms"]) == int(w)
            # the slowest rank's median
            assert r["median_ms"] == max(r["rank_medians_ms"]) > 0
            assert r["min_ms"] <= r["median_ms"] <= r["max_ms"]
            assert r["steps_per_rank"] == ddp.ROUNDS * data["timing"]["reps"]
            assert r["images_per_s"] == pytest.approx(int(w) * 2 / r["median_ms"] * 1e3)
            assert r["speedup_vs_eager"] == pytest.approx(row["eager"]["median_ms"] / r["median_ms"])
            assert r["peak_mem_MiB"] is None  # no device memory on the CPU
            one = data["rows"]["1"][v]["images_per_s"]
            assert r["scaling_efficiency"] == pytest.approx(r["images_per_s"] / (int(w) * one))


def test_variants_take_eager_s_step(results):
    for w, row in results["data"]["rows"].items():
        assert row["eager"]["err_vs_eager"] == {"out": 0.0, "grads": 0.0}
        assert row["eager"]["fused"] == {} and row["torchscript"]["fused"] == {}
        # a fused chain changes a graph; with none fused the report says the
        # optimized module runs TorchScript's graphs
        tf = row["torchfuse"]
        assert isinstance(tf["same_graphs_as_torchscript"], bool)
        if tf["fused"]:
            assert not tf["same_graphs_as_torchscript"], (w, tf["fused"])
        for v in ("torchscript", "torchfuse"):
            # float32 on the CPU, one step from the same weights
            errs = row[v]["err_vs_eager"]
            assert errs["out"] < 1e-4 and errs["grads"] < 1e-3, (w, v, errs)


def test_report_short_table_and_chart(results, ddp, tmp_path):
    data = results["data"]
    md = ddp.markdown_section(data, "chart.png")
    assert md.startswith("## Distributed training (DDP)") and "DRY RUN" in md
    assert "| 1 | " in md and "| 2 | " in md and "](chart.png)" in md
    same = all(r["torchfuse"]["same_graphs_as_torchscript"] for r in data["rows"].values())
    assert ("the optimized module's graphs are the TorchScript module's" in md) == same
    short = ddp.short_table(data)
    assert "resnet18" in short and "DRY RUN" in short
    assert short.splitlines()[-1] in results["stdout"]
    png = tmp_path / "chart.png"
    assert ddp.chart(data, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md_path = tmp_path / "ddp.md"
    assert ddp.main(["--report", results["path"], "--md", str(md_path), "--png", str(png)]) == 0
    assert md_path.read_text().startswith("# Distributed training (DDP)")


def test_performance_page_gets_the_ddp_section(results, tmp_path):
    report = load_script(os.path.join(ROOT, "bench", "report.py"), "bench_report")
    seed = os.path.join(ROOT, "bench", "results", "nvidia-h200.json")
    md, png = tmp_path / "performance.md", tmp_path / "performance.png"
    assert report.main([seed, "--md", str(md), "--png", str(png), "--ddp", results["path"]]) == 0
    text = md.read_text()
    assert text.startswith("# Performance") and "## Distributed training (DDP)" in text
    assert "](performance-ddp.png)" in text
    assert (tmp_path / "performance-ddp.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, expected", [
    (["--reps", "5"], "--reps: expected at least 20 outside --dry-run, got 5"),
    (["--dry-run", "--warmup", "1"], "--warmup: expected at least 3"),
    (["--dry-run", "--world-sizes", "1,x"], "--world-sizes: expected comma-separated integers, got '1,x'"),
    (["--dry-run", "--world-sizes", "0"], "--world-sizes: expected positive integers, got [0]"),
    (["--dry-run", "--batch", "-1"], "--batch: expected a positive integer, got -1"),
])
def test_bad_arguments_are_named(ddp, capsys, args, expected):
    with pytest.raises(SystemExit) as e:
        ddp.parse_args(args)
    assert e.value.code == 2
    assert expected in capsys.readouterr().err
