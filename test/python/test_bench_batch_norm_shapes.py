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


def _row(shape, dtype, speedup, **kw):
    return dict({"shape": list(shape), "dtype": dtype, "floor_fwd_us": 1.0, "fused_fwd_us": 2.0, "eager_fwd_us": 3.0,
                 "fwd_speedup": 1.5, "fused_fwdbwd_us": 4.0, "eager_fwdbwd_us": 4.0 * speedup,
                 "fwdbwd_speedup": speedup}, **kw)


def test_report_section_and_chart_of_a_results_file(tmp_path):
    """bench/report.py's section: the latest run of each chain (a file of
    runs, the swish chain's recorded without a `chain`), a row per shape,
    dtype and layout; and its chart."""
    mod = load()
    data = {"gpu": "G", "torch": "2.11.0", "runs": [
        {"commit": "old", "date": "d0", "command": "python bench/batch_norm_shapes.py",
         "rows": [_row((8, 4), "float32", 9.0)]},
        {"commit": "new", "date": "d1", "command": "python bench/batch_norm_shapes.py",
         "rows": [_row((8, 4), "float32", 1.25)]},
        {"commit": "cl", "date": "d2", "command": "python bench/batch_norm_shapes.py --chain silu",
         "rows": [_row((2, 3, 4, 4), "float16", 0.5, channels_last=True)]}]}
    text = mod.markdown_section(data, "chart.png")
    assert "| (8, 4) | float32 | – | 2.0 | 3.0 | 1.50 | 1.0 | 4.0 | 5.0 | 1.25 |" in text.splitlines()
    assert "9.00" not in text and "commit `new`" in text
    assert "| (2, 3, 4, 4) | float16 | CL | 2.0 | 3.0 | 1.50 | 1.0 | 4.0 | 2.0 | 0.50 |" in text.splitlines()
    assert text.index("x*sigmoid(x)") < text.index("silu of a conv output") and "![" in text
    one = {"gpu": "G", "torch": "2.11.0", "commit": "c", "date": "d", "command": "c", "chain": "silu",
           "rows": [_row((2, 3, 4, 4), "bfloat16", 2.0, channels_last=False)]}
    assert "| (2, 3, 4, 4) | bfloat16 | NCHW |" in mod.markdown_section(one)
    png = tmp_path / "bn.png"
    assert mod.chart(data, str(png)) and png.stat().st_size > 0
