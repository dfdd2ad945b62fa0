"""The command line (tools/fuzz_pass.py, python -m fuzz)."""

import argparse
import time
from typing import List, Sequence

import torch

import fuzz

from .modes import MODES
from .program import FEATURES, generate
from .report import print_summary, run


def _names(allowed: Sequence[str]):
    def parse(text: str) -> List[str]:
        names = [] if text == "none" else [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; expected a comma-separated subset of "
                                             f"{','.join(allowed)}")
        return names
    return parse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=fuzz.__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=100, help="how many programs to check")
    ap.add_argument("--seed", type=int, default=0, help="generator seed")
    ap.add_argument("--start", type=int, default=0, help="index of the first program")
    ap.add_argument("--emit-regressions", metavar="DIR", help="write a pytest file per failure to DIR")
    ap.add_argument("--no-shrink", action="store_true", help="report failures unshrunk")
    ap.add_argument("--round-trip-every", type=int, default=1, metavar="K",
                    help="also check the optimized modules after torch.jit.save/load in programs "
                         "whose index is a multiple of K (default 1: all; 0: none)")
    ap.add_argument("--modes", default=",".join(MODES), type=_names(MODES),
                    help="comma-separated modes to check (default: all, %(default)s)")
    ap.add_argument("--features", default=",".join(FEATURES), type=_names(FEATURES),
                    help="comma-separated program features to draw, or 'none' (default: all, %(default)s); "
                         "without them a program is the one drawn before they existed")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the modules and inputs live (default cpu; cuda checks the ops' CUDA kernels, "
                         "with TF32 off)")
    ap.add_argument("--show", action="store_true", help="print the programs' source and exit")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: expected a CUDA device, but torch.cuda.is_available() is False")
    if args.show:
        for index in range(args.start, args.start + args.programs):
            print(f"# program {index}\n" + generate(args.seed, index * 100, args.features).source())
        return 0
    t0 = time.monotonic()
    s = run(args.programs, args.seed, args.start, not args.no_shrink, args.emit_regressions, args.verbose,
            round_trip_every=args.round_trip_every, modes=args.modes, features=args.features, device=args.device)
    print_summary(s, args.seed, args.start, args.programs, time.monotonic() - t0, args.modes, args.features)
    return 1 if s.failed else 0
