"""optimize(freeze=True) of torchvision CNNs with torchfuse.backends.conv.cudnn_fusion 'never' (eager's
convolution and one epilogue pass) against 'auto' (cuDNN's fused plans where they win), in one process:
alternating rounds of 5 forwards each (CUDA events, 12 rounds, medians), after 4 warm-up calls per setting
(TorchScript's profiling runs, and 'auto''s first-call timing), the peak memory of a round above what was
allocated before it, and each setting's error against the model in float64 (eager's own error beside it).
BatchNorm's running statistics are set from random batches first, as bench/models.py does (with
torchvision's initial ones the float16 models overflow).

    python bench/cudnn_fusion_ab.py --models resnet50,vgg16 --dtypes fp16,bf16 --output ab.json

docs/kernels/conv_add_act.md cites its results (bench/results/cudnn-fusion-<gpu>.json)."""

import argparse
import json
import statistics
import time

import torch
import torchvision.models as tvm

import torchfuse
from models import calibrate_batch_norms

MODELS = {"resnet50": (tvm.resnet50, 32), "vgg16": (tvm.vgg16, 16),
          "mobilenet_v3_large": (tvm.mobilenet_v3_large, 64), "efficientnet_b0": (tvm.efficientnet_b0, 64)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
SETTINGS = ("never", "auto")


def rel_err(x, ref):
    return ((x.double() - ref).abs().max() / ref.abs().max()).item()


def measure(name: str, dtype: torch.dtype, rounds: int = 12, per_round: int = 5) -> dict:
    ctor, batch = MODELS[name]
    torch.manual_seed(0)
    model = ctor().cuda()
    calibrate_batch_norms(model, (batch, 3, 224, 224), torch.device("cuda"))
    model = model.eval().to(dtype)
    x = torch.randn(batch, 3, 224, 224, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = model.double()(x.double())
        model.to(dtype)
        eager_err = rel_err(model(x), ref)
        opt = torchfuse.optimize(torch.jit.script(model), freeze=True)
        outs, t0 = {}, time.time()
        for setting in SETTINGS:
            with torchfuse.backends.conv.flags(cudnn_fusion=setting):
                for _ in range(4):
                    outs[setting] = opt(x)
        torch.cuda.synchronize()
        warmup_s = time.time() - t0
        times, peak = {s: [] for s in SETTINGS}, {}
        for _ in range(rounds):
            for setting in SETTINGS:
                with torchfuse.backends.conv.flags(cudnn_fusion=setting):
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(per_round):
                        opt(x)
                    end.record()
                    end.synchronize()
                    times[setting].append(start.elapsed_time(end) / per_round)
                    peak[setting] = torch.cuda.max_memory_allocated() - base
    med = {s: statistics.median(t) for s, t in times.items()}
    return {"model": name, "dtype": [k for k, v in DTYPES.items() if v == dtype][0], "batch": batch,
            "never_ms": med["never"], "auto_ms": med["auto"], "speedup": med["never"] / med["auto"],
            "peak_bytes_never": peak["never"], "peak_bytes_auto": peak["auto"],
            "err_never": rel_err(outs["never"], ref), "err_auto": rel_err(outs["auto"], ref), "err_eager": eager_err,
            "warmup_s": warmup_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="fp16,bf16,fp32")
    ap.add_argument("--output", default="cudnn_fusion_ab.json")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        for d in args.dtypes.split(","):
            row = measure(name, DTYPES[d])
            rows.append(row)
            print(f"{name:20s} {d} never {row['never_ms']:.3f} ms auto {row['auto_ms']:.3f} ms "
                  f"-> {row['speedup']:.3f}x; peak +{row['peak_bytes_auto'] - row['peak_bytes_never']} B; "
                  f"err {row['err_never']:.1e} / {row['err_auto']:.1e} (eager {row['err_eager']:.1e})", flush=True)
            with open(args.output, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "cudnn": torch.backends.cudnn.version(), "rows": rows}, f, indent=1)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
