"""End-to-end tests of the optimize-model command-line tool (CPU).

Each test scripts a small model, saves it, runs the CLI in a subprocess and
checks the exit code, the one-line error, what was written (or that nothing
was), and that the optimized model computes what the original does when
reloaded in a fresh process that only loads the ops library.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchfuse

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE, EXIT_LOAD, EXIT_OPTIMIZE, EXIT_CHECK, EXIT_WRITE = range(7)
REPO = Path(__file__).resolve().parents[2]


def _cli_path() -> Path:
    build = os.environ.get("TORCHFUSE_BUILD_DIR")
    if not build:
        pytest.skip("TORCHFUSE_BUILD_DIR is not set; source env.sh after `make build`")
    cli = Path(build) / "bin" / "optimize-model"
    if cli.exists():
        return cli
    # NB: the tool is built whenever the passes library is; a missing binary
    # next to a built passes library is a build bug, not a reason to skip.
    if list((Path(build) / "lib").glob("libtorchfuse_passes.so*")):
        pytest.fail(f"{cli} is missing although libtorchfuse_passes was built")
    pytest.skip(f"{cli} is not built: this build has no torchfuse_passes library yet")


@pytest.fixture(scope="module")
def cli():
    return _cli_path()


def run(cli, *args, timeout=300, env=None):
    # NB: no progress lines unless a test asks for them (env): on a loaded
    # machine a check outlasts the progress delay, and tests count stderr's lines
    if env is None:
        env = dict(os.environ, OPTIMIZE_MODEL_PROGRESS_AFTER_S="3600")
    return subprocess.run(
        [str(cli), *map(str, args)], capture_output=True, text=True, timeout=timeout,
        env=env,
    )


# ---- models -------------------------------------------------------------


class LinearAddRelu(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x) + x)


class ConvNet(torch.nn.Module):
    """conv->relu->add, batch_norm->add->div->swish, linear->add->relu, relu."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 8)
        self.skip = torch.nn.Linear(4 * 6 * 6, 8)

    def forward(self, x):
        y = torch.relu(self.conv(x)) + x
        t = (self.bn(y) + x) / 2.0
        z = t * torch.sigmoid(t)
        f = torch.flatten(z, 1)
        return torch.relu(torch.relu(self.fc(f) + self.skip(f)))


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.relu(self.fc(x) + y)


class LogNet(torch.nn.Module):
    """NaN on about half of random normal inputs."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(torch.log(x)) + x)


class SlowNet(torch.nn.Module):
    """Takes long enough on random 512x512 inputs for progress to show."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(512, 512)

    def forward(self, x):
        for _ in range(40):
            x = torch.relu(self.fc(x) + x) / 16.0
        return x


def save_scripted(module, path, train=False):
    torch.manual_seed(0)
    m = module.train() if train else module.eval()
    torch.jit.script(m).save(str(path))
    return path


@pytest.fixture
def linear_pt(tmp_path):
    return save_scripted(LinearAddRelu(), tmp_path / "linear.pt")


# ---- a fresh process that only loads the ops library ---------------------

_RELOAD = r"""
import sys, torch
torch.ops.load_library(sys.argv[1])
m = torch.jit.load(sys.argv[2])
inputs = torch.load(sys.argv[3])
with torch.no_grad():
    out = m(*inputs)
torch.save(out, sys.argv[4])
"""


def run_in_fresh_process(model_path, inputs, tmp_path):
    inputs_path = tmp_path / "inputs.pt"
    out_path = tmp_path / "fresh_out.pt"
    torch.save(list(inputs), inputs_path)
    proc = subprocess.run(
        [sys.executable, "-c", _RELOAD, torchfuse.library_path(), str(model_path),
         str(inputs_path), str(out_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return torch.load(out_path)


def torchfuse_ops_in(model_path):
    """The torchfuse op names in a saved model's forward graph."""
    graph = str(torch.jit.load(str(model_path)).graph)
    return sorted(set(re.findall(r"torchfuse::(custom_\w+)", graph)))


# ---- the happy paths ------------------------------------------------------


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "not-frozen"])
def test_optimized_model_matches_the_original_in_a_fresh_process(cli, tmp_path, freeze):
    src = save_scripted(ConvNet(), tmp_path / "net.pt")
    out = tmp_path / "net.opt.pt"
    report = tmp_path / "report.json"
    args = [src, out, "--report", report] + (["--freeze"] if freeze else [])
    proc = run(cli, *args)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stderr == ""

    fused = json.loads(report.read_text())["fused"]
    ops = torchfuse_ops_in(out)
    assert ops, "the optimized model has no torchfuse ops"
    for kind, count in fused.items():
        present = any(op.startswith(f"custom_{kind}") for op in ops)
        assert present == (count > 0), (kind, count, ops)

    x = torch.randn(2, 4, 6, 6)
    expected = torch.jit.load(str(src))(x)
    actual = run_in_fresh_process(out, [x], tmp_path)
    torch.testing.assert_close(actual, expected)


def test_prints_fused_chains_node_counts_and_time(cli, tmp_path, linear_pt):
    proc = run(cli, linear_pt, tmp_path / "out.pt", "--freeze")
    assert proc.returncode == EXIT_OK, proc.stderr
    text = proc.stdout
    assert re.search(r"linear_add_relu\s+1\b", text), text
    for kind in ("conv_relu_add", "batch_norm_add_div_swish", "relu"):
        assert re.search(rf"\b{kind}\s+\d+", text), text
    assert re.search(r"nodes: \d+ -> \d+", text), text
    assert re.search(r"time: [\d.]+ s", text), text


def test_report_json_has_the_same_content(cli, tmp_path, linear_pt):
    report_path = tmp_path / "report.json"
    proc = run(cli, linear_pt, tmp_path / "out.pt", "--freeze", "--report", report_path,
               "--check", "--input-shape", "3x16")
    assert proc.returncode == EXIT_OK, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["input"] == str(linear_pt)
    assert report["freeze"] is True and report["device"] == "cpu"
    assert report["channels_last_weights"] == 0  # no 2-d convolution
    assert report["fused"] == {
        "linear_add_relu": 1, "conv_relu_add": 0, "conv_act_max_pool": 0, "gate_mul": 0, "conv_add_act": 0,
        "conv_batch_norm_act": 0, "batch_norm_add_div_swish": 0, "linear_act": 0, "add_layer_norm": 0, "relu": 0,
    }
    assert report["nodes_before"] > report["nodes_after"] > 0
    assert report["time_s"]["total"] > 0
    check = report["check"]
    assert check["passed"] is True
    assert check["device"] == "cpu" and check["dtype"] == "float32"
    assert check["input_shapes"] == "3x16"
    assert check["max_abs_error"] <= check["atol"]
    assert check["original_ms"] > 0 and check["optimized_ms"] > 0
    # leaves no temporary files behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linear.pt", "out.pt", "report.json"]


def test_check_prints_errors_and_times(cli, tmp_path):
    src = save_scripted(TwoInputs(), tmp_path / "two.pt")
    proc = run(cli, src, tmp_path / "out.pt", "--check", "--input-shape=4x8,4x8",
               "--dtype", "float32", "--device", "cpu")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert re.search(r"max abs error \S+, max rel error \S+", proc.stdout), proc.stdout
    assert re.search(r"original\s+[\d.]+ ms/run", proc.stdout), proc.stdout
    assert re.search(r"optimized\s+[\d.]+ ms/run", proc.stdout), proc.stdout


def test_check_in_float64(cli, tmp_path):
    m = LinearAddRelu().double()
    src = save_scripted(m, tmp_path / "m64.pt")
    proc = run(cli, src, tmp_path / "out.pt", "--freeze", "--check", "--input-shape", "2x16",
               "--dtype", "float64")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "float64" in proc.stdout


def test_long_check_shows_progress(cli, tmp_path):
    src = save_scripted(SlowNet(), tmp_path / "slow.pt")
    # NB: progress starts after a delay; zero it so the test does not depend
    # on how fast this machine runs the model.
    env = dict(os.environ, OPTIMIZE_MODEL_PROGRESS_AFTER_S="0")
    proc = run(cli, src, tmp_path / "out.pt", "--check", "--input-shape", "512x512", env=env)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "optimize-model: checking: " in proc.stderr, proc.stderr


def test_short_check_shows_no_progress(cli, tmp_path):
    src = save_scripted(SlowNet(), tmp_path / "slow.pt")
    env = dict(os.environ, OPTIMIZE_MODEL_PROGRESS_AFTER_S="3600")
    proc = run(cli, src, tmp_path / "out.pt", "--check", "--input-shape", "512x512", env=env)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "checking:" not in proc.stderr, proc.stderr


def test_passes_selects_the_passes(cli, tmp_path):
    src = save_scripted(ConvNet(), tmp_path / "net.pt")
    out = tmp_path / "out.pt"
    report = tmp_path / "r.json"
    proc = run(cli, src, out, "--freeze", "--passes=relu", "--report", report)
    assert proc.returncode == EXIT_OK, proc.stderr
    data = json.loads(report.read_text())
    assert data["passes"] == ["relu"]
    assert data["fused"]["linear_add_relu"] == 0
    assert data["fused"]["conv_relu_add"] == 0
    assert data["fused"]["relu"] > 0
    assert torchfuse_ops_in(out) == ["custom_relu"]


def test_quiet_prints_nothing(cli, tmp_path, linear_pt):
    proc = run(cli, linear_pt, tmp_path / "out.pt", "-q")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_verbose_prints_the_optimized_graph(cli, tmp_path, linear_pt):
    proc = run(cli, linear_pt, tmp_path / "out.pt", "-v", "--freeze")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "torchfuse::custom_linear_add_relu" in proc.stdout


def test_replaces_an_existing_output(cli, tmp_path, linear_pt):
    out = tmp_path / "out.pt"
    out.write_bytes(b"old")
    proc = run(cli, linear_pt, out)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert out.read_bytes()[:2] == b"PK"  # a zip archive
    assert torchfuse_ops_in(out) == ["custom_linear_add_relu"]


def test_help_documents_options_and_exit_codes_and_matches_the_docs(cli):
    proc = run(cli, "--help")
    assert proc.returncode == EXIT_OK
    text = proc.stdout
    for option in ("--freeze", "--passes", "--check", "--input-shape", "--dtype", "--device",
                   "--report", "-v", "-q"):
        assert option in text
    for code in range(7):
        assert re.search(rf"^\s+{code}\s+\S", text, re.M), code
    docs = (REPO / "docs" / "cli.md").read_text()
    assert f"```\n{text}```" in docs, "docs/cli.md must repeat the --help text verbatim"


# ---- bad input: exit code, one clear line, nothing written ----------------


def _truncated(tmp_path, src):
    data = src.read_bytes()
    path = tmp_path / "truncated.pt"
    path.write_bytes(data[: len(data) // 2])
    return path


def _not_archive(tmp_path, src):
    path = tmp_path / "notes.pt"
    path.write_text("this is not a model\n")
    return path


def _state_dict(tmp_path, src):
    path = tmp_path / "state_dict.pt"
    torch.save(LinearAddRelu().state_dict(), path)
    return path


def _unwritable_dir(tmp_path):
    if os.geteuid() == 0:
        # NB: root writes into a read-only folder anyway; /sys refuses even root.
        probe = Path("/sys/torchfuse-probe")
        try:
            probe.touch()
        except OSError:
            return Path("/sys")
        probe.unlink()
        pytest.skip("no folder here refuses writes to root")
    d = tmp_path / "readonly"
    d.mkdir()
    d.chmod(0o555)
    return d


# (id, args builder, exit code, message pattern).  Builders get (tmp_path, src)
# and return the argument list; OUT is tmp_path/"out.pt" unless they say so.
BAD_INPUTS = [
    ("no-arguments", lambda t, s: [], EXIT_USAGE, r"missing arguments IN\.pt and OUT\.pt"),
    ("missing-out", lambda t, s: [s], EXIT_USAGE, r"missing argument OUT\.pt"),
    ("extra-argument", lambda t, s: [s, t / "out.pt", t / "x"], EXIT_USAGE, r"unexpected argument"),
    ("unknown-option", lambda t, s: [s, t / "out.pt", "--fast"], EXIT_USAGE,
     r"unknown option '--fast'"),
    ("missing-value", lambda t, s: [s, t / "out.pt", "--passes"], EXIT_USAGE,
     r"--passes needs a value"),
    ("unknown-pass", lambda t, s: [s, t / "out.pt", "--passes=linear_add_relu,fuse_all"],
     EXIT_USAGE, r"unknown pass 'fuse_all' in --passes; known passes: conv_relu_add, linear_add_relu, "),
    ("check-without-shape", lambda t, s: [s, t / "out.pt", "--check"], EXIT_USAGE,
     r"--check needs --input-shape"),
    ("shape-without-check", lambda t, s: [s, t / "out.pt", "--input-shape", "1x16"], EXIT_USAGE,
     r"--input-shape is only used with --check"),
    ("shape-does-not-parse", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "1x16x"],
     EXIT_USAGE, r"--input-shape '1x16x' does not parse"),
    ("shape-not-a-number", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "1xabc"],
     EXIT_USAGE, r"--input-shape '1xabc' does not parse: 'abc'"),
    ("shape-zero", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "0x16"],
     EXIT_USAGE, r"not a positive integer"),
    ("shape-does-not-fit", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "2x15"],
     EXIT_USAGE, r"--input-shape '2x15' \(float32\) does not fit the model: .*shapes cannot be multiplied"),
    ("too-many-inputs", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "2x16,2x16"],
     EXIT_USAGE, r"gives 2 input\(s\), but the model's forward takes 1 \(x\)"),
    ("dtype-does-not-fit", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "2x16",
                                         "--dtype", "float64"],
     EXIT_USAGE, r"\(float64\) does not fit the model"),
    ("unknown-dtype", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "2x16",
                                    "--dtype", "int8"], EXIT_USAGE, r"unknown --dtype 'int8'"),
    ("unknown-device", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "2x16",
                                     "--device", "tpu"], EXIT_USAGE, r"unknown --device 'tpu'"),
    ("bad-tolerance", lambda t, s: [s, t / "out.pt", "--check", "--input-shape", "2x16",
                                    "--rtol", "-1"], EXIT_USAGE, r"--rtol expects a non-negative number"),
    ("verbose-and-quiet", lambda t, s: [s, t / "out.pt", "-v", "-q"], EXIT_USAGE,
     r"-v and -q exclude each other"),
    ("missing-input", lambda t, s: [t / "absent.pt", t / "out.pt"], EXIT_LOAD,
     r"cannot read IN\.pt '.*absent\.pt': No such file or directory"),
    ("input-is-a-folder", lambda t, s: [t, t / "out.pt"], EXIT_LOAD, r"it is a folder"),
    ("not-an-archive", lambda t, s: [_not_archive(t, s), t / "out.pt"], EXIT_LOAD,
     r"cannot load '.*notes\.pt' as a TorchScript model: not a TorchScript archive"),
    ("truncated-archive", lambda t, s: [_truncated(t, s), t / "out.pt"], EXIT_LOAD,
     r"cannot load '.*truncated\.pt' as a TorchScript model: not a TorchScript archive, or a truncated one"),
    ("state-dict", lambda t, s: [_state_dict(t, s), t / "out.pt"], EXIT_LOAD,
     r"cannot load '.*state_dict\.pt' as a TorchScript model"),
    ("output-folder-missing", lambda t, s: [s, t / "nowhere" / "out.pt"], EXIT_WRITE,
     r"cannot write OUT\.pt '.*nowhere/out\.pt': folder '.*nowhere' does not exist"),
    ("output-parent-is-a-file", lambda t, s: [s, s / "out.pt"], EXIT_WRITE,
     r"cannot write OUT\.pt .*' is not a folder"),
    ("output-is-a-folder", lambda t, s: [s, t], EXIT_WRITE,
     r"cannot write OUT\.pt .*: expected a regular file or a new path, got a folder"),
    ("output-folder-not-writable", lambda t, s: [s, _unwritable_dir(t) / "out.pt"], EXIT_WRITE,
     r"cannot write OUT\.pt '.*out\.pt': folder '.*' is not writable"),
    ("report-folder-missing", lambda t, s: [s, t / "out.pt", "--report", t / "no" / "r.json"],
     EXIT_WRITE, r"cannot write --report '.*r\.json': folder '.*no' does not exist"),
]


@pytest.mark.parametrize("existing_out", [False, True], ids=["no-out", "existing-out"])
@pytest.mark.parametrize(
    "build_args, code, message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_input_fails_cleanly(cli, tmp_path, build_args, code, message, existing_out):
    src = save_scripted(LinearAddRelu(), tmp_path / "model.pt")
    out = tmp_path / "out.pt"
    if existing_out:
        out.write_bytes(b"previous result")
    args = build_args(tmp_path, src)
    before = {p.name for p in tmp_path.iterdir()}

    proc = run(cli, *args)

    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("optimize-model: ")
    assert re.search(message, lines[0]), lines[0]
    assert "Exception raised from" not in proc.stderr
    # nothing written: OUT absent or byte-identical, no temporary files
    if existing_out:
        assert out.read_bytes() == b"previous result"
    else:
        assert not out.exists()
    assert {p.name for p in tmp_path.iterdir()} == before


def test_freeze_on_a_training_mode_model(cli, tmp_path):
    src = save_scripted(LinearAddRelu(), tmp_path / "train.pt", train=True)
    out = tmp_path / "out.pt"
    proc = run(cli, src, out, "--freeze")
    assert proc.returncode == EXIT_OPTIMIZE
    assert proc.stderr.count("\n") == 1
    assert "--freeze needs a model saved in eval mode" in proc.stderr
    assert not out.exists()
    # without --freeze a training-mode model is optimized as it is
    proc = run(cli, src, out)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert torch.jit.load(str(out)).training


@pytest.mark.parametrize("existing_out", [False, True], ids=["no-out", "existing-out"])
def test_failed_check_writes_nothing(cli, tmp_path, existing_out):
    src = save_scripted(LogNet(), tmp_path / "log.pt")
    out = tmp_path / "out.pt"
    report = tmp_path / "r.json"
    if existing_out:
        out.write_bytes(b"previous result")
    proc = run(cli, src, out, "--check", "--input-shape", "4x8", "--report", report)
    assert proc.returncode == EXIT_CHECK, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert re.search(r"^optimize-model: check failed: output \S+ has NaN values", proc.stderr)
    assert "FAILED" in proc.stdout
    assert not report.exists()
    if existing_out:
        assert out.read_bytes() == b"previous result"
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["log.pt"] + (["out.pt"] if existing_out else [])
    )


class ConvBnRelu(torch.nn.Module):
    """Freezing folds the BatchNorm into the conv: the outputs round
    differently (about 2e-6 here), as close to the exact ones."""

    def __init__(self, plain_attribute=False):
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(16)
        # NB: a tensor attribute that is no buffer stays float32 under
        # Module::to(float64): the float64 run then fails
        self.proj = torch.randn(16, 16)
        self.plain_attribute = plain_attribute
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 2)
            self.bn.bias.uniform_(-1, 1)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        if self.plain_attribute:
            y = y.transpose(1, 3) @ self.proj
        return y


def test_beyond_the_tolerance_the_check_judges_against_float64(cli, tmp_path):
    src = save_scripted(ConvBnRelu(), tmp_path / "cbr.pt")
    report = tmp_path / "r.json"
    atol = 1e-6
    proc = run(cli, src, tmp_path / "out.pt", "--freeze", "--check", "--input-shape", "4x16x16x16",
               "--rtol", "0", "--atol", atol, "--report", report)
    assert proc.returncode == EXIT_OK, proc.stderr
    check = json.loads(report.read_text())["check"]
    assert check["passed"] and check["mismatched"] > 0 and check["max_abs_error"] > atol, check
    f64 = check["float64"]
    assert 0 < f64["optimized_error"] <= 2 * f64["original_error"] + atol, f64
    assert "against a float64 run of the original" in proc.stdout


def test_no_float64_run_no_judgement(cli, tmp_path):
    src = save_scripted(ConvBnRelu(plain_attribute=True), tmp_path / "cbr.pt")
    out = tmp_path / "out.pt"
    proc = run(cli, src, out, "--freeze", "--check", "--input-shape", "4x16x16x16",
               "--rtol", "0", "--atol", "0")
    assert proc.returncode == EXIT_CHECK, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "outputs differ beyond the float32 tolerance" in proc.stderr
    assert "a float64 run of the original model, to judge them by, failed" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("check", [True, False], ids=["check", "no-check"])
def test_cuda_device_without_cuda(cli, tmp_path, linear_pt, check):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    out = tmp_path / "out.pt"
    args = ["--check", "--input-shape", "2x16"] if check else []
    proc = run(cli, linear_pt, out, *args, "--device", "cuda")
    assert proc.returncode == EXIT_USAGE
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "--device cuda: no CUDA device is available" in proc.stderr
    assert not out.exists()


def test_device_cpu_without_check_is_accepted(cli, tmp_path, linear_pt):
    out = tmp_path / "out.pt"
    proc = run(cli, linear_pt, out, "--freeze", "--device", "cpu")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "(on cpu, frozen)" in proc.stdout
    assert re.search(r"layout: 0 convolution weights stored channels-last", proc.stdout), proc.stdout
    assert torchfuse_ops_in(out) == ["custom_linear_add_relu"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_saved_resnet50_is_fused_channels_last_and_checked(cli, tmp_path, dtype):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None)
    # NB: running statistics of random inputs, as a trained model has (the
    # initial ones let deep layers overflow float16)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.momentum = None
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(4, 3, 64, 64))
    model = model.eval().to(getattr(torch, dtype))
    src = tmp_path / "resnet50.pt"
    torch.jit.script(model).save(str(src))  # saved with CPU tensors
    out, report = tmp_path / "resnet50.opt.pt", tmp_path / "r.json"
    proc = run(cli, src, out, "--freeze", "--check", "--input-shape", "2x3x64x64", "--dtype", dtype,
               "--device", "cuda", "--report", report)
    assert proc.returncode == EXIT_OK, proc.stderr
    r = json.loads(report.read_text())
    assert r["device"] == "cuda" and r["check"]["passed"] and r["check"]["device"] == "cuda"
    # 16 bottlenecks: each block's last conv with the residual add and relu,
    # and the other convs with their relu (BN folded by the freeze)
    assert r["fused"]["conv_add_act"] >= 16 and r["fused"]["conv_act_max_pool"] == 1, r["fused"]
    # NB: the saved model's 4-d constants are its convolution weights: on
    # the GPU, every one channels-last (the cost model's choice for resnet50)
    saved = torch.jit.load(str(out))
    weights = [c.output().toIValue() for c in saved.graph.findAllNodes("prim::Constant")
               if c.output().type().kind() == "TensorType"]
    weights = [w for w in weights if w.dim() == 4]
    assert len(weights) == r["channels_last_weights"] > 0, (len(weights), r["channels_last_weights"])
    assert all(w.is_cuda and w.is_contiguous(memory_format=torch.channels_last) for w in weights)
