"""bench/batch_norm_shapes.py: it refuses to run without CUDA, with the
reason; on CUDA one shape's row has both ways' times and their ratios."""

import json

import pytest
import torch
from bench_scripts import assert_refuses_without_cuda, load_bench


def load():
    return load_bench("batch_norm_shapes")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_refuses_without_cuda(capsys, tmp_path):
    assert_refuses_without_cuda(load().main, capsys, tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
@pytest.mark.parametrize("chain, channels_last", [("swish", False), ("silu", False), ("silu", True)])
def test_one_shape_on_cuda(chain, channels_last):
    import torchfuse  # noqa: F401

    row = load().measure((64, 32, 4, 4), torch.float16, chain, channels_last)
    assert row.get("channels_last", False) == channels_last
    for k in ("fused_fwd_us", "eager_fwd_us", "fused_fwdbwd_us", "eager_fwdbwd_us", "floor_fwd_us"):
        assert row[k] > 0, (k, row)
    assert row["fwd_speedup"] == pytest.approx(row["eager_fwd_us"] / row["fused_fwd_us"])
    assert json.loads(json.dumps(row)) == row
