"""python -m fuzz (from tools/): the fuzzer's command line, as tools/fuzz_pass.py."""

import sys

from .cli import main

sys.exit(main())
