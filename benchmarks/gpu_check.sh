#!/usr/bin/env bash
# GPU check of the CUDA logprob kernels, in one go: report the kernels' registers and spills (nvcc), build
# megatron_grpo._C with CUDA, run the GPU tests, then the fused linear op's GPU tests, the runner on one GPU, measure
# the kernels against the memory roof, run the benchmark.
#
# What it needs: bash, coreutils (`timeout`), a Python with a CUDA build of torch, and nvcc (CUDA_HOME or PATH),
# on any machine with an NVIDIA GPU. Nothing is downloaded: the package is installed editable with --no-deps and
# --no-index. A full run stops at once, with one line saying so, when nvcc is missing and the build is selected.
#
# megatron-core (the runner step and the benchmark's Megatron peer) comes from the environment or, where the GPU
# machine lacks it and has no network, from wheels carried with the checkout in the git-ignored .whl/ folder:
#   1. beforehand, on a machine with internet, `make gpu-wheels` runs
#        pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1
#      (the cp312 wheel is tagged manylinux_2_28: manylinux2014 alone finds none; PYTHON_VERSION= for another
#      Python). megatron-core needs only torch, numpy and packaging, which a CUDA torch image has;
#   2. ship .whl/ with the checkout (a tool that copies only tracked files must be told to take this ignored folder);
#   3. the `wheels` step installs them offline (--no-index --no-deps) into build/gpu_check_site, a private folder
#      that later runs reuse; the machine's own packages stay untouched.
#
# How to run it, from the repo root:
#     bash benchmarks/gpu_check.sh                  # PYTHON=python3 by default; PYTHON=/path/to/python to choose
#     STEPS="tests runner" bash benchmarks/gpu_check.sh   # rerun chosen steps only (an earlier run's build stays)
#     bash benchmarks/gpu_check.sh --dry-run        # no GPU needed: every step, the CUDA ones skipped (see below)
# Without a CUDA device it always dry-runs. Every run first prints its plan: each step, whether STEPS selects it,
# its budget, where megatron-core comes from, and what it leaves out: sequence parallelism needs TP >= 2, so two GPUs,
# and this check runs on one; tests/megatron/test_sequence_parallel_fused.py checks it at TP 2 on the CPU (gloo).
#
# Budgets (seconds): machine 15, wheels 5, registers 40, build 100, tests 65, linear 20, runner 75, roofline 12,
# bench 35, step 62: 429 s in all, each about 1.2x or more of its time on an H200 (2026-12-04: 4, 1, 7, 52-68, 35+,
# 12, 30 + 25, 9, 25, 52 s); machine and registers also run in the dry run, on a CPU machine that may be busy
# (nvcc took 6 s on an idle 2-core VM, over 12 s beside other work; the kernels of 2026-12-10, warp-per-row and
# in-place variants and the top-p kernels, take some 20 s of CPU for sm_90). A step that reaches its budget gets SIGINT (pytest then writes its summary and JUnit
# report, and `tee -i` keeps every line), and SIGKILL 5 s later: at most 479 s for all ten steps, under 8 minutes.
# Every step runs even when an earlier one failed, and prints one status line (ok, skipped, not selected, FAILED
# or TIMED OUT); the exit status is the first failure's.
#
# The results go to $OUT, by default benchmarks/results/gpu_check-<UTC date>-<device>/ (commit that folder); a
# rerun with STEPS= appends to the logs and replaces the files of the steps it reruns. $OUT holds at most 8 files:
#     summary.txt      per run: date, device, mode, STEPS, and each step's status and time
#     gpu_check.log    everything every step printed, whole (pytest's output included)
#     ptxas.txt        nvcc -Xptxas -v: registers, shared memory and spills of every kernel variant (both .cu files)
#     build.log        the whole log of `pip install -e .`
#     pytest.xml       the GPU tests' JUnit report (partial if the step ran out of time)
#     runner.txt       the runner step's two torchrun jobs (4 steps, then resumed to 6)
#     roofline.txt     the kernels alone (CUDA-graph replays) and the op per call, each as a fraction of a copy's roof
#     bench.tgz        the benchmark's Markdown table, JSON and plot (benchmarks/results/ format)
# The dry run (no CUDA): the register report runs (it needs nvcc only), the build, GPU tests, runner, roofline and
# step are skipped with a line saying so, the CPU op tests run instead of the GPU tests, the fused linear op's GPU tests
# are collected and skip (no CUDA), and the benchmark runs in its quick CPU mode with megatron-core hidden
# (benchmarks/hide_megatron), as on a bare GPU image.
#
# On a GPU machine reached as a batch job (one command, its output folder copied back, no internet there): ship
# the checkout with .whl/ and run `OUT=<the job's output folder> bash benchmarks/gpu_check.sh` with a wall-clock
# limit of 8 minutes or more; every file under $OUT is written as its step goes, so a job cut off still brings back
# the steps it finished. Then copy the files into benchmarks/results/gpu_check-<date>-<device>/ and commit them.
set -uo pipefail
cd "$(dirname "$0")/.."

export PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") && trap 'rm -rf "$WORK"' EXIT
export WORK WHEELS=.whl SITE="$PWD/build/gpu_check_site"  # SITE: megatron-core from .whl/, kept for reruns
# The CUDA and CPU test files (the GPU tests are their `gpu`-marked cases: tests/ops/test_gpu_kernels.py, and the
# op tests' cuda cases of conftest's `device` fixture); the dry run runs CPU_TESTS.
# tests/bench/test_bench_gpu_check.py checks that GPU_TESTS and LINEAR_TESTS name every file with a `gpu`-marked case.
export GPU_TESTS="${GPU_TESTS:-tests/ops/test_gpu_kernels.py tests/ops/test_logprob_op.py tests/ops/test_logprob_errors.py \
tests/ops/test_logprob_filtered.py tests/ops/test_logprob_temperature.py \
tests/ops/test_linear_logprobs.py tests/loss/test_linear_loss.py tests/ops/test_kept_set.py tests/megatron/test_attention.py}"
export CPU_TESTS="${CPU_TESTS:-tests/ops/test_logprob_op.py tests/ops/test_logprob_errors.py}"
# The fused linear op's GPU-specific tests (split-row and production shapes, peak memory, the loss-fused path in
# bf16): their own step and budget. Its small-shape cuda cases run in `tests`.
export LINEAR_TESTS="${LINEAR_TESTS:-tests/ops/test_gpu_linear.py}" LINEAR_SELECT=fused_linear

ALL_STEPS="machine wheels registers build tests linear runner roofline bench step"
# Step budgets in seconds (sum 429); GRACE: from a step's SIGINT to its SIGKILL.
BUDGET_MACHINE=15 BUDGET_WHEELS=5 BUDGET_REGISTERS=40 BUDGET_BUILD=100 BUDGET_TESTS=65 BUDGET_LINEAR=20
BUDGET_RUNNER=75 BUDGET_ROOFLINE=12 BUDGET_BENCH=35 BUDGET_STEP=62
GRACE=5
export BUDGET_BENCH
SKIPPED=77  # a step's exit status for "skipped"; it prints why

section() { printf '\n==================== %s ====================\n' "$*"; }

step_machine() {
  if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
  if command -v nvcc >/dev/null; then nvcc --version | tail -n 2; else echo "nvcc: not found"; fi
  "$PYTHON" -c 'import platform, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "|", platform.platform())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"cuda:{i}: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB")'
}

# megatron-core from the carried wheels that this Python can install (their tags), into the private SITE folder (see
# the header), offline.
step_wheels() {
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "skipped: no $WHEELS/*.whl (make gpu-wheels, then ship .whl/); megatron-core only if the environment has it"
    return $SKIPPED
  fi
  local wheels
  wheels=$("$PYTHON" - "$WHEELS" <<'PY'
import pathlib, sys
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename
supported = set(sys_tags())
print(" ".join(str(path) for path in sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
               if set(parse_wheel_filename(path.name)[3]) & supported))
PY
) || return
  if [ -z "$wheels" ]; then
    echo "skipped: no wheel in $WHEELS/ fits this Python ($("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')):" \
      "$(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
    return $SKIPPED
  fi
  # shellcheck disable=SC2086  # wheels is a list of paths
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels \
    || return
  echo "installed into $SITE (the runner step imports it): $(cd "$SITE" && ls -d -- *.dist-info | tr '\n' ' ')"
}

# Needs nvcc only (no torch headers), so it runs first and in the dry run too.
step_registers() {
  if ! command -v nvcc >/dev/null; then echo "skipped: nvcc not found"; return $SKIPPED; fi
  local arch="${CUDA_ARCH:-90}"
  echo "nvcc -Xptxas -v for sm_$arch; whole output in ptxas.txt"
  : >"$OUT/ptxas.txt"
  local source rc
  for source in csrc/logprob_cuda.cu csrc/top_p_cuda.cu; do
    nvcc -std=c++17 -O3 -Icsrc -c "$source" -o "$WORK/$(basename "$source" .cu).o" \
      -gencode "arch=compute_$arch,code=sm_$arch" -Xptxas -v >>"$OUT/ptxas.txt" 2>&1
    rc=$?
    if [ "$rc" -ne 0 ]; then tail -n 40 "$OUT/ptxas.txt"; return "$rc"; fi
  done
  local variants spilling most
  variants=$(grep -c "Used [0-9]* registers" "$OUT/ptxas.txt")
  spilling=$(grep "spill stores" "$OUT/ptxas.txt" | grep -vc " 0 bytes spill stores, 0 bytes spill loads")
  most=$(grep -o "Used [0-9]* registers" "$OUT/ptxas.txt" | awk '{print $2}' | sort -n | tail -n 1)
  echo "kernel variants: $variants; with spills: $spilling; most registers per thread: $most"
}

# The package in editable mode: setup.py adds the CUDA kernels because this torch has CUDA and nvcc is found, for
# TORCH_CUDA_ARCH_LIST (here this device's architecture). No build isolation (the build must use this CUDA torch),
# no deps and no index (nothing is downloaded).
step_build() {
  if [ "$DRY_RUN" = 1 ]; then echo "skipped (dry run): no CUDA build; the CPU extension stays as built"; return $SKIPPED; fi
  echo "MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST CUDA_HOME=$CUDA_HOME; whole log in build.log"
  "$PYTHON" -m pip install --no-index --no-deps --no-build-isolation -v -e . >"$OUT/build.log" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "pip install failed (exit $rc); the errors in build.log:"
    grep -n -i -E "error|fatal|no such file" "$OUT/build.log" | head -n 40
    return "$rc"
  fi
  tail -n 3 "$OUT/build.log"
  "$PYTHON" -c 'import torch; from megatron_grpo.ops import extension_status, fused_supports
print("extension:", extension_status())
assert fused_supports(torch.device("cuda")), "megatron_grpo._C was built without its CUDA kernels"'
}

# pytest's exit status: 1 tests failed or a file could not be collected (the other files still run), 2
# interrupted (the step's budget: the summary and pytest.xml are still written), 3 internal error, 4 usage, 5 none
# collected. Its whole output is in gpu_check.log; the errors and the summary are repeated at the end of the step.
# Where pytest-xdist is importable the tests run in one worker process (`-n 1`): a test that crashes the process
# (the first H200 run lost every test after a SIGSEGV) then fails alone, and xdist starts a new worker for the rest.
step_tests() {
  local log="$WORK/pytest.log" rc worker=""
  if "$PYTHON" -c 'import xdist' 2>/dev/null; then worker="-n 1"; fi
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: the CPU op tests instead of the GPU tests${worker:+ (pytest-xdist: $worker)}"
    # shellcheck disable=SC2086  # CPU_TESTS is a list of paths; worker is empty or two words
    "$PYTHON" -m pytest -q -ra -p no:cacheprovider --continue-on-collection-errors $worker $CPU_TESTS 2>&1 \
      | tee -i "$log"
  else
    # shellcheck disable=SC2086  # GPU_TESTS is a list of paths; worker is empty or two words
    "$PYTHON" -m pytest -q -ra -p no:cacheprovider --continue-on-collection-errors $worker -m gpu \
      -k "not $LINEAR_SELECT" --junitxml="$OUT/pytest.xml" $GPU_TESTS 2>&1 | tee -i "$log"
  fi
  rc=${PIPESTATUS[0]}
  case $rc in
    0) ;;
    5) echo "pytest: no tests collected (exit 5): check GPU_TESTS and the gpu marker" ;;
    *) echo "pytest exit $rc; collection and other errors (whole, above), then the summary:"
       sed -n '/^=* ERRORS =*$/,/^=* short test summary/p' "$log" | head -n 80
       sed -n '/short test summary info/,$p' "$log" | grep -v '^SKIPPED' | head -n 60 ;;
  esac
  return "$rc"
}

# vocab_parallel_linear_logprobs on CUDA: against a float64 anchor (fp32, bf16, padding, ignored rows, entropy,
# logit_scale, uneven chunks), a T=8192 H=4096 V_local=32768 bf16 case with gradients, and its peak memory
# against the materialised logits'. The dry run runs the same selection: collected, every test skipped (no CUDA).
step_linear() {
  local log="$WORK/pytest_linear.log" rc
  [ "$DRY_RUN" = 0 ] || echo "dry run: collected only, each test skips without CUDA"
  # shellcheck disable=SC2086  # LINEAR_TESTS is a list of paths
  "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider -m gpu -k "$LINEAR_SELECT" $LINEAR_TESTS 2>&1 | tee -i "$log"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) ;;
    5) echo "pytest: no tests collected (exit 5): check LINEAR_TESTS and the test_fused_linear_ names" ;;
    *) echo "pytest exit $rc; the summary:"
       sed -n '/short test summary info/,$p' "$log" | head -n 40 ;;
  esac
  return "$rc"
}

# The runner on one GPU (NCCL): Megatron's DDP and its distributed optimizer, a checkpoint of its sharded state,
# and a resume from it. The tiny config at TP 1 for 4 steps (a checkpoint every 2), then to 6 steps, resumed.
step_runner() {
  if [ "$DRY_RUN" = 1 ]; then echo "skipped (dry run): needs a CUDA device"; return $SKIPPED; fi
  if ! "$PYTHON" -c 'import megatron.core' 2>/dev/null; then
    echo "skipped: megatron-core is not importable (make gpu-wheels, ship .whl/, run the wheels step)"
    return $SKIPPED
  fi
  local dir="$WORK/runner" steps
  mkdir -p "$dir"
  : >"$OUT/runner.txt"
  for steps in 4 6; do
    "$PYTHON" - "$dir" "$steps" <<'PY' || return
import sys, yaml
directory, steps = sys.argv[1], int(sys.argv[2])
data = yaml.safe_load(open("configs/grpo_tiny_cpu.yaml"))
data.update(run_dir=f"{directory}/run")
data["policy"]["tensor_model_parallel_size"] = 1
data["grpo"]["max_num_steps"] = steps
data["checkpoint"].update(dir=f"{directory}/run/checkpoints", every_n_steps=2)
data["logging"].update(progress_bar=False, tensorboard=False)
yaml.safe_dump(data, open(f"{directory}/config.yaml", "w"))
PY
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 -m megatron_grpo train \
      --config "$dir/config.yaml" 2>&1 | tee -ia "$OUT/runner.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  done
  grep -q "resuming from step 4" "$OUT/runner.txt" || { echo "the second run did not resume from step 4"; return 1; }
}

step_roofline() {
  if [ "$DRY_RUN" = 1 ]; then echo "skipped (dry run): needs a CUDA device"; return $SKIPPED; fi
  "$PYTHON" -m megatron_grpo bench roofline 2>&1 | tee -i "$OUT/roofline.txt"
  return "${PIPESTATUS[0]}"
}

# TP=2 runs one rank per GPU (NCCL), so it is measured only where there are two. The benchmark's own timeout
# is below the step's budget, so that a stuck rank is reported by the benchmark rather than interrupted silently.
step_bench() {
  local dir="$WORK/bench" args
  rm -rf "$dir" && mkdir -p "$dir/bench"
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: quick CPU benchmark with megatron-core hidden (benchmarks/hide_megatron)"
    args="--device cpu --quick --tp 1 --dtypes fp32 --repeats 1"
    export PYTHONPATH="$PWD/benchmarks/hide_megatron${PYTHONPATH:+:$PYTHONPATH}"
  else
    args="--device cuda --tp 1"
    [ "$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ] || args="--device cuda --tp 1 2"
  fi
  echo "python -m megatron_grpo bench logprob $args"
  # shellcheck disable=SC2086  # args is a list of words
  "$PYTHON" -m megatron_grpo bench logprob $args --timeout $((BUDGET_BENCH - 15)) --out "$dir/bench" || return
  tar czf "$OUT/bench.tgz" -C "$dir" bench && echo "bench.tgz: $(tar tzf "$OUT/bench.tgz" | tr '\n' ' ')"
}

# The whole GRPO train step (`megatron-grpo bench step`) on one GPU at a realistic shape: vocab 128K, hidden 4096,
# 2 layers, bf16, 16 sequences of 256-4096 tokens; its four configurations one after the other (one model in
# memory at a time), one warm-up and two timed steps each. Its report is printed here, so it lands in gpu_check.log,
# and then one line on packing: configuration 4's peak memory and step time against configuration 3's (packed
# microbatches through torch's varlen_attn without TE, against padded ones).
# The dry run skips it: tests/bench/test_bench_step.py runs its CPU version at a tiny shape.
step_step() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "skipped (dry run): needs a CUDA device; tests/bench/test_bench_step.py runs it on the CPU at a tiny shape"
    return $SKIPPED
  fi
  if ! "$PYTHON" -c 'import megatron.core' 2>/dev/null; then
    echo "skipped: megatron-core is not importable (make gpu-wheels, ship .whl/, run the wheels step)"
    return $SKIPPED
  fi
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 -m megatron_grpo bench step --device cuda \
    --dtype bf16 --vocab 128000 --hidden 4096 --heads 32 --layers 2 --prompts 4 --generations 4 \
    --prompt-tokens 64 256 --response-tokens 192 3840 --micro-batch-size 1 --warmup 1 --steps 2 --sequential \
    --out "$WORK/step" || return
  "$PYTHON" - "$WORK/step/step_cuda.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["configurations"]
fused, packed = c["fused"], c["packed"]
print(f"packing: peak extra memory {packed['peak_extra_mib']:.0f} MiB (configuration 4) against "
      f"{fused['peak_extra_mib']:.0f} MiB (3), {fused['peak_extra_mib'] / packed['peak_extra_mib']:.2f}x smaller; "
      f"step {packed['step_s']:.3f} s against {fused['step_s']:.3f} s, {fused['step_s'] / packed['step_s']:.2f}x faster")
PY
}

export -f section step_machine step_wheels step_registers step_build step_tests step_linear step_runner step_roofline \
  step_bench step_step
export SKIPPED

selected() { case " $STEPS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

budget_of() { local var="BUDGET_${1^^}"; echo "${!var}"; }

# The plan: each step, whether STEPS selects it, its budget; where megatron-core comes from; the budgets' sum;
# what the check leaves out.
print_plan() {
  local name total=0 count=0 carry
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    carry="carry: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')-> $SITE (pip --no-index --no-deps)"
  else
    carry="carry: no $WHEELS/*.whl; megatron-core from the environment if it has one (make gpu-wheels, ship .whl/)"
  fi
  echo "plan ($([ "$DRY_RUN" = 1 ] && echo "dry run" || echo full)): STEPS=\"$STEPS\""
  for name in $ALL_STEPS; do
    local budget
    budget=$(budget_of "$name")
    total=$((total + budget)) count=$((count + 1))
    printf '  %-10s %4d s  %-14s%s\n' "$name" "$budget" "$(selected "$name" && echo selected || echo "not selected")" \
      "$([ "$name" = wheels ] && echo "$carry")"
  done
  echo "budgets: $total s in all; SIGINT at a step's budget, SIGKILL $GRACE s later: at most" \
    "$((total + count * GRACE)) s"
  echo "rerun chosen steps: STEPS=\"tests runner\" bash benchmarks/gpu_check.sh (names: $ALL_STEPS)"
  echo "not checked here: sequence parallelism (needs TP >= 2, two GPUs; this check runs on one)." \
    "tests/megatron/test_sequence_parallel_fused.py checks the fused paths under it at TP 2 on the CPU"
}

first_failure=0
# run_step NAME: runs the step in its own bash under `timeout` (which signals the step's whole process group:
# SIGINT at the budget, SIGKILL $GRACE s later) and records one status line in summary.txt.
run_step() {
  local name=$1 budget fn="step_$1" start=$SECONDS rc status
  budget=$(budget_of "$name")
  if ! selected "$name"; then
    printf '%-10s %-40s %4d s\n' "$name" "not selected (STEPS)" 0 | tee -a "$OUT/summary.txt"
    return
  fi
  section "$name (budget $budget s)"
  timeout --signal=INT --kill-after="$GRACE" "$budget" bash -c "$fn"
  rc=$?
  case $rc in
    0) status="ok" ;;
    "$SKIPPED") status="skipped" ;;
    124 | 137) status="TIMED OUT at its budget of $budget s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  case $rc in 0 | "$SKIPPED") ;; *) [ "$first_failure" -ne 0 ] || first_failure=$rc ;; esac
  printf '%-10s %-40s %4d s\n' "$name" "$status" $((SECONDS - start)) | tee -a "$OUT/summary.txt"
}

main() {
  local total_start=$SECONDS name
  print_plan
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "device: $DEVICE"
    echo "mode: $([ "$DRY_RUN" = 1 ] && echo "dry run (build, GPU tests, runner, roofline and step skipped)" || echo full)"
    echo "steps: $STEPS"
  } | tee -a "$OUT/summary.txt"
  for name in $ALL_STEPS; do
    run_step "$name"
    [ "$name" != wheels ] || [ ! -d "$SITE/megatron" ] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  done
  section "done in $((SECONDS - total_start)) s (exit $first_failure)"
  echo "end: $((SECONDS - total_start)) s, exit $first_failure" >>"$OUT/summary.txt"
  return "$first_failure"
}

export DRY_RUN=0
[ "${1:-}" != "--dry-run" ] || DRY_RUN=1
STEPS="${STEPS:-$ALL_STEPS}"
for name in $STEPS; do
  case " $ALL_STEPS " in
    *" $name "*) ;;
    *) echo "error: STEPS names an unknown step '$name' (the steps: $ALL_STEPS)"; exit 2 ;;
  esac
done
# The device, and whether it can run CUDA at all: without it the run is a dry run.
DEVICE=$("$PYTHON" -c 'import torch
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")' 2>/dev/null) || DEVICE=none
if [ "$DEVICE" = none ]; then
  [ "$DRY_RUN" = 1 ] || echo "no CUDA device (torch.cuda.is_available() is False, or $PYTHON lacks torch): dry run"
  DRY_RUN=1
  DEVICE="no CUDA device (dry run)"
  SLUG=cpu-dry-run
else
  SLUG=$(printf '%s' "$DEVICE" | tr -c 'A-Za-z0-9.' '-' | tr -s '-')
  CAPABILITY=$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$CAPABILITY}"  # the build: this device's architecture
  export CUDA_ARCH="${CUDA_ARCH:-${CAPABILITY//./}}"                  # the register report: the same
  export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  # The build needs nvcc: torch's extension builder finds it through CUDA_HOME, else on PATH. Stop now if neither.
  if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then
    export PATH="$CUDA_HOME/bin:$PATH"
  elif command -v nvcc >/dev/null; then
    CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
  fi
  export CUDA_HOME="${CUDA_HOME:-}"
  if selected build && ! command -v nvcc >/dev/null; then
    echo "error: nvcc not found (CUDA_HOME=${CUDA_HOME:-unset}, and none on PATH): the CUDA kernels cannot be built;" \
      "stopping before the first step. Set CUDA_HOME to the CUDA toolkit, or leave build out of STEPS."
    exit 3
  fi
fi
export DEVICE STEPS
export OUT="${OUT:-benchmarks/results/gpu_check-$(date -u +%Y-%m-%d)-$SLUG}"
mkdir -p "$OUT"
main 2>&1 | tee -ai "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
