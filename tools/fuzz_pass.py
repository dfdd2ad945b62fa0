#!/usr/bin/env python3
"""Differential fuzzer for torchfuse.optimize: the command line of the
package tools/fuzz/ (see its docstring, and docs/reliability.md).

    tools/fuzz_pass.py --programs N --seed S [--start K] [--emit-regressions DIR]
                       [--modes train,eval,frozen,autocast,double_backward]
                       [--features tied,exported|none]

As a module (`import fuzz_pass` with tools/ on sys.path, as the tests and
the regression files it writes do) it offers the names of the package's
modules, private ones included; to replace one for the package itself
(a stand-in for torchfuse.optimize, say), patch it where it is defined:
`fuzz.modes._optimize`.
"""

import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fuzz  # noqa: E402
from fuzz import cli, judge, modes, program, report, shrink  # noqa: E402

for _module in (program, judge, modes, shrink, report, cli):
    globals().update({k: v for k, v in vars(_module).items()
                      if not k.startswith("__") and not isinstance(v, types.ModuleType)})
del _module

if __name__ == "__main__":
    sys.exit(cli.main())
