"""The chart of bench/cudnn_fusion_ab.py's runs kept in a results file: every `model_ab*` section
of bench/results/cudnn-fusion-<gpu>.json (one run each: a setting's 'auto' against 'never', as
optimize(freeze=True)'s forward), as grouped bars of the speedup per model and dtype.

    python bench/plot_cudnn_fusion_ab.py bench/results/cudnn-fusion-nvidia-h200.json docs/performance-cudnn-fusion.png
"""

import argparse
import json
import sys

from report import pyplot


def sections(data: dict) -> list[tuple[str, dict]]:
    """(name, {(model, dtype): speedup}) per model_ab* section, in file order."""
    out = []
    for name, section in data.items():
        if name.startswith("model_ab") and isinstance(section, dict) and "rows" in section:
            out.append((name, {(r["model"], r["dtype"]): r["never_ms"] / r["auto_ms"] for r in section["rows"]}))
    return out


def chart(data: dict, png: str) -> bool:
    runs = sections(data)
    if not runs:
        print("plot_cudnn_fusion_ab: no model_ab sections", file=sys.stderr)
        return False
    plt = pyplot("plot_cudnn_fusion_ab")
    if plt is None:
        return False
    keys = []
    for _, rows in runs:
        keys += [k for k in rows if k not in keys]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(keys)), 4.8))
    for i, (name, rows) in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, [rows.get(k, 0) for k in keys], width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    # NB: the ratios lie near 1: the axis starts below the lowest, not at 0
    values = [v for _, rows in runs for v in rows.values()]
    ax.set_ylim(min(0.9, min(values) - 0.05), max(values) + 0.05)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels([f"{m}\n{d}" for m, d in keys], fontsize=8, rotation=30, ha="right")
    ax.set_ylabel("'never' time / 'auto' time (> 1: auto faster)")
    ax.set_title(f"{data.get('device', '')}: optimize(freeze=True), the measured choice against the unfused path")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    ap.add_argument("png")
    args = ap.parse_args()
    with open(args.results) as f:
        return 0 if chart(json.load(f), args.png) else 1


if __name__ == "__main__":
    sys.exit(main())
