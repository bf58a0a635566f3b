#!/usr/bin/env bash
# GPU check of the CUDA logprob kernels: build megatron_grpo._C with CUDA, run the GPU tests, measure the kernels
# against the memory-bandwidth roof, and run the kernel benchmark. One prepared script for a fresh GPU machine
# (written for the H200 device machine: nothing can be downloaded there; its python3 holds a CUDA torch, and
# nvcc is installed). It takes about 6-8 minutes. Results go to $OUT (default benchmarks/results/gpu_check)
# and the benchmark's own files to benchmarks/results/gpu/.
#
# How to run it with the device tool, from the repo root here:
#   1. Once: the image lacks megatron-core, which the benchmark's Megatron baseline needs. Its Python is 3.12,
#      so fetch the cp312 wheel (2.6 MB; its requirements torch, numpy and packaging are already there).
#      .whl/ is git-ignored and travels only when named in carry:
#        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#            --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
#   2. run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
#      Each step has its own `timeout` (build 240 s, tests 150 s, roofline 90 s, benchmark 240 s), and every
#      file under $OUT is written as its step goes, so even a run cut off at 540 s brings back the steps done.
#   3. What comes back (at most 8 files): gpu_check.log (everything printed), nvidia-smi.txt, ptxas.txt
#      (registers and spills per kernel), pytest-gpu.xml, kernel_roofline.txt, and bench_results.tgz (the
#      benchmark's table and plot). Copy the benchmark files into benchmarks/results/ here and commit them.
# Then give the machine back (give_back) unless rerunning at once.
set -euo pipefail

OUT="${OUT:-benchmarks/results/gpu_check}"
BENCH_DIR=benchmarks/results/gpu
WHEELS=.whl
SITE=/tmp/site
export PYTHONUNBUFFERED=1
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0

section() { printf '\n==================== %s ====================\n' "$*"; }

print_machine() {
  section "machine"
  nvidia-smi | tee "$OUT/nvidia-smi.txt"
  nvcc --version | tail -n 2
  python3 -c 'import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
print("device:", torch.cuda.get_device_name())'
}

# megatron-core from carried wheels, into a private site dir (the image's packages stay untouched).
install_carried_wheels() {
  section "carried wheels"
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    python3 -c 'import megatron.core; print("megatron-core", megatron.core.__version__)'
  else
    echo "WARNING: no $WHEELS/*.whl carried: megatron-core is missing, so the benchmark has no Megatron baseline"
  fi
}

# The package in editable mode: setup.py adds the CUDA kernels because this torch has CUDA and nvcc is found.
# No build isolation (the build must use the installed CUDA torch) and no deps (nothing can be downloaded).
build_extension() {
  section "build (pip install -e .)"
  timeout 240 python3 -m pip install --no-deps --no-build-isolation -e . 2>&1 | tail -n 30
  python3 -c 'import torch; from megatron_grpo.ops import fused_supports, extension_status
print("extension:", extension_status()); assert fused_supports(torch.device("cuda")), "no CUDA kernels in _C"'
}

report_registers() {
  section "ptxas: registers, shared memory and spills (sm_90)"
  nvcc -std=c++17 -O3 -c csrc/logprob_cuda.cu -o /tmp/logprob_cuda.o -gencode arch=compute_90,code=sm_90 \
    -Xptxas -v >/tmp/ptxas.txt 2>&1
  grep -E "Compiling entry|Used|spill" /tmp/ptxas.txt >"$OUT/ptxas.txt"
  local kernels spill_free
  kernels=$(grep -c "Used" "$OUT/ptxas.txt" || true)
  spill_free=$(grep -c " 0 bytes spill stores" "$OUT/ptxas.txt" || true)
  echo "kernel variants: $kernels, without spills: $spill_free"
}

run_gpu_tests() {
  section "pytest -m gpu"
  timeout 150 python3 -m pytest -m gpu -q --continue-on-collection-errors --junitxml="$OUT/pytest-gpu.xml" tests
}

# Each kernel alone (torch.ops.megatron_grpo, CUDA events, median of 20) against a device-to-device copy: bytes
# moved per second as a fraction of the copy's. Shapes are far larger than the 60 MB L2 so nothing is cached.
measure_roofline() {
  section "kernel roofline"
  timeout 90 python3 - <<'PY' | tee "$OUT/kernel_roofline.txt"
import torch
from megatron_grpo.ops import fused_supports

assert fused_supports(torch.device("cuda"))  # also loads _C, which registers torch.ops.megatron_grpo
ops = torch.ops.megatron_grpo

def median_ms(fn, repeats=20):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record(); fn(); end.record(); torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]

src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
roof = 2 * src.numel() / median_ms(lambda: dst.copy_(src)) / 1e6
print(f"device-to-device copy (read + write): {roof:.0f} GB/s")
del src, dst
print(f"{'dtype':9} {'rows':>6} {'cols':>7} {'kernel':18} {'ms':>8} {'GB/s':>6} {'of copy':>7}")
for dtype in (torch.float32, torch.bfloat16):
    for rows, cols in ((8192, 32768), (32768, 4096), (256, 131072)):
        logits = torch.randn(rows, cols, device="cuda").mul_(3).to(dtype)
        targets = torch.randint(0, cols, (rows,), device="cuda")
        lse = logits.float().logsumexp(-1)
        ones, grad = torch.ones(rows, device="cuda"), torch.empty_like(logits)
        size = logits.numel() * logits.element_size()
        def backward(mean_x, grad_entropy):
            ops.logprob_backward(logits, targets, 0, cols, lse, mean_x, ones, grad_entropy, grad)
        kernels = {
            "forward": (size, lambda: ops.logprob_partials(logits, targets, 0, cols, False)),
            "forward+entropy": (size, lambda: ops.logprob_partials(logits, targets, 0, cols, True)),
            "backward": (2 * size, lambda: backward(None, None)),
            "backward+entropy": (2 * size, lambda: backward(lse, ones)),
        }
        for name, (moved, fn) in kernels.items():
            ms = median_ms(fn)
            rate = moved / ms / 1e6
            print(f"{str(dtype)[6:]:9} {rows:6} {cols:7} {name:18} {ms:8.3f} {rate:6.0f} {rate / roof:7.1%}")
        del logits, lse, grad
PY
}

# TP=2 runs one rank per GPU (NCCL), so it is measured only where there are two.
run_benchmark() {
  local tp_sizes="1"
  [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ] || tp_sizes="1 2"
  section "benchmark: python -m megatron_grpo bench logprob --device cuda --tp $tp_sizes"
  mkdir -p "$BENCH_DIR"
  # shellcheck disable=SC2086  # tp_sizes is a list of words
  timeout 240 python3 -m megatron_grpo bench logprob --device cuda --tp $tp_sizes --out "$BENCH_DIR"
}

collect_benchmark() {
  section "collect"
  ls -la "$BENCH_DIR"
  tar czf "$OUT/bench_results.tgz" -C "$(dirname "$BENCH_DIR")" "$(basename "$BENCH_DIR")"
}

# Runs one step after the build; a failure is reported and remembered, and the next steps still run, so that
# one call brings back everything it can. The script's exit status is the first failure's.
first_failure=0
step() {
  local rc=0
  "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "FAILED: $1 (exit $rc)"
    [ "$first_failure" -ne 0 ] || first_failure=$rc
  fi
}

main() {
  print_machine
  install_carried_wheels
  build_extension
  step run_gpu_tests
  step report_registers
  step measure_roofline
  step run_benchmark
  collect_benchmark
  section "done (exit $first_failure)"
  return "$first_failure"
}

mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu_check.log"
