"""An optimized model under DistributedDataParallel: two processes on the CPU
with the gloo backend.

Each rank trains on its half of a batch for 3 SGD steps.  The parameters and
BatchNorm buffers of the optimized DDP run must match those of the
unoptimized DDP run (float64, so that the comparison is tight), and, for the
model without BatchNorm, those of one process trained on the whole batch
(DDP averages the ranks' gradients: the gradient of the whole batch's mean
loss).  A BatchNorm under DDP normalizes each rank's half with its own
statistics, so there the single-process run is not the reference.  Also
checked: gradient accumulation under `no_sync`, and a checkpoint
(`torch.jit.save` of the trained optimized module) that loads and computes
the same outputs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import torchfuse

WORLD = 2
STEPS = 3
BATCH = 8  # the whole batch; each rank takes BATCH // WORLD


class SmallCnn(nn.Module):
    """relu(conv1(x)) + conv2(x) (conv_relu_add), then a BatchNorm chain
    (batch_norm_add_div_swish), a pooling and a linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 6, 1)
        self.bn = nn.BatchNorm2d(6)
        self.shift = nn.Parameter(torch.randn(1))
        self.fc = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.relu(self.conv1(x)) + self.conv2(x)
        t = (self.bn(h) + self.shift) / 2.0
        t = t * torch.sigmoid(t)
        return self.fc(t.mean((2, 3)))

    @staticmethod
    def batch(generator):
        return torch.randn(BATCH, 3, 6, 6, generator=generator, dtype=torch.float64)


class SmallMlp(nn.Module):
    """relu(fc1(x) + fc2(x)) (linear_add_relu), then a linear."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(5, 7)
        self.fc3 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc1(x) + self.fc2(x)))

    @staticmethod
    def batch(generator):
        return torch.randn(BATCH, 5, generator=generator, dtype=torch.float64)


MODELS = {"cnn": (SmallCnn, "conv_relu_add", "batch_norm_add_div_swish"), "mlp": (SmallMlp, "linear_add_relu")}


def _model(name, optimized):
    torch.manual_seed(0)
    scripted = torch.jit.script(MODELS[name][0]().double())
    if not optimized:
        return scripted
    # NB: every pass, so that the chains above fuse on the CPU too
    opt = torchfuse.optimize(scripted, passes=torchfuse.pass_names())
    report = torchfuse.report(opt)
    for chain in MODELS[name][1:]:
        assert report[chain] >= 1, (name, report)
    return opt


def _batches(name, steps):
    g = torch.Generator().manual_seed(1)
    return [MODELS[name][0].batch(g) for _ in range(steps)]


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _train(model, batches, step_fn):
    """SGD steps; step_fn(model, batch) runs the forward and backward."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in batches:
        opt.zero_grad(set_to_none=True)
        step_fn(model, x)
        opt.step()


def _loss(out):
    return out.square().mean()


def _worker(rank, name, optimized, no_sync, store, out_path):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        module = _model(name, optimized)
        ddp = DDP(module)
        half = BATCH // WORLD
        mine = slice(rank * half, (rank + 1) * half)

        def step(model, x):
            x = x[mine]
            if no_sync:
                # two micro-batches: the first's gradients stay local
                with model.no_sync():
                    _loss(model(x[: half // 2])).backward()
                _loss(model(x[half // 2:])).backward()
            else:
                _loss(model(x)).backward()

        _train(ddp, _batches(name, STEPS), step)
        if rank == 0:
            result = {"state": _state(module)}
            if optimized:
                # a checkpoint of the trained optimized module
                path = out_path + ".pt"
                torch.jit.save(module, path)
                x = _batches(name, 1)[0]
                module.eval()
                loaded = torch.jit.load(path).eval()
                with torch.no_grad():
                    result["checkpoint"] = (module(x), loaded(x))
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def _run(tmp_path, name, optimized, no_sync=False):
    tag = f"{name}-{'opt' if optimized else 'orig'}-{'nosync' if no_sync else 'sync'}"
    out = str(tmp_path / f"{tag}.result")
    # NB: forkserver, not fork: a process that traced a backward on fake
    # tensors (any torch.compile training, e.g. test_compile.py earlier in
    # the suite) has started autograd's device threads, and a forked child's
    # backward then raises "Unable to handle autograd's threading in
    # combination with fork-based multiprocessing".  The server, started
    # once with torch and torchfuse imported, forks the workers quickly.
    mp.set_forkserver_preload(["torch", "torchfuse"])
    mp.start_processes(
        _worker, args=(name, optimized, no_sync, str(tmp_path / f"{tag}.store"), out),
        nprocs=WORLD, join=True, start_method="forkserver")
    return torch.load(out)


def _assert_same_state(got, want, what):
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m: f"{what}: {k}: {m}")


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
@pytest.mark.parametrize("no_sync", [False, True], ids=["sync", "no_sync"])
@pytest.mark.parametrize("name", list(MODELS))
def test_optimized_model_trains_under_ddp_as_the_original(tmp_path, name, no_sync):
    original = _run(tmp_path, name, optimized=False, no_sync=no_sync)
    optimized = _run(tmp_path, name, optimized=True, no_sync=no_sync)
    _assert_same_state(optimized["state"], original["state"], f"{name}: optimized vs original DDP")
    initial = _state(_model(name, optimized=False))
    assert not torch.equal(optimized["state"]["fc3.weight" if name == "mlp" else "fc.weight"],
                           initial["fc3.weight" if name == "mlp" else "fc.weight"]), "no step was taken"
    if name == "cnn":
        assert not torch.equal(optimized["state"]["bn.running_mean"], initial["bn.running_mean"])
    trained, loaded = optimized["checkpoint"]
    torch.testing.assert_close(loaded, trained, rtol=0, atol=0)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
def test_ddp_without_batch_norm_matches_one_process_on_the_whole_batch(tmp_path):
    optimized = _run(tmp_path, "mlp", optimized=True)
    single = _model("mlp", optimized=False)
    _train(single, _batches("mlp", STEPS), lambda model, x: _loss(model(x)).backward())
    _assert_same_state(optimized["state"], _state(single), "mlp: optimized DDP vs one process")
