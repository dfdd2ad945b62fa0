#!/usr/bin/env python3
"""DistributedDataParallel training: the step time per GPU of a torchvision
model, eager against TorchScript and torchfuse.optimize, at each world size
from one GPU to all of them (NCCL, one process per GPU).

    python bench/ddp.py                                # resnet50, 32 images per GPU, fp32
    python bench/ddp.py --model resnet18 --batch 64 --world-sizes 1,2
    python bench/ddp.py --dry-run                      # tiny shapes, CPU processes over gloo
    python bench/ddp.py --report RESULTS.json [--md OUT.md] [--png OUT.png]
    python bench/ddp.py --short RESULTS.json

A step, as users train: zero_grad, forward, backward of a fixed random
output gradient (DDP's bucketed all-reduce overlapping it), an SGD step with
momentum.  Every rank feeds its own random batch; every variant starts from
the same weights.  Dropout is off (none in the ResNets).

Per world size, one launch of `world` processes:
1. check: all variants built from the same weights take one step on the same
   batch; the output and every parameter's all-reduced gradient are compared
   with eager's (max|x - eager| / max|eager|, for information: the accuracy
   rule itself is test/python/test_distributed.py's);
2. memory: each variant alone, nothing else alive, measured twice (the
   variants in order, then in reverse): the peak of MEMORY_STEPS steps after
   the warm-up, less what was allocated before the variant was built (so its
   parameters, gradients, momentum and DDP's buckets count); the larger of
   the two;
3. time: all variants alive, ROUNDS rounds in a rotating order (drift hits
   them alike), each round `--reps` steps timed one by one with CUDA events,
   after a warm-up that includes TorchScript's profiling runs; a variant's
   time is the median of its steps on each rank, and the slowest rank's.

Results: bench/results/ddp-<gpu>.json (a copy in $OUT/ddp.json when $OUT is
set); docs/performance.md gets its section through
`bench/report.py ... --ddp RESULTS.json`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

# NB: NVLink multicast stays off on shared GPU hosts (set before NCCL loads)
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import ROOT, Timer, free_memory, git_commit, rel_err, slug  # noqa: E402
from report import load, pyplot, save_chart, section_page  # noqa: E402

VARIANTS = ["eager", "torchscript", "torchfuse"]
ROUNDS = 5
MEMORY_STEPS = 3  # steps whose peak is a variant's peak memory
LR, MOMENTUM = 0.01, 0.9


# ----------------------------------------------------------------- worker ----

def build_master(model: str, num_classes: int) -> torch.nn.Module:
    import torchvision

    torch.manual_seed(0)
    return getattr(torchvision.models, model)(weights=None, num_classes=num_classes).train()


def make_variant(name: str, master: torch.nn.Module, device: torch.device):
    import torchfuse

    model = copy.deepcopy(master).to(device)
    if name == "eager":
        return model
    scripted = torch.jit.script(model)
    return scripted if name == "torchscript" else torchfuse.optimize(scripted)


class Trainer:
    """One variant wrapped in DDP with its optimizer."""

    def __init__(self, name, master, device):
        self.module = make_variant(name, master, device)
        self.ddp = DDP(self.module, device_ids=[device.index] if device.type == "cuda" else None)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=LR, momentum=MOMENTUM)

    def step(self, x, gy):
        self.opt.zero_grad(set_to_none=True)
        out = self.ddp(x)
        out.backward(gy)
        self.opt.step()
        return out


def graphs(module) -> dict:
    """The TorchScript graph of every submodule, as text."""
    return {name: str(m.graph) for name, m in module.named_modules() if hasattr(m, "graph")}


def worker(rank, world, backend, store, out_dir, a):
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        import torchfuse

        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)
        master = build_master(a.model, a.classes)
        g = torch.Generator().manual_seed(1000 + rank)  # each rank its own batch
        x = torch.randn(a.batch, 3, a.resolution, a.resolution, generator=g).to(device)
        gy = torch.randn(a.batch, a.classes, generator=g).to(device)
        res = {"rank": rank, "variants": {}}
        timer = Timer(device)  # its sync is the current device's

        # 1. check: one step from the same weights
        trainers = {v: Trainer(v, master, device) for v in VARIANTS}
        firsts = {}
        for v, t in trainers.items():
            firsts[v] = (t.step(x, gy).detach(), [p.grad.detach().clone() for p in t.ddp.parameters()])
        ref_out, ref_grads = firsts["eager"]
        for v in VARIANTS:
            out, grads = firsts[v]
            res["variants"][v] = {
                "err_vs_eager": {"out": rel_err(out, ref_out),
                                 "grads": max((rel_err(gr, rg) for gr, rg in zip(grads, ref_grads)), default=0.0)},
                "fused": {k: n for k, n in torchfuse.report(trainers[v].module).items() if n}
                if v != "eager" else {},
            }
        # NB: whether optimize changed anything, so that the report can say
        # that differences from TorchScript are noise
        res["variants"]["torchfuse"]["same_graphs_as_torchscript"] = (
            graphs(trainers["torchfuse"].module) == graphs(trainers["torchscript"].module))
        del trainers, firsts
        free_memory()

        # 2. memory: each variant alone (device memory: CUDA only), in
        # order and again in reverse, so that none is always measured first
        peaks = {v: [] for v in VARIANTS}
        for v in (VARIANTS + VARIANTS[::-1]) if device.type == "cuda" else []:
            timer.sync()
            base = torch.cuda.memory_allocated(device)
            t = Trainer(v, master, device)
            for _ in range(a.warmup):
                t.step(x, gy)
            timer.sync()
            torch.cuda.reset_peak_memory_stats(device)
            # NB: several steps: with more than one process, when DDP's
            # all-reduce on NCCL's stream lets go of a bucket depends on the
            # timing of the two streams, so one step's peak varies
            for _ in range(MEMORY_STEPS):
                t.step(x, gy)
            timer.sync()
            peaks[v].append((torch.cuda.max_memory_allocated(device) - base) / 2**20)
            del t
            free_memory()
        for v, p in peaks.items():
            if p:
                res["variants"][v].update(peak_mem_MiB=max(p), peak_mem_passes_MiB=p)

        # 3. time: all alive, rounds in rotating order
        trainers = {v: Trainer(v, master, device) for v in VARIANTS}
        for t in trainers.values():
            for _ in range(a.warmup):
                t.step(x, gy)
        timer.sync()
        times = {v: [] for v in VARIANTS}
        for r in range(ROUNDS):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for v in order:
                # NB: no warm-up and no target time: exactly a.reps steps
                times[v] += timer.measure(lambda i, t=trainers[v]: t.step(x, gy), lambda: None, 0, a.reps, 0.0)
        for v in VARIANTS:
            res["variants"][v].update(median_ms=statistics.median(times[v]), min_ms=min(times[v]),
                                      max_ms=max(times[v]), steps=len(times[v]))
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------- runs ----

def run_world(world: int, backend: str, a) -> dict:
    """Launches `world` processes; returns the row of this world size."""
    with tempfile.TemporaryDirectory(prefix="torchfuse-ddp-") as tmp:
        mp.start_processes(worker, args=(world, backend, os.path.join(tmp, "store"), tmp, a), nprocs=world,
                           join=True, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    row = {}
    for v in VARIANTS:
        per = [rk["variants"][v] for rk in ranks]
        slowest = max(per, key=lambda p: p["median_ms"])
        mems = [p["peak_mem_MiB"] for p in per if p.get("peak_mem_MiB") is not None]
        row[v] = {
            "median_ms": slowest["median_ms"], "min_ms": min(p["min_ms"] for p in per),
            "max_ms": max(p["max_ms"] for p in per), "rank_medians_ms": [p["median_ms"] for p in per],
            "steps_per_rank": slowest["steps"],
            "images_per_s": world * a.batch / slowest["median_ms"] * 1e3,
            "peak_mem_MiB": max(mems) if mems else None,
            "peak_mem_passes_MiB": [p.get("peak_mem_passes_MiB") for p in per],  # per rank
            "err_vs_eager": {k: max(p["err_vs_eager"][k] for p in per) for k in ("out", "grads")},
            "fused": per[0]["fused"],
        }
        if v == "torchfuse":
            row[v]["same_graphs_as_torchscript"] = all(p["same_graphs_as_torchscript"] for p in per)
    for v in VARIANTS:
        row[v]["speedup_vs_eager"] = row["eager"]["median_ms"] / row[v]["median_ms"]
        row[v]["speedup_vs_torchscript"] = row["torchscript"]["median_ms"] / row[v]["median_ms"]
    return row


def add_scaling(data: dict) -> None:
    """Scaling efficiency: images/s at N processes over N times one's."""
    one = data["rows"].get("1")
    for w, row in data["rows"].items():
        for v, r in row.items():
            r["scaling_efficiency"] = (r["images_per_s"] / (int(w) * one[v]["images_per_s"])) if one else None


# ----------------------------------------------------------------- report ----

def fmt(t) -> str:
    return "–" if t is None else (f"{t:.2f}" if t >= 1 else f"{t:.3f}")


def markdown_section(data: dict, png_rel: str | None = None, level: int = 2) -> str:
    h = "#" * level
    out = [f"{h} Distributed training (DDP)", ""]
    out.append(f"- GPU: **{data['gpu']}** × {data['gpus']}; torch {data['torch']}, backend {data['backend']}; "
               f"commit `{data['commit']}`, {data['date']}" + (" — **DRY RUN (CPU): not measurements**"
                                                                if data.get("dry_run") else ""))
    out.append(f"- Produced by `{data['command']}`")
    out.append(f"- Model: torchvision {data['model']} (training mode, {data['classes']} classes), "
               f"x[{data['batch_per_gpu']}, 3, {data['resolution']}, {data['resolution']}] per GPU, float32, "
               "PyTorch's default flags (cuDNN TF32 on, matmul TF32 off), NNC on")
    tm = data["timing"]
    out.append("- A step: zero_grad, forward, backward of a fixed random output gradient with DDP's all-reduce, "
               "SGD with momentum. One process per GPU; median ms of each rank's steps, timed one by one "
               f"({tm['method']}; {tm['rounds']} interleaved rounds of ≥ {tm['reps']} after {tm['warmup']} "
               f"warm-up steps), the slowest rank's. Peak memory: the peak of {tm.get('memory_steps', 1)} steps "
               "of the variant alone, its parameters, gradients, momentum and DDP buckets included, the largest "
               "rank's, the larger of two measurements (the variants in order, then in reverse).")
    out.append("")
    out.append("| GPUs | eager ms (min) | TorchScript ms (min) | torchfuse ms (min) | torchfuse / eager "
               "| torchfuse / TorchScript | images/s (eager, torchfuse) | scaling eff. (eager, torchfuse) "
               "| peak MiB (eager, script, torchfuse) | err vs eager (out, grads) | fused |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for w in sorted(data["rows"], key=int):
        r = data["rows"][w]
        e, s, t = r["eager"], r["torchscript"], r["torchfuse"]

        def eff(x):
            return "–" if x.get("scaling_efficiency") is None else f"{x['scaling_efficiency'] * 100:.0f} %"

        mem = ", ".join("–" if x["peak_mem_MiB"] is None else f"{x['peak_mem_MiB']:.0f}" for x in (e, s, t))
        fused = ", ".join(f"{k} {n}" for k, n in sorted(t["fused"].items())) or "none"
        ms = " | ".join(f"{fmt(x['median_ms'])} ({fmt(x['min_ms'])})" for x in (e, s, t))
        out.append(f"| {w} | {ms} | "
                   f"{t['speedup_vs_eager']:.2f}× | {t['speedup_vs_torchscript']:.2f}× | "
                   f"{e['images_per_s']:.0f}, {t['images_per_s']:.0f} | {eff(e)}, {eff(t)} | {mem} | "
                   f"{t['err_vs_eager']['out']:.1e}, {t['err_vs_eager']['grads']:.1e} | {fused} |")
    out.append("")
    out.append("*ms (min)*: the median step, and in brackets the fastest step of any rank, when nothing on the "
               "host delayed the launches. *torchfuse / eager*, *torchfuse / TorchScript*: the other's median over "
               "torchfuse's (> 1: torchfuse is faster). *scaling eff.*: images/s at N GPUs over N times the "
               "images/s at one. *err vs eager*: max|x − eager| / max|eager| after one step from the same "
               "weights, of the output and the worst all-reduced parameter gradient (0 where both ran the same "
               "kernels in the same order).")
    if all(r["torchfuse"].get("same_graphs_as_torchscript") for r in data["rows"].values()):
        out += ["", f"torchfuse fused no chain of {data['model']}'s training graph: the optimized module's graphs "
                "are the TorchScript module's, so the differences between the two, in time and memory, are this "
                "run's noise."]
    if png_rel:
        out += ["", f"![DDP step time per GPU]({png_rel})"]
    return "\n".join(out) + "\n"


def chart(data: dict, png: str) -> bool:
    plt = pyplot("ddp")
    if plt is None or not data.get("rows"):
        return False
    worlds = sorted(data["rows"], key=int)
    fig, ax = plt.subplots(figsize=(max(6, 2 * len(worlds)), 4.2))
    width = 0.8 / len(VARIANTS)
    for k, v in enumerate(VARIANTS):
        xs = [i + (k - (len(VARIANTS) - 1) / 2) * width for i in range(len(worlds))]
        ax.bar(xs, [data["rows"][w][v]["median_ms"] for w in worlds], width, label=v, color=f"C{k}")
    ax.set_xticks(range(len(worlds)))
    ax.set_xticklabels([f"{w} GPU{'s' if int(w) > 1 else ''}" for w in worlds])
    ax.set_ylabel("ms per training step (per GPU)")
    return save_chart(fig, ax, f"DDP {data['model']}, {data['batch_per_gpu']} images per GPU, {data['gpu']}, "
                      f"torch {data['torch']}", data, png)


def short_table(data: dict) -> str:
    out = [f"ddp: {data['model']} x[{data['batch_per_gpu']}] per GPU | {data['gpu']} | median ms per step"
           + (" | DRY RUN" if data.get("dry_run") else ""),
           f"{'GPUs':>4s} {'eager':>8s} {'script':>8s} {'torchfuse':>9s} {'tf/eager':>8s} {'tf/scr':>6s} "
           f"{'MiB eager':>9s} {'MiB tf':>7s}"]
    for w in sorted(data["rows"], key=int):
        r = data["rows"][w]
        mem = ["–" if r[v]["peak_mem_MiB"] is None else f"{r[v]['peak_mem_MiB']:.0f}" for v in ("eager", "torchfuse")]
        out.append(f"{w:>4s} {fmt(r['eager']['median_ms']):>8s} {fmt(r['torchscript']['median_ms']):>8s} "
                   f"{fmt(r['torchfuse']['median_ms']):>9s} {r['torchfuse']['speedup_vs_eager']:>7.2f}x "
                   f"{r['torchfuse']['speedup_vs_torchscript']:>5.2f}x {mem[0]:>9s} {mem[1]:>7s}")
    return "\n".join(out)


# ------------------------------------------------------------------- main ----

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a torchvision classifier (default resnet50; resnet18 dry)")
    ap.add_argument("--batch", type=int, default=None, help="images per GPU (default 32; 2 dry)")
    ap.add_argument("--resolution", type=int, default=None, help="image side (default 224; 32 dry)")
    ap.add_argument("--classes", type=int, default=1000, help="classifier outputs")
    ap.add_argument("--world-sizes", default=None,
                    help="comma-separated process counts (default 1, 2, 4, 8 up to the GPUs there are; 1,2 dry)")
    ap.add_argument("--reps", type=int, default=None, help="timed steps per round and rank (default 20; 2 dry)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 6; 3 dry)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU processes over gloo")
    ap.add_argument("--output", default=None, help="results JSON (default bench/results/ddp-<gpu>.json)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--short", metavar="JSON", help="print the short table of a results JSON, run nothing")
    ap.add_argument("--report", metavar="JSON", help="write the markdown section (--md) and chart (--png)")
    ap.add_argument("--md", default=None, help="with --report: markdown output (default: stdout)")
    ap.add_argument("--png", default=None, help="with --report: chart output")
    a = ap.parse_args(argv)
    dry = a.dry_run
    defaults = {"model": ("resnet50", "resnet18"), "batch": (32, 2), "resolution": (224, 32), "reps": (20, 2),
                "warmup": (6, 3)}
    for name, (full, tiny) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, tiny if dry else full)
    if not dry and a.reps < 20:
        ap.error(f"--reps: expected at least 20 outside --dry-run, got {a.reps}")
    if a.warmup < 3:
        # NB: TorchScript's profiling executor profiles, then optimizes, forward and backward
        ap.error(f"--warmup: expected at least 3 (TorchScript's profiling runs), got {a.warmup}")
    for name in ("batch", "resolution", "classes"):
        if getattr(a, name) < 1:
            ap.error(f"--{name}: expected a positive integer, got {getattr(a, name)}")
    if a.world_sizes is not None:
        try:
            a.world_sizes = [int(w) for w in a.world_sizes.split(",")]
        except ValueError:
            ap.error(f"--world-sizes: expected comma-separated integers, got {a.world_sizes!r}")
        if not a.world_sizes or min(a.world_sizes) < 1:
            ap.error(f"--world-sizes: expected positive integers, got {a.world_sizes}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.short:
        print(short_table(load(a.short)))
        return 0
    if a.report:
        return section_page(markdown_section, chart, a.report, a.md, a.png)

    if a.dry_run:
        backend, gpu, gpus = "gloo", "dry-run-cpu", 0
        worlds = a.world_sizes or [1, 2]
    else:
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            print("ddp: needs CUDA and NCCL; use --dry-run to check the script on the CPU", file=sys.stderr)
            return 2
        backend, gpu, gpus = "nccl", torch.cuda.get_device_name(), torch.cuda.device_count()
        worlds = a.world_sizes or [w for w in (1, 2, 4, 8) if w <= gpus]
        if max(worlds) > gpus:
            print(f"ddp: --world-sizes: at most {gpus} (the CUDA devices here), got {max(worlds)}", file=sys.stderr)
            return 2
    out_path = a.output or (os.path.join(tempfile.gettempdir(), "torchfuse-ddp-dry-run.json") if a.dry_run
                            else os.path.join(ROOT, "bench", "results", f"ddp-{slug(gpu)}.json"))
    import torchvision

    start = time.monotonic()
    data = {
        "gpu": gpu, "gpus": gpus, "backend": backend, "torch": torch.__version__,
        "torchvision": torchvision.__version__, "dry_run": a.dry_run, "model": a.model,
        "batch_per_gpu": a.batch, "resolution": a.resolution, "classes": a.classes,
        "commit": a.commit or os.environ.get("TORCHFUSE_COMMIT") or git_commit(),
        "date": datetime.datetime.now().strftime("%Y-%m-%dT%H:%M"),
        "command": "python bench/ddp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "flags": {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                  "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                  "texpr_fuser": torch._C._jit_texpr_fuser_enabled()},
        "timing": {"method": "CUDA events per step" if not a.dry_run else "perf_counter per step",
                   "rounds": ROUNDS, "reps": a.reps, "warmup": a.warmup, "memory_steps": MEMORY_STEPS,
                   "statistic": "median of each rank's steps, the slowest rank's"},
        "rows": {},
    }
    print(f"ddp: {a.model}, {a.batch} per process, world sizes {worlds}, {backend} on {gpu}", flush=True)
    for w in worlds:
        t0 = time.monotonic()
        data["rows"][str(w)] = run_world(w, backend, a)
        print(f"ddp: world {w} done in {time.monotonic() - t0:.0f} s", flush=True)
    add_scaling(data)
    data["elapsed_s"] = round(time.monotonic() - start, 1)
    paths = [out_path] + ([os.path.join(os.environ["OUT"], "ddp.json")] if os.environ.get("OUT") else [])
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "w") as f:
            json.dump(data, f, indent=1)
    print(short_table(data))
    print(f"ddp: {data['elapsed_s']:.0f} s; results in {', '.join(paths)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
