"""optimize-model never loses a file and never calls the user's input a bug.

- OUT.pt and --report may not name IN.pt or each other, by path, symlink or
  hard link: refused with exit 2 before anything is read or written.
- OUT.pt and --report may only be a missing path or a regular file (a symlink
  to one is written through and kept): anything else is refused with exit 6.
- An --input-shape that overflows int64 or does not fit in memory is the
  user's input: exit 2 with one line, never exit 1.

Every refusal is checked to leave the folder exactly as it was: the same
entries, bytes, inodes and modification times (a folder's own mtime aside
for refusals that come after the writability probe).
"""

import os
import re
import resource
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from test_cli import (
    EXIT_OK,
    EXIT_USAGE,
    EXIT_WRITE,
    LinearAddRelu,
    cli,  # noqa: F401  (fixture)
    run,
    save_scripted,
    torchfuse_ops_in,
)

OLD_BYTES = b"the user's previous file"


def snapshot(*roots, folder_mtimes=True):
    """Every entry under `roots`, not following symlinks: kind, inode, size,
    mtime, and the bytes of regular files or the target of links.  A folder's
    mtime changes when a file is made and removed in it: the writability
    probe, which runs after every check that needs no model."""
    state = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in [".", *dirnames, *filenames]:
                path = os.path.normpath(os.path.join(dirpath, name))
                st = os.lstat(path)
                mtime = st.st_mtime_ns if folder_mtimes or not stat.S_ISDIR(st.st_mode) else None
                entry = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, mtime)
                if stat.S_ISREG(st.st_mode):
                    entry += (Path(path).read_bytes(),)
                elif stat.S_ISLNK(st.st_mode):
                    entry += (os.readlink(path),)
                state[path] = entry
    return state


def one_error_line(proc):
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("optimize-model: "), lines[0]
    assert "Exception raised from" not in proc.stderr
    return lines[0]


def assert_refused_untouched(cli, args, code, pattern, roots):
    before = snapshot(*roots)
    proc = run(cli, *args)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    line = one_error_line(proc)
    assert re.search(pattern, line), line
    assert snapshot(*roots) == before, "a refused run changed the folder"
    return line


@pytest.fixture
def src(tmp_path):
    return save_scripted(LinearAddRelu(), tmp_path / "net.pt")


# ---- OUT.pt and --report must not name IN.pt or each other --------------------


def _same_path(t, src):
    return t / "out.pt", t / "out.pt"


def _same_path_existing(t, src):
    (t / "out.pt").write_bytes(OLD_BYTES)
    return t / "out.pt", t / "out.pt"


def _spelled_differently(t, src):
    (t / "sub").mkdir()
    return t / "out.pt", f"{t}/./sub/../out.pt"


def _symlink_to_out(t, src):
    (t / "out.pt").write_bytes(OLD_BYTES)
    (t / "report.json").symlink_to("out.pt")
    return t / "out.pt", t / "report.json"


def _out_is_symlink_to_report(t, src):
    (t / "report.json").write_bytes(OLD_BYTES)
    (t / "out.pt").symlink_to(t / "report.json")
    return t / "out.pt", t / "report.json"


def _hard_link_of_out(t, src):
    (t / "out.pt").write_bytes(OLD_BYTES)
    os.link(t / "out.pt", t / "report.json")
    return t / "out.pt", t / "report.json"


def _missing_through_symlinked_folder(t, src):
    (t / "d").mkdir()
    (t / "alias").symlink_to("d", target_is_directory=True)
    return t / "d" / "out.pt", t / "alias" / "out.pt"


REPORT_IS_OUTPUT = [
    ("same-path", _same_path),
    ("same-path-existing", _same_path_existing),
    ("spelled-differently", _spelled_differently),
    ("report-is-a-symlink-to-out", _symlink_to_out),
    ("out-is-a-symlink-to-report", _out_is_symlink_to_report),
    ("hard-link", _hard_link_of_out),
    ("missing-through-symlinked-folder", _missing_through_symlinked_folder),
]


@pytest.mark.parametrize("make", [m for _, m in REPORT_IS_OUTPUT],
                         ids=[i for i, _ in REPORT_IS_OUTPUT])
def test_report_that_is_the_output_is_refused(cli, tmp_path, src, make):
    out, report = make(tmp_path, src)
    assert_refused_untouched(
        cli, [src, out, "--report", report], EXIT_USAGE,
        r"^optimize-model: --report '.*' is the same file as OUT\.pt '.*'; expected a separate "
        r"file \(the report would replace the optimized model\)$",
        [tmp_path])


def _input_same_path(t, src):
    return src


def _input_symlink(t, src):
    (t / "link.pt").symlink_to(src.name)
    return t / "link.pt"


def _input_hard_link(t, src):
    os.link(src, t / "copy.pt")
    return t / "copy.pt"


INPUT_ALIASES = [
    ("same-path", _input_same_path),
    ("symlink", _input_symlink),
    ("hard-link", _input_hard_link),
]


@pytest.mark.parametrize("alias", [a for _, a in INPUT_ALIASES], ids=[i for i, _ in INPUT_ALIASES])
def test_output_that_is_the_input_is_refused(cli, tmp_path, src, alias):
    assert_refused_untouched(
        cli, [src, alias(tmp_path, src)], EXIT_USAGE,
        r"^optimize-model: OUT\.pt '.*' is the same file as IN\.pt '.*net\.pt'; expected a separate "
        r"file \(the input model would be replaced\)$",
        [tmp_path])


@pytest.mark.parametrize("alias", [a for _, a in INPUT_ALIASES], ids=[i for i, _ in INPUT_ALIASES])
def test_report_that_is_the_input_is_refused(cli, tmp_path, src, alias):
    assert_refused_untouched(
        cli, [src, tmp_path / "out.pt", "--report", alias(tmp_path, src)], EXIT_USAGE,
        r"^optimize-model: --report '.*' is the same file as IN\.pt '.*net\.pt'; expected a "
        r"separate file \(the input model would be replaced\)$",
        [tmp_path])


# ---- OUT.pt and --report: a missing path or a regular file, nothing else ------


def _folder(path):
    path.mkdir()
    return "a folder"


def _fifo(path):
    os.mkfifo(path)
    return "a FIFO"


def _char_device(path):
    try:
        # the null device's numbers: harmless even if something opened it
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs root (CAP_MKNOD)")
    return "a character device"


def _symlink_to_folder(path):
    (path.parent / "target_dir").mkdir()
    path.symlink_to("target_dir")
    return r"a symlink to a folder \('target_dir'\)"


def _symlink_to_fifo(path):
    os.mkfifo(path.parent / "target_fifo")
    path.symlink_to("target_fifo")
    return r"a symlink to a FIFO \('target_fifo'\)"


def _dangling_symlink(path):
    path.symlink_to("missing.pt")
    return r"a symlink to a missing file \('missing\.pt'\)"


def _symlink_loop(path):
    path.symlink_to(path.name)
    return rf"a symlink that cannot be followed \('{re.escape(path.name)}': .*\)"


NOT_REGULAR = [
    ("folder", _folder),
    ("fifo", _fifo),
    ("char-device", _char_device),
    ("symlink-to-folder", _symlink_to_folder),
    ("symlink-to-fifo", _symlink_to_fifo),
    ("dangling-symlink", _dangling_symlink),
    ("symlink-loop", _symlink_loop),
]


@pytest.mark.parametrize("which", ["OUT.pt", "--report"])
@pytest.mark.parametrize("make", [m for _, m in NOT_REGULAR], ids=[i for i, _ in NOT_REGULAR])
def test_a_path_that_is_not_a_regular_file_is_refused(cli, tmp_path, src, make, which):
    out = tmp_path / "out.pt"
    target = out if which == "OUT.pt" else tmp_path / "report.json"
    got = make(target)
    args = [src, out] + (["--report", target] if which == "--report" else [])
    assert_refused_untouched(
        cli, args, EXIT_WRITE,
        rf"^optimize-model: cannot write {re.escape(which)} '{re.escape(str(target))}': expected a "
        rf"regular file or a new path, got {got}$",
        [tmp_path])


def test_dev_null_is_refused_and_left_a_device(cli, tmp_path, src):
    dev_null = os.stat("/dev/null")
    assert stat.S_ISCHR(dev_null.st_mode)
    if os.geteuid() == 0:
        # NB: as root, a tool that does not refuse device nodes replaces
        # /dev/null for the whole machine.  Prove the refusal on a node of
        # our own first; only then hand it the real one.
        node = tmp_path / "null"
        _char_device(node)
        proc = run(cli, src, node)
        assert proc.returncode == EXIT_WRITE and stat.S_ISCHR(os.lstat(node).st_mode), (
            "a character device as OUT.pt is not refused; /dev/null not tried", proc.stderr)
    line = assert_refused_untouched(
        cli, [src, "/dev/null"], EXIT_WRITE,
        r"^optimize-model: cannot write OUT\.pt '/dev/null': expected a regular file or a new "
        r"path, got a character device$",
        [tmp_path])
    after = os.lstat("/dev/null")
    assert stat.S_ISCHR(after.st_mode), line
    assert (after.st_ino, after.st_rdev) == (dev_null.st_ino, dev_null.st_rdev)


@pytest.mark.parametrize("which", ["OUT.pt", "--report"])
def test_a_symlink_to_a_regular_file_is_written_through_and_kept(cli, tmp_path, src, which):
    # the target lives in another folder: the temporary file must go beside it
    (tmp_path / "store").mkdir()
    real = tmp_path / "store" / ("real.pt" if which == "OUT.pt" else "real.json")
    real.write_bytes(OLD_BYTES)
    link = tmp_path / ("out.pt" if which == "OUT.pt" else "report.json")
    link.symlink_to(os.path.relpath(real, tmp_path))
    out = link if which == "OUT.pt" else tmp_path / "out.pt"
    args = [src, out] + (["--report", link] if which == "--report" else [])

    proc = run(cli, *args)

    assert proc.returncode == EXIT_OK, proc.stderr
    assert link.is_symlink() and os.readlink(link) == os.path.relpath(real, tmp_path)
    assert real.is_file() and not real.is_symlink()
    if which == "OUT.pt":
        assert real.read_bytes()[:2] == b"PK"
        assert torchfuse_ops_in(real) == ["custom_linear_add_relu"]
    else:
        assert b'"fused"' in real.read_bytes()
    # no temporary file left in either folder
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(["net.pt", "out.pt", "store"] + (["report.json"] if which == "--report" else []))
    assert [p.name for p in (tmp_path / "store").iterdir()] == [real.name]


# ---- --input-shape: too large is the user's input, not a bug ------------------


def _limit_address_space(gib):
    limit = gib << 30
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _run_limited(cli, *args, gib=8):
    proc = subprocess.run(
        [str(cli), *map(str, args)], capture_output=True, text=True, timeout=300,
        preexec_fn=_limit_address_space(gib))
    # NB: on a GPU machine the CUDA driver cannot initialize within the
    # limit, and torch's device query warns about it on stderr (its own
    # "[W... CUDAFunctions.cpp" line, whatever CUDA_VISIBLE_DEVICES says).
    proc.stderr = "".join(
        line for line in proc.stderr.splitlines(keepends=True)
        if not re.match(r"\[W\d{4} [^\]]*CUDAFunctions\.cpp:\d+\] Warning: CUDA initialization", line))
    return proc


def _machine_bytes():
    """Memory and swap, as the tool's check reads them (sysinfo)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":")
        info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] + info["SwapTotal"]


def test_input_shape_that_overflows_int64(cli, tmp_path, src):
    shape = "99999999999x99999999999x6x6"
    assert_refused_untouched(
        cli, [src, tmp_path / "out.pt", "--check", "--input-shape", shape], EXIT_USAGE,
        rf"^optimize-model: --input-shape '{shape}': the input {shape} has more elements than "
        r"fit in int64 \(at most 9223372036854775807\)$",
        [tmp_path])


@pytest.mark.parametrize("dtype, per_element", [("float32", 4), ("float64", 8)])
def test_input_shape_larger_than_memory(cli, tmp_path, src, dtype, per_element):
    shape = "100000x4x600x600"
    need = 100000 * 4 * 600 * 600 * per_element
    before = snapshot(tmp_path, folder_mtimes=False)
    # NB: the address-space limit keeps a machine with this much memory from
    # actually filling it; the refusal is the same either way.
    proc = _run_limited(cli, src, tmp_path / "out.pt", "--check", "--input-shape", shape,
                        "--dtype", dtype)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    line = one_error_line(proc)
    assert re.search(
        rf"^optimize-model: --input-shape '{shape}' \({dtype}\): the inputs need {need} bytes, "
        r"which could not be allocated", line), line
    assert snapshot(tmp_path, folder_mtimes=False) == before


def test_inputs_that_cannot_be_allocated_are_the_users_input(cli, tmp_path, src):
    # 12 GiB of float32 inputs under an 8 GiB address-space limit: the
    # allocation itself fails, whatever the machine's memory.
    shape, need = "3x1024x1024x1024", 3 << 32
    if _machine_bytes() <= need:
        pytest.skip("this machine has less memory and swap than the 12 GiB the test asks for; "
                    "test_input_shape_larger_than_memory covers that refusal")
    before = snapshot(tmp_path, folder_mtimes=False)
    proc = _run_limited(cli, src, tmp_path / "out.pt", "--check", "--input-shape", shape, gib=8)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    line = one_error_line(proc)
    assert re.search(
        rf"^optimize-model: --input-shape '{shape}' \(float32\): the inputs need {need} bytes, "
        r"which could not be allocated on cpu: .*(allocate|memory)", line), line
    assert snapshot(tmp_path, folder_mtimes=False) == before


class FailsAfterFirstRun(torch.nn.Module):
    """Fails from its second forward on, as a model may that runs out of
    memory only once the allocator's cache is full."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("simulated: not enough memory")
        return torch.relu(self.fc(x) + x)


def test_original_model_failing_in_a_timed_run_is_the_users_input(cli, tmp_path):
    src = save_scripted(FailsAfterFirstRun(), tmp_path / "later.pt")
    out = tmp_path / "out.pt"
    proc = run(cli, src, out, "--check", "--input-shape", "2x16")
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    line = one_error_line(proc)
    assert re.search(r"^optimize-model: --input-shape '2x16' \(float32\) does not fit the model: "
                     r".*simulated: not enough memory", line), line
    assert not out.exists()
