"""python -m torchfuse.export_cli: the torchfuse fusions for torch.export
programs, and their AOTInductor packages.

    python -m torchfuse.export_cli IN.pt2 OUT.pt2 [--aoti] [--passes a,b]
                                   [--check-accuracy [--rtol R --atol A]] [-q]

IN.pt2 is an ExportedProgram saved with torch.export.save.  OUT.pt2 is the
rewritten program (torch.export.save), or with --aoti its AOTInductor package
(torch._inductor.aoti_compile_and_package), which C++ loads with
torch::inductor::AOTIModelPackageLoader in a process that links
torchfuse::ops (examples/aoti_inference).

Exit codes: 0 success; 1 IN could not be loaded, rewritten, compiled or OUT
written; 2 bad arguments; 3 --check-accuracy found the rewritten program's
outputs differ from the original's on the program's example inputs.
"""

import argparse
import os
import sys
from typing import List, Optional

PROG = "python -m torchfuse.export_cli"


class _Failure(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="The torchfuse fusions for a torch.export program, and its AOTInductor package.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="exit codes: 0 success; 1 load, rewrite, compile or write failed; 2 bad arguments; "
               "3 --check-accuracy found a difference")
    p.add_argument("input", help="an ExportedProgram saved with torch.export.save (.pt2)")
    p.add_argument("output", help="where to write the rewritten program, or with --aoti its package (.pt2)")
    p.add_argument("--aoti", action="store_true",
                   help="write an AOTInductor package (aoti_compile_and_package) instead of the program")
    p.add_argument("--passes", help="comma-separated pass names (default: the fusions on by default)")
    p.add_argument("--check-accuracy", action="store_true",
                   help="run the original and the rewritten program on the program's example inputs and "
                        "compare their outputs")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance of --check-accuracy")
    p.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance of --check-accuracy")
    p.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    return p


def _load(path: str):
    import torch

    if not os.path.isfile(path):
        raise _Failure(f"cannot read {path}: no such file")
    try:
        return torch.export.load(path)
    except Exception as e:  # NB: torch raises several types for a wrong file
        raise _Failure(f"{path} is not a program saved with torch.export.save "
                       f"(a TorchScript model goes to optimize-model): {type(e).__name__}: {e}") from None


def _check(original, rewritten, rtol: float, atol: float) -> str:
    import torch

    inputs = original.example_inputs
    if inputs is None:
        raise _Failure("--check-accuracy: the program has no example inputs; export it with "
                       "torch.export.export(model, args) and save it with torch.export.save", 2)
    args, kwargs = inputs
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(original.module()(*args, **kwargs))
        got = torch.utils._pytree.tree_leaves(rewritten.module()(*args, **kwargs))
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        if not isinstance(b, torch.Tensor):
            continue
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as e:
            raise _Failure(f"--check-accuracy: output {i} differs from the original's: {e}", 3) from None
        if b.numel():
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    return f"accuracy: outputs match (max abs difference {worst:.3g}, rtol {rtol:g}, atol {atol:g})"


def run(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    import torchfuse
    import torchfuse.fx as tfx

    passes = None
    if args.passes is not None:
        passes = [p for p in args.passes.split(",") if p]
        known = torchfuse.pass_names()
        unknown = [p for p in passes if p not in known]
        if unknown:
            raise _Failure(f"unknown pass name(s) {unknown} in --passes; expected some of {known}", 2)
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise _Failure(f"cannot write {args.output}: directory {out_dir} does not exist")
    original = _load(args.input)
    try:
        rewritten = tfx.optimize_exported(original, passes=passes)
    except Exception as e:
        raise _Failure(f"rewriting {args.input} failed: {type(e).__name__}: {e}") from None
    lines = ["fused: " + ", ".join(f"{k}={v}" for k, v in tfx.report(rewritten).items())]
    if args.check_accuracy:
        lines.append(_check(original, rewritten, args.rtol, args.atol))
    try:
        if args.aoti:
            torch._inductor.aoti_compile_and_package(rewritten, package_path=args.output)
        else:
            torch.export.save(rewritten, args.output)
    except Exception as e:
        what = "compiling the AOTInductor package" if args.aoti else "saving the program"
        raise _Failure(f"{what} {args.output} failed: {type(e).__name__}: {e}") from None
    lines.append(f"wrote {'AOTInductor package' if args.aoti else 'program'} {args.output}")
    if not args.quiet:
        print("\n".join(lines))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    try:
        return run(argv)
    except _Failure as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
