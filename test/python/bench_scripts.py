"""Helpers for the tests of the bench scripts that time CUDA ops
(bench/batch_norm_shapes.py, bench/compile_rewrite.py)."""

import importlib.util
import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def load_bench(name: str):
    """bench/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(ROOT, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def assert_refuses_without_cuda(main, capsys, tmp_path) -> None:
    """main refuses to run where torch sees no CUDA device, says why, and
    writes no results file."""
    out = tmp_path / "r.json"
    assert main(["--output", str(out)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not out.exists()
