#!/usr/bin/env bash
# GPU check of the CUDA logprob kernels, in one go: report the kernels' registers and spills (nvcc), build
# megatron_grpo._C with CUDA, run the GPU tests, then the fused linear op's GPU tests, measure the kernels against
# the memory roof, run the benchmark.
#
# What it needs: bash, coreutils (`timeout`), a Python with a CUDA build of torch, and nvcc (CUDA_HOME or PATH),
# on any machine with an NVIDIA GPU. Nothing is downloaded: the package is installed editable with --no-deps and
# --no-index. Optional: megatron-core, for the benchmark's Megatron peer (from the environment, or as wheels in
# .whl/, installed into a private folder); without it the benchmark reports that peer as missing.
#
# How to run it, from the repo root:
#     bash benchmarks/gpu_check.sh                  # PYTHON=python3 by default; PYTHON=/path/to/python to choose
#     bash benchmarks/gpu_check.sh --dry-run        # no GPU needed: every step, the CUDA ones skipped (see below)
# Without a CUDA device it always dry-runs. The results go to $OUT, by default
# benchmarks/results/gpu_check-<UTC date>-<device>/; commit that folder. Each step has its own time budget
# (all together 470 s, under 8 minutes), runs even when an earlier one failed, and prints one status line
# (ok, skipped, FAILED or TIMED OUT); the exit status is the first failure's. $OUT holds at most 8 files:
#     summary.txt      date, device, and each step's status and time
#     gpu_check.log    everything every step printed, whole (pytest's output included)
#     ptxas.txt        nvcc -Xptxas -v: registers, shared memory and spills of every kernel variant
#     build.log        the whole log of `pip install -e .`
#     pytest.xml       the GPU tests' JUnit report
#     roofline.txt     each kernel's bytes per second as a fraction of a device-to-device copy's
#     bench.tgz        the benchmark's Markdown table, JSON and plot (benchmarks/results/ format)
# The dry run (no CUDA): the register report runs (it needs nvcc only), the build, GPU tests and roofline are
# skipped with a line saying so, the CPU op tests run instead of the GPU tests, the fused linear op's GPU tests
# are collected and skip (no CUDA), and the benchmark runs in its quick CPU mode with megatron-core hidden
# (benchmarks/hide_megatron), as on a bare GPU image.
#
# On a GPU machine reached as a batch job (one command, its output folder copied back, no internet there):
#   1. Beforehand, on a machine with internet: if the GPU image lacks megatron-core, fetch the wheel for its
#      Python into the git-ignored .whl/ (megatron-core needs only torch, numpy and packaging), e.g. for 3.12:
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
#   2. Ship the checkout with .whl/ and run `OUT=<the job's output folder> bash benchmarks/gpu_check.sh` with a
#      wall-clock limit of about 9 minutes. Every file under $OUT is written as its step goes, so even a job
#      cut off brings back the steps it finished.
#   3. Copy the returned files into benchmarks/results/gpu_check-<date>-<device>/ and commit them.
set -uo pipefail
cd "$(dirname "$0")/.."

export PYTHON="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") && trap 'rm -rf "$WORK"' EXIT
export WORK WHEELS=.whl SITE="$WORK/site"  # WORK: this run's scratch folder (wheels' site, pytest log, ...)
# The CUDA and CPU test files (the GPU tests are their `gpu`-marked cases: test_gpu.py, and the op tests' cuda
# cases of conftest's `device` fixture); the dry run runs CPU_TESTS. tests/test_bench_gpu_check.py checks that
# GPU_TESTS names every test file with a `gpu`-marked case.
export GPU_TESTS="${GPU_TESTS:-tests/test_gpu.py tests/test_logprob_op.py tests/test_logprob_errors.py \
tests/test_logprob_filtered.py tests/test_logprob_temperature.py \
tests/test_linear_logprobs.py tests/test_linear_loss.py}"
export CPU_TESTS="${CPU_TESTS:-tests/test_logprob_op.py tests/test_logprob_errors.py}"
# The fused linear op's GPU-specific tests (test_gpu.py's `test_fused_linear_*`: split-row and production shapes,
# peak memory): their own step and budget, not in `tests`. Its small-shape cuda cases run in `tests`.
export LINEAR_TESTS="${LINEAR_TESTS:-tests/test_gpu.py}" LINEAR_SELECT=fused_linear

# Step budgets in seconds (sum 475). Each step is killed, with its child processes, at its budget.
BUDGET_MACHINE=20 BUDGET_WHEELS=15 BUDGET_REGISTERS=35 BUDGET_BUILD=150 BUDGET_TESTS=95 BUDGET_LINEAR=40
BUDGET_RUNNER=40 BUDGET_ROOFLINE=20 BUDGET_BENCH=60
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

# megatron-core from carried wheels, into a private folder (the machine's packages stay untouched).
step_wheels() {
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "skipped: no $WHEELS/*.whl; megatron-core is used only if the environment has it"
    return $SKIPPED
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || return
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c \
    'import megatron.core; print("megatron-core", megatron.core.__version__)'
}

# Needs nvcc only (no torch headers), so it runs first and in the dry run too.
step_registers() {
  if ! command -v nvcc >/dev/null; then echo "skipped: nvcc not found"; return $SKIPPED; fi
  local arch="${CUDA_ARCH:-90}"
  echo "nvcc -Xptxas -v for sm_$arch; whole output in ptxas.txt"
  nvcc -std=c++17 -O3 -Icsrc -c csrc/logprob_cuda.cu -o "$WORK/logprob_cuda.o" \
    -gencode "arch=compute_$arch,code=sm_$arch" -Xptxas -v >"$OUT/ptxas.txt" 2>&1
  local rc=$?
  if [ "$rc" -ne 0 ]; then tail -n 40 "$OUT/ptxas.txt"; return "$rc"; fi
  local variants spilling most
  variants=$(grep -c "Used [0-9]* registers" "$OUT/ptxas.txt")
  spilling=$(grep "spill stores" "$OUT/ptxas.txt" | grep -vc " 0 bytes spill stores, 0 bytes spill loads")
  most=$(grep -o "Used [0-9]* registers" "$OUT/ptxas.txt" | awk '{print $2}' | sort -n | tail -n 1)
  echo "kernel variants: $variants; with spills: $spilling; most registers per thread: $most"
}

# The package in editable mode: setup.py adds the CUDA kernels because this torch has CUDA and nvcc is found.
# No build isolation (the build must use this CUDA torch), no deps and no index (nothing is downloaded).
step_build() {
  if [ "$DRY_RUN" = 1 ]; then echo "skipped (dry run): no CUDA build; the CPU extension stays as built"; return $SKIPPED; fi
  echo "MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST; whole log in build.log"
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
# interrupted, 3 internal error, 4 usage, 5 none collected. Its whole output is in gpu_check.log; the errors
# and the summary are repeated at the end of the step, with their detail.
step_tests() {
  local log="$WORK/pytest.log" rc
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: the CPU op tests instead of the GPU tests"
    # shellcheck disable=SC2086  # CPU_TESTS is a list of paths
    "$PYTHON" -m pytest -q -ra -p no:cacheprovider --continue-on-collection-errors $CPU_TESTS 2>&1 | tee "$log"
  else
    # shellcheck disable=SC2086  # GPU_TESTS is a list of paths
    "$PYTHON" -m pytest -q -ra -p no:cacheprovider --continue-on-collection-errors -m gpu -k "not $LINEAR_SELECT" \
      --junitxml="$OUT/pytest.xml" $GPU_TESTS 2>&1 | tee "$log"
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
  "$PYTHON" -m pytest -q -rs -s -p no:cacheprovider -m gpu -k "$LINEAR_SELECT" $LINEAR_TESTS 2>&1 | tee "$log"
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
  if ! "$PYTHON" -c 'import megatron.core' 2>/dev/null; then
    echo "skipped: megatron-core is not importable (carry its wheels in $WHEELS)"; return $SKIPPED
  fi
  if [ "$DRY_RUN" = 1 ]; then echo "skipped (dry run): needs a CUDA device"; return $SKIPPED; fi
  local dir="$WORK/runner" steps
  mkdir -p "$dir"
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
      --config "$dir/config.yaml" 2>&1 | tee -a "$OUT/runner.txt" | tail -n 12
    [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  done
  grep -q "resuming from step 4" "$OUT/runner.txt" || { echo "the second run did not resume from step 4"; return 1; }
}

step_roofline() {
  if [ "$DRY_RUN" = 1 ]; then echo "skipped (dry run): needs a CUDA device"; return $SKIPPED; fi
  "$PYTHON" benchmarks/kernel_roofline.py 2>&1 | tee "$OUT/roofline.txt"
  return "${PIPESTATUS[0]}"
}

# TP=2 runs one rank per GPU (NCCL), so it is measured only where there are two. The benchmark's own timeout
# is below the step's budget, so that a stuck rank is reported by the benchmark rather than killed silently.
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

export -f section step_machine step_wheels step_registers step_build step_tests step_linear step_runner step_roofline \
  step_bench
export SKIPPED

first_failure=0
# run_step NAME BUDGET FUNCTION: runs the step in its own bash under `timeout` (which signals the step's whole
# process group) and records one status line in summary.txt.
run_step() {
  local name=$1 budget=$2 fn=$3 start=$SECONDS rc status
  section "$name (budget $budget s)"
  timeout --kill-after=5 "$budget" bash -c "$fn"
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
  local total_start=$SECONDS
  {
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "device: $DEVICE"
    echo "mode: $([ "$DRY_RUN" = 1 ] && echo "dry run (build, GPU tests and roofline skipped)" || echo full)"
  } | tee "$OUT/summary.txt"
  run_step machine "$BUDGET_MACHINE" step_machine
  run_step wheels "$BUDGET_WHEELS" step_wheels
  [ ! -d "$SITE/megatron" ] || export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  run_step registers "$BUDGET_REGISTERS" step_registers
  run_step build "$BUDGET_BUILD" step_build
  run_step tests "$BUDGET_TESTS" step_tests
  run_step linear "$BUDGET_LINEAR" step_linear
  run_step runner "$BUDGET_RUNNER" step_runner
  run_step roofline "$BUDGET_ROOFLINE" step_roofline
  run_step bench "$BUDGET_BENCH" step_bench
  section "done in $((SECONDS - total_start)) s (exit $first_failure)"
  cat "$OUT/summary.txt"
  return "$first_failure"
}

export DRY_RUN=0
[ "${1:-}" != "--dry-run" ] || DRY_RUN=1
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
fi
export DEVICE
export OUT="${OUT:-benchmarks/results/gpu_check-$(date -u +%Y-%m-%d)-$SLUG}"
mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
