"""The fuzzer's judgements that the 10,000 programs of seed 20261124
called for: a frozen mode is judged against torch's own frozen original
where freeze_module itself changes meaning; autocast gradients against the
original's backward rounding spread; a double backward whose original is
wrong by central differences.  The shrunk programs pass; planted
faults in the same programs still fail."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
import fuzz_pass  # noqa: E402
from fuzz.cases import case, keeps_meaning_test  # noqa: E402
from fuzz import modes as fuzz_modes  # noqa: E402

CASES = [
    # seed 20261124, program 23: a dead training-mode batch_norm (literal True) updates a buffer that an eval BatchNorm reads under another name: freeze_module drops it (AliasDb ignores batch_norm's writes when frozen); optimize(freeze=True) agrees with torch's own frozen original.
    case("frozen_training_bn_on_a_shared_buffer_dead", [[3, 4]], 23, {}, """\
        self.register_buffer("rm0", torch.zeros(4))
        self.register_buffer("rv1", torch.ones(4))
        self.p2 = nn.Parameter(torch.randn(4))
        self.p3 = nn.Parameter(torch.randn(4))
        self.bn9 = nn.BatchNorm1d(4, affine=False)
        self.bn9.running_mean = self.rm0
    def forward(self, x0):
        v4 = F.batch_norm(x0, self.rm0, self.rv1, self.p2, self.p3, True, 0.3, 1e-05)
        v10 = self.bn9(x0)
        v11 = v10
        v12 = v11
        v13 = v12
        v23 = v13
        return v23
"""),
    # seed 20261124, program 714: the same with a second name of the buffer (register_buffer of it).
    case("frozen_training_bn_statistic_folded", [[4, 2, 4, 4]], 714, {}, """\
        self.register_buffer("rm0", torch.zeros(2))
        self.register_buffer("rv1", torch.ones(2))
        self.p2 = nn.Parameter(torch.randn(2))
        self.register_buffer("rm7", self.rm0)
        self.register_buffer("rv8", torch.ones(2))
        self.p9 = nn.Parameter(torch.randn(2))
    def forward(self, x2):
        v3 = F.batch_norm(x2, self.rm0, self.rv1, None, self.p2, True, 0.1, 1e-05)
        v10 = F.batch_norm(x2, self.rm7, self.rv8, self.p2, self.p9, False, 0.1, 1e-05)
        v11 = v10
        v12 = v11
        v13 = v12
        v14 = v13
        return v14
"""),
    # seed 20261124, program 9491: a training-mode batch_norm in an eval module whose statistics equal other constants: torch's frozen original and the optimized module differ from the original, each in its own way (not judged).
    case("frozen_training_bn_no_reference", [[4, 4, 6]], 9491, {}, """\
        self.bn0 = nn.BatchNorm1d(4)
        self.p21 = nn.Parameter(torch.randn(4))
        self.register_buffer("rm26", torch.zeros(4))
        self.register_buffer("rv27", self.bn0.running_var)
        self.p28 = nn.Parameter(torch.randn(4))
        self.register_buffer("rm35", torch.zeros(4))
        self.p36 = self.bn0.weight
        self.p37 = nn.Parameter(torch.randn(4))
    def forward(self, x0):
        v1 = self.bn0(x0)
        v3 = v1
        v4 = v3
        v5 = v4
        if self.training:
            v16 = x0
            v14 = v16
        else:
            v29 = F.batch_norm(v5, self.rm26, self.rv27, self.p28, self.p21, True, 0.1, 1e-05)
            v14 = x0
        v38 = F.batch_norm(v14, self.rm35, self.rv27, self.p36, self.p37, False, 0.3, 1e-05)
        return v38
"""),
    # seed 20261124, program 3788: under autocast a bias gradient summed from bfloat16 terms that cancel: a bfloat16 ulp of the terms, within the backward's rounding spread.
    case("autocast_bias_gradient_rounding", [[3, 2, 6]], 3788, {}, """\
        self.fc1 = nn.Linear(6, 6, bias=True)
        self.p5 = nn.Parameter(torch.randn(5, 6))
        self.p6 = nn.Parameter(torch.randn(5))
        self.p8 = nn.Parameter(torch.randn(3, 2, 5))
        self.conv24 = nn.Conv1d(2, 2, 3, stride=1, padding=1, dilation=1, groups=1, bias=True)
    def forward(self, x0):
        v0 = x0.view(3, 12)
        v2 = self.fc1(x0)
        v3 = v2 + x0
        v4 = F.relu(v3)
        v7 = F.linear(v4, self.p5, self.p6)
        v9 = self.p8 + v7
        v10 = F.relu(v9)
        v23 = F.relu(x0, inplace=True)
        v25 = self.conv24(v10)
        v26 = v25.relu_()
        v28 = v26
        v22 = v28
        return (v22, v0, v10,)
"""),
    # seed 20261124, program 5795: under autocast a bias gradient of bfloat16 products of the loss weights.
    case("autocast_bias_gradient_of_weights", [[4, 3]], 5795, {}, """\
        self.fc0 = nn.Linear(3, 6, bias=False)
        self.p2 = nn.Parameter(torch.randn(4, 6))
        self.p9 = nn.Parameter(torch.randn(1, 1))
        self.p10 = nn.Parameter(torch.randn(1))
        self.register_buffer("b12", torch.randn(4, 3, 1))
        self.fc20 = nn.Linear(6, 6, bias=False)
    def forward(self, x1):
        v1 = self.fc0(x1)
        v3 = torch.add(v1, self.p2, alpha=2)
        v5 = v3
        x1.div_(2.0)
        v6 = x1.reshape(4, 3, 1)
        v7 = v5
        v8 = v7
        v11 = F.linear(v6, self.p9, self.p10)
        v13 = torch.add(v11, self.b12, alpha=0.5)
        v14 = torch.relu(v13)
        v21 = self.fc20(v8)
        v23 = v21
        v24 = v23
        return (v24, v7, v14,)
"""),
    # seed 20261124, program 2047: a fused eval-mode BN chain's running_var, written after it by a training BatchNorm that shares it: the chain stays unfused.
    case("running_var_written_under_another_name", [[4, 3, 5, 4], [4], [4, 3, 5, 4]], 2047, {}, """\
        self.register_buffer("rm0", torch.zeros(3))
        self.register_buffer("rv1", torch.ones(3))
        self.p2 = nn.Parameter(torch.randn(3))
        self.p3 = self.p2
        self.bn9 = nn.BatchNorm2d(3)
        self.bn9.running_var = self.rv1
    def forward(self, x0, x1, x2):
        v4 = F.batch_norm(x0, self.rm0, self.rv1, self.p2, self.p3, False, 0.1, 1e-05)
        v5 = v4 + x1
        v6 = v5 / 3.0
        v8 = v6 * torch.sigmoid(v6)
        v10 = self.bn9(x2)
        v17 = v8
        v18 = v17
        return v18
"""),
    # seed 20261124, program 1532: eager's eval-mode batch_norm double backward with weight=None gives
    # half the bias's second derivative; the fused op gives the one central differences show.
    case("double_backward_original_wrong", [[3, 6]], 1532, {}, """\
        self.p0 = nn.Parameter(torch.randn(3, 6))
        self.nb1 = None
        self.bn9 = nn.BatchNorm1d(3, momentum=0.5)
        self.register_buffer("rm14", torch.zeros(3))
        self.p16 = self.bn9.bias
    def forward(self, x0):
        v2 = F.linear(x0, self.p0, self.nb1)
        v10 = self.bn9(v2)
        v11 = v10
        v12 = torch.div(v11, 2.0, rounding_mode='floor')
        v13 = v12
        v15 = F.batch_norm(v13, self.rm14, self.bn9.running_var, None, self.bn9.weight, False, 0.1, 1e-05)
        v17 = torch.add(v15, self.p16, alpha=1)
        v18 = v17 / -1.5
        v19 = F.silu(v18)
        return v19
"""),
]

test_optimize_keeps_meaning = keeps_meaning_test(CASES)


def _source(case_id):
    return next(c.values for c in CASES if c.id == case_id)


def _frozen_from(source, fault=""):
    """An optimize that freezes, as torch does, a module scripted from
    `source` with `fault` appended to its forward's return expression and
    the state of the module given."""

    lines = source.splitlines(True)
    at = max(i for i, line in enumerate(lines) if line.strip().startswith("return "))
    lines[at] = lines[at].rstrip("\n") + fault + "\n"
    variant = "".join(lines)

    def optimize(module, freeze, preserved):
        assert freeze
        dtype = next(iter(module.state_dict().values())).dtype
        result = torch.jit.script(fuzz_pass._to_dtype(fuzz_pass.load_class(variant)(), dtype).eval())
        result.load_state_dict(module.state_dict())
        with torch.jit.optimized_execution(True):
            return torch.jit._recursive.wrap_cpp_module(torch._C._freeze_module(result._c, list(preserved)))

    return optimize


def test_frozen_like_torchs_own_frozen_original_passes(monkeypatch):
    # NB: the control of the next test; torch's own freezing differs from
    # the original here.
    source, shapes, seed, _ = _source("frozen_training_bn_on_a_shared_buffer_dead")
    monkeypatch.setattr(fuzz_modes, "_optimize", _frozen_from(source))
    outcome = fuzz_pass.check_source(source, shapes, seed, dtypes=("float64",), modes=("frozen",), round_trip=False)
    assert outcome.failures == [] and outcome.frozen_alike == 1


def test_frozen_unlike_torchs_own_frozen_original_fails(monkeypatch):
    source, shapes, seed, _ = _source("frozen_training_bn_on_a_shared_buffer_dead")
    monkeypatch.setattr(fuzz_modes, "_optimize", _frozen_from(source, " * 1.001"))
    outcome = fuzz_pass.check_source(source, shapes, seed, dtypes=("float64",), modes=("frozen",), round_trip=False)
    assert outcome.failures and outcome.failures[0].startswith("float64 frozen: output 0: max |diff|"), outcome.failures
    assert outcome.frozen_alike == 0 and outcome.frozen_torch_differs == 0


def test_frozen_change_without_a_training_batch_norm_fails(monkeypatch):
    # NB: the "no reference" verdict needs a batch_norm that may train in a
    # frozen graph; an eval-only program whose frozen module differs fails.
    source = """\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn0 = nn.BatchNorm1d(4)
    def forward(self, x0):
        return self.bn0(x0) * 2.0
"""
    monkeypatch.setattr(fuzz_modes, "_optimize", _frozen_from(source, " * 1.001"))
    outcome = fuzz_pass.check_source(source, [[3, 4]], 5, dtypes=("float64",), modes=("frozen",), round_trip=False)
    assert outcome.failures and outcome.frozen_alike == 0 and outcome.frozen_torch_differs == 0


def _frozen(source):
    cls = fuzz_pass.load_class(source)
    with torch.jit.optimized_execution(True):
        return torch.jit._recursive.wrap_cpp_module(
            torch._C._freeze_module(torch.jit.script(cls().eval())._c, []))


def test_trains_batch_norm():
    trains = _frozen("""\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rm", torch.zeros(4))
        self.register_buffer("rv", torch.ones(4))
    def forward(self, x0):
        return F.batch_norm(x0, self.rm, self.rv, None, None, True, 0.1, 1e-05)
""")
    evaluates = _frozen("""\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(4)
    def forward(self, x0):
        return self.bn(x0)
""")
    assert fuzz_modes._trains_batch_norm(trains)
    assert not fuzz_modes._trains_batch_norm(evaluates)


def test_autocast_gradient_change_fails(monkeypatch):
    # 5% more gradient under autocast only, values unchanged: beyond the
    # backward's rounding spread (the weights' perturbation moves nothing
    # by 5%).
    from test_fuzz_modes import SHAPES, program, stand_in

    fault = " + 0.05 * (v2 - v2.detach()).sum() * float(self.fc1(x0).dtype == torch.bfloat16)"
    monkeypatch.setattr(fuzz_modes, "_optimize", stand_in(program(fault=fault)))
    failures = fuzz_pass.check_source(program(), SHAPES, 3, dtypes=("float64", "float32"), modes=("autocast",)).failures
    assert failures and all(f.startswith("float32 autocast ") for f in failures), failures
    assert any(": grad of " in f for f in failures), failures


def test_double_backward_wrong_in_both_fails(monkeypatch):
    # NB: the original's second derivative is wrong here (the case above);
    # an optimized module that is wrong too (another second derivative,
    # same values and gradients) is not excused by central differences.
    from test_fuzz_modes import stand_in

    source, shapes, seed, _ = _source("double_backward_original_wrong")
    lines = source.splitlines(True)
    lines[-1] = lines[-1].rstrip("\n") + " + 0.5 * (v19 - v19.detach()) ** 2\n"
    monkeypatch.setattr(fuzz_modes, "_optimize", stand_in("".join(lines)))
    outcome = fuzz_pass.check_source(source, shapes, seed, dtypes=("float64",), modes=("double_backward",))
    assert outcome.failures and outcome.double_backward_original_wrong == 0, outcome.failures
    assert all(": grad of the penalty w.r.t. " in f for f in outcome.failures), outcome.failures


def test_double_backward_original_wrong_is_counted(monkeypatch):
    from test_fuzz_modes import stand_in

    source, shapes, seed, _ = _source("double_backward_original_wrong")
    # NB: the stand-in is the original itself, with the true second
    # derivative: its eval-mode batch_norm with an explicit weight of ones.
    fixed = source.replace("None, self.bn9.weight, False", "torch.ones_like(self.bn9.weight), self.bn9.weight, False")
    assert fixed != source
    monkeypatch.setattr(fuzz_modes, "_optimize", stand_in(fixed))
    outcome = fuzz_pass.check_source(source, shapes, seed, dtypes=("float64", "float32"), modes=("double_backward",))
    assert outcome.failures == [] and outcome.double_backward_original_wrong == 2


# Fuzz seed 20261252, program 879: x / x is 1 everywhere, so the circular
# conv's output is constant per channel and the training BatchNorm after it
# normalizes its mean's rounding by up to 1 / sqrt(eps).  In channels-last
# (the layout the pass gives the conv) ATen's CPU BatchNorm rounds that mean
# otherwise: the optimized output was 4.6e-5 from the original's against a
# 2e-5 bound, and no perturbation of the original's state moves its own
# result (it stays exact).  The original run with its 4-d parameters
# channels-last moves as far (judge._layout_spread).
BN_OF_A_PER_CHANNEL_CONSTANT = """\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rm6", torch.zeros(2))
        self.register_buffer("rv7", torch.ones(2))
        self.p8 = nn.Parameter(torch.randn(2))
        self.p9 = nn.Parameter(torch.randn(2))
        self.conv16 = nn.Conv2d(2, 2, 2, stride=1, padding=1, dilation=1, groups=1, bias=True, padding_mode='circular')
        self.bn18 = nn.BatchNorm2d(2, momentum=None)
        self.fc23 = nn.Linear(5, 5, bias=True)
    def forward(self, x0):
        v10 = F.batch_norm(x0, self.rm6, self.rv7, self.p8, self.p9, False, 0.3, 1e-05)
        v12 = v10 / v10
        v17 = self.conv16(v12)
        v19 = self.bn18(v17)
        return self.fc23(v19)
"""


def test_channels_last_rounding_of_a_batch_norm_of_a_constant_passes():
    outcome = fuzz_pass.check_source(BN_OF_A_PER_CHANNEL_CONSTANT, [[4, 2, 5, 4]], 879, dtypes=("float32",),
                                     modes=("train",), round_trip=False, channels_last="channels_last")
    assert outcome.failures == [] and outcome.within_spread >= 1, (outcome.failures, outcome.within_spread)


def test_channels_last_change_beyond_the_layouts_rounding_fails(monkeypatch):
    # NB: the same program, whose channels-last optimized module is 0.1 %
    # off: more than the original's own layout change moves it.
    from test_fuzz_modes import stand_in

    lines = BN_OF_A_PER_CHANNEL_CONSTANT.splitlines(True)
    lines[-1] = lines[-1].rstrip("\n") + " * 1.001\n"
    faulty, real = stand_in("".join(lines)), fuzz_modes._optimize

    def optimize(module, freeze, preserved, layout="auto"):
        return faulty(module, freeze, preserved) if layout == "channels_last" else real(module, freeze, preserved)

    monkeypatch.setattr(fuzz_modes, "_optimize", optimize)
    failures = fuzz_pass.check_source(BN_OF_A_PER_CHANNEL_CONSTANT, [[4, 2, 5, 4]], 879, dtypes=("float32",),
                                      modes=("train",), round_trip=False, channels_last="channels_last").failures
    assert failures and all(f.startswith("float32 channels_last+inputs train step ") for f in failures), failures
