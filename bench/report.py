#!/usr/bin/env python3
"""Turns a bench/benchmark.py results JSON into docs/performance.md and a
bar chart of torchfuse's speedups (docs/performance.png).

    python bench/report.py bench/results/nvidia-h100-80gb-hbm3.json
    python bench/report.py RESULTS.json --md OUT.md --png OUT.png
    python bench/report.py RESULTS.json --short       # the short table only
    python bench/report.py RESULTS.json --models bench/results/models-GPU.json
                              # with the model zoo's section (bench/models.py)
    python bench/report.py RESULTS.json --ddp bench/results/ddp-GPU.json
                              # with the DDP section (bench/ddp.py)
    python bench/report.py RESULTS.json --compile-rewrite bench/results/compile-rewrite-GPU.json
                              # with the section of bench/compile_rewrite.py
    python bench/report.py RESULTS.json --batch-norm-shapes bench/results/batch-norm-shapes-GPU.json
                              # with the section of bench/batch_norm_shapes.py

Without a path it takes the newest JSON under bench/results/.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANT_ORDER = ["eager", "bare_gemm", "torchscript", "optimize_for_inference", "compile", "compile_max_autotune", "torchfuse"]
SHORT_NAMES = {"eager": "eager", "bare_gemm": "gemm", "torchscript": "script", "optimize_for_inference": "ofi",
               "compile": "compile", "compile_max_autotune": "c-maxat", "torchfuse": "torchfuse"}
# bare_gemm is a reference row (the GEMM alone), not an implementation of the workload
NOT_COMPETITORS = {"bare_gemm"}
# do no harm: torchfuse at least this fraction of the speed of what it replaces
HARM_FLOOR = 0.98


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def index(data: dict) -> dict:
    """{(workload, pass): {variant: row}}"""
    out: dict = {}
    for r in data.get("rows", []):
        out.setdefault((r["workload"], r["pass"]), {})[r["variant"]] = r
    return out


def ordered_keys(data: dict, idx: dict) -> list:
    names = list(data.get("workloads", {})) or sorted({w for w, _ in idx})
    return [(w, p) for w in names for p in ("fwd", "fwdbwd") if (w, p) in idx]


def best_other(rows: dict, variant: str, mode_sensitive: bool = False):
    """(name, median) of the fastest correct competitor other than `variant`;
    where train and eval mode compute different things (BatchNorm), only
    competitors in the same mode count."""
    mode = rows.get(variant, {}).get("mode", "train")
    cands = [(r["median_ms"], v) for v, r in rows.items()
             if v != variant and v not in NOT_COMPETITORS and not r.get("wrong")
             and not (mode_sensitive and r.get("mode", "train") != mode)]
    if not cands:
        return None, None
    t, v = min(cands)
    return v, t


def sensitive(data: dict, w: str) -> bool:
    return bool(data.get("workloads", {}).get(w, {}).get("mode_sensitive"))


def floor_of(data: dict, w: str, p: str):
    return data.get("workloads", {}).get(w, {}).get(p, {}).get("floor_ms")


def fmt_ms(t) -> str:
    if t is None:
        return "–"
    if t >= 100:
        return f"{t:.1f}"
    if t >= 1:
        return f"{t:.3f}"
    return f"{t:.4f}"


def fmt_err(e) -> str:
    return "–" if e is None else ("0" if e == 0 else f"{e:.1e}")


def speedups(data: dict, idx: dict) -> list:
    """[(workload, pass, vs eager, vs torchscript, vs best other, best other name)]"""
    out = []
    for w, p in ordered_keys(data, idx):
        rows = idx[(w, p)]
        tf = rows.get("torchfuse")
        if not tf:
            continue
        t = tf["median_ms"]
        e = rows.get("eager", {}).get("median_ms")
        s = rows.get("torchscript", {}).get("median_ms")
        bo, bt = best_other(rows, "torchfuse", sensitive(data, w))
        out.append((w, p, e / t if e else None, s / t if s else None, bt / t if bt else None, bo))
    return out


def tails(data: dict, idx: dict) -> list:
    """[(workload, pass, gemm ms, eager tail ms, torchfuse tail ms)] for the
    workloads with a bare_gemm row: the tail is a variant's median minus the
    bare GEMM's (fwdbwd: the GEMM's forward and backward)."""
    out = []
    for w, p in ordered_keys(data, idx):
        rows = idx[(w, p)]
        g = rows.get("bare_gemm")
        if not g or "eager" not in rows or "torchfuse" not in rows:
            continue
        gm = g["median_ms"]
        out.append((w, p, gm, rows["eager"]["median_ms"] - gm, rows["torchfuse"]["median_ms"] - gm))
    return out


def tail_ratio(e: float, t: float) -> str:
    return f"{t / e:.2f}" if e > 0 else "–"


# ---------------------------------------------------------------- markdown ----

def markdown(data: dict, json_path: str, cmdline: str, png_rel: str = "performance.png") -> str:
    idx = index(data)
    L = []
    add = L.append
    add("# Performance")
    add("")
    add("<!-- Generated by bench/report.py from the results JSON; do not edit by hand. -->")
    add("")
    if data.get("dry_run"):
        add("> **DRY RUN**: tiny shapes on the CPU, timed with perf_counter. These numbers check the "
            "benchmark script; they are not measurements of torchfuse.")
        add("")
    dev = data.get("device", {})
    dev_s = ", ".join(f"{k} {v}" for k, v in dev.items()) if dev else "–"
    add(f"- GPU: **{data.get('gpu')}** ({dev_s})")
    add(f"- torch {data.get('torch')}, commit `{data.get('commit')}`, date {data.get('date')}")
    add(f"- Produced by: `{data.get('command', 'python bench/benchmark.py')}` then `{cmdline}`")
    fl = data.get("flags", {})
    add(f"- Precision: float32 with PyTorch's default flags (matmul allow_tf32={fl.get('matmul_allow_tf32')}, "
        f"cuDNN allow_tf32={fl.get('cudnn_allow_tf32')}); TorchScript's NNC fuser "
        f"{'on' if fl.get('texpr_fuser') else 'off'}")
    tm = data.get("timing", {})
    add(f"- Timing: {tm.get('method', '?')}, {tm.get('warmup', '?')} warm-up runs after the first call, "
        f"median (min, max) of at least {tm.get('min_reps', '?')} runs; small inputs rotate among several "
        "copies so they do not run from L2")
    add(f"- Results file: `{os.path.relpath(json_path, ROOT) if os.path.isabs(json_path) else json_path}`")
    add("")

    add("## Device ceilings (measured in the same run)")
    add("")
    c = data.get("ceilings", {})
    add("| Copy (read + write) | fp32 matmul | TF32 matmul | bf16 matmul |")
    add("|---|---|---|---|")
    add(f"| {c.get('copy_GBps', 0):.0f} GB/s | {c.get('fp32_matmul_TFLOPs', 0):.1f} TFLOP/s | "
        f"{c.get('tf32_matmul_TFLOPs', 0):.1f} TFLOP/s | {c.get('bf16_matmul_TFLOPs', 0):.1f} TFLOP/s |")
    add("")
    add(f"Matmuls are {c.get('matmul_n', '?')}³ `torch.mm`; the copy moves {c.get('copy_bytes', 0) / 1e9:.2f} GB.")
    add("")

    add("## Roofline floors")
    add("")
    add(data.get("floor_formula", ""))
    add("")
    add("| Workload | Shapes | Pass | GFLOP | GB | compute ms | memory ms | floor ms | bound |")
    add("|---|---|---|---|---|---|---|---|---|")
    for w, info in data.get("workloads", {}).items():
        for p in ("fwd", "fwdbwd"):
            f = info.get(p)
            if not f:
                continue
            add(f"| {w} | {info.get('desc', '')} | {p} | {f['flops'] / 1e9:.3g} | {f['bytes'] / 1e9:.3g} | "
                f"{fmt_ms(f['compute_ms'])} | {fmt_ms(f['memory_ms'])} | {fmt_ms(f['floor_ms'])} | "
                f"{f['bound']} ({f['peak']}) |")
    add("")

    sp = speedups(data, idx)
    if sp:
        add("## torchfuse speedups")
        add("")
        add("Ratio of the other variant's median time to torchfuse's (> 1: torchfuse is faster).")
        add("")
        add("| Workload | Pass | vs eager | vs TorchScript | vs best other |")
        add("|---|---|---|---|---|")
        for w, p, e, s, b, bo in sp:
            add(f"| {w} | {p} | {f'{e:.2f}×' if e else '–'} | {f'{s:.2f}×' if s else '–'} | "
                f"{f'{b:.2f}× ({bo})' if b else '–'} |")
        add("")
        add(f"![torchfuse speedups]({png_rel})")
        add("")

    inter = data.get("interleaved", [])
    if inter:
        add("## Do no harm: torchfuse against eager and TorchScript, interleaved")
        add("")
        add(f"eager, TorchScript (NNC on) and torchfuse alive together, warmed up alike, timed in "
            f"{inter[0].get('rounds', '?')} alternating rounds; medians of every run of each. Ratio: the other's "
            f"median over torchfuse's (> 1: torchfuse is faster). The do-no-harm target is ≥ {HARM_FLOOR}× "
            "both; **bold** rows miss it.")
        add("")
        add("| Workload | Pass | eager ms | TorchScript ms | torchfuse ms | vs eager | vs TorchScript |")
        add("|---|---|---|---|---|---|---|")
        for r in inter:
            m, sp = r["median_ms"], r["torchfuse_speedup"]
            miss = min(sp.values()) < HARM_FLOOR
            e, t = (f"{sp[k]:.2f}×" for k in ("eager", "torchscript"))
            if miss:
                e, t = f"**{e}**", f"**{t}**"
            add(f"| {r['workload']} | {r['pass']} | {fmt_ms(m['eager'])} | {fmt_ms(m['torchscript'])} | "
                f"{fmt_ms(m['torchfuse'])} | {e} | {t} |")
        add("")

    tl = tails(data, idx)
    if tl:
        add("## Fused tails")
        add("")
        add("The tail is the time a model spends besides its GEMM: its median minus the bare GEMM's "
            "(`x @ W.T`; for fwdbwd with its backward, dX and dW). A difference of medians, so "
            "only as exact as the two medians. *torchfuse / eager*: < 1 means torchfuse's tail is faster.")
        add("")
        add("| Workload | Pass | bare GEMM | eager tail | torchfuse tail | torchfuse / eager |")
        add("|---|---|---|---|---|---|")
        for w, p, gm, e, t in tl:
            add(f"| {w} | {p} | {fmt_ms(gm)} | {fmt_ms(e)} | {fmt_ms(t)} | {tail_ratio(e, t)} |")
        add("")

    add("## All measurements")
    add("")
    add("Times in ms. *vs best other*: the fastest other correct variant's median over this one's "
        "(> 1: this one is faster; the bare GEMM is a reference, not a competitor; for matmul_bn_swish "
        "only variants in the same train/eval mode compete). *% of floor*: the "
        "floor over the median. *max rel err*: max|out − eager| / max|eager| over the output and, for "
        "fwdbwd, every gradient; above the workload's tolerance the row is marked **wrong**. The TF32 "
        "workloads (tolerance \"2× eager's against float64\") are judged against the model in float64 "
        "instead: **wrong** when an error against it exceeds twice eager's, plus 1e-6; *max rel err* "
        "then stays the difference from eager, for information.")
    add("")
    for w, p in ordered_keys(data, idx):
        rows = idx[(w, p)]
        fl_ms = floor_of(data, w, p)
        tol = data.get("workloads", {}).get(w, {}).get("tol")
        if data.get("workloads", {}).get(w, {}).get("float64_check"):
            tol = "2× eager's against float64"

        add(f"### {w}, {p}")
        add("")
        add(f"{data.get('workloads', {}).get(w, {}).get('desc', '')}; floor {fmt_ms(fl_ms)} ms; tolerance {tol}")
        add("")
        add("| Variant | median | min | max | vs best other | % of floor | max rel err | notes |")
        add("|---|---|---|---|---|---|---|---|")
        for v in sorted(rows, key=lambda v: VARIANT_ORDER.index(v) if v in VARIANT_ORDER else 99):
            r = rows[v]
            bo, bt = best_other(rows, v, sensitive(data, w))
            ratio = f"{bt / r['median_ms']:.2f} ({bo})" if bt and v not in NOT_COMPETITORS else "–"
            pct = f"{100 * fl_ms / r['median_ms']:.0f} %" if fl_ms else "–"
            notes = []
            if r.get("wrong"):
                notes.append("**wrong**")
            if r.get("fused_ops") is not None:
                notes.append("fused: " + (", ".join(r["fused_ops"]) or "none"))
            if r.get("note"):
                notes.append(r["note"])
            add(f"| {v} | {fmt_ms(r['median_ms'])} | {fmt_ms(r['min_ms'])} | {fmt_ms(r['max_ms'])} | {ratio} | "
                f"{pct} | {fmt_err(r.get('max_rel_err'))} | {'; '.join(notes)} |")
        add("")

    sk = data.get("skipped", [])
    if sk:
        add("## Not measured")
        add("")
        add("| Workload | Variant | Pass | Reason |")
        add("|---|---|---|---|")
        for s in sk:
            reason = s["reason"].replace("|", "\\|").replace("\n", " ")
            add(f"| {s['workload']} | {s['variant']} | {s['pass']} | {reason}{' (**failure**)' if s.get('failure') else ''} |")
        add("")
    if data.get("failures"):
        add("## Failures")
        add("")
        for f in data["failures"]:
            add(f"- {f}")
        add("")
    return "\n".join(L)


# ------------------------------------------------------------------- chart ----

def pyplot(who: str):
    """matplotlib.pyplot on the Agg backend, or None, said on stderr for
    `who`, where matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"{who}: no chart ({e})", file=sys.stderr)
        return None
    return plt


def chart(data: dict, png: str) -> bool:
    plt = pyplot("report")
    if plt is None:
        return False
    sp = speedups(data, index(data))
    if not sp:
        print("report: no torchfuse rows, no chart", file=sys.stderr)
        return False
    labels = [f"{w}\n{p}" for w, p, *_ in sp]
    series = [("vs eager", [s[2] for s in sp]), ("vs TorchScript", [s[3] for s in sp]), ("vs best other", [s[4] for s in sp])]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(sp)), 4.8))
    width = 0.27
    for k, (name, vals) in enumerate(series):
        xs = [i + (k - 1) * width for i in range(len(sp))]
        ax.bar(xs, [v if v else 0 for v in vals], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(sp)))
    ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("speedup of torchfuse (×)")
    return save_chart(fig, ax, f"torchfuse speedups, {data.get('gpu')}, torch {data.get('torch')}, {data.get('commit')}",
                      data, png)


def save_chart(fig, ax, title: str, data: dict, png: str) -> bool:
    """Titles `ax` (a dry run's title says so), writes `fig` to `png` and
    closes it; bench/models.py's chart ends the same way."""
    import matplotlib.pyplot as plt

    if data.get("dry_run"):
        title = "DRY RUN (CPU, not measurements): " + title
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return True


# ------------------------------------------------------------------- short ----

def short_table(data: dict) -> str:
    idx = index(data)
    cols = [v for v in VARIANT_ORDER if any(v in rows for rows in idx.values())]
    head = f"{'workload':22s} {'pass':6s} " + " ".join(f"{SHORT_NAMES[v]:>9s}" for v in cols) + f" {'tf/best':>7s} {'floor%':>6s}"
    out = [f"{data.get('gpu')} | torch {data.get('torch')} | {data.get('commit')} | median ms"
           + (" | DRY RUN" if data.get("dry_run") else ""), head]
    for w, p in ordered_keys(data, idx):
        rows = idx[(w, p)]
        cells = []
        for v in cols:
            r = rows.get(v)
            cells.append(f"{'–' if r is None else fmt_ms(r['median_ms']) + ('!' if r.get('wrong') else ''):>9s}")
        tf = rows.get("torchfuse")
        rel, pct = "–", "–"
        if tf:
            _, bt = best_other(rows, "torchfuse", sensitive(data, w))
            rel = f"{bt / tf['median_ms']:.2f}" if bt else "–"
            fl = floor_of(data, w, p)
            pct = f"{100 * fl / tf['median_ms']:.0f}" if fl else "–"
        out.append(f"{w:22s} {p:6s} " + " ".join(cells) + f" {rel:>7s} {pct:>6s}")
    for w, p, gm, e, t in tails(data, idx):
        out.append(f"tail {w} {p}: eager {fmt_ms(e)}, torchfuse {fmt_ms(t)} ms (ratio {tail_ratio(e, t)}; "
                   f"bare GEMM {fmt_ms(gm)})")
    for r in data.get("interleaved", []):
        sp = r["torchfuse_speedup"]
        flag = "  < " + str(HARM_FLOOR) if min(sp.values()) < HARM_FLOOR else ""
        out.append(f"interleaved {r['workload']} {r['pass']}: torchfuse {sp['eager']:.2f}x eager, "
                   f"{sp['torchscript']:.2f}x TorchScript{flag}")
    c = data.get("ceilings", {})
    out.append(f"ceilings: copy {c.get('copy_GBps', 0):.0f} GB/s, fp32 {c.get('fp32_matmul_TFLOPs', 0):.1f}, "
               f"tf32 {c.get('tf32_matmul_TFLOPs', 0):.1f} TFLOP/s; '!' = wrong result; tf/best = best other / torchfuse")
    n_skip = len(data.get("skipped", []))
    if n_skip:
        out.append(f"{n_skip} unit(s) not measured (see results.json 'skipped')")
    return "\n".join(out)


def render_section(markdown_section, chart_fn, data: dict, png: str | None, md_path: str | None,
                   level: int = 2) -> tuple[str, bool]:
    """The markdown of a section of bench/models.py or bench/ddp.py (their
    markdown_section and chart) and whether its chart was written to `png`
    (None: none), linked relative to the page at `md_path` (None: the working
    directory)."""
    made = bool(png) and chart_fn(data, png)
    rel = None
    if made:
        base = os.path.dirname(os.path.abspath(md_path)) if md_path else os.getcwd()
        rel = os.path.relpath(os.path.abspath(png), base)
    return markdown_section(data, rel, level=level), made


def section_page(markdown_section, chart_fn, results: str, md: str | None, png: str | None) -> int:
    """`--report` of bench/models.py and bench/ddp.py: the section of a
    results JSON as a page of its own, written to `md` (stdout without), and
    its chart to `png` (none without)."""
    text, _ = render_section(markdown_section, chart_fn, load(results), png, md, level=1)
    text = text.rstrip("\n") + "\n"
    if md:
        with open(md, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    return 0


def gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def section(module: str, results: str, png: str, md_path: str, written: list) -> str:
    """The page's section of bench/<module>.py's results JSON, its chart
    written to `png` (then appended to `written`)."""
    import importlib

    mod = importlib.import_module(module)
    text, made = render_section(mod.markdown_section, mod.chart, load(results), png, md_path)
    if made:
        written.append(png)
    rel = os.path.relpath(results, ROOT) if os.path.isabs(results) else results
    return text + f"\nResults file: `{rel}`.\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="?", help="results JSON (default: newest bench/results/*.json)")
    ap.add_argument("--md", default=os.path.join(ROOT, "docs", "performance.md"))
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "performance.png"))
    ap.add_argument("--short", action="store_true", help="print the short table only, write nothing")
    ap.add_argument("--models", action="append", default=[], metavar="JSON",
                    help="a bench/models.py results JSON: its section and chart are added to the page "
                         "(repeat it for several GPUs' results)")
    ap.add_argument("--models-png", default=None,
                    help="the first model zoo's chart (default: the --png path with -models before .png; "
                         "further ones add -<gpu>)")
    ap.add_argument("--ddp", default=None, metavar="JSON",
                    help="a bench/ddp.py results JSON: its section and chart (the --png path with -ddp before "
                         ".png) are added to the page")
    ap.add_argument("--compile-rewrite", default=None, metavar="JSON",
                    help="a bench/compile_rewrite.py results JSON: its section and chart (the --png path with "
                         "-compile-rewrite before .png) are added to the page")
    ap.add_argument("--batch-norm-shapes", default=None, metavar="JSON",
                    help="a bench/batch_norm_shapes.py results JSON: its section and chart (the --png path with "
                         "-batch-norm before .png) are added to the page")
    a = ap.parse_args(argv)
    path = a.json
    if not path:
        found = sorted((p for p in glob.glob(os.path.join(ROOT, "bench", "results", "*.json"))
                        if not os.path.basename(p).startswith(("models-", "ddp-", "batch-norm-shapes-",
                                                               "compile-rewrite-"))), key=os.path.getmtime)
        if not found:
            print("report: no results JSON given and none under bench/results/", file=sys.stderr)
            return 2
        path = found[-1]
    data = load(path)
    if a.short:
        print(short_table(data))
        return 0
    cmdline = "python bench/report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    png_rel = os.path.relpath(os.path.abspath(a.png), os.path.dirname(os.path.abspath(a.md)))
    md = markdown(data, path, cmdline.strip(), png_rel)
    made = chart(data, a.png)
    written = [a.md] + ([a.png] if made else [])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    base = os.path.splitext(a.png)[0]
    sections = [("models", r, (a.models_png if i == 0 else None) or
                 base + "-models" + ("" if i == 0 else "-" + gpu_slug(load(r).get("gpu") or str(i))) + ".png")
                for i, r in enumerate(a.models)]
    if a.ddp:
        sections.append(("ddp", a.ddp, base + "-ddp.png"))
    if a.compile_rewrite:
        sections.append(("compile_rewrite", a.compile_rewrite, base + "-compile-rewrite.png"))
    if a.batch_norm_shapes:
        sections.append(("batch_norm_shapes", a.batch_norm_shapes, base + "-batch-norm.png"))
    for module, results, spng in sections:
        md += "\n" + section(module, results, spng, a.md, written)
    os.makedirs(os.path.dirname(os.path.abspath(a.md)), exist_ok=True)
    with open(a.md, "w") as f:
        f.write(md + "\n")
    print("report: wrote " + " and ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
