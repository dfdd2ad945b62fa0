"""Regression cases for the tests: programs written as Python source, each
with the shapes of its inputs, its check seed and the fused-node counts
expected, and the test that checks each with assert_keeps_meaning."""

from .modes import assert_keeps_meaning

# NB: every program's class starts so; a case writes what follows.
HEADER = """\
class Program(nn.Module):
    def __init__(self):
        super().__init__()
"""


def case(case_id: str, input_shapes, seed: int, fused, body: str, marks=()):
    """A pytest case of the program HEADER + `body` (the rest of __init__
    and the methods, indented as in the class); `marks` as pytest.param's
    (an xfail for a known failure)."""
    import pytest

    return pytest.param(HEADER + body, input_shapes, seed, fused, id=case_id, marks=marks)


def keeps_meaning_test(cases):
    """test_optimize_keeps_meaning, parametrized over `cases`: the fuzzer's
    full check of each program, with the fused counts it must show."""
    import pytest

    @pytest.mark.parametrize("source,input_shapes,seed,fused", cases)
    def test_optimize_keeps_meaning(source, input_shapes, seed, fused):
        assert_keeps_meaning(source, input_shapes, seed, fused)

    return test_optimize_keeps_meaning
