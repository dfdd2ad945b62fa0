"""custom_batch_norm_add_div_swish in training against eager's unfused ops
over a spread of shapes and dtypes, for the two chains it serves:

- `--chain swish` (default): batch_norm -> add -> div -> x*sigmoid(x), wide
  and narrow (N, C) inputs (the column reduction, narrow ones with many
  splits per channel), NCHW planes, and small host-bound ones;
- `--chain silu`: batch_norm -> silu of a conv output (other 0, divisor 1,
  as custom_conv_batch_norm_act runs it in training), efficientnet_b0's
  shapes at batch 64 and some smaller ones, NCHW and channels-last, with
  float32 BatchNorm parameters (a 16-bit input is autocast's).

    python bench/batch_norm_shapes.py [--chain silu] [--output bench/results/batch-norm-shapes-<gpu>.json]

Forward, and forward plus backward (of a fixed random gradient), each the
median of 50 calls timed with CUDA events after 5 warm-up calls, PyTorch's
default flags.  The floor is the forward's memory traffic (x read twice,
the output written once) at the device's 4.8 TB/s."""

import argparse
import json
import os
import subprocess
import sys
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_timing import median_ms  # noqa: E402

SHAPES = [(8192, 4096), (65536, 256), (256, 64), (32, 256, 56, 56), (64, 64, 112, 112), (8, 16, 5, 5)]
SILU_SHAPES = [(64, 16, 112, 112), (32, 96, 112, 112), (64, 32, 112, 112), (64, 96, 56, 56), (64, 144, 56, 56),
               (64, 240, 28, 28), (64, 480, 14, 14), (64, 1152, 7, 7), (32, 256, 56, 56), (8, 64, 28, 28),
               (4, 672, 7, 7)]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PEAK_GBS = 4800.0
REPS, WARMUP = 50, 5


def measure(shape, dtype, chain="swish", channels_last=False):
    ops = torch.ops.torchfuse
    c = shape[1]
    x = (torch.randn(*shape, device="cuda") * 2 + 0.5).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    # the silu chain's BatchNorm parameters are float32, as a module's under autocast
    pdt = dtype if chain == "swish" else torch.float32
    w, b = torch.randn(c, device="cuda", dtype=pdt), torch.randn(c, device="cuda", dtype=pdt)
    rm, rv = torch.zeros(c, device="cuda", dtype=pdt), torch.ones(c, device="cuda", dtype=pdt)
    other = torch.randn(1, device="cuda", dtype=dtype) if chain == "swish" else torch.zeros((), device="cuda",
                                                                                              dtype=dtype)
    divisor = 2.0 if chain == "swish" else 1
    xg, gy = x.clone().requires_grad_(True), torch.randn_like(x)

    def fused(inp):
        return ops.custom_batch_norm_add_div_swish(inp, w, b, rm, rv, True, 0.1, 1e-5, other, divisor)

    def eager(inp):
        if chain == "silu":
            return F.silu(F.batch_norm(inp, rm, rv, w, b, True, 0.1, 1e-5))
        t = (F.batch_norm(inp, rm, rv, w, b, True, 0.1, 1e-5) + other) / 2.0
        return t * torch.sigmoid(t)

    row = {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
           "floor_fwd_us": x.numel() * x.element_size() * 3 / PEAK_GBS / 1e3}
    if chain == "silu":
        row["channels_last"] = channels_last
    for name, fn in (("fused", fused), ("eager", eager)):
        row[f"{name}_fwd_us"] = median_ms(lambda: fn(x), REPS, WARMUP) * 1e3
        row[f"{name}_fwdbwd_us"] = median_ms(lambda: fn(xg).backward(gy), REPS, WARMUP) * 1e3
    row["fwd_speedup"] = row["eager_fwd_us"] / row["fused_fwd_us"]
    row["fwdbwd_speedup"] = row["eager_fwdbwd_us"] / row["fused_fwdbwd_us"]
    return row


# ----------------------------------------------------------------- report ----

CHAIN_TITLES = {"swish": "batch_norm -> add -> div -> x*sigmoid(x)",
                "silu": "batch_norm -> silu of a conv output (custom_conv_batch_norm_act's training route)"}


def runs(data: dict) -> list:
    """The latest run of each chain in a results file: a file of several
    runs (`runs`, each with its rows) or one this script wrote."""
    latest: dict = {}
    for run in data.get("runs", [data]):
        chain = run.get("chain") or ("silu" if "--chain silu" in run.get("command", "") else "swish")
        latest[chain] = dict(run, chain=chain)
    return [latest[c] for c in CHAIN_TITLES if c in latest]


def _layout(row: dict) -> str:
    """The input's layout where the run varied it (the silu chain's)."""
    if "channels_last" not in row:
        return "–"
    return "CL" if row["channels_last"] else "NCHW"


def _series(row: dict) -> str:
    layout = _layout(row)
    return row["dtype"] if layout == "–" else f"{row['dtype']} {layout}"


def markdown_section(data: dict, png_rel=None, level: int = 2) -> str:
    """bench/report.py's section of a results JSON of this script."""
    h = "#" * level
    out = [f"{h} BatchNorm in training: custom_batch_norm_add_div_swish against eager's ops ({data['gpu']})", "",
           f"- torch {data['torch']}; forward, and forward + backward of a fixed random gradient, each the median "
           f"of {REPS} calls timed with CUDA events after {WARMUP} warm-up calls; PyTorch's default flags",
           "- ×: eager's time over the fused op's (> 1: faster); floor: the forward's memory traffic (x read "
           "twice, the output written once) at 4.8 TB/s"]
    for run in runs(data):
        out += ["", f"{h}# {CHAIN_TITLES[run['chain']]}", "",
                f"- commit `{run['commit']}`, {run['date']}; `{run['command']}`"
                + (f"; {run['what']}" if run.get("what") else ""), "",
                "| shape | dtype | layout | fwd fused µs | fwd eager µs | fwd × | floor µs | fwd+bwd fused µs "
                "| fwd+bwd eager µs | fwd+bwd × |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in run["rows"]:
            out.append(f"| {tuple(r['shape'])} | {r['dtype']} | {_layout(r)} | {r['fused_fwd_us']:.1f} | "
                       f"{r['eager_fwd_us']:.1f} | {r['fwd_speedup']:.2f} | {r['floor_fwd_us']:.1f} | "
                       f"{r['fused_fwdbwd_us']:.1f} | {r['eager_fwdbwd_us']:.1f} | {r['fwdbwd_speedup']:.2f} |")
    if png_rel:
        out += ["", f"![custom_batch_norm_add_div_swish against eager, forward + backward]({png_rel})"]
    return "\n".join(out) + "\n"


def chart(data: dict, png: str) -> bool:
    """Forward + backward speedups of each chain's latest run: a bar per
    dtype and layout over each shape."""
    from report import pyplot, save_chart

    plt = pyplot("batch_norm_shapes")
    chains = runs(data)
    if plt is None or not chains:
        return False
    groups = [(run["chain"], tuple(r["shape"])) for run in chains for r in run["rows"]]
    groups = list(dict.fromkeys(groups))
    series = list(dict.fromkeys(_series(r) for run in chains for r in run["rows"]))
    ratio = {(run["chain"], tuple(r["shape"]), _series(r)): r["fwdbwd_speedup"]
             for run in chains for r in run["rows"]}
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(groups)), 4.6))
    width = 0.8 / len(series)
    for k, name in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, [ratio.get((c, sh, name), 0.0) for c, sh in groups], width, label=name, color=f"C{k}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{c}\n{'x'.join(map(str, sh))}" for c, sh in groups], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("× eager, forward + backward (> 1: faster)")
    return save_chart(fig, ax, f"custom_batch_norm_add_div_swish in training, {data['gpu']}, torch {data['torch']}",
                      data, png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chain", choices=["swish", "silu"], default="swish", help="the chain measured (see above)")
    ap.add_argument("--output", default=None, help="results JSON (default: print only)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("batch_norm_shapes: needs a CUDA device; torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    import torchfuse  # noqa: F401  (registers torch.ops.torchfuse)

    rows = []
    layouts = [False, True] if args.chain == "silu" else [False]
    cases = [(shape, dt, cl) for shape in (SILU_SHAPES if args.chain == "silu" else SHAPES)
             for dt in DTYPES.values() for cl in layouts]
    for shape, dt, cl in cases:
        r = measure(shape, dt, args.chain, cl)
        rows.append(r)
        layout = " cl" if cl else ""
        print(f"{str(tuple(r['shape'])):22s} {r['dtype']:9s}{layout} fwd fused {r['fused_fwd_us']:8.1f} us "
              f"eager {r['eager_fwd_us']:8.1f} us ({r['fwd_speedup']:.2f}x) floor {r['floor_fwd_us']:7.1f} us | "
              f"fwd+bwd fused {r['fused_fwdbwd_us']:8.1f} eager {r['eager_fwdbwd_us']:8.1f} "
              f"({r['fwdbwd_speedup']:.2f}x)", flush=True)
    if args.output:
        commit = args.commit or subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], capture_output=True,
                                               text=True).stdout.strip()
        out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
               "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M"),
               "command": "python bench/batch_norm_shapes.py " + " ".join(argv or sys.argv[1:]), "chain": args.chain,
               "rows": rows}
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
