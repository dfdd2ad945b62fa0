"""bench/models.py, the model-zoo benchmark, in its CPU dry run (tiny
shapes), so that the script cannot rot: one run through the command line,
one merged into the same JSON in-process, and its report."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

import torchfuse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "bench", "models.py")

# run 1 (command line): a torchvision CNN, scripted, in every variant but
# torch.compile (minutes of C++ compiling on a CPU); run 2 (in-process,
# merged): BERT traced and the MLP block, in train mode, and the MLP in bf16
CNN = "mobilenet_v3_large"
RUN1 = ["--models", CNN, "--modes", "eval_fp32,train_fp32",
        "--variants", "eager_cl,freeze_cl,ofi,torchfuse,torchfuse_freeze"]
RUN2 = ["--models", "bert,mlp", "--modes", "train_fp32,eval_bf16", "--variants", "torchfuse"]
EVAL_VARIANTS = {"eager", "eager_cl", "torchscript", "freeze", "freeze_cl", "ofi", "torchfuse", "torchfuse_freeze"}
TRAIN_VARIANTS = {"eager", "eager_cl", "torchscript", "torchfuse"}


def load_models_module():
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", autouse=True)
def no_out_dir():
    # NB: with $OUT set (the GPU check) the script copies its JSON there
    old = os.environ.pop("OUT", None)
    yield
    if old is not None:
        os.environ["OUT"] = old


@pytest.fixture(scope="module")
def models():
    return load_models_module()


@pytest.fixture(scope="module")
def results(tmp_path_factory, models):
    out = str(tmp_path_factory.mktemp("models") / "models.json")
    common = ["--dry-run", "--budget-s", "3000", "--output", out]
    proc = subprocess.run([sys.executable, SCRIPT, *common, *RUN1], cwd=ROOT,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        first = json.load(f)
    assert models.main([*common, *RUN2]) == 0
    with open(out) as f:
        merged = json.load(f)
    return {"path": out, "first": first, "merged": merged, "stdout": proc.stdout}


def expected_keys():
    keys = {f"{CNN}/eval_fp32/{v}" for v in EVAL_VARIANTS} | {f"{CNN}/train_fp32/{v}" for v in TRAIN_VARIANTS}
    # BERT and the MLP block: no channels-last variants; eval_bf16 adds
    # nothing but the baseline and eager for torchfuse
    for m in ("bert", "mlp"):
        keys |= {f"{m}/{mode}/{v}" for mode in ("train_fp32", "eval_bf16") for v in ("eager", "torchscript", "torchfuse")}
    return keys


def test_every_unit_measured_and_merged(results):
    data = results["merged"]
    assert data["dry_run"] is True
    assert set(data["rows"]) == expected_keys(), data.get("skipped")
    assert data["skipped"] == {}
    # the first run's rows were kept by the second, which added its own
    assert set(results["first"]["rows"]) < set(data["rows"])
    assert len(data["runs"]) == 2
    first_id, second_id = data["runs"][0]["run_id"], data["runs"][1]["run_id"]
    assert first_id != second_id
    for key, row in data["rows"].items():
        assert key == f"{row['model']}/{row['mode']}/{row['variant']}"
        assert row["run_id"] == (first_id if row["model"] == CNN else second_id)
        assert row["reps"] >= 2 and row["median_ms"] > 0
        assert row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert row["warmup_runs"] >= torch._C._jit_get_num_profiled_runs() + 2
    # the recorded flags are PyTorch's defaults, NNC on
    assert data["flags"]["texpr_fuser"] is True
    assert data["flags"]["matmul_allow_tf32"] is False
    assert data["models"]["bert"]["attn_implementation"]
    assert data["models"][CNN]["input_shape"] == [2, 3, 64, 64]


def test_errors_small_against_float64_and_eager(results):
    for key, row in results["merged"]["rows"].items():
        e64, eager64, ee = row["errors_vs_float64"], row["eager_errors_vs_float64"], row["errors_vs_eager"]
        train = row["mode"].startswith("train")
        assert ("grad" in e64) == train, key
        for errs in (e64, eager64, ee):
            for k in ("out", "grad"):
                if k in errs:
                    assert math.isfinite(errs[k]), (key, errs)
        bf16 = row["mode"].endswith("bf16")
        # float32 on the CPU: a few ulps per layer; bf16: 8 bits
        assert e64["out"] < (5e-2 if bf16 else 1e-4), (key, e64)
        assert e64["out"] > 0, key  # a float64 reference that is really another computation
        if train:
            assert e64["grad"] < 1e-3, (key, e64)
        assert ee["out"] < (5e-2 if bf16 else 1e-4), (key, ee)
        assert not row["wrong"], (key, e64, eager64)
        if row["variant"] == "eager":
            assert ee["out"] == 0.0, key
    # BERT's key biases get a gradient that is zero in exact arithmetic: left
    # out of the gradient errors (else relative errors of 1e8 are noise)
    bert = results["merged"]["rows"]["bert/train_fp32/torchfuse"]
    assert bert["zero_grads_left_out"]
    assert all(n.endswith("key.bias") for n in bert["zero_grads_left_out"])


def test_fused_counts_and_baselines(results):
    rows = results["merged"]["rows"]
    for key, row in rows.items():
        if not row["variant"].startswith("torchfuse"):
            assert "fused" not in row
            continue
        assert set(row["fused"]) == set(torchfuse.pass_names()), key
        # NB: besides the fusions' ops, the op DropAllTrueAttentionMasks puts
        # in place of an attention call whose mask is true everywhere (BERT),
        # and the one FuseConvBatchNormAct puts where BatchNorm read the conv
        # output's sizes
        ops = {op for f in torchfuse.fusions() for op in f["ops"]} | {"torchfuse::custom_unmasked_attention",
                                                                      "torchfuse::custom_conv_output_size"}
        assert all(f"torchfuse::{op}" in ops for op in row["fused_ops"]), (key, row["fused_ops"])
        base = {"torchfuse": "torchscript", "torchfuse_freeze": "freeze"}[row["variant"]]
        b = row["vs_baseline"]
        assert b["baseline"] == base
        base_row = rows[f"{row['model']}/{row['mode']}/{base}"]
        assert base_row["run_id"] == row["run_id"]
        assert b["baseline_ms"] == base_row["median_ms"]
        assert b["separate_speedup"] == pytest.approx(base_row["median_ms"] / row["median_ms"])
        # the speedup is the interleaved rounds' ratio of medians
        inter = row["interleaved"]
        assert b["interleaved"] and inter["rounds"] >= 2
        assert all(n >= inter["rounds"] for n in inter["reps"].values()), inter
        assert b["speedup"] == pytest.approx(inter["baseline_ms"] / inter["ms"])
        # each round's own ratio
        assert len(inter["round_speedups"]) == inter["rounds"]
        assert all(r > 0 for r in inter["round_speedups"]), inter
        # no device memory on the CPU
        assert b["mem_ratio"] is None and b["allocated_mem_ratio"] is None
        assert row["peak_mem_MiB"] is None and row["peak_requested_MiB"] is None
    # the models hold no chain that is fused by default, and the standalone
    # relu replacement runs only when named
    off = [f["name"] for f in torchfuse.fusions() if not f["by_default"]]
    for key in (f"{CNN}/eval_fp32/torchfuse", f"{CNN}/eval_fp32/torchfuse_freeze", f"{CNN}/train_fp32/torchfuse"):
        assert off and all(rows[key]["fused"][name] == 0 for name in off), rows[key]["fused"]
        assert rows[key]["fused_ops"].get("custom_relu", 0) == rows[key]["fused"]["relu"]
    # BERT (dry run: 2 layers): the intermediate linear -> gelu of each
    # layer; the embeddings' add -> LayerNorm and each layer's two residual
    # add -> LayerNorm
    bert_fused = rows["bert/train_fp32/torchfuse"]["fused"]
    assert bert_fused["linear_act"] == 2 and bert_fused["add_layer_norm"] == 1 + 2 * 2, bert_fused
    assert sum(bert_fused.values()) == 2 + 5, bert_fused
    # and each layer's attention, whose traced mask is true everywhere
    assert rows["bert/train_fp32/torchfuse"]["fused_ops"]["custom_unmasked_attention"] == 2
    # TorchScript variants report NNC's fusion groups (none on the CPU)
    assert rows[f"{CNN}/eval_fp32/torchscript"]["nnc_groups"] == 0
    assert "nnc_groups" not in rows[f"{CNN}/eval_fp32/eager"]


def test_report_short_table_and_chart(results, models, tmp_path):
    data = results["merged"]
    md = models.markdown_section(data, "chart.png")
    assert "DRY RUN" in md and "## Model zoo" in md and "![" in md
    for m in (CNN, "bert", "mlp"):
        assert f"| {m} | " in md
    # a torchfuse cell gives the range of the interleaved rounds' own ratios
    assert re.search(r"\| \d+\.\d\d× \(rounds \d+\.\d\d–\d+\.\d\d\)", md), md
    short = models.short_table(data)
    assert CNN in short and "bert" in short and "DRY RUN" in short
    assert short in results["stdout"] or CNN in results["stdout"]
    png = tmp_path / "chart.png"
    assert models.chart(data, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md_path = tmp_path / "zoo.md"
    assert models.main(["--report", results["path"], "--md", str(md_path), "--png", str(png)]) == 0
    assert "](chart.png)" in md_path.read_text()


def test_performance_page_gets_the_model_zoo_section(results, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(ROOT, "bench", "report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    seed = os.path.join(ROOT, "bench", "results", "nvidia-h200.json")
    md, png = tmp_path / "performance.md", tmp_path / "performance.png"
    assert report.main([seed, "--md", str(md), "--png", str(png), "--models", results["path"]]) == 0
    text = md.read_text()
    assert text.startswith("# Performance") and "## Model zoo" in text
    assert "](performance-models.png)" in text
    assert (tmp_path / "performance-models.png").read_bytes()[:4] == b"\x89PNG"


def test_a_failing_variant_is_recorded_and_the_run_goes_on(models, tmp_path, monkeypatch):
    orig = models.ModelBench.make_variant

    def failing(self, spec, v, model, x):
        if v in ("torchscript", "freeze"):
            raise RuntimeError(f"injected failure of {v}")
        return orig(self, spec, v, model, x)

    monkeypatch.setattr(models.ModelBench, "make_variant", failing)
    out = str(tmp_path / "m.json")
    args = ["--dry-run", "--budget-s", "3000", "--output", out, "--models", "mlp", "--modes", "eval_fp32"]
    # a baseline's failure is recorded; torchfuse is still measured, with no ratio
    assert models.main([*args, "--variants", "torchfuse"]) == 0
    with open(out) as f:
        data = json.load(f)
    assert set(data["rows"]) == {"mlp/eval_fp32/eager", "mlp/eval_fp32/torchfuse"}
    sk = data["skipped"]["mlp/eval_fp32/torchscript"]
    assert "injected failure of torchscript" in sk["reason"] and sk["failure"] is False
    assert data["rows"]["mlp/eval_fp32/torchfuse"]["vs_baseline"]["speedup"] is None

    # a torchfuse failure is a failure of the run (exit 3); the failed unit
    # replaces the row an earlier run left, the other rows stay
    def failing_tf(self, spec, v, model, x):
        if v == "torchfuse":
            raise RuntimeError("injected failure of torchfuse")
        return orig(self, spec, v, model, x)

    monkeypatch.setattr(models.ModelBench, "make_variant", failing_tf)
    assert models.main([*args, "--variants", "torchfuse"]) == 3
    with open(out) as f:
        data = json.load(f)
    assert "mlp/eval_fp32/torchfuse" not in data["rows"]
    assert data["skipped"]["mlp/eval_fp32/torchfuse"]["failure"] is True
    assert "mlp/eval_fp32/torchscript" in data["rows"]  # measured this time
    assert "mlp/eval_fp32/torchscript" not in data["skipped"]


def test_bad_arguments(models, capsys):
    assert models.main(["--dry-run", "--models", "resnet51"]) == 2
    assert "unknown model ['resnet51']" in capsys.readouterr().err
    assert models.main(["--dry-run", "--modes", "eval_fp8"]) == 2
    with pytest.raises(SystemExit):
        models.main(["--reps", "5"])  # fewer than 20 timed runs outside the dry run


def test_seed_benchmark_keeps_nnc_on(tmp_path):
    # bench/benchmark.py measures TorchScript with the executor's defaults
    # (it used to switch NNC off for every TorchScript variant)
    out = tmp_path / "seed.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "benchmark.py"), "--dry-run", "--workloads",
                           "relu", "--variants", "eager,torchscript", "--passes", "fwd", "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OUT": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["flags"]["texpr_fuser"] is True
    assert {r["variant"] for r in data["rows"]} == {"eager", "torchscript"}


def test_batch_norms_get_running_statistics_of_a_random_input(models):
    """An eval-mode CNN with torchvision's initial statistics (mean 0,
    variance 1) overflows float16; the benchmark's models get statistics
    of a random input first, and keep their momentum."""
    spec = models.specs(dry_run=True)[CNN]
    bench = models.ModelBench.__new__(models.ModelBench)
    bench.device = torch.device("cpu")
    model = bench.seeded_model(spec, "eval_fp32")
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert bns and not model.training
    assert all(bn.momentum == 0.01 for bn in bns)  # torchvision's for mobilenet_v3
    assert all(int(bn.num_batches_tracked) == models.CALIBRATION_BATCHES for bn in bns)
    assert max((bn.running_var - 1).abs().max().item() for bn in bns) > 0.1
    assert max(bn.running_mean.abs().max().item() for bn in bns) > 0.1
    # the same statistics for every variant built
    again = bench.seeded_model(spec, "eval_fp32")
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_autocast_training_mode(models, tmp_path):
    """train_bf16 is autocast's mixed precision: float32 parameters and
    input, a bfloat16 forward (the MLP's outputs), float32 gradients; the
    errors against float64 are recorded and within the run's bound."""
    out = str(tmp_path / "m.json")
    args = ["--dry-run", "--budget-s", "3000", "--output", out, "--models", "mlp", "--modes", "train_bf16",
            "--variants", "torchfuse"]
    assert models.main(args) == 0
    with open(out) as f:
        rows = json.load(f)["rows"]
    assert set(rows) == {f"mlp/train_bf16/{v}" for v in ("eager", "torchscript", "torchfuse")}
    for row in rows.values():
        assert not row["wrong"], row["errors_vs_float64"]
        e, eager = row["errors_vs_float64"], row["eager_errors_vs_float64"]
        # bfloat16's rounding shows: a float32 forward would be ~1e-7 off
        assert 1e-4 < eager["out"] < 1e-1 and 0 < e["grad"] < 1e-1
    assert models.mode_dtype("train_bf16") == (True, "bf16", torch.float32)
    assert models.mode_dtype("eval_bf16") == (False, "bf16", torch.bfloat16)


def test_host_bound_rows_are_listed(models):
    """A row whose launch time comes to 90 % of its device time is listed as
    host-bound, one below is not, and CPU rows (no host_ms) never are."""
    data = {"gpu": "G", "rows": {
        "a/eval_bf16/torchfuse_freeze": {"model": "a", "mode": "eval_bf16", "variant": "torchfuse_freeze",
                                          "median_ms": 2.0, "host_ms": 1.95},
        "b/eval_bf16/torchfuse_freeze": {"model": "b", "mode": "eval_bf16", "variant": "torchfuse_freeze",
                                          "median_ms": 2.0, "host_ms": 1.2},
        "c/eval_fp32/eager": {"model": "c", "mode": "eval_fp32", "variant": "eager", "median_ms": 2.0}}}
    assert [r["model"] for r in models.host_bound_rows(data)] == ["a"]
    md = models.markdown_section(data)
    assert "host-bound rows" in md and "| a | eval_bf16 | tf-freeze | 1.95 | 2.00 | 0.97 |" in md
    assert "| b | eval_bf16 |" not in md.split("host-bound rows")[1]
    cpu_only = {"gpu": "G", "rows": {"c/eval_fp32/eager": data["rows"]["c/eval_fp32/eager"]}}
    assert "host-bound rows" not in models.markdown_section(cpu_only)


def test_a_multi_line_skip_reason_is_one_table_row(models):
    """A failed unit's reason (a TorchScript traceback spans lines and may
    hold pipes) is one row of the not-measured table."""
    data = {"gpu": "G", "rows": {}, "skipped": {
        "a/train_bf16/torchscript": {"reason": "failed: RuntimeError: x\n  File a | b\n    y", "failure": False}}}
    md = models.markdown_section(data)
    assert "| a/train_bf16/torchscript | failed: RuntimeError: x File a / b y |" in md.splitlines()


def test_layout_variants_run_only_where_named_and_only_for_cnns(models):
    """torchfuse_keep and torchfuse_cl (optimize with a fixed layout) are
    not part of "all"; named, they are known, CNN-only, and timed against
    TorchScript."""
    known = models.VARIANTS + list(models.LAYOUT_VARIANTS)
    every = models.selection("all", known, "variant", models.LAYOUT_VARIANTS)
    assert not set(models.LAYOUT_VARIANTS) & set(every) and "torchfuse" in every
    assert models.selection("torchfuse_keep,torchfuse_cl", known, "variant",
                            models.LAYOUT_VARIANTS) == ["torchfuse_keep", "torchfuse_cl"]
    cnn, mlp = models.Spec.__new__(models.Spec), models.Spec.__new__(models.Spec)
    cnn.kind, mlp.kind = "cnn", "mlp"
    for v in models.LAYOUT_VARIANTS:
        assert models.BASELINE[v] == "torchscript"
        assert models.applicable(cnn, "train_fp32", v) and models.applicable(cnn, "eval_fp16", v)
        assert not models.applicable(mlp, "eval_fp32", v)
