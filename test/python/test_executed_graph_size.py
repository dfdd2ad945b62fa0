"""The graph the profiling executor runs for an optimized module is no larger
than the one it runs for the scripted (or traced) module, in training and
in eval.

A fused chain replaces several nodes with one; what a pass inserts beside
it (a size the original read, a layout call) must stay one node, not
interpreted code: the executor unrolls loops, and each node it runs costs
host time on every call (in eval the training branch's nodes are counted
but not run).  A TorchScript function computing BatchNorm's input size once
made resnet18's training graph 4401 nodes against the scripted module's
1328, and resnet50's training step, host-bound on an H200, 0.6 ms slower
(docs/kernels/conv_batch_norm_act.md, "Training")."""

import copy
import warnings

import pytest
import torch
import torchvision

import torchfuse
from test_attention_masks import EmbedsIn, tiny_bert

MODELS = ["resnet18", "mobilenet_v3_small", "efficientnet_b0"]


def executed_nodes(module, x, train: bool) -> int:
    """Nodes (nested blocks included) of the forward graph the executor
    last ran, after enough calls for it to profile and optimize."""
    with torch.set_grad_enabled(train):
        for _ in range(3):
            module(x)
    graph = torch.jit.last_executed_optimized_graph()

    # NB: autodiff's and NNC's groups hold their nodes in a Subgraph
    # attribute, not in a block
    def count(block) -> int:
        return sum(1 + sum(count(b) for b in node.blocks()) +
                   (count(node.g("Subgraph")) if node.hasAttribute("Subgraph") else 0)
                   for node in block.nodes())

    return count(graph)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", MODELS)
def test_optimized_forward_graph_is_no_larger_than_the_scripted_one(name, train):
    torch.manual_seed(0)
    model = getattr(torchvision.models, name)().train(train)
    x = torch.randn(2, 3, 32, 32)
    scripted = torch.jit.script(copy.deepcopy(model))
    opt = torchfuse.optimize(torch.jit.script(model))
    assert any(n > 0 for n in torchfuse.report(opt).values())
    ours, theirs = executed_nodes(opt, x, train), executed_nodes(scripted, x, train)
    assert ours <= theirs, (ours, theirs)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_optimized_traced_bert_graph_is_no_larger_than_the_traced_one(train):
    model = EmbedsIn(tiny_bert().train(train)).train(train)
    x = torch.randn(3, 7, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(copy.deepcopy(model), (x,), check_trace=False)
        opt = torchfuse.optimize(torch.jit.trace(model, (x,), check_trace=False))
    assert any(n > 0 for n in torchfuse.report(opt).values())
    ours, theirs = executed_nodes(opt, x, train), executed_nodes(traced, x, train)
    assert ours <= theirs, (ours, theirs)
