"""torch.compile with torchfuse.fx's rewrite against Inductor's own code,
per model and per fusion kind (CNNs of bench/models.py, eval, CUDA):

    python bench/compile_rewrite.py [--models mobilenet_v3_large,efficientnet_b0]
        [--dtypes fp16,fp32] [--budget-s 300] [--output bench/results/compile-rewrite-<gpu>.json]

Variants, each its own torch.compile of a copy of the model (default mode,
PyTorch's default flags): `compile` (Inductor alone); `rewrite` (the
backend's default passes for Inductor, the rewrite always kept,
choice="fused"); `rewrite:all` (every pass whose op Inductor compiles as
such, backend_passes("aot_eager"), those Inductor's defaults leave out
included); `rewrite:<pass>` for each pass that fused a chain there, alone
(where more than one did);
`measured` (the default backend, whose measured choice decides in its first
torchfuse.fx.TRIAL_CALLS calls, recorded with its block times).  Each
variant is warmed past those calls, its output compared with `compile`'s, then all are timed in
alternating rounds (each round: `--calls` calls of each variant, each timed
with CUDA events); a variant's time is the median of all its calls, and its
ratio is `compile`'s median over its own (> 1: faster than Inductor)."""

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CNNS = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "vgg16"]


def compiled_variants(model, x):
    """{variant: (callable, fused counts)}: Inductor alone, the rewrite, each
    fused pass alone and the measured backend, each compiled and warmed."""
    import torchfuse.fx
    from models import counting_inductor

    warm_calls = torchfuse.fx.TRIAL_CALLS + 3  # past the measured choice

    def build(passes, choice):
        fused = {}
        return torchfuse.fx.make_backend(passes=passes, inner=counting_inductor(fused), choice=choice), fused

    def compile_and_warm(name, backend, fused):
        t0 = time.perf_counter()
        fn = torch.compile(copy.deepcopy(model), backend=backend) if backend else torch.compile(copy.deepcopy(model))
        with torch.no_grad():
            for _ in range(warm_calls):
                fn(x)
        torch.cuda.synchronize()
        print(f"  {name:28s} compiled and warmed in {time.perf_counter() - t0:5.1f} s, fused {fused}", flush=True)
        return fn

    # NB: one reset, before all: a reset between them would drop the earlier
    # variants' graphs, to be compiled again (and chosen again) when timed.
    # Each variant compiles its own copy of the model, one cache entry each.
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    out = {"compile": (compile_and_warm("compile", None, {}), {})}
    backend, fused = build(torchfuse.fx.backend_passes("inductor"), "fused")
    out["rewrite"] = (compile_and_warm("rewrite", backend, fused), fused)
    # every pass whose op Inductor compiles as such, those its defaults
    # leave out included; then each that fused, alone
    backend, every = build(torchfuse.fx.backend_passes("aot_eager"), "fused")
    out["rewrite:all"] = (compile_and_warm("rewrite:all", backend, every), every)
    took = [k for k, n in every.items() if n]
    for name in took if len(took) > 1 else []:
        b, f = build([name], "fused")
        out[f"rewrite:{name}"] = (compile_and_warm(f"rewrite:{name}", b, f), f)
    before = len(torchfuse.fx.measured_choices())
    b, f = build(torchfuse.fx.backend_passes("inductor"), "measured")
    out["measured"] = (compile_and_warm("measured", b, f), f)
    return out, torchfuse.fx.measured_choices()[before:]


def measure(name: str, dtype_name: str, rounds: int, calls: int) -> dict:
    import models
    import torchfuse.fx

    spec = models.specs(False)[name]
    dt = DTYPES[dtype_name]
    torch.manual_seed(0)
    model = spec.build().eval().cuda().to(dt)
    x = torch.randn(*spec.input_shape, device="cuda", dtype=dt)
    variants, choices = compiled_variants(model, x)
    with torch.no_grad():
        want = variants["compile"][0](x).float()
        diffs = {v: (fn(x).float() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
                 for v, (fn, _) in variants.items()}
        times = {v: [] for v in variants}
        for _ in range(rounds):
            for v, (fn, _) in variants.items():
                for _ in range(calls):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    fn(x)
                    e.record()
                    e.synchronize()
                    times[v].append(s.elapsed_time(e))
    med = {v: statistics.median(t) for v, t in times.items()}
    return {"model": name, "dtype": dtype_name, "input": list(spec.input_shape), "median_ms": med,
            "speedup_vs_compile": {v: med["compile"] / t for v, t in med.items()},
            "fused": {v: {k: n for k, n in f.items() if n} for v, (_, f) in variants.items()},
            "rel_diff_vs_compile": diffs, "measured_choices": choices, "calls_timed": len(times["compile"]),
            "trial_calls": torchfuse.fx.TRIAL_CALLS}


# ----------------------------------------------------------------- report ----

def markdown_section(data: dict, png_rel=None, level: int = 2) -> str:
    """bench/report.py's section of a results JSON of this script."""
    h = "#" * level
    # NB: 27, the protocol's length before the rows recorded it
    trial = max([r.get("trial_calls", 27) for r in data["rows"]], default=27)
    out = [f"{h} torch.compile: the FX rewrite against Inductor's own code ({data['gpu']})", "",
           f"- torch {data['torch']}; commit `{data['commit']}`, {data['date']}",
           f"- Produced by `{data['command']}`",
           "- Eval, the model's dtype; each variant its own torch.compile of a copy of the model (default mode, "
           "PyTorch's default flags), warmed past the measured choice, then all timed in alternating rounds, "
           "each call with CUDA events; median ms of all its calls. *× compile*: Inductor alone's median over "
           "the variant's (> 1: faster). *rewrite*: the backend's default passes for Inductor at that commit, "
           "always kept; *rewrite:all*: every pass whose op Inductor compiles as such, those its defaults leave "
           "out included; *rewrite:<pass>*: that pass alone; *measured*: the default backend, which keeps the "
           f"rewrite only where its first {trial} calls measured it faster.", "",
           "| Model | dtype | variant | fused | ms | × compile |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        for v, ms in r["median_ms"].items():
            fused = ", ".join(f"{k} {n}" for k, n in sorted(r["fused"][v].items())) or "–"
            out.append(f"| {r['model']} | {r['dtype']} | {v} | {fused} | {ms:.3f} | "
                       f"{r['speedup_vs_compile'][v]:.3f}× |")
    # the variants of a row that ran the same graph: the same chains fused
    # (the measured one's: those of the graph it kept)
    spread = []
    for r in data["rows"]:
        graphs: dict = {}
        for v, ratio in r["speedup_vs_compile"].items():
            fused = r["fused"][v]
            if v == "measured" and not any(c["chosen_fused"] for c in r["measured_choices"]):
                fused = {}
            graphs.setdefault(tuple(sorted(fused.items())), []).append(ratio)
        spread += [max(g) / min(g) - 1 for g in graphs.values() if len(g) > 1]
    if spread:
        out += ["", f"Variants of a row that ran the same graph (the same chains fused; the measured one's kept "
                f"graph) differ by up to {max(spread):.1%}: the resolution of this measurement."]
    choices = [(r, c) for r in data["rows"] for c in r["measured_choices"]]
    if choices:
        out += ["", "The measured variant's choice, and its block times in ms (2 calls each; rewrite, original, "
                "original, rewrite, ...):", "", "| Model | dtype | kept the rewrite | blocks |", "|---|---|---|---|"]
        for r, c in choices:
            out.append(f"| {r['model']} | {r['dtype']} | {c['chosen_fused']} | "
                       f"{', '.join(f'{b:.2f}' for b in c['blocks_ms'])} |")
    if data.get("not_run"):
        out += ["", f"Not run (budget): {', '.join(data['not_run'])}."]
    if png_rel:
        out += ["", f"![torch.compile with the FX rewrite against Inductor]({png_rel})"]
    return "\n".join(out) + "\n"


def chart(data: dict, png: str) -> bool:
    from report import pyplot, save_chart

    plt = pyplot("compile_rewrite")
    if plt is None or not data.get("rows"):
        return False
    labels = [f"{r['model']}\n{r['dtype']}" for r in data["rows"]]
    variants = list(dict.fromkeys(v for r in data["rows"] for v in r["median_ms"]))
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(labels)), 4.2))
    width = 0.8 / len(variants)
    for k, v in enumerate(variants):
        xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [r["speedup_vs_compile"].get(v, 0.0) for r in data["rows"]], width, label=v, color=f"C{k}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("× torch.compile (> 1: faster)")
    return save_chart(fig, ax, f"torch.compile with torchfuse.fx's rewrite, {data['gpu']}, torch {data['torch']}",
                      data, png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mobilenet_v3_large,efficientnet_b0,resnet50")
    ap.add_argument("--dtypes", default="fp16,fp32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=5, help="calls of each variant per round")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no model after this many seconds (each takes about 2 minutes)")
    ap.add_argument("--output", default=None, help="results JSON (default: print only)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    names = args.models.split(",")
    dtypes = args.dtypes.split(",")
    bad = [n for n in names if n not in CNNS] + [d for d in dtypes if d not in DTYPES]
    if bad:
        print(f"compile_rewrite: unknown model or dtype {bad}; expected models of {CNNS} and dtypes of "
              f"{list(DTYPES)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("compile_rewrite: needs a CUDA device; torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                           text=True).stdout.strip()
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
           "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M"),
           "command": "python bench/compile_rewrite.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": [], "not_run": []}
    rows, skipped = out["rows"], out["not_run"]

    def save():  # after each row, so that a run cut short keeps what it measured
        if args.output:
            with open(args.output, "w") as f:
                json.dump(out, f, indent=1)

    t0 = time.perf_counter()
    for name in names:
        for dt in dtypes:
            if args.budget_s is not None and time.perf_counter() - t0 > args.budget_s:
                skipped.append(f"{name}/{dt}")
                continue
            print(f"{name} eval {dt}", flush=True)
            r = measure(name, dt, args.rounds, args.calls)
            rows.append(r)
            for v, ms in r["median_ms"].items():
                print(f"  {v:28s} {ms:7.3f} ms  {r['speedup_vs_compile'][v]:5.3f}x compile  "
                      f"rel diff {r['rel_diff_vs_compile'][v]:.1e}", flush=True)
            for c in r["measured_choices"]:
                print(f"  measured choice: fused {c['chosen_fused']}, blocks {[round(b, 2) for b in c['blocks_ms']]}",
                      flush=True)
            save()
    if skipped:
        print(f"compile_rewrite: budget spent, not run: {skipped}", flush=True)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
