"""Shrinking: a failing program simplified, statement by statement,
while it still fails."""

import dataclasses
import time
from typing import Tuple


from .modes import Invalid, check_program
from .program import Program, Stmt


def _variants(stmts: Tuple[Stmt, ...]):
    """Programs one step simpler: a statement dropped, replaced by one of its
    alternatives, or simplified inside a block."""
    for i in range(len(stmts)):
        yield stmts[:i] + stmts[i + 1:]
    for i, s in enumerate(stmts):
        for alt in s.alts:
            yield stmts[:i] + alt + stmts[i + 1:]
        for bi, block in enumerate(s.blocks):
            for vb in _variants(block):
                blocks = list(s.blocks)
                blocks[bi] = vb
                yield stmts[:i] + (dataclasses.replace(s, blocks=tuple(blocks), alts=()),) + stmts[i + 1:]


def _candidates(prog: Program):
    for i in range(len(prog.returns)):
        if len(prog.returns) > 1:
            yield dataclasses.replace(prog, returns=prog.returns[:i] + prog.returns[i + 1:])
    for body in _variants(prog.body):
        yield dataclasses.replace(prog, body=body)
    for name in prog.inits:
        if ".tie" in name:  # a tie dropped
            yield dataclasses.replace(prog, inits={n: line for n, line in prog.inits.items() if n != name})
    if prog.export:
        yield dataclasses.replace(prog, export=None, preserved=())
        if prog.preserved:
            yield dataclasses.replace(prog, preserved=())
        body, returns = prog.export
        for i in range(len(returns)):
            if len(returns) > 1:
                yield dataclasses.replace(prog, export=(body, returns[:i] + returns[i + 1:]))
        for variant in _variants(body):
            yield dataclasses.replace(prog, export=(variant, returns))


def _size(prog: Program) -> int:
    return len(prog.source())


def shrink(prog: Program, seed: int, dtypes, modes, budget_s: float = 120.0,
           require: str = "", device: str = "cpu") -> Program:
    """Greedily simplifies `prog` while check_program still fails in the
    given dtypes and modes, with a failure message containing `require`
    (e.g. AFTER_SAVE_LOAD, so that a failure after save/load does not
    shrink into an in-memory one)."""
    deadline = time.monotonic() + budget_s
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        for cand in _candidates(prog):
            if time.monotonic() > deadline:
                break
            if _size(cand) >= _size(prog):
                continue
            try:
                out = check_program(cand, seed, dtypes=dtypes, modes=modes, stop_early=True, device=device)
            except Invalid:
                continue
            except Exception:  # noqa: BLE001  (e.g. a shape error in the candidate)
                continue
            if any(require in f for f in out.failures):
                prog, improved = cand, True
                break
    return prog
