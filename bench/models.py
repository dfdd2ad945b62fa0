#!/usr/bin/env python3
"""Model-zoo benchmark: torchfuse against eager PyTorch, TorchScript, freeze,
optimize_for_inference and torch.compile on real models, random-initialised,
under PyTorch's default precision flags (nothing is switched on or off).

    python bench/models.py                                  # everything, on CUDA
    python bench/models.py --models resnet50,bert --modes eval_fp16 --variants torchscript,torchfuse
    python bench/models.py --variants compile --budget-s 500 # one slice; merged into the same JSON
    python bench/models.py --dry-run                        # tiny shapes on the CPU
    python bench/models.py --short RESULTS.json             # the short table of a results file
    python bench/models.py --report RESULTS.json --md OUT.md --png OUT.png

Models: torchvision resnet50 (batch 32), mobilenet_v3_large (64),
efficientnet_b0 (64) and vgg16 (16) at 224x224; BERT-base (transformers
BertModel, traced with inputs_embeds 32x128x768); a transformer MLP block
(Linear 1024->4096, GELU, Linear 4096->1024, residual) on 8192 tokens.
Dropout and stochastic depth are built with p=0.

Modes: eval_fp32, eval_fp16, eval_bf16 (the model and input in that dtype,
under no_grad) and train_fp32, train_fp16, train_bf16 (forward, then backward
of a fixed random gradient of every output; parameter gradients reset to None
before a step; train_fp16/bf16 are autocast's mixed precision: float32
parameters and input, the forward under torch.autocast of that dtype).

Variants: eager, eager_cl (channels-last model and input), torchscript
(torch.jit.script; torch.jit.trace for BERT; the default executor, NNC on),
freeze, freeze_cl (freeze of the channels-last model), ofi
(torch.jit.optimize_for_inference), compile (torch.compile, default mode),
torchfuse (torchfuse.optimize of the torchscript variant),
torchfuse_freeze (torchfuse.optimize(..., freeze=True)) and torchfuse_compile
(torch.compile with torchfuse.fx's backend: the FX rewrite, then Inductor).
freeze, freeze_cl,
ofi and torchfuse_freeze run in the eval modes only; the _cl variants on the
CNNs only.  Each torchfuse variant is compared with the TorchScript variant it
replaces (torchfuse: torchscript, torchfuse_freeze: freeze, torchfuse_compile:
compile), measured in the
same process: selecting a torchfuse variant selects its baseline, and eager
(the reference) is always measured.

Metrics, per (model, mode, variant):
- median (min, max) ms of >= 20 timed runs, CUDA events around each run
  (perf_counter on the CPU), after a warm-up that includes the profiling
  executor's profiling and optimizing runs; inputs rotate among several
  copies so that a small one does not run from L2;
- on CUDA, the host's time to launch one step (perf_counter around the
  call, the device idle before it; median of 10): a row whose host time
  comes near its device time is host-bound, listed in the report;
- peak memory of one step: the reference results are on the host, only
  this variant's model, one input and the output gradients are on the
  device; torch.cuda.reset_peak_memory_stats, then max_memory_allocated
  (includes the model's parameters), less what was allocated before the
  unit built its model (the input and output gradients, the same for every
  variant of a mode, included).  The same peak in requested bytes (before
  the caching allocator's rounding, requested_bytes) is recorded too, and
  the memory ratio of a torchfuse variant to its baseline compares those.  cuBLAS's workspaces are released before
  the step (benchmark.free_memory), so that each variant's peak counts
  those its own GEMMs allocate, whichever unit ran first.  NB:
  torch.jit.freeze's result keeps its constants' memory allocated after it
  is deleted (H100, torch 2.11: one parameter copy per call), so memory
  that earlier units leave behind is not counted against later ones;
- errors of the output(s) and, in train mode, of every parameter gradient
  against eager and against a float64 run of the same model (the mode's
  parameters and input, upcast): max|x - ref| / max|ref| per tensor, the
  worst over tensors;
- torchfuse variants: torchfuse.report (fused chains per pass) and the
  torchfuse ops in the graph; TorchScript-based variants: the NNC fusion
  groups in the last optimized graph;
- a torchfuse variant's speedup over its baseline (when the baseline was
  measured in this process): both built again and warmed up in the
  torchfuse unit, then timed in INTERLEAVED_ROUNDS alternating rounds, and
  the ratio of the two medians ("interleaved", with each round's own ratio
  in "round_speedups"; the ratio of the separate units' medians is kept as
  "separate_speedup").  NB: on a shared machine
  a CPU-bound model's time drifts by 10-50 % between units minutes apart.

Results: bench/results/models-<gpu>.json (a copy in $OUT/models.json when
$OUT is set).  An existing file is merged into by key model/mode/variant (a
slice replaces the keys it measured or failed on and keeps the others), and
rewritten after every measurement.  A variant that fails is recorded under
"skipped" with its error, and the run goes on.

Exit status: 0; 3 when an eager or torchfuse unit failed or a torchfuse
result was flagged wrong; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark import ROOT, Timer, UnitTimeout, free_memory, git_commit, rel_err, slug, time_limit  # noqa: E402
from report import load, pyplot, save_chart, section_page  # noqa: E402

MODEL_NAMES = ["resnet50", "mobilenet_v3_large", "efficientnet_b0", "vgg16", "bert", "mlp"]
MODES = ["eval_fp32", "eval_fp16", "eval_bf16", "train_fp32", "train_fp16", "train_bf16"]
VARIANTS = ["eager", "eager_cl", "torchscript", "freeze", "freeze_cl", "ofi", "compile", "torchfuse", "torchfuse_freeze",
            "torchfuse_compile"]
# optimize(m, layout=...) of the unfrozen module, the CNNs only: against
# "torchfuse" (layout="auto", the measured choice), what each fixed layout
# gives; run only where named (not in "all")
LAYOUT_VARIANTS = {"torchfuse_keep": "keep", "torchfuse_cl": "channels_last"}
EVAL_ONLY = {"freeze", "freeze_cl", "ofi", "torchfuse_freeze"}
CL_ONLY = {"eager_cl", "freeze_cl"}  # channels-last: the CNNs only
# the TorchScript module each torchfuse variant replaces
BASELINE = {"torchfuse": "torchscript", "torchfuse_freeze": "freeze", "torchfuse_compile": "compile",
            "torchfuse_keep": "torchscript", "torchfuse_cl": "torchscript"}
# cheapest first, so that a run cut short by its budget has the comparisons
PHASES = [["eager", "torchscript", "torchfuse", "torchfuse_keep", "torchfuse_cl", "freeze", "torchfuse_freeze",
           "eager_cl", "freeze_cl", "ofi"],
          ["compile", "torchfuse_compile"]]
COMPILED = {"compile", "torchfuse_compile"}  # torch.compile variants: Dynamo is reset after each
MIN_SECONDS = {"compile": 60.0, "torchfuse_compile": 60.0}  # a unit is not started with less left of the budget
DEFAULT_MIN_SECONDS = 8.0
# rounds of the interleaved timing of a torchfuse variant and its baseline
INTERLEAVED_ROUNDS = 6
# forward passes in training mode that set the BatchNorms' running statistics
CALIBRATION_BATCHES = 2
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# a result is flagged wrong when an error against float64 exceeds
# WRONG_FACTOR x eager's plus the dtype's unit roundoff
WRONG_FACTOR = 4.0
ROUNDOFF = {"fp32": 2.0**-24, "fp16": 2.0**-11, "bf16": 2.0**-8}
ZERO_GRAD = 1e-9  # see ModelBench.reference


def calibrate_batch_norms(model: nn.Module, input_shape, device: torch.device) -> None:
    """Running statistics of a random input, as a trained model has:
    with torchvision's initial ones (mean 0, variance 1) an eval-mode
    mobilenet_v3_large overflows float16 (every variant, eager too, is
    then 100% off from float64).  Leaves the model in training mode."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        return
    momenta = [bn.momentum for bn in bns]
    for bn in bns:
        bn.momentum = None  # a cumulative average
    model.train()
    g = torch.Generator(device=device)
    g.manual_seed(99)
    with torch.no_grad():
        for _ in range(CALIBRATION_BATCHES):
            model(torch.randn(input_shape, device=device, generator=g))
    for bn, momentum in zip(bns, momenta):
        bn.momentum = momentum


# ------------------------------------------------------------------ models ----

class MLPBlock(nn.Module):
    """A transformer MLP block: x + fc2(gelu(fc1(x)))."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class BertEmbedsIn(nn.Module):
    """BertModel called with inputs_embeds, so that a variant is fn(x)."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, x):
        return self.bert(inputs_embeds=x)


@dataclass
class Spec:
    name: str
    kind: str  # cnn | bert | mlp
    input_shape: tuple
    desc: str
    build: Callable[[], nn.Module]
    info: dict


def bert_config(dry_run: bool):
    from transformers import BertConfig

    # NB: torchscript=True is what transformers 4 documents for tracing (it
    # implied return_dict=False); transformers 5 dropped the flag, so
    # return_dict=False is passed too: outputs are a tuple either way.
    common = dict(torchscript=True, return_dict=False, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if dry_run:
        return BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          max_position_embeddings=64, vocab_size=128, **common)
    return BertConfig(**common)  # BERT-base: 12 layers, hidden 768, 12 heads, intermediate 3072


def specs(dry_run: bool) -> dict[str, Spec]:
    import torchvision

    res = 64 if dry_run else 224
    tv = torchvision.models
    cnn = {  # name: (batch, constructor keyword arguments that zero dropout and stochastic depth)
        "resnet50": (32, {}),
        "mobilenet_v3_large": (64, {"dropout": 0.0}),
        "efficientnet_b0": (64, {"dropout": 0.0, "stochastic_depth_prob": 0.0}),
        "vgg16": (16, {"dropout": 0.0}),
    }
    out = {}
    for name, (batch, kw) in cnn.items():
        b = 2 if dry_run else batch
        out[name] = Spec(name, "cnn", (b, 3, res, res), f"torchvision {name}, x[{b}, 3, {res}, {res}]",
                         lambda name=name, kw=kw: getattr(tv, name)(weights=None, **kw),
                         {"batch": b, "resolution": res})
    cfg = bert_config(dry_run)
    b, s = (2, 8) if dry_run else (32, 128)
    out["bert"] = Spec("bert", "bert", (b, s, cfg.hidden_size),
                       f"transformers BertModel ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}), "
                       f"traced, inputs_embeds[{b}, {s}, {cfg.hidden_size}]",
                       lambda: BertEmbedsIn(__import__("transformers").BertModel(bert_config(dry_run))),
                       {"batch": b, "seq": s, "hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers})
    d, h, t = (64, 256, 16) if dry_run else (1024, 4096, 8192)
    out["mlp"] = Spec("mlp", "mlp", (t, d), f"Linear {d}->{h}, GELU, Linear {h}->{d}, + x; x[{t}, {d}]",
                      lambda: MLPBlock(d, h), {"tokens": t, "d": d, "hidden": h})
    return out


def counting_inductor(counts: dict) -> Callable:
    """Inductor (compile_fx) as a torchfuse.fx backend's inner, adding the
    chains each graph it compiles has fused (torchfuse.fx.report) to counts."""
    import torchfuse.fx
    from torch._inductor.compile_fx import compile_fx

    def inductor(gm, example_inputs):
        for name, n in torchfuse.fx.report(gm).items():
            counts[name] = counts.get(name, 0) + n
        return compile_fx(gm, example_inputs)

    return inductor


def check_no_dropout(model: nn.Module) -> None:
    """Train-mode results compare only with dropout and stochastic depth off."""
    for name, m in model.named_modules():
        p = getattr(m, "p", None)
        kind = type(m).__name__
        if isinstance(p, float) and p > 0 and ("Dropout" in kind or "StochasticDepth" in kind):
            raise RuntimeError(f"models: {name} ({kind}) has p={p}; expected 0")


def applicable(spec: Spec, mode: str, variant: str) -> bool:
    if variant in EVAL_ONLY and not mode.startswith("eval"):
        return False
    if (variant in CL_ONLY or variant in LAYOUT_VARIANTS) and spec.kind != "cnn":
        return False
    return True


def mode_dtype(mode: str) -> tuple[bool, str, torch.dtype]:
    """(training, the dtype's name, the dtype of the parameters and input):
    training keeps float32 ones, its fp16/bf16 modes being autocast's."""
    train_s, dt = mode.split("_")
    train = train_s == "train"
    return train, dt, torch.float32 if train else DTYPES[dt]


def autocast(mode: Optional[str], device: torch.device):
    """The forward's context in `mode`: torch.autocast for train_fp16/bf16
    (None: a float64 reference run, never autocast)."""
    if mode is None:
        return contextlib.nullcontext()
    train, dt, _ = mode_dtype(mode)
    return torch.autocast(device.type, dtype=DTYPES[dt]) if train and dt != "fp32" else contextlib.nullcontext()


# ----------------------------------------------------------------- helpers ----

def tensors(out) -> list[torch.Tensor]:
    """The output's tensors, in order (a model returns a tensor or a tuple)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in tensors(o)]
    raise TypeError(f"models: expected the model to return tensors, got {type(out).__name__}")


def worst(errs: dict) -> tuple[float, Optional[str]]:
    if not errs:
        return 0.0, None
    k = max(errs, key=lambda k: errs[k])
    return errs[k], k


def fmt_ms(t) -> str:
    if t is None:
        return "–"
    return f"{t:.1f}" if t >= 100 else f"{t:.2f}" if t >= 1 else f"{t:.3f}"


@dataclass
class Reference:
    """Eager's and float64's results for one (model, mode), on the host."""
    x: torch.Tensor  # the verification input, on the host (so that it
    gys: Optional[list]  # and the output gradients (train) are not alive
    # during another unit's memory measurement)
    eager: dict  # {"out": [tensors], "grads": {name: tensor}}
    f64: dict
    info: dict


# ------------------------------------------------------------------- bench ----

class ModelBench:
    def __init__(self, args, device: torch.device, results: dict, paths: list, deadline: float, run_id: str):
        self.args, self.device, self.results, self.paths, self.deadline = args, device, results, paths, deadline
        self.run_id = run_id
        self.timer = Timer(device)
        self.specs = specs(args.dry_run)
        self.refs: dict[tuple, Reference] = {}
        self.failures: list[str] = []
        self.measured: dict[tuple, dict] = {}  # rows measured in this process

    # -- bookkeeping
    def save(self):
        data = json.dumps(self.results, indent=1)
        for p in self.paths:
            os.makedirs(os.path.dirname(p) or ".", exist_ok=True)
            with open(p + ".tmp", "w") as f:
                f.write(data)
            os.replace(p + ".tmp", p)

    def skip(self, key: str, reason: str, failure: bool, kind: str):
        # NB: a unit not run for lack of time keeps an earlier slice's row
        if kind == "budget" and key in self.results["rows"]:
            print(f"  SKIP {key:44s} {reason} (keeping the earlier row)", flush=True)
            return
        self.results["rows"].pop(key, None)
        model, mode, variant = key.split("/")
        self.results["skipped"][key] = {"model": model, "mode": mode, "variant": variant, "reason": reason,
                                        "failure": failure, "run_id": self.run_id}
        print(f"  SKIP {key:44s} {reason}", flush=True)
        if failure:
            self.failures.append(f"{key}: {reason}")
        self.save()

    # -- models and inputs
    def seeded_model(self, spec: Spec, mode: str) -> nn.Module:
        train, _, dtype = mode_dtype(mode)
        torch.manual_seed(1234)
        m = spec.build()
        check_no_dropout(m)
        m = m.to(device=self.device)
        calibrate_batch_norms(m, spec.input_shape, self.device)
        return m.to(dtype=dtype).train(train)

    def make_input(self, spec: Spec, dtype: torch.dtype, seed: int) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed(seed)
        return torch.randn(spec.input_shape, device=self.device, generator=g).to(dtype)

    def n_inputs(self, x: torch.Tensor) -> int:
        if self.device.type != "cuda":
            return 1
        l2 = getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 50 << 20)
        nbytes = x.numel() * x.element_size()
        return 1 if nbytes >= 2 * l2 else min(8, math.ceil(2 * l2 / nbytes))

    def trace_or_script(self, spec: Spec, model: nn.Module, x: torch.Tensor):
        if spec.kind == "bert":  # as its users do
            # NB: transformers' Python conditions on shapes become constants
            # in the trace, each with a TracerWarning: expected, and the
            # shapes do not change
            with torch.no_grad() if not model.training else contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                return torch.jit.trace(model, (x,))
        return torch.jit.script(model)

    def make_variant(self, spec: Spec, v: str, model: nn.Module, x: torch.Tensor):
        if v in CL_ONLY:
            model = model.to(memory_format=torch.channels_last)
        if v in ("eager", "eager_cl"):
            return model
        if v == "torchscript":
            return self.trace_or_script(spec, model, x)
        if v in ("freeze", "freeze_cl"):
            return torch.jit.freeze(self.trace_or_script(spec, model, x))
        if v == "ofi":
            return torch.jit.optimize_for_inference(self.trace_or_script(spec, model, x))
        if v == "compile":
            torch._dynamo.reset()
            return torch.compile(model)
        if v == "torchfuse_compile":
            # the torchfuse FX rewrite of Dynamo's graph (the backend's
            # passes for Inductor), then Inductor as in the compile variant;
            # the wrapper records what the rewrite fused
            import torchfuse.fx

            torch._dynamo.reset()
            self.compile_fused = {}
            self.compile_choices = len(torchfuse.fx.measured_choices())
            return torch.compile(model, backend=torchfuse.fx.make_backend(
                passes=torchfuse.fx.backend_passes("inductor"), inner=counting_inductor(self.compile_fused)))
        if v in ("torchfuse", "torchfuse_freeze"):
            import torchfuse

            return torchfuse.optimize(self.trace_or_script(spec, model, x), freeze=v == "torchfuse_freeze")
        if v in LAYOUT_VARIANTS:
            import torchfuse

            return torchfuse.optimize(self.trace_or_script(spec, model, x), layout=LAYOUT_VARIANTS[v])
        raise ValueError(v)

    # -- references
    def run_once(self, fn, model: nn.Module, x, gys, train: bool, mode: Optional[str]) -> dict:
        """One step on x: the outputs and, in train mode, the parameter
        gradients (the variants share `model`'s parameters); the forward
        under `mode`'s autocast."""
        if not train:
            with torch.no_grad(), autocast(mode, self.device):
                return {"out": [t.detach() for t in tensors(fn(x))], "grads": {}}
        for q in model.parameters():
            q.grad = None
        with autocast(mode, self.device):
            outs = tensors(fn(x))
        torch.autograd.backward(outs, gys)
        grads = {n: q.grad for n, q in model.named_parameters() if q.grad is not None}
        for q in model.parameters():
            q.grad = None
        return {"out": [t.detach() for t in outs], "grads": grads}

    @staticmethod
    def to_host(r: dict) -> dict:
        return {"out": [t.cpu() for t in r["out"]], "grads": {n: g.cpu() for n, g in r["grads"].items()}}

    def reference(self, spec: Spec, mode: str) -> Reference:
        key = (spec.name, mode)
        if key in self.refs:
            return self.refs[key]
        train, _, dtype = mode_dtype(mode)
        t0 = time.perf_counter()
        x = self.make_input(spec, dtype, 100)
        model = self.seeded_model(spec, mode)
        gys = None
        if train:
            g = torch.Generator(device=self.device)
            g.manual_seed(7)
            with torch.no_grad(), autocast(mode, self.device):
                outs = [(t.shape, t.dtype) for t in tensors(model(x))]
            gys = [torch.randn(s, device=self.device, generator=g).to(t) for s, t in outs]
        eager = self.to_host(self.run_once(model, model, x, gys, train, mode))
        if spec.kind == "bert":
            self.results["models"][spec.name]["attn_implementation"] = getattr(
                model.bert.config, "_attn_implementation", None)
        del model
        free_memory()
        # the same model in float64: the mode's parameters and input, upcast
        m64 = self.seeded_model(spec, mode).double()
        f64 = self.to_host(self.run_once(m64, m64, x.double(), [g.double() for g in gys] if gys else None, train,
                                         None))
        del m64
        free_memory()
        # NB: a gradient that is zero in exact arithmetic (BERT's key bias:
        # softmax ignores a constant added to a query's scores) is rounding
        # noise in every variant, and relative to its own scale meaningless:
        # such parameters (float64 gradient below ZERO_GRAD x the largest)
        # are left out of the gradient errors.
        big = max((g.abs().max().item() for g in f64["grads"].values()), default=0.0)
        zero = sorted(n for n, g in f64["grads"].items() if g.abs().max().item() <= ZERO_GRAD * big)
        for r in (eager, f64):
            for n in zero:
                r["grads"].pop(n, None)
        info = {"eager_errors_vs_float64": self.errors(eager, f64), "zero_grads_left_out": zero}
        ref = Reference(x.cpu(), [g.cpu() for g in gys] if gys else None, eager, f64, info)
        del x, gys
        free_memory()
        self.refs[key] = ref
        print(f"  reference {spec.name}/{mode}: eager vs float64 {info['eager_errors_vs_float64']} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        return ref

    @staticmethod
    def errors(mine: dict, ref: dict) -> dict:
        """The worst relative error over the outputs and over the gradients."""
        if len(mine["out"]) != len(ref["out"]):
            return {"out": float("inf")}
        out = {"out": max(rel_err(a.cpu(), b) for a, b in zip(mine["out"], ref["out"]))}
        if ref["grads"]:
            g = {n: rel_err(mine["grads"][n].cpu(), r) if n in mine["grads"] else float("inf")
                 for n, r in ref["grads"].items()}
            out["grad"], out["grad_worst"] = worst(g)
        return out

    # -- one unit
    def run_unit(self, spec: Spec, mode: str, v: str) -> None:
        key = f"{spec.name}/{mode}/{v}"
        remaining = self.deadline - time.monotonic()
        need = MIN_SECONDS.get(v, DEFAULT_MIN_SECONDS)
        if remaining < need:
            self.skip(key, f"budget: {remaining:.0f} s left of --budget-s, this variant needs about {need:.0f} s",
                      failure=False, kind="budget")
            return
        critical = v in ("eager", "torchfuse", "torchfuse_freeze", "torchfuse_compile")
        t0 = time.perf_counter()
        try:
            with time_limit(min(self.args.unit_timeout_s, remaining - 1.0)):
                ref = self.reference(spec, mode)
                row = self.measure(spec, mode, v, ref)
                base = BASELINE.get(v)
                if base and (spec.name, mode, base) in self.measured:
                    free_memory()
                    row["interleaved"] = self.interleaved(spec, mode, v, base, ref)
        except UnitTimeout as e:
            self.skip(key, str(e), failure=False, kind="timeout")
            return
        except Exception as e:  # noqa: BLE001 - record and go on
            last = traceback.format_exception_only(type(e), e)[-1].strip()
            self.skip(key, f"failed: {last[:400]}", failure=critical, kind="error")
            if self.args.verbose:
                traceback.print_exc()
            return
        finally:
            if v in COMPILED:
                torch._dynamo.reset()
            free_memory()
        row["setup_and_measure_s"] = round(time.perf_counter() - t0, 2)
        self.compare(row)
        self.results["rows"][key] = row
        self.results["skipped"].pop(key, None)
        self.measured[(spec.name, mode, v)] = row
        self.save()
        e64 = row["errors_vs_float64"]
        mem = f"{row['peak_mem_MiB']:.0f} MiB" if row.get("peak_mem_MiB") is not None else "–"
        extra = ""
        b = row.get("vs_baseline")
        if b and b["speedup"] is None:
            extra = f" | {b['baseline']}: {b['note']}"
        elif b:
            extra = f" | {b['speedup']:.3f}x {b['baseline']}" + (
                f", mem {b['mem_ratio']:.3f}x" if b.get("mem_ratio") is not None else "")
        if "measured_layout" in row:
            m = row["measured_layout"]
            chosen = {True: "channels-last", False: "NCHW", None: "undecided"}[m["channels_last"]]
            extra += f" | measured layout {chosen}" + (
                f" (NCHW {m['nchw_ms']:.2f}, CL {m['channels_last_ms']:.2f} ms)" if m["nchw_ms"] else "")
        for m in row.get("measured_choices", []):
            chosen = {True: "fused", False: "inductor", None: "undecided"}[m["chosen_fused"]]
            extra += f" | measured {chosen}" + (
                f" (inductor {m['original_ms']:.2f}, fused {m['fused_ms']:.2f} ms)" if m["original_ms"] else "")
        if "fused" in row:
            extra += " | fused " + (", ".join(f"{k} {n}" for k, n in row["fused"].items() if n) or "none")
        print(f"  {key:44s} median {row['median_ms']:9.3f} ms (n={row['reps']}) peak {mem} "
              f"err64 out {e64['out']:.1e}{' grad %.1e' % e64['grad'] if 'grad' in e64 else ''}"
              f"{' WRONG' if row.get('wrong') else ''}{extra}", flush=True)

    def stepper(self, spec: Spec, mode: str, v: str, x0: torch.Tensor, gys):
        """A new seeded model of the mode, variant v of it, and that
        variant's step(x) (forward, and in train mode backward of gys) and
        reset() (in train mode, parameter gradients to None)."""
        train = mode_dtype(mode)[0]
        model = self.seeded_model(spec, mode)
        fn = self.make_variant(spec, v, model, x0)
        params = [q for q in model.parameters() if q.requires_grad]

        def reset():
            if train:
                for q in params:
                    q.grad = None

        if train:
            def step(x):
                with autocast(mode, self.device):
                    outs = tensors(fn(x))
                torch.autograd.backward(outs, gys)
        else:
            def step(x):
                with torch.no_grad():
                    fn(x)

        return model, fn, step, reset

    def warm_runs(self, variant: str) -> int:
        """Warm-up runs: the compile, the profiling executor's profiling
        and optimizing runs, and on CUDA the trials of torchfuse's measured
        choices: the layout's (unfrozen graphs, layout="auto": the profiling
        runs, the optimizing run, 4 alternating and 20 timed calls, and the
        call that decides) and, for torchfuse_compile, torchfuse.fx's
        (TRIAL_CALLS)."""
        profiled = torch._C._jit_get_num_profiled_runs()
        trial = 0
        if self.device.type == "cuda":
            trial = profiled + 1 + 4 + 20 + 1
            if variant == "torchfuse_compile":
                import torchfuse.fx

                trial = max(trial, torchfuse.fx.TRIAL_CALLS)
        return max(self.args.warmup, profiled + 2, trial)

    def interleaved(self, spec: Spec, mode: str, v: str, base: str, ref: Reference) -> dict:
        """v against its baseline, timed in alternating rounds in this unit
        (both alive, warmed up alike): drift of the machine over the minutes
        between two units then falls on both.  The rounds alternate which
        goes first."""
        x0 = ref.x.to(self.device)
        gys = [g.to(self.device) for g in ref.gys] if ref.gys else None
        xs = [x0] + [self.make_input(spec, mode_dtype(mode)[2], 101 + i) for i in range(self.n_inputs(x0) - 1)]
        runs = {w: self.stepper(spec, mode, w, x0, gys) for w in (base, v)}
        for w, (_, _, step, reset) in runs.items():
            for _ in range(self.warm_runs(w)):
                reset()
                step(x0)
        self.timer.sync()
        times: dict = {base: [], v: []}
        per_round = []
        rounds = 2 if self.args.dry_run else INTERLEAVED_ROUNDS
        reps = max(1, self.args.reps // 2)
        for r in range(rounds):
            this: dict = {}
            for w in ((base, v) if r % 2 == 0 else (v, base)):
                _, _, step, reset = runs[w]
                this[w] = self.timer.measure(lambda i, step=step: step(xs[i % len(xs)]), reset, 1, reps,
                                             self.args.target_s / 2)
                times[w] += this[w]
            per_round.append(statistics.median(this[base]) / statistics.median(this[v]))
        mb, mv = statistics.median(times[base]), statistics.median(times[v])
        del runs, xs, x0, gys
        # NB: the rounds' own ratios show how far the machine's drift moves
        # the ratio (host-bound rows: 10 % and more)
        return {"rounds": rounds, "baseline_ms": mb, "ms": mv, "speedup": mb / mv,
                "round_speedups": per_round, "reps": {base: len(times[base]), v: len(times[v])}}

    def measure(self, spec: Spec, mode: str, v: str, ref: Reference) -> dict:
        train, dt, dtype = mode_dtype(mode)
        cl = v in CL_ONLY
        x0 = ref.x.to(self.device)
        x0 = x0.contiguous(memory_format=torch.channels_last) if cl else x0
        gys = [g.to(self.device) for g in ref.gys] if ref.gys else None
        free_memory()
        held = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        held_requested = requested_bytes(self.device)
        t0 = time.perf_counter()
        model, fn, step, reset = self.stepper(spec, mode, v, x0, gys)
        setup_s = time.perf_counter() - t0

        # warm-up on the verification input
        warm = self.warm_runs(v)
        t0 = time.perf_counter()
        reset()
        step(x0)
        self.timer.sync()
        first_call_s = time.perf_counter() - t0
        for _ in range(warm - 1):
            reset()
            step(x0)
        self.timer.sync()
        row = {"model": spec.name, "mode": mode, "variant": v, "run_id": self.run_id,
               "setup_s": round(setup_s, 3), "first_call_s": round(first_call_s, 3), "warmup_runs": warm}
        if isinstance(fn, torch.jit.ScriptModule):
            # NB: a forward alone, so that the last executed graph is the
            # forward's (in train mode a backward runs graphs of its own)
            with torch.no_grad() if not train else contextlib.nullcontext(), autocast(mode, self.device):
                fn(x0)
            graph = str(torch.jit.last_executed_optimized_graph())
            row["nnc_groups"] = len(re.findall(r"= prim::TensorExprGroup_\d+\(", graph))
        if v == "torchfuse_compile":
            # NB: the graphs compiled so far (forward and, in train mode, the
            # backward's compile happen in the warm-up)
            row["fused"] = dict(self.compile_fused)
            # the measured choice of each graph compiled for this unit
            # (fused or Inductor's own; decided in the warm-up)
            import torchfuse.fx

            row["measured_choices"] = torchfuse.fx.measured_choices()[self.compile_choices:]
        elif v.startswith("torchfuse"):
            import torchfuse

            row["fused"] = torchfuse.report(fn)
            row["fused_ops"] = dict(collections.Counter(re.findall(r"torchfuse::(\w+)", str(fn.inlined_graph))))
            # the measured layout choice this model's calls made (the latest
            # site of this input and grad mode)
            sites = [m for m in torchfuse.measured_layouts()
                     if m["input_sizes"] == list(x0.shape) and m["grad"] == train]
            if sites:
                row["measured_layout"] = sites[-1]

        # verify, after the warm-up: the optimized graph is what runs
        mine = self.run_once(fn, model, x0, gys, train, mode)
        row["errors_vs_eager"] = self.errors(mine, ref.eager)
        row["errors_vs_float64"] = self.errors(mine, ref.f64)
        row["eager_errors_vs_float64"] = ref.info["eager_errors_vs_float64"]
        if ref.info["zero_grads_left_out"]:
            row["zero_grads_left_out"] = ref.info["zero_grads_left_out"]
        del mine
        e64, eager64, eps = row["errors_vs_float64"], ref.info["eager_errors_vs_float64"], ROUNDOFF[dt]
        row["wrong"] = any(not (e64[k] <= WRONG_FACTOR * eager64.get(k, 0.0) + eps)
                           for k in ("out", "grad") if k in e64)

        # peak memory of one step: this variant's model, x0 and gys alive
        reset()
        free_memory()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            step(x0)
            torch.cuda.synchronize()
            row["peak_mem_MiB"] = (torch.cuda.max_memory_allocated(self.device) - held) / 2**20
            row["peak_requested_MiB"] = (requested_bytes(self.device, peak=True) - held_requested) / 2**20
            row["alive_before_step_MiB"] = (before - held) / 2**20
            row["held_before_unit_MiB"] = held / 2**20
        else:
            row["peak_mem_MiB"] = row["peak_requested_MiB"] = None
        reset()

        xs = [x0] + [self.make_input(spec, dtype, 101 + i) for i in range(self.n_inputs(x0) - 1)]
        if cl:
            xs = [x0] + [x.contiguous(memory_format=torch.channels_last) for x in xs[1:]]
        times = self.timer.measure(lambda i: step(xs[i % len(xs)]), reset, 1 if self.args.dry_run else 2,
                                   self.args.reps, self.args.target_s)
        row.update({"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                    "reps": len(times), "inputs_rotated": len(xs)})
        host = self.timer.host_times(lambda i: step(xs[i % len(xs)]), reset, HOST_REPS)
        if host:
            row["host_ms"] = statistics.median(host)
        del fn, model, step, reset, xs, x0, gys
        return row

    def compare(self, row: dict) -> None:
        """Speedup and memory of a torchfuse variant against the TorchScript
        variant it replaces, both measured in this process."""
        base = BASELINE.get(row["variant"])
        if not base:
            return
        b = self.measured.get((row["model"], row["mode"], base))
        if b is None:
            row["vs_baseline"] = {"baseline": base, "speedup": None, "note": "baseline not measured in this run"}
            return
        def ratio(key):
            return row[key] / b[key] if row.get(key) and b.get(key) else None

        # NB: the verdict compares the bytes the ops requested; the allocated
        # peak rounds each block up and may keep an unsplit remainder of up
        # to 1 MiB in it, depending on the free blocks that earlier units left
        # in segments still in use (see requested_bytes)
        mem = ratio("peak_requested_MiB")
        separate = b["median_ms"] / row["median_ms"]
        inter = row.get("interleaved")
        row["vs_baseline"] = {"baseline": base, "baseline_ms": b["median_ms"],
                              "speedup": inter["speedup"] if inter else separate, "separate_speedup": separate,
                              "interleaved": inter is not None,
                              "baseline_peak_mem_MiB": b.get("peak_mem_MiB"),
                              "baseline_peak_requested_MiB": b.get("peak_requested_MiB"), "mem_ratio": mem,
                              "allocated_mem_ratio": ratio("peak_mem_MiB")}
        if row.get("wrong"):
            self.failures.append(f"{row['model']}/{row['mode']}/{row['variant']}: errors against float64 "
                                 f"{row['errors_vs_float64']} above {WRONG_FACTOR:g}x eager's "
                                 f"{row['eager_errors_vs_float64']}")


# ------------------------------------------------------------------ report ----

# host-time calls per unit (synchronized, so the launches alone are timed),
# and the share of the step's device time above which a row is host-bound
HOST_REPS = 10
HOST_BOUND = 0.9

COLS = ["eager", "eager_cl", "torchscript", "freeze", "freeze_cl", "ofi", "compile", "torchfuse", "torchfuse_freeze",
        "torchfuse_compile"]
SHORT = {"eager": "eager", "eager_cl": "eager-CL", "torchscript": "script", "freeze": "freeze", "freeze_cl": "freeze-CL",
         "ofi": "ofi", "compile": "compile", "torchfuse": "torchfuse", "torchfuse_freeze": "tf-freeze",
         "torchfuse_compile": "tf-compile"}


def requested_bytes(device: torch.device, peak: bool = False) -> int:
    """The bytes of the live allocations as the ops requested them (the
    peak since reset_peak_memory_stats with peak=True): max_memory_allocated
    counts the caching allocator's blocks, each rounded up to 512 B, and a
    block reused from a free one keeps a remainder of up to 1 MiB unsplit,
    so two variants with the same allocations can differ by a MiB with the
    free blocks that the units before them left.  0 off CUDA."""
    if device.type != "cuda":
        return 0
    return torch.cuda.memory_stats(device).get(f"requested_bytes.all.{'peak' if peak else 'current'}", 0)


def grouped(data: dict) -> dict:
    """{(model, mode): {variant: row}} in the benchmark's order."""
    out: dict = {}
    for r in data.get("rows", {}).values():
        out.setdefault((r["model"], r["mode"]), {})[r["variant"]] = r
    order = {n: i for i, n in enumerate(MODEL_NAMES)}
    return dict(sorted(out.items(), key=lambda kv: (order.get(kv[0][0], 99), MODES.index(kv[0][1])
                                                    if kv[0][1] in MODES else 99)))


def ratio_cell(row: Optional[dict]) -> str:
    b = (row or {}).get("vs_baseline") or {}
    if b.get("speedup") is None:
        return "–"
    s = f"{b['speedup']:.2f}×"
    notes = []
    rounds = ((row or {}).get("interleaved") or {}).get("round_speedups")
    if rounds:
        notes.append(f"rounds {min(rounds):.2f}–{max(rounds):.2f}")
    if b.get("mem_ratio") is not None:
        notes.append(f"mem {b['mem_ratio']:.2f}×")
    return s + (f" ({'; '.join(notes)})" if notes else "")


def host_bound_rows(data: dict) -> list[dict]:
    """The measured rows (host_ms recorded: CUDA) that are host-bound."""
    rows = data.get("rows", {})
    rows = rows.values() if isinstance(rows, dict) else rows
    return [r for r in rows if r.get("host_ms") and r.get("median_ms")
            and r["host_ms"] >= HOST_BOUND * r["median_ms"]]


def markdown_section(data: dict, png_rel: Optional[str] = None, level: int = 2) -> str:
    h = "#" * level
    g = grouped(data)
    # NB: the GPU in each heading keeps the anchors of several GPUs' sections apart
    on = f" ({data['gpu']})" if data.get("gpu") else ""
    L = [f"{h} Model zoo{on}", ""]
    if data.get("dry_run"):
        L += ["> **DRY RUN**: tiny shapes on the CPU. These numbers check the script; they are not measurements.", ""]
    fl = data.get("flags", {})
    # NB: the runs whose rows the tables show (merged slices keep older rows)
    shown = {r.get("run_id") for r in data.get("rows", {}).values()} if isinstance(data.get("rows"), dict) else None
    runs = [r for r in data.get("runs", []) if shown is None or r.get("run_id") in shown]
    L += [f"- GPU: **{data.get('gpu')}**; torch {data.get('torch')}, torchvision {data.get('torchvision')}, "
          f"transformers {data.get('transformers')}; runs the rows come from: "
          + ", ".join(f"`{r.get('commit')}` {r.get('date')}" for r in runs),
          f"- Produced by `python bench/models.py` (slices merged by model/mode/variant); flags as PyTorch's "
          f"defaults: matmul allow_tf32={fl.get('matmul_allow_tf32')}, cuDNN allow_tf32={fl.get('cudnn_allow_tf32')}, "
          f"NNC {'on' if fl.get('texpr_fuser') else 'off'}",
          f"- Median ms of ≥ {data.get('timing', {}).get('min_reps', '?')} runs "
          f"({data.get('timing', {}).get('method', '?')}) after a warm-up that includes the profiling runs. "
          "*torchfuse* is compared with *TorchScript* (script, or trace for BERT), *tf-freeze* "
          "(`optimize(freeze=True)`) with *freeze*, *tf-compile* (torchfuse.fx's backend, then Inductor) with "
          "*compile*, each pair measured in the same process, the ratio from "
          "alternating rounds of the two where the row was measured so (results from before that: the "
          "separate units' medians): > 1× is faster; "
          "mem is the ratio of the peak memory of one step (< 1× uses less): of the bytes the ops requested "
          "where the row records them, else of the caching allocator's blocks.", ""]
    for m, info in data.get("models", {}).items():
        L.append(f"- `{m}`: {info.get('desc')}")
    L.append("")
    cols = [v for v in COLS if any(v in rows for rows in g.values())]
    ratios = [("torchfuse", "torchfuse / script"), ("torchfuse_freeze", "tf-freeze / freeze")]
    ratios += [("torchfuse_compile", "tf-compile / compile")] if "torchfuse_compile" in cols else []
    L.append("| Model | Mode | " + " | ".join(SHORT[v] for v in cols) + " | "
             + " | ".join(title for _, title in ratios) + " |")
    L.append("|---|---|" + "---|" * (len(cols) + len(ratios)))
    for (m, mode), rows in g.items():
        cells = [fmt_ms(rows[v]["median_ms"]) + (" **wrong**" if rows[v].get("wrong") else "") if v in rows else "–"
                 for v in cols]
        L.append(f"| {m} | {mode} | " + " | ".join(cells) + " | "
                 + " | ".join(ratio_cell(rows.get(v)) for v, _ in ratios) + " |")
    L.append("")
    choices = [(m, mode, rows["torchfuse_compile"]) for (m, mode), rows in g.items()
               if rows.get("torchfuse_compile", {}).get("measured_choices")]
    if choices:
        L += [f"{h}# Model zoo{on}: torchfuse.fx's measured choice", "",
              "Each graph the rewrite changed, compiled with and without it; the calls' timed blocks "
              "(2 calls each, median of 5 per way, docs/usage.md) decide, and the rewrite stays where it is "
              "at least 3% faster. *tf-compile / compile* above is then the chosen graph against plain "
              "torch.compile, in alternating rounds. A tf-compile row not listed here was measured before the "
              "choice existed, with the rewrite always kept.", "",
              "| Model | Mode | fused chains | chosen | block ms without | block ms with |", "|---|---|---|---|---|---|"]
        for m, mode, r in choices:
            for c in r["measured_choices"]:
                chosen = {True: "the rewrite", False: "Inductor's own", None: "undecided"}[c["chosen_fused"]]
                blocks = [fmt_ms(c[k]) if c.get(k) else "–" for k in ("original_ms", "fused_ms")]
                L.append(f"| {m} | {mode} | " + (", ".join(f"{k} {n}" for k, n in c["fused"].items()) or "none")
                         + f" | {chosen} | {blocks[0]} | {blocks[1]} |")
        L.append("")
    if png_rel:
        L += [f"![torchfuse against the TorchScript module it replaces]({png_rel})", ""]
    L += [f"{h}# Model zoo{on}: memory, errors, fused chains", "",
          "Peak MiB of one step (parameters included). Errors: max|x − ref| / max|ref| against the same "
          "model in float64, the worst over the outputs and (train) the parameter gradients; "
          "*eager* is eager's own.", "",
          "| Model | Mode | peak script | peak torchfuse | peak freeze | peak tf-freeze | err eager | "
          "err torchfuse | err tf-freeze | fused (torchfuse / tf-freeze) |",
          "|---|---|---|---|---|---|---|---|---|---|"]

    def mem(r):
        return "–" if not r or r.get("peak_mem_MiB") is None else f"{r['peak_mem_MiB']:.0f}"

    def err(e):
        if not e:
            return "–"
        s = f"{e['out']:.1e}"
        return s + (f" / {e['grad']:.1e}" if "grad" in e else "")

    def fused(r):
        if not r or "fused" not in r:
            return "–"
        return ", ".join(f"{k} {n}" for k, n in r["fused"].items() if n) or "none"

    for (m, mode), rows in g.items():
        any_row = next(iter(rows.values()))
        tf, tff = rows.get("torchfuse"), rows.get("torchfuse_freeze")
        L.append(f"| {m} | {mode} | {mem(rows.get('torchscript'))} | {mem(tf)} | {mem(rows.get('freeze'))} | "
                 f"{mem(tff)} | {err(any_row.get('eager_errors_vs_float64'))} | "
                 f"{err(tf and tf.get('errors_vs_float64'))} | {err(tff and tff.get('errors_vs_float64'))} | "
                 f"{fused(tf)} / {fused(tff)} |")
    L.append("")
    bound = host_bound_rows(data)
    if bound:
        L += [f"{h}# Model zoo{on}: host-bound rows", "",
              f"Rows whose host time to launch one step (median of {HOST_REPS} calls, each after the device went "
              f"idle) is at least {HOST_BOUND:.0%} of the step's device time: the GPU waits for the launches, "
              "so their times and ratios measure the host's speed as much as the kernels'.", "",
              "| Model | Mode | Variant | host ms | device ms | host / device |", "|---|---|---|---|---|---|"]
        for r in bound:
            L.append(f"| {r['model']} | {r['mode']} | {SHORT.get(r['variant'], r['variant'])} | "
                     f"{fmt_ms(r['host_ms'])} | {fmt_ms(r['median_ms'])} | {r['host_ms'] / r['median_ms']:.2f} |")
        L.append("")
    sk = data.get("skipped", {})
    if sk:
        L += [f"{h}# Model zoo{on}: not measured", "", "| Unit | Reason |", "|---|---|"]
        for k, s in sk.items():
            # one table row: a traceback's lines joined, its pipes escaped
            reason = " ".join(s["reason"].split()).replace("|", "/")
            L.append(f"| {k} | {reason}{' (**failure**)' if s.get('failure') else ''} |")
        L.append("")
    return "\n".join(L)


def chart(data: dict, png: str) -> bool:
    plt = pyplot("models")
    if plt is None:
        return False
    g = grouped(data)
    keys = [k for k, rows in g.items() if any((rows.get(v) or {}).get("vs_baseline", {}).get("speedup")
                                              for v in BASELINE)]
    if not keys:
        print("models: no torchfuse comparisons, no chart", file=sys.stderr)
        return False
    fig, (ax, axm) = plt.subplots(2, 1, figsize=(max(8, 0.55 * len(keys)), 7.5), sharex=True,
                                  gridspec_kw={"height_ratios": [2, 1]})
    width = 0.4
    pairs = (("torchfuse", "optimize vs TorchScript"), ("torchfuse_freeze", "optimize(freeze=True) vs freeze"))
    for k, (v, label) in enumerate(pairs):
        base = [((g[key].get(v) or {}).get("vs_baseline") or {}) for key in keys]
        xs = [i + (k - 0.5) * width for i in range(len(keys))]
        ax.bar(xs, [b.get("speedup") or 0 for b in base], width, label=label, color=f"C{k}")
        axm.bar(xs, [b.get("mem_ratio") or 0 for b in base], width, color=f"C{k}")
    for a in (ax, axm):
        a.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(0.98, color="red", linewidth=0.6, linestyle="--", label="0.98×")
    axm.set_xticks(range(len(keys)))
    axm.set_xticklabels([f"{m}\n{mode}" for m, mode in keys], fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("speedup of torchfuse (×)")
    axm.set_ylabel("peak memory ratio (×)", fontsize=8)
    return save_chart(
        fig, ax, f"torchfuse vs the TorchScript module it replaces, {data.get('gpu')}, torch {data.get('torch')}", data,
        png)


def short_table(data: dict) -> str:
    g = grouped(data)
    head = (f"{'model':19s} {'mode':10s} {'eager':>8s} {'script':>8s} {'torchfuse':>9s} {'tf/scr':>6s} {'mem':>5s} "
            f"{'freeze':>8s} {'tf-freeze':>9s} {'tf/frz':>6s} {'mem':>5s} {'compile':>8s}")
    out = [f"models: {data.get('gpu')} | torch {data.get('torch')} | median ms; tf/scr, tf/frz: speedup of torchfuse "
           "over the TorchScript module it replaces; mem: peak memory ratio (requested bytes where recorded)" + (" | DRY RUN" if data.get("dry_run") else ""),
           head]

    def t(rows, v):
        r = rows.get(v)
        return "–" if r is None else fmt_ms(r["median_ms"]) + ("!" if r.get("wrong") else "")

    def rat(rows, v):
        b = (rows.get(v) or {}).get("vs_baseline") or {}
        s = "–" if b.get("speedup") is None else f"{b['speedup']:.2f}"
        m = "–" if b.get("mem_ratio") is None else f"{b['mem_ratio']:.2f}"
        return s, m

    for (m, mode), rows in g.items():
        s1, m1 = rat(rows, "torchfuse")
        s2, m2 = rat(rows, "torchfuse_freeze")
        out.append(f"{m:19s} {mode:10s} {t(rows, 'eager'):>8s} {t(rows, 'torchscript'):>8s} {t(rows, 'torchfuse'):>9s} "
                   f"{s1:>6s} {m1:>5s} {t(rows, 'freeze'):>8s} {t(rows, 'torchfuse_freeze'):>9s} {s2:>6s} {m2:>5s} "
                   f"{t(rows, 'compile'):>8s}")
    n_skip = len(data.get("skipped", {}))
    if n_skip:
        fails = sum(1 for s in data["skipped"].values() if s.get("failure"))
        out.append(f"{n_skip} unit(s) not measured, {fails} of them failures (see the JSON's 'skipped'); '!' = wrong")
    return "\n".join(out)


# ------------------------------------------------------------------- main ----

def selection(arg: str, known: list, what: str, named_only=()) -> Optional[list]:
    if arg == "all":
        return [k for k in known if k not in named_only]
    names = [n for n in arg.split(",") if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        print(f"models: unknown {what} {unknown or arg!r}; known: {','.join(known)}", file=sys.stderr)
        return None
    return names


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help=f"comma-separated, of {','.join(MODEL_NAMES)}")
    ap.add_argument("--modes", default="all", help=f"comma-separated, of {','.join(MODES)}")
    ap.add_argument("--variants", default="all", help=f"comma-separated, of {','.join(VARIANTS)} "
                    f"(all), or {','.join(LAYOUT_VARIANTS)} (only where named; eager and each "
                    "torchfuse variant's baseline are added)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="total time budget; later units are skipped")
    ap.add_argument("--unit-timeout-s", type=float, default=300.0, help="time limit of one unit, compiling included")
    ap.add_argument("--reps", type=int, default=None, help="timed runs at least (default 20; 2 with --dry-run)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 5; 2 with --dry-run)")
    ap.add_argument("--target-s", type=float, default=None, help="aim for this much timed work per unit (default 0.5)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, perf_counter timing")
    ap.add_argument("--output", default=None, help="results JSON (default bench/results/models-<gpu>.json)")
    ap.add_argument("--fresh", action="store_true", help="do not merge into an existing results JSON")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failed units")
    ap.add_argument("--short", metavar="JSON", help="print the short table of a results JSON, run nothing")
    ap.add_argument("--report", metavar="JSON", help="write the markdown section (--md) and chart (--png) of a results JSON")
    ap.add_argument("--md", default=None, help="with --report: markdown output (default: stdout)")
    ap.add_argument("--png", default=None, help="with --report: chart output")
    a = ap.parse_args(argv)
    a.reps = a.reps or (2 if a.dry_run else 20)
    a.warmup = a.warmup or (2 if a.dry_run else 5)
    a.target_s = a.target_s if a.target_s is not None else (0.0 if a.dry_run else 0.5)
    if not a.dry_run and a.reps < 20:
        ap.error("--reps must be >= 20 outside --dry-run")
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.short:
        print(short_table(load(args.short)))
        return 0
    if args.report:
        return section_page(markdown_section, chart, args.report, args.md, args.png)

    models = selection(args.models, MODEL_NAMES, "model")
    modes = selection(args.modes, MODES, "mode")
    variants = selection(args.variants, VARIANTS + list(LAYOUT_VARIANTS), "variant", LAYOUT_VARIANTS)
    if models is None or modes is None or variants is None:
        return 2
    variants = set(variants) | {"eager"} | {BASELINE[v] for v in variants if v in BASELINE}

    start = time.monotonic()
    deadline = start + args.budget_s
    if args.dry_run:
        # NB: one thread: on a loaded machine OpenMP's barriers made a
        # 2-thread forward 100x slower (they only check the script)
        torch.set_num_threads(1)
        device, gpu = torch.device("cpu"), "dry-run-cpu"
    else:
        if not torch.cuda.is_available():
            print("models: no CUDA device; use --dry-run to check the script on the CPU", file=sys.stderr)
            return 2
        device, gpu = torch.device("cuda"), torch.cuda.get_device_name()

    if args.output:
        out_path = args.output
    elif args.dry_run:
        out_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "torchfuse-models-dry-run.json")
    else:
        out_path = os.path.join(ROOT, "bench", "results", f"models-{slug(gpu)}.json")
    paths = [out_path] + ([os.path.join(os.environ["OUT"], "models.json")] if os.environ.get("OUT") else [])

    import torchvision
    import transformers

    results = {}
    if not args.fresh and os.path.exists(out_path):
        try:
            results = load(out_path)
        except (OSError, ValueError) as e:
            print(f"models: not merging into {out_path}: {e}", file=sys.stderr)
            results = {}
        if results and (results.get("gpu") != gpu or results.get("dry_run") != args.dry_run):
            print(f"models: {out_path} holds results of {results.get('gpu')}; starting afresh", file=sys.stderr)
            results = {}
    props = {}
    if device.type == "cuda":
        pr = torch.cuda.get_device_properties(device)
        props = {"sm_count": pr.multi_processor_count, "memory_GiB": round(pr.total_memory / 2**30, 1),
                 "capability": f"{pr.major}.{pr.minor}", "cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version()}
    run_id = datetime.datetime.now().strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    commit = args.commit or os.environ.get("TORCHFUSE_COMMIT") or git_commit()
    results.update({
        "gpu": gpu, "torch": torch.__version__, "torchvision": torchvision.__version__,
        "transformers": transformers.__version__, "dry_run": args.dry_run, "device": props,
        "flags": {"matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                  "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                  "float32_matmul_precision": torch.get_float32_matmul_precision(),
                  "texpr_fuser": torch._C._jit_texpr_fuser_enabled(),
                  "profiling_executor": torch._C._get_graph_executor_optimize()},
        "timing": {"method": "CUDA events per run" if device.type == "cuda" else "perf_counter per run",
                   "min_reps": args.reps, "warmup": args.warmup, "statistic": "median, min, max"},
    })
    results.setdefault("models", {})
    results.setdefault("rows", {})
    results.setdefault("skipped", {})
    results.setdefault("runs", [])
    run = {"run_id": run_id, "commit": commit, "date": datetime.datetime.now().strftime("%Y-%m-%dT%H:%M"),
           "command": "python bench/models.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    results["runs"].append(run)

    bench = ModelBench(args, device, results, paths, deadline, run_id)
    for m in models:
        results["models"][m] = {"desc": bench.specs[m].desc, "input_shape": list(bench.specs[m].input_shape),
                                **bench.specs[m].info}
    bench.save()
    print(f"models: {gpu}, torch {torch.__version__}, budget {args.budget_s:.0f} s -> {', '.join(paths)}", flush=True)
    for phase in PHASES:
        for m in models:
            spec = bench.specs[m]
            for mode in modes:
                for v in phase:
                    if v in variants and applicable(spec, mode, v):
                        bench.run_unit(spec, mode, v)
            free_memory()
    bench.refs.clear()
    run["elapsed_s"] = round(time.monotonic() - start, 1)
    run["failures"] = bench.failures
    bench.save()
    print(short_table(results), flush=True)
    print(f"models: {len(bench.measured)} measurements, {run['elapsed_s']:.0f} s; results in {out_path}", flush=True)
    if bench.failures:
        print("models: FAILURES:\n  " + "\n  ".join(bench.failures), flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
