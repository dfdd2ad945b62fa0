"""The fuzzer's checks for tied parameters and shared buffers, autocast,
double backward and exported methods of frozen modules (tools/fuzz_pass.py)
must fail on a planted fault and pass without it.  The module compared
with the original comes from a stand-in for torchfuse.optimize
(fuzz.modes._optimize): the original itself, or a module scripted from a
variant of its source with the same state, optionally altered; so these
tests do not depend on what the library does today."""

import os
import re
import sys

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz_pass  # noqa: E402
from fuzz import modes as fuzz_modes  # noqa: E402

SOURCE = """\
class Program(nn.Module):
    # preserved_attrs: exported
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.fc2.weight = self.fc1.weight
        self.bn1 = nn.BatchNorm1d(4)
        self.bn2 = nn.BatchNorm1d(4)
        self.bn2.running_mean = self.bn1.running_mean
        self.p0 = nn.Parameter(torch.randn(4))
    def forward(self, x0):
        v1 = torch.relu(self.fc1(x0) + self.bn1(x0))
        v2 = self.bn2(self.fc2(v1)) + self.p0
        return torch.tanh(v2){fault}
    @torch.jit.export
    def exported(self, x0):
        return torch.relu(self.fc2(x0)){export_fault}
"""
SHAPES = [[5, 4]]


def program(fault: str = "", export_fault: str = "") -> str:
    return SOURCE.format(fault=fault, export_fault=export_fault)


def stand_in(source: str = None, alter=None):
    """An optimize that returns `source`'s module (default: the original's
    own) with the state of the module given, frozen as optimize(freeze=True)
    freezes, then altered by `alter(module, freeze)`."""

    def optimize(module, freeze, preserved):
        if source is None:
            result = fuzz_pass._copy(module)
        else:
            dtype = next(module.parameters()).dtype
            result = torch.jit.script(fuzz_pass._to_dtype(fuzz_pass.load_class(source)(), dtype))
            result.load_state_dict(module.state_dict())
            result.train(module.training)
        if freeze:
            with torch.jit.optimized_execution(True):
                result = torch.jit._recursive.wrap_cpp_module(torch._C._freeze_module(result._c, list(preserved)))
        if alter is not None:
            alter(result, freeze)
        return result

    return optimize


def check(monkeypatch, optimize, source=None, modes=("train", "eval", "frozen"), dtypes=("float64",), **kw):
    monkeypatch.setattr(fuzz_modes, "_optimize", optimize)
    return fuzz_pass.check_source(source or program(), SHAPES, 3, dtypes=dtypes, modes=modes, **kw).failures


def test_the_faithful_stand_in_passes_every_mode(monkeypatch):
    # NB: the control for every planted fault below.
    assert check(monkeypatch, stand_in(), modes=fuzz_pass.MODES, dtypes=("float64", "float32")) == []
    assert check(monkeypatch, stand_in(program()), modes=fuzz_pass.MODES, dtypes=("float64", "float32")) == []


# ---- NaN and Inf


def test_nonfinite_inputs_are_drawn_from_their_own_stream():
    """A quarter of the check seeds get copies of the inputs with NaN (and
    maybe infinities) in some of them; the inputs themselves are not
    touched."""
    inputs = [torch.randn(5, 4), torch.randn(3), torch.arange(4)]
    drawn = {seed: fuzz_modes._nonfinite_inputs(inputs, seed) for seed in range(400)}
    poisoned = [seed for seed, bad in drawn.items() if bad is not None]
    assert 60 < len(poisoned) < 140, len(poisoned)
    assert all(torch.isfinite(t).all() for t in inputs[:2])
    for seed in poisoned:
        bad = drawn[seed]
        assert torch.equal(bad[2], inputs[2]) and any(t.isnan().any() for t in bad[:2]), seed
        again = fuzz_modes._nonfinite_inputs(inputs, seed)  # reproducible from the seed
        assert all(torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
                   for a, b in zip(bad, again)), seed


def test_a_module_that_drops_nan_fails_in_the_nonfinite_mode(monkeypatch):
    """The optimized module maps NaN and Inf to finite values at its output:
    alike on finite inputs, caught on the nonfinite mode's."""
    monkeypatch.setattr(fuzz_modes, "NONFINITE_FRACTION", 1.0)
    optimize = stand_in(program(fault=".nan_to_num()"))
    assert check(monkeypatch, optimize, modes=("train", "eval", "frozen")) == []
    failures = check(monkeypatch, optimize, modes=("nonfinite",))
    assert failures and failures[0].startswith("float64 nonfinite train step 0"), failures


# ---- tied parameters and shared buffers


def _untie_weight(module, freeze):
    if not freeze:
        module.fc2.weight = nn.Parameter(module.fc2.weight.detach().clone())


def _unshare_running_mean(module, freeze):
    if not freeze:
        module.bn2.running_mean = module.bn2.running_mean.clone()


@pytest.mark.parametrize("alter,parameters,name", [(_untie_weight, 9, "parameter fc1.weight"),
                                                   (_unshare_running_mean, 8, "buffer bn1.running_mean")])
def test_untied_tensor_fails(monkeypatch, alter, parameters, name):
    failures = check(monkeypatch, stand_in(alter=alter), modes=("train",))
    assert len(failures) == 1 and failures[0].startswith(f"float64 train: {parameters} parameters vs 8 in the original; "), failures
    assert f"{name} is one tensor with 0 other ({name}), in the original with 1" in failures[0], failures


def test_untied_after_save_and_load_fails(monkeypatch):
    load = fuzz_pass._load

    def load_untied(data):
        module = load(data)
        _untie_weight(module, False)
        return module

    monkeypatch.setattr(fuzz_modes, "_load", load_untied)
    failures = check(monkeypatch, stand_in(), modes=("train",))
    assert failures == [f"float64 train {fuzz_pass.AFTER_SAVE_LOAD}: 9 parameters vs 8 in the original; "
                        "parameter fc1.weight is one tensor with 0 other (parameter fc1.weight), "
                        "in the original with 1 (parameter fc1.weight, parameter fc2.weight)"]


def test_shared_buffer_values_are_compared_after_training_steps(monkeypatch):
    # NB: the sharing check off, so that the values must show the untying:
    # bn1 and bn2 update one running mean in the original, two in the copy.
    monkeypatch.setattr(fuzz_modes, "_sharing_mismatch", lambda *a: None)
    failures = check(monkeypatch, stand_in(alter=_unshare_running_mean), modes=("train", "eval"), round_trip=False)
    assert any("train step 0: buffer bn1.running_mean" in f for f in failures), failures
    assert any("eval step 2: output 0" in f for f in failures), failures


def test_optimize_changing_its_input_fails(monkeypatch):
    def optimize(module, freeze, preserved):
        result = fuzz_pass._copy(module)
        module._c._get_method("forward").graph.insertConstant(1)
        return result

    failures = check(monkeypatch, optimize, modes=("train",))
    assert "float64 train: optimize changed its input module's methods" in failures, failures


def test_to_dtype_keeps_sharing():
    model = fuzz_pass.load_class(program())()
    converted = fuzz_pass._to_dtype(model, torch.float64)
    assert converted.fc2.weight is converted.fc1.weight
    assert converted.bn2.running_mean is converted.bn1.running_mean
    assert converted.bn1.running_mean.dtype == torch.float64


def _ties(source: str):
    """__init__ lines that give an existing tensor a second name."""
    return re.findall(r"^ +(self\.\w+(?:\.\w+)? = self\.\S+|self\.register_buffer\(\"\w+\", self\.\S+\))$",
                      source, re.M)


def test_generator_draws_ties_and_exports_without_changing_other_programs():
    sources = [fuzz_pass.generate(0, i * 100).source() for i in range(300)]
    plain = [fuzz_pass.generate(0, i * 100, features=()).source() for i in range(300)]
    ties = [t for s in sources for t in _ties(s)]
    assert sum(".weight = self." in t for t in ties) >= 10
    assert sum(".running_mean = self." in t for t in ties) >= 5
    assert sum("register_buffer" in t for t in ties) >= 3
    assert sum("@torch.jit.export" in s for s in sources) >= 30
    assert not any("@torch.jit.export" in s or _ties(s) for s in plain)
    # NB: a program drawn with the features differs only where one was drawn.
    same = sum(a == b for a, b in zip(sources, plain))
    assert 60 <= same < 300


# ---- autocast


def test_autocast_dtype_change_fails(monkeypatch):
    # NB: the linear's output dtype is bfloat16 under autocast only; the
    # original's output is float32 there (+ a float32 parameter).
    source = program(fault=".to(self.fc1(x0).dtype)")
    failures = check(monkeypatch, stand_in(source), modes=("autocast",), dtypes=("float64", "float32"))
    assert failures, failures
    assert all(f.startswith("float32 autocast ") for f in failures), failures
    assert "output 0: shape/dtype (5, 4)/torch.bfloat16 vs (5, 4)/torch.float32" in failures[0], failures


def test_autocast_value_change_fails(monkeypatch):
    # 5% more under autocast only: beyond the bfloat16 tolerance (the
    # outputs are at most 1) and 4 times the original's bfloat16 error.
    source = program(fault=" * (1.0 + 0.05 * float(self.fc1(x0).dtype == torch.bfloat16))")
    failures = check(monkeypatch, stand_in(source), modes=("autocast",), dtypes=("float64", "float32"))
    assert failures and all(f.startswith("float32 autocast ") for f in failures), failures
    assert any("output 0: max |diff|" in f for f in failures), failures


# ---- double backward


def test_double_backward_raising_fails(monkeypatch):
    # cdist has no double backward; 0 * cdist leaves the values alone.
    source = program(fault=" + 0.0 * torch.cdist(v2, v2).sum()")
    failures = check(monkeypatch, stand_in(source), modes=("train", "double_backward"))
    assert failures == ["float64 double_backward step 0: optimized module raised: "
                        "the derivative for '_cdist_backward' is not implemented."], failures


def test_double_backward_value_change_fails(monkeypatch):
    # c * (v - v.detach())**2 is 0 with a zero gradient, but its second
    # derivative is 2c: only the gradient penalty's gradient differs.
    source = program(fault=" + 0.5 * (v2 - v2.detach()) ** 2")
    failures = check(monkeypatch, stand_in(source), modes=("train", "eval", "double_backward"))
    assert failures, failures
    assert all(f.startswith("float64 double_backward step 0: grad of the penalty w.r.t. ") for f in failures), failures


def test_original_whose_double_backward_raises_is_skipped(monkeypatch):
    source = program(fault=" + 0.0 * torch.cdist(v2, v2).sum()")
    monkeypatch.setattr(fuzz_modes, "_optimize", stand_in())
    outcome = fuzz_pass.check_source(source, SHAPES, 3, dtypes=("float64",), modes=("double_backward",))
    assert outcome.failures == [] and outcome.double_backward_skipped == 1


# ---- exported methods of frozen modules


def test_exported_method_value_change_fails(monkeypatch):
    source = program(export_fault=" + 1e-6")
    failures = check(monkeypatch, stand_in(source), modes=("frozen",))
    assert failures == ["float64 frozen exported(): output 0: max |diff| 1e-06 > 1e-10"], failures


def test_exported_method_dropped_fails(monkeypatch):
    def optimize(module, freeze, preserved):
        return stand_in()(module, freeze, ())  # frozen without preserving it

    failures = check(monkeypatch, optimize, modes=("frozen",))
    assert len(failures) == 1 and failures[0].startswith("float64 frozen exported(): optimized exported raised"), failures


def test_preserved_attribute_dropped_fails(monkeypatch):
    source = program().replace("# preserved_attrs: exported", "# preserved_attrs: exported, p0")
    monkeypatch.setattr(fuzz_modes, "_optimize", lambda m, freeze, preserved: stand_in()(m, freeze, preserved[:1]))
    failures = fuzz_pass.check_source(source, SHAPES, 3, dtypes=("float64",), modes=("frozen",)).failures
    assert failures == ["float64 frozen: preserved attributes ['p0'] missing"], failures


def test_frozen_programs_call_optimize_with_preserved_attrs(monkeypatch):
    # NB: the keyword as torchfuse.optimize is to take it; the stand-in
    # freezes as it is to.
    calls = []

    def optimize(module, *, freeze=False, passes=None, preserved_attrs=None):
        calls.append((freeze, preserved_attrs))
        return stand_in()(module, freeze, preserved_attrs or ())

    monkeypatch.setattr(fuzz_modes.torchfuse, "optimize", optimize)
    source = program().replace("# preserved_attrs: exported", "# preserved_attrs: exported, p0")
    failures = fuzz_pass.check_source(source, SHAPES, 3, dtypes=("float64",), modes=("train", "frozen")).failures
    assert failures == []
    assert calls == [(False, None), (True, ["exported", "p0"])]


# ------------------------------------------------------------------ fx mode

FX_SOURCE = """\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 5)
        self.bn = nn.BatchNorm1d(5)
    def forward(self, x0):
        v = F.relu(self.lin(x0) + 1.0)
        return self.bn(v)
"""


def fx_stand_in(alter):
    """A torchfuse.fx.optimize whose result is then altered by alter(gm)."""
    import torchfuse.fx as tfx

    real = tfx.optimize

    def optimize(gm, passes=None):
        out = real(gm, passes=passes)
        alter(out)
        out.recompile()
        return out

    return optimize


def scale_output(gm):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        scaled = gm.graph.call_function(torch.mul, (out.args[0], 1.0001))
    out.args = (scaled,)


def bn_momentum(gm):
    for m in gm.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.momentum = 0.2


def test_fx_mode_passes_the_rewrite_and_fails_planted_faults(monkeypatch):
    """fx mode: torchfuse.fx.optimize of the program's symbolic traces,
    in training and eval mode, against the traces; a scaled output and a
    running-statistics update of another momentum are failures."""
    import torchfuse.fx as tfx

    out = fuzz_pass.check_source(FX_SOURCE, [[3, 4]], 0, modes=("fx",))
    assert not out.failures, out.failures
    assert out.fx_traced["fx"] == 4 and not out.fx_untraceable  # train and eval, float64 and float32
    assert out.fx_fused["relu"] == 4, out.fx_fused  # an add of a number is not linear_add_relu's
    monkeypatch.setattr(tfx, "optimize", fx_stand_in(scale_output))
    out = fuzz_pass.check_source(FX_SOURCE, [[3, 4]], 0, dtypes=("float64",), modes=("fx",))
    assert any(re.match(r"float64 fx train step 0: output 0: max \|diff\|", f) for f in out.failures), out.failures
    monkeypatch.setattr(tfx, "optimize", fx_stand_in(bn_momentum))
    out = fuzz_pass.check_source(FX_SOURCE, [[3, 4]], 0, dtypes=("float64",), modes=("fx",))
    assert any("buffer root.bn.running_mean" in f for f in out.failures), out.failures


def test_fx_mode_skips_what_symbolic_trace_cannot_trace():
    source = """\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, x0):
        if bool(x0.sum() > 0):
            return self.lin(x0)
        return x0
"""
    out = fuzz_pass.check_source(source, [[3, 4]], 0, dtypes=("float64",), modes=("fx",))
    assert not out.failures and not out.fx_traced and out.fx_untraceable["fx"] == 1, out


def test_compile_mode_passes_the_rewrite_and_fails_a_planted_fault(monkeypatch):
    """compile mode: torch.compile with torchfuse.fx's backend (Dynamo's
    graphs rewritten, then run as they are) against the module itself; a
    rewrite that scales the output is a failure, and the rewrite-free
    torch.compile agrees with the module, so the failure is judged."""
    import torchfuse.fx as tfx

    out = fuzz_pass.check_source(FX_SOURCE, [[3, 4]], 0, modes=("compile",))
    assert not out.failures, out.failures
    assert out.fx_traced["compile"] == 4 and not out.fx_untraceable, out
    real = tfx.fuse_graph

    def scaled(graph, passes=None):
        counts = real(graph, passes)
        out_node = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(out_node):
            first = graph.call_function(torch.mul, (out_node.args[0][0], 1.0001))
        out_node.args = ((first,) + tuple(out_node.args[0][1:]),)
        return counts

    monkeypatch.setattr(tfx, "fuse_graph", scaled)
    out = fuzz_pass.check_source(FX_SOURCE, [[3, 4]], 0, dtypes=("float64",), modes=("compile",))
    assert any(re.match(r"float64 compile train step 0: output 0: max \|diff\|", f) for f in out.failures), \
        out.failures
