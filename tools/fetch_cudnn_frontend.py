#!/usr/bin/env python3
"""Fetches the header-only cudnn-frontend at a pinned version from the package
registry (PyPI's nvidia-cudnn-frontend wheel, through pip and its
configuration) and unpacks its include/ into DEST, for CMakeLists.txt.

    fetch_cudnn_frontend.py VERSION DEST

A machine without network takes the wheel from the source tree's
.deps/wheels/ instead, where one was put (`pip download --no-deps
nvidia-cudnn-frontend==VERSION -d .deps/wheels` elsewhere; bench/gpu_check.sh).
DEST/include/cudnn_frontend.h exists afterwards, or the script exits non-zero
with one message that says what failed.  DEST appears whole or not at all
(unpacked beside it, then renamed), so a fetch that fails half-way leaves
nothing behind that a later build would take for the headers."""

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "nvidia-cudnn-frontend"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fail(message: str) -> None:
    sys.exit(f"fetch_cudnn_frontend: {message}")


def main() -> None:
    if len(sys.argv) != 3:
        fail(f"expected arguments VERSION DEST, got {sys.argv[1:]}")
    version, dest = sys.argv[1], os.path.abspath(sys.argv[2])
    if os.path.isfile(os.path.join(dest, "include", "cudnn_frontend.h")):
        return
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".cudnn-frontend-", dir=parent)
    try:
        # NB: any of the package's wheels holds the same headers; pip picks
        # one for this interpreter and honours the machine's index settings.
        wheels = glob.glob(os.path.join(ROOT, ".deps", "wheels", f"{PACKAGE.replace('-', '_')}-{version}-*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--dest", work, f"{PACKAGE}=={version}"]
        result = subprocess.run(cmd, capture_output=True, text=True) if not wheels else None
        wheels = wheels or glob.glob(os.path.join(work, "*.whl"))
        if result is not None and (result.returncode != 0 or not wheels):
            fail(f"could not download {PACKAGE}=={version} with `{' '.join(cmd)}`: "
                 f"{(result.stderr or result.stdout).strip()[-600:] or 'no wheel'}; set the CMake variable "
                 "TORCHFUSE_CUDNN_FRONTEND_INCLUDE_DIR to an include/ directory holding cudnn_frontend.h instead")
        unpacked = os.path.join(work, "unpacked")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.startswith("include/")]
            if "include/cudnn_frontend.h" not in members:
                fail(f"{os.path.basename(wheels[0])} has no include/cudnn_frontend.h")
            wheel.extractall(unpacked, members)
        try:
            os.rename(unpacked, dest)
        except OSError:
            # another build unpacked the same version first
            if not os.path.isfile(os.path.join(dest, "include", "cudnn_frontend.h")):
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
