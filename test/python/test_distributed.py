"""An optimized model under DistributedDataParallel: two processes, gloo on
the CPU (and NCCL on two GPUs where there are two).

One launch of two workers (a module-scoped fixture) trains every case: the
models below, unoptimized and optimized (`torchfuse.optimize`), in float32
and float64, with one backward per step ("sync") or two micro-batches of
which the first runs under `no_sync` ("no_sync"), 3 SGD steps with momentum;
then a checkpoint (the DDP module's and the optimizer's state_dict, through
torch.save) is loaded into a fresh DDP model (gradient_as_bucket_view) which
takes a 4th step.  This process computes the float64 references and compares.

What DDP computes, hence the reference of each model:
- DDP averages the ranks' gradients, so without BatchNorm a step equals one
  process's step on the concatenated batch (the MLP; with no_sync, on the
  mean loss times the number of micro-batches);
- a BatchNorm2d under DDP normalizes each rank's (micro-)batch with its own
  statistics, and DDP broadcasts rank 0's buffers before each forward, so
  rank 0's running statistics are those of its own batches only.  The CNN's
  reference is one process that runs each rank's chunk separately, averages
  the losses, and keeps the running statistics of rank 0's chunks (the
  others' are undone).  The concatenated batch is the reference only with
  SyncBatchNorm, which cannot be scripted and runs only on GPUs: the "split"
  model optimizes the scriptable parts and keeps its BatchNorm in eager; on
  the GPUs it is a SyncBatchNorm and its reference the concatenated batch.

Checks, per case: the float64 runs equal the reference (this pins down the
reference); the float32 optimized run is within 2x the unoptimized float32
run's error against the float64 reference, plus a floor (cuda_utils'
accuracy rule), parameters and every BatchNorm buffer; num_batches_tracked
exactly; both ranks hold the same parameters; the loaded checkpoint's step
equals the uninterrupted run's, bit for bit.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import torchfuse
from cuda_utils import assert_close_to_reference, run_seed

WORLD = 2
STEPS = 3
BATCH = 8  # the whole batch of a step; each rank takes BATCH // WORLD
LR, MOMENTUM = 0.05, 0.9
MODES = {"sync": 1, "no_sync": 2}  # micro-batches per rank and step
DTYPES = (torch.float32, torch.float64)


class SmallCnn(nn.Module):
    """conv -> BatchNorm2d -> relu (unfused in training), two residual convs
    (conv_relu_add, conv_add_act), a BatchNorm chain that fuses in training
    (batch_norm_add_div_swish, which updates the running statistics), a
    pooling and a linear."""

    fused = ("conv_relu_add", "conv_add_act", "batch_norm_add_div_swish")
    in_shape, out_features = (3, 6, 6), 4

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 1)
        self.bn2 = nn.BatchNorm2d(8)
        self.shift = nn.Parameter(torch.randn(1))
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.conv2(h)) + h
        h = torch.relu(self.conv3(h) + h)
        t = (self.bn2(h) + self.shift) / 2.0
        t = t * torch.sigmoid(t)
        return self.fc(F.adaptive_avg_pool2d(t, 1).flatten(1))


class SmallMlp(nn.Module):
    """linear -> add -> relu twice (linear_add_relu), fc1 and fc2 sharing
    one weight (DDP registers it once), then a linear."""

    fused = ("linear_add_relu",)
    in_shape, out_features = (5,), 3

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(5, 7)
        self.fc2.weight = self.fc1.weight
        self.fc3 = nn.Linear(7, 7)
        self.fc4 = nn.Linear(7, 3)

    def forward(self, x):
        h = torch.relu(self.fc1(x) + self.fc2(x))
        h = torch.relu(self.fc3(h) + h)
        return self.fc4(h)


class _Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 8, 1)

    def forward(self, x):
        return torch.relu(self.conv1(x)) + self.conv2(x)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.conv(x) + x)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class SplitCnn(nn.Module):
    """A model whose BatchNorm stays in eager: `optimize_parts` optimizes
    the scriptable stem (conv_relu_add) and head (conv_add_act).  With
    sync_bn the BatchNorm is a SyncBatchNorm (not scriptable; CUDA only)."""

    fused = ("conv_relu_add", "conv_add_act")
    in_shape, out_features = (3, 6, 6), 4

    def __init__(self, sync_bn=False):
        super().__init__()
        self.stem = _Stem()
        self.bn = nn.SyncBatchNorm(8) if sync_bn else nn.BatchNorm2d(8)
        self.head = _Head()

    def forward(self, x):
        return self.head(self.bn(self.stem(x)))

    def optimize_parts(self, optimized):
        for name in ("stem", "head"):
            scripted = torch.jit.script(getattr(self, name))
            setattr(self, name, torchfuse.optimize(scripted) if optimized else scripted)
        return self


MODELS = {"cnn": SmallCnn, "mlp": SmallMlp, "split": SplitCnn}


def _fused_counts(module):
    if isinstance(module, SplitCnn):
        a, b = torchfuse.report(module.stem), torchfuse.report(module.head)
        return {k: a[k] + b[k] for k in a}
    return torchfuse.report(module)


def _sync_bn(backend, name):
    """Whether the model's BatchNorm is a SyncBatchNorm, which normalizes the
    ranks' batches together: only the split model's, on the GPUs (NCCL).  The
    other models' BatchNorms are scripted, hence plain BatchNorm2d, on every
    backend."""
    return backend == "nccl" and name == "split"


def _build(name, dtype, device, optimized, sync_bn=False, seed=0):
    torch.manual_seed(seed)
    if name == "split":
        return SplitCnn(sync_bn).to(device, dtype).optimize_parts(optimized)
    scripted = torch.jit.script(MODELS[name]().to(device, dtype))
    if not optimized:
        return scripted
    module = torchfuse.optimize(scripted)
    # NB: the optimized module trains the input's tensors (tied ones stay
    # tied), and it is these that DDP registers and the optimizer updates.
    assert [p is q for p, q in zip(module.parameters(), scripted.parameters())] == [True] * len(
        list(scripted.parameters())), name
    return module


def _data(name, seed, steps):
    """Per step: the whole batch and a target, random and signed."""
    g = torch.Generator().manual_seed(seed)
    cls = MODELS[name]
    return [(torch.randn(BATCH, *cls.in_shape, generator=g, dtype=torch.float64),
             torch.randn(BATCH, cls.out_features, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _rows(rank, micro, micros):
    """The rows of the whole batch that `rank` feeds in micro-batch `micro`."""
    per_rank = BATCH // WORLD
    size = per_rank // micros
    start = rank * per_rank + micro * size
    return slice(start, start + size)


def _loss(out, target):
    return (out - target).square().mean()


def _state(module):
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def _ddp_step(ddp, opt, x, y, rank, micros, device, dtype):
    opt.zero_grad(set_to_none=True)
    for m in range(micros):
        rows = _rows(rank, m, micros)
        xm, ym = x[rows].to(device, dtype), y[rows].to(device, dtype)
        if m < micros - 1:
            # the first micro-batches' gradients accumulate locally
            with ddp.no_sync():
                _loss(ddp(xm), ym).backward()
        else:
            _loss(ddp(xm), ym).backward()
    opt.step()


def _new_ddp(module, device, **options):
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, **options)
    # NB: DDP must register the module's own parameters (the tensors the
    # fused ops read), the tied weight once.
    assert [p is q for p, q in zip(ddp.parameters(), module.parameters())] == [True] * len(
        list(module.parameters()))
    return ddp, torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)


def _worker(rank, backend, store, out_dir, seed):
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
            # NB: float32 accuracy is the subject; TF32 would blur it
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        results = {}
        for name in MODELS:
            sync_bn = _sync_bn(backend, name)
            data = _data(name, seed, STEPS + 1)
            for dtype in DTYPES:
                for optimized in (False, True):
                    for mode, micros in MODES.items():
                        module = _build(name, dtype, device, optimized, sync_bn)
                        if optimized:
                            counts = _fused_counts(module)
                            for chain in MODELS[name].fused:
                                assert counts[chain] >= 1, (name, counts)
                        ddp, opt = _new_ddp(module, device)
                        for x, y in data[:STEPS]:
                            _ddp_step(ddp, opt, x, y, rank, micros, device, dtype)
                        case = {"state": _state(module)}
                        if mode == "sync":
                            # checkpoint, then the 4th step: uninterrupted, and
                            # after loading into a fresh (differently initialized) model
                            path = os.path.join(out_dir, f"{name}-{dtype}-{optimized}.ckpt")
                            if rank == 0:
                                torch.save({"model": ddp.state_dict(), "optim": opt.state_dict()}, path)
                            dist.barrier()
                            case["keys"] = list(ddp.state_dict())
                            x, y = data[STEPS]
                            _ddp_step(ddp, opt, x, y, rank, micros, device, dtype)
                            case["state4"] = _state(module)
                            fresh = _build(name, dtype, device, optimized, sync_bn, seed=1)
                            # (with the gradients as views of DDP's buckets)
                            ddp2, opt2 = _new_ddp(fresh, device, gradient_as_bucket_view=True)
                            ckpt = torch.load(path, map_location=device)
                            ddp2.load_state_dict(ckpt["model"])
                            opt2.load_state_dict(ckpt["optim"])
                            _ddp_step(ddp2, opt2, x, y, rank, micros, device, dtype)
                            case["state4_loaded"] = _state(fresh)
                        results[(name, dtype, optimized, mode)] = case
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


BACKENDS = [
    pytest.param("gloo", marks=pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")),
    pytest.param("nccl", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not dist.is_available() or not dist.is_nccl_available() or torch.cuda.device_count() < 2,
        reason="needs NCCL and two CUDA devices")]),
]


@pytest.fixture(scope="module", params=BACKENDS)
def runs(request, tmp_path_factory):
    """Both ranks' results of every case, with the backend and the seed."""
    backend = request.param
    seed = run_seed()
    out_dir = tmp_path_factory.mktemp(f"ddp-{backend}")
    # NB: forkserver, not fork: a process that traced a backward on fake
    # tensors (any torch.compile training, e.g. test_compile.py earlier in
    # the suite) has started autograd's device threads, and a forked child's
    # backward then raises "Unable to handle autograd's threading in
    # combination with fork-based multiprocessing".  The server, started
    # once with torch and torchfuse imported, forks the workers quickly.
    mp.set_forkserver_preload(["torch", "torchfuse"])
    mp.start_processes(_worker, args=(backend, str(out_dir / "store"), str(out_dir), seed),
                       nprocs=WORLD, join=True, start_method="forkserver")
    ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]
    return backend, seed, ranks


def _reference(name, mode, steps, data, sync_bn):
    """One process, float64, eager: the state DDP's rank 0 should reach."""
    torch.manual_seed(0)
    model = SplitCnn() if name == "split" else MODELS[name]()
    model = model.double()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    micros = MODES[mode]
    has_bn = any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    per_rank = has_bn and not sync_bn
    for x, y in data[:steps]:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(micros):
            if not per_rank:
                # the micro-batch m of every rank, concatenated
                rows = torch.cat([torch.arange(BATCH)[_rows(r, m, micros)] for r in range(WORLD)])
                total = total + _loss(model(x[rows]), y[rows])
                continue
            for r in range(WORLD):
                rows = _rows(r, m, micros)
                # rank r's running statistics are not rank 0's (DDP overwrites
                # them with rank 0's): rank r > 0 updates copies.  NB: copies
                # rather than restoring values in place, as the BatchNorm's
                # backward reads the buffers it was given.
                kept = {}
                if r != 0:
                    for mod in model.modules():
                        for k, b in mod._buffers.items():
                            if b is not None:
                                kept[mod, k] = b
                                mod._buffers[k] = b.clone()
                total = total + _loss(model(x[rows]), y[rows]) / WORLD
                for (mod, k), b in kept.items():
                    mod._buffers[k] = b
        total.backward()
        opt.step()
    return _state(model)


def _assert_rule(opt32, orig32, ref64, what):
    assert opt32.keys() == orig32.keys() == ref64.keys(), what
    for k, ref in ref64.items():
        if not ref.is_floating_point():  # num_batches_tracked
            assert torch.equal(opt32[k], ref) and torch.equal(orig32[k], ref), f"{what}: {k}"
            continue
        assert_close_to_reference(opt32[k], orig32[k], ref, what=f"{what}: {k}")


def _assert_equal(got, want, what, exact=False):
    assert got.keys() == want.keys(), what
    for k in want:
        tol = dict(rtol=0, atol=0) if exact else {}
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m: f"{what}: {k}: {m}")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(MODELS))
def test_optimized_model_trains_under_ddp_as_the_reference(runs, name, mode):
    backend, seed, ranks = runs
    data = _data(name, seed, STEPS)
    ref = _reference(name, mode, STEPS, data, _sync_bn(backend, name))
    what = f"{backend} {name} {mode} seed {seed}"
    r0 = ranks[0]
    # the float64 DDP runs are the reference (pins the reference down)
    for optimized in (False, True):
        _assert_equal(r0[(name, torch.float64, optimized, mode)]["state"], ref,
                      f"{what}: float64 {'optimized' if optimized else 'unoptimized'} DDP vs one process")
    _assert_rule(r0[(name, torch.float32, True, mode)]["state"], r0[(name, torch.float32, False, mode)]["state"],
                 ref, f"{what}: float32 optimized vs unoptimized DDP vs float64 reference")
    # both ranks hold the same parameters
    for key, case in r0.items():
        if key[0] == name and key[3] == mode:
            other = ranks[1][key]["state"]
            for k, p in case["state"].items():
                if "running" not in k:
                    assert torch.equal(p, other[k]), f"{what}: {key}: rank 1's {k} differs from rank 0's"
    # not vacuous: the steps moved the weights and the running statistics
    initial = _state(_build(name, torch.float64, "cpu", optimized=False))
    trained = r0[(name, torch.float64, True, mode)]["state"]
    for k, v in initial.items():
        if k.endswith("weight") or k.endswith("running_mean"):
            assert not torch.equal(trained[k], v), f"{what}: {k} did not change"


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_of_the_ddp_module_loads_and_trains_on(runs, name):
    backend, seed, ranks = runs
    what = f"{backend} {name} seed {seed}"
    r0 = ranks[0]
    # the optimized DDP module's state_dict has the original's keys
    assert r0[(name, torch.float32, True, "sync")]["keys"] == r0[(name, torch.float32, False, "sync")]["keys"]
    assert all(k.startswith("module.") for k in r0[(name, torch.float32, True, "sync")]["keys"])
    for dtype in DTYPES:
        for optimized in (False, True):
            case = r0[(name, dtype, optimized, "sync")]
            # NB: bit for bit on the CPU; cuDNN's and the CUDA kernels'
            # reductions need not be deterministic
            _assert_equal(case["state4_loaded"], case["state4"],
                          f"{what}: {dtype} optimized={optimized}: loaded vs uninterrupted",
                          exact=backend == "gloo")
    ref = _reference(name, "sync", STEPS + 1, _data(name, seed, STEPS + 1), _sync_bn(backend, name))
    _assert_equal(r0[(name, torch.float64, True, "sync")]["state4_loaded"], ref,
                  f"{what}: float64 optimized, loaded, 4th step vs one process")
    _assert_rule(r0[(name, torch.float32, True, "sync")]["state4_loaded"],
                 r0[(name, torch.float32, False, "sync")]["state4_loaded"], ref,
                 f"{what}: float32 loaded, 4th step, optimized vs unoptimized vs float64 reference")


def test_sync_batch_norm_is_left_to_eager():
    """SyncBatchNorm never reaches the TorchScript passes (it cannot be
    scripted); optimizing the parts around it leaves it in place, and
    torchfuse.fx leaves the module call alone."""
    with pytest.raises(Exception):
        torch.jit.script(nn.SyncBatchNorm(8))
    # NB: and converting after scripting silently converts nothing (a
    # scripted BatchNorm is no _BatchNorm): docs/usage.md says to split
    plain = torchfuse.optimize(torch.jit.script(nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8))))
    assert nn.SyncBatchNorm.convert_sync_batchnorm(plain) is plain
    assert [m.original_name for m in plain.modules()] == ["Sequential", "Conv2d", "BatchNorm2d"]
    torch.manual_seed(0)
    model = SplitCnn(sync_bn=True).double()
    bn = model.bn
    model.optimize_parts(True)
    assert model.bn is bn and type(model.bn) is nn.SyncBatchNorm
    assert _fused_counts(model)["conv_relu_add"] == 1 and _fused_counts(model)["conv_add_act"] == 1
    # one process, no process group: SyncBatchNorm is a BatchNorm
    torch.manual_seed(0)
    eager = SplitCnn().double()
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    torch.testing.assert_close(model(x), eager(x))
    torch.testing.assert_close(model.bn.running_var, eager.bn.running_var)

    tfx = torchfuse.fx  # imported on first use

    class BnChain(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 1)
            self.bn = nn.SyncBatchNorm(8)

        def forward(self, x):
            t = (self.bn(torch.relu(self.conv(x)) + x.mean(1, keepdim=True)) + 1.0) / 2.0
            return t * torch.sigmoid(t)

    gm = tfx.optimize(torch.fx.symbolic_trace(BnChain().double()))
    counts = tfx.report(gm)
    assert counts["conv_relu_add"] == 1 and counts["batch_norm_add_div_swish"] == 0, counts
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["bn"]
    assert type(gm.bn) is nn.SyncBatchNorm
