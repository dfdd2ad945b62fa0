#!/usr/bin/env python3
"""optimize-model as `pip install .` installs it: the environment's bin/ gets
this launcher, which runs the binary that the torchfuse package holds
(torchfuse/bin/optimize-model).  `make build` and `cmake --install` put the
binary itself on the path instead.
"""

# NB: not a console-script entry point: that would import the torchfuse
# package, and with it torch (seconds), before the binary loads torch's C++
# libraries itself.  find_spec locates a package without importing it.
import importlib.util
import os
import sys


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.stderr.write(f"optimize-model: the {name} package is not installed for {sys.executable}\n")
        sys.exit(1)
    return list(spec.submodule_search_locations)[0]


def main() -> None:
    binary = os.path.join(_package_dir("torchfuse"), "bin", "optimize-model")
    if not os.access(binary, os.X_OK):
        sys.stderr.write(f"optimize-model: {binary} is missing; reinstall torchfuse\n")
        sys.exit(1)
    # NB: the binary's RPATH finds a torch beside torchfuse in site-packages;
    # this finds the torch Python would import wherever it is (say, the
    # packages of another environment that this one extends).
    env = dict(os.environ)
    torch_lib = os.path.join(_package_dir("torch"), "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (torch_lib, env.get("LD_LIBRARY_PATH")) if p
    )
    os.execve(binary, [binary, *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
