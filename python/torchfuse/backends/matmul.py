"""Choices of the cuBLASLt matmuls behind custom_linear_add_relu,
process-wide (torchfuse::backends::matmul() in C++; docs/options.md).

    torchfuse.backends.matmul.autotune  True (default) or False

With autotune, the first call of each problem times cuBLASLt's candidate
algorithms and keeps the fastest; without, the heuristic's first choice
runs, untimed.  Plans are kept per problem and setting.

    with torchfuse.backends.matmul.flags(autotune=False):
        ...
"""

import sys

from torchfuse import _C
from torchfuse.backends._options import Option, boolean, install

install(sys.modules[__name__], {
    "autotune": Option("autotune", _C._get_matmul_autotune, _C._set_matmul_autotune, boolean),
})
