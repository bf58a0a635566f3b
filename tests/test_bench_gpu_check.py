"""benchmarks/gpu_check.sh fits its budget and, without a GPU, dry-runs every step.

The dry run (no CUDA: build, GPU tests and roofline skipped with a line saying so) runs the nvcc register
report, a small subset of the CPU op tests, the fused linear op's GPU tests (collected, all skipped) and the
quick benchmark with megatron-core hidden, and writes its logs and results under $OUT, at most 8 files (the
device tool brings back no more).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
STEPS = ["machine", "wheels", "registers", "build", "tests", "linear", "runner", "roofline", "bench"]


def test_step_budgets_sum_to_under_480_s_and_every_step_has_one():
    text = SCRIPT.read_text()
    budgets = {name.lower(): int(value) for name, value in re.findall(r"BUDGET_(\w+)=(\d+)", text)}
    assert set(budgets) == set(STEPS)
    assert sum(budgets.values()) < 480
    run_steps = re.findall(r'^\s*run_step (\w+) "\$BUDGET_(\w+)" step_(\w+)$', text, flags=re.M)
    assert [name for name, _, _ in run_steps] == STEPS
    assert all(name == budget.lower() == fn for name, budget, fn in run_steps)


def files_with_gpu_tests() -> set[str]:
    """Test files with a `gpu`-marked case: marked by hand, or a test taking conftest's `device` fixture."""
    marked = re.compile(r"(@|= |marks=\[?)pytest\.mark\.gpu\b")
    takes_device = re.compile(r"^def test_\w+\([^)]*\bdevice\b", flags=re.M)
    return {f"tests/{path.name}" for path in (REPO / "tests").glob("test_*.py")
            if marked.search(path.read_text()) or takes_device.search(path.read_text())}


def test_gpu_tests_name_every_file_with_a_gpu_marked_case():
    listed = re.search(r'^export GPU_TESTS="\$\{GPU_TESTS:-(.*?)\}"$', SCRIPT.read_text(), flags=re.M | re.S)
    assert listed, "GPU_TESTS's default not found in gpu_check.sh"
    gpu_tests = set(listed.group(1).replace("\\\n", " ").split())
    found = files_with_gpu_tests()
    assert {"tests/test_gpu.py", "tests/test_logprob_op.py", "tests/test_linear_logprobs.py"} <= found
    assert found - gpu_tests == set(), "benchmarks/gpu_check.sh's GPU_TESTS misses these files' gpu-marked cases"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_dry_run_goes_through_every_step_within_budget(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, CPU_TESTS="tests/test_logprob_errors.py",
               TMPDIR=str(tmp_path))
    start = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=480)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert time.monotonic() - start < 470
    summary = (out / "summary.txt").read_text()
    status = dict(re.findall(r"^(\w+)\s+(ok|skipped|FAILED.*?|TIMED OUT.*?)\s+\d+ s$", summary, flags=re.M))
    assert list(status) == STEPS, summary
    expected = {"machine": "ok", "build": "skipped", "tests": "ok", "linear": "ok", "runner": "skipped",
                "roofline": "skipped",
                "bench": "ok", "registers": "ok" if shutil.which("nvcc") else "skipped"}
    assert {step: status[step] for step in expected} == expected, summary
    log = (out / "gpu_check.log").read_text()
    assert "skipped (dry run): no CUDA build" in log and "skipped (dry run): needs a CUDA device" in log
    linear = log.split("linear (budget")[1].split("runner (budget")[0]
    skipped = re.search(r"(\d+) skipped", linear)
    assert skipped and int(skipped.group(1)) >= 4, linear  # collected, and every one skipped without CUDA
    assert " passed" not in linear and " failed" not in linear and "error" not in linear.lower(), linear
    assert "megatron vocab_parallel_cross_entropy not measured: ModuleNotFoundError" in log
    with tarfile.open(out / "bench.tgz") as tar:
        assert "bench/logprob_cpu_quick.md" in tar.getnames()
    if shutil.which("nvcc"):
        assert "Used" in (out / "ptxas.txt").read_text()
    assert len(list(out.rglob("*"))) <= 8
