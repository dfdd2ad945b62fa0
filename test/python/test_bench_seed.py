"""bench/benchmark.py's do-no-harm measurement: torchfuse, eager and
TorchScript timed in alternating rounds (a CPU dry run)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import report  # noqa: E402


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("seed") / "seed.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "benchmark.py"), "--dry-run", "--workloads",
                           "relu,conv_relu_bias_small", "--variants", "eager,torchscript,torchfuse", "--output",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OUT": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(out.read_text()), out


def test_every_workload_and_pass_is_interleaved(seed_run):
    data, _ = seed_run
    rows = {(r["workload"], r["pass"]): r for r in data["interleaved"]}
    assert set(rows) == {(w, p) for w in ("relu", "conv_relu_bias_small") for p in ("fwd", "fwdbwd")}
    for r in rows.values():
        med = r["median_ms"]
        assert set(med) == {"eager", "torchscript", "torchfuse"} and all(t > 0 for t in med.values())
        # every variant timed in every round, and the ratios are those of the medians
        assert all(n >= r["rounds"] for n in r["reps"].values())
        for v in ("eager", "torchscript"):
            assert r["torchfuse_speedup"][v] == pytest.approx(med[v] / med["torchfuse"])


def test_interleaving_needs_all_three_variants(tmp_path):
    out = tmp_path / "seed.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "benchmark.py"), "--dry-run", "--workloads",
                           "relu", "--variants", "eager,torchfuse", "--passes", "fwd", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OUT": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert json.loads(out.read_text())["interleaved"] == []


def test_report_shows_the_do_no_harm_rows(seed_run, tmp_path):
    data, path = seed_run
    md = report.markdown(data, str(path), "python bench/report.py")
    head = "## Do no harm: torchfuse against eager and TorchScript, interleaved"
    assert head in md
    section = md.split(head, 1)[1].split("\n## ", 1)[0]
    for r in data["interleaved"]:
        row = next(line for line in section.splitlines() if line.startswith(f"| {r['workload']} | {r['pass']} |"))
        sp = r["torchfuse_speedup"]
        assert f"{sp['eager']:.2f}×" in row and f"{sp['torchscript']:.2f}×" in row
        # a miss of the 0.98 floor is shown in bold
        assert ("**" in row) == (min(sp.values()) < report.HARM_FLOOR)
    short = report.short_table(data)
    assert short.count("interleaved ") == len(data["interleaved"])
