"""bench/plot_cudnn_fusion_ab.py: the chart of the model_ab* runs kept in
bench/results/cudnn-fusion-<gpu>.json, on a synthetic results file and on the
committed one."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "plot_cudnn_fusion_ab.py")


def load():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import plot_cudnn_fusion_ab
    finally:
        sys.path.pop(0)
    return plot_cudnn_fusion_ab


def row(model, dtype, never, auto):
    return {"model": model, "dtype": dtype, "never_ms": never, "auto_ms": auto}


def test_sections_are_the_model_ab_runs_in_order():
    data = {"device": "GPU", "plan_probe": {"rows": []},
            "model_ab": {"rows": [row("a", "fp16", 2.0, 1.6), row("b", "bf16", 1.0, 1.25)]},
            "model_ab_later": {"rows": [row("a", "fp16", 3.0, 2.0)]},
            "model_ab_note": "not a run"}
    got = load().sections(data)
    assert [name for name, _ in got] == ["model_ab", "model_ab_later"]
    assert got[0][1] == {("a", "fp16"): 1.25, ("b", "bf16"): 0.8}
    assert got[1][1] == {("a", "fp16"): 1.5}


def test_chart_of_the_committed_results(tmp_path):
    pytest.importorskip("matplotlib")
    results = glob.glob(os.path.join(ROOT, "bench", "results", "cudnn-fusion-*.json"))
    assert results
    png = tmp_path / "ab.png"
    proc = subprocess.run([sys.executable, SCRIPT, results[0], str(png)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_runs_is_an_error(tmp_path):
    src = tmp_path / "empty.json"
    src.write_text(json.dumps({"device": "GPU"}))
    proc = subprocess.run([sys.executable, SCRIPT, str(src), str(tmp_path / "x.png")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "no model_ab sections" in proc.stderr
    assert not (tmp_path / "x.png").exists()
