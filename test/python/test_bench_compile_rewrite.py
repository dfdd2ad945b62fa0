"""bench/compile_rewrite.py: it refuses bad arguments and a machine without
CUDA, with the reason; on CUDA a small model's variants are compiled, each
with what it fused, and the measured backend's choice is recorded."""

import pytest
import torch
import torch.nn as nn
from bench_scripts import assert_refuses_without_cuda, load_bench

import torchfuse.fx


def load():
    return load_bench("compile_rewrite")


def test_refuses_unknown_models_and_dtypes(capsys, tmp_path):
    out = tmp_path / "r.json"
    assert load().main(["--models", "resnet50,bert", "--dtypes", "fp8", "--output", str(out)]) == 2
    assert "unknown model or dtype ['bert', 'fp8']" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_refuses_without_cuda(capsys, tmp_path):
    assert_refuses_without_cuda(load().main, capsys, tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")
def test_variants_of_a_small_model_on_cuda():
    import torchfuse  # noqa: F401

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 1), nn.Hardswish(),
                          nn.Flatten(), nn.Linear(8 * 16 * 16, 16), nn.ReLU()).cuda().eval()
    x = torch.randn(2, 3, 16, 16, device="cuda")
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        variants, choices = load().compiled_variants(model, x)
        assert set(variants) == {"compile", "rewrite", "rewrite:all", "rewrite:conv_add_act", "rewrite:linear_act",
                                 "measured"}, set(variants)
        # conv_add_act only where named: Inductor's defaults leave it out
        fused = {v: {k: n for k, n in f.items() if n} for v, (_, f) in variants.items()}
        assert fused["rewrite"] == fused["measured"] == fused["rewrite:linear_act"] == {"linear_act": 1}, fused
        assert fused["rewrite:all"] == {"linear_act": 1, **fused["rewrite:conv_add_act"]}, fused
        assert fused["rewrite:conv_add_act"]["conv_add_act"] >= 1, fused
        with torch.no_grad():
            for name, (fn, _) in variants.items():
                torch.testing.assert_close(fn(x), model(x), rtol=1e-4, atol=1e-4, msg=name)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old
    (choice,) = choices
    assert choice["calls"] == torchfuse.fx.TRIAL_CALLS and choice["chosen_fused"] in (True, False), choice
    assert len(choice["blocks_ms"]) == 2 * torchfuse.fx._PROTOCOL["blocks"], choice


def test_report_section_of_a_results_file(tmp_path):
    """bench/report.py's section: a row per variant with its ratio to
    Inductor alone, and the measured choice's blocks."""
    mod = load()
    data = {"gpu": "G", "torch": "2.11.0", "commit": "abc1234", "date": "2026-11-29T00:00", "command": "c",
            "not_run": ["resnet50/fp32"],
            "rows": [{"model": "m", "dtype": "fp16", "median_ms": {"compile": 2.0, "rewrite": 4.0},
                      "speedup_vs_compile": {"compile": 1.0, "rewrite": 0.5},
                      "fused": {"compile": {}, "rewrite": {"conv_add_act": 3}},
                      "measured_choices": [{"chosen_fused": False, "blocks_ms": [1.0, 2.0]}]}]}
    text = mod.markdown_section(data)
    assert "| m | fp16 | rewrite | conv_add_act 3 | 4.000 | 0.500× |" in text
    assert "| m | fp16 | False | 1.00, 2.00 |" in text and "Not run (budget): resnet50/fp32." in text
