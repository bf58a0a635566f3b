"""benchmarks/gpu_check.sh fits its budget, says so in its header, and, without a GPU, dry-runs every step.

Every run prints its plan (each step, whether STEPS= selects it, its budget; where megatron-core comes from); a
full run without nvcc stops before its first step. The dry run (no CUDA: build, GPU tests, runner, roofline and
step skipped with a line saying so) runs the nvcc register
report, a small subset of the CPU op tests, the fused linear op's GPU tests (collected, all skipped) and the
quick benchmark with megatron-core hidden, and writes its logs and results under $OUT, at most 8 files (the
device tool brings back no more).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from megatron_grpo.bench.logprob import FUSED_EXP, MEGATRON

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
STEPS = ["machine", "wheels", "registers", "build", "tests", "linear", "runner", "roofline", "bench", "step"]


def budgets() -> dict[str, int]:
    return {name.lower(): int(value) for name, value in re.findall(r"BUDGET_(\w+)=(\d+)", SCRIPT.read_text())}


def test_step_budgets_sum_to_under_480_s_and_the_header_says_so():
    text = SCRIPT.read_text()
    steps = re.search(r'^ALL_STEPS="(.*)"$', text, flags=re.M).group(1).split()
    assert steps == STEPS and set(budgets()) == set(STEPS)
    grace = int(re.search(r"^GRACE=(\d+)$", text, flags=re.M).group(1))
    total = sum(budgets().values())
    assert total + len(STEPS) * grace < 480  # every step at its budget, then killed after the grace
    header = text.split("\nset -uo pipefail")[0]
    stated = re.search(r"# Budgets \(seconds\): (.*?): (\d+) s in all", header, flags=re.S)
    assert stated, "the header states each step's budget and their sum"
    listed = dict(re.findall(r"(\w+) (\d+)", stated.group(1).replace("#", " ")))
    assert {name: int(value) for name, value in listed.items()} == budgets() and int(stated.group(2)) == total
    assert f"at most {total + len(STEPS) * grace} s for all ten steps" in " ".join(header.replace("#", "").split())


def test_the_header_lists_every_output_file_and_at_most_8():
    text = SCRIPT.read_text()
    header = text.split("\nset -uo pipefail")[0]
    listed = set(re.findall(r"^#     (\S+\.\w+) ", header, flags=re.M))
    written = set(re.findall(r'"\$OUT/([\w.]+)"', text)) | {"pytest.xml"}
    assert written <= listed and len(listed) <= 8, (written, listed)


def test_setup_py_leaves_the_cuda_architectures_to_torch_cuda_arch_list():
    setup = (REPO / "setup.py").read_text()
    assert "-gencode=" not in setup and 'DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"' in setup
    assert 'os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)' in setup


def dry_run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "TMPDIR": str(tmp_path),
                   **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_the_plan_lists_the_carry_step_the_steps_filter_and_the_budgets(tmp_path):
    done = dry_run(tmp_path, "--dry-run", STEPS="machine")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    out = done.stdout
    assert 'plan (dry run): STEPS="machine"' in out
    for name, budget in budgets().items():
        assert re.search(rf"^  {name} +{budget} s  {'selected' if name == 'machine' else 'not selected'}", out,
                         flags=re.M), name
    assert re.search(r"^  wheels .*carry: (no \.whl/\*\.whl|.*\.whl)", out, flags=re.M)
    total = sum(budgets().values())
    assert f"budgets: {total} s in all" in out and 'rerun chosen steps: STEPS="tests runner"' in out
    # what the one-GPU check leaves out, and the test that covers it instead (a file that exists)
    left_out = re.search(r"^not checked here: sequence parallelism .* (tests/\S+\.py) checks", out, flags=re.M)
    assert left_out and (REPO / left_out.group(1)).is_file()
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert re.search(r"^machine +ok ", summary, flags=re.M)
    assert len(re.findall(r"^\w+ +not selected \(STEPS\) ", summary, flags=re.M)) == len(STEPS) - 1


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_an_unknown_step_is_named(tmp_path):
    done = dry_run(tmp_path, "--dry-run", STEPS="tests bulid")
    assert done.returncode == 2 and "STEPS names an unknown step 'bulid'" in done.stdout


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_a_full_run_without_nvcc_stops_before_its_first_step(tmp_path):
    """A machine whose torch sees a GPU (a stand-in Python says so) but with no nvcc: one clear line, exit 3."""
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
case "$*" in
  *get_device_name*) echo "Fake GPU" ;;
  *get_device_capability*) echo "9.0" ;;
  *) exec {sys.executable} "$@" ;;
esac
""")
    fake.chmod(0o755)
    done = dry_run(tmp_path, PYTHON=str(fake), PATH="/usr/bin:/bin", CUDA_HOME="")
    assert done.returncode == 3, done.stdout[-2000:]
    assert "error: nvcc not found (CUDA_HOME=unset, and none on PATH)" in done.stdout
    assert not (tmp_path / "out").exists()  # stopped before any step wrote anything


def files_with_gpu_tests() -> set[str]:
    """Test files with a `gpu`-marked case: marked by hand, or a test taking conftest's `device` fixture."""
    marked = re.compile(r"(@|= |marks=\[?)pytest\.mark\.gpu\b")
    takes_device = re.compile(r"^def test_\w+\([^)]*\bdevice\b", flags=re.M)
    return {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
            if marked.search(path.read_text()) or takes_device.search(path.read_text())}


def test_gpu_tests_name_every_file_with_a_gpu_marked_case():
    listed = re.search(r'^export GPU_TESTS="\$\{GPU_TESTS:-(.*?)\}"$', SCRIPT.read_text(), flags=re.M | re.S)
    assert listed, "GPU_TESTS's default not found in gpu_check.sh"
    linear = re.search(r'^export LINEAR_TESTS="\$\{LINEAR_TESTS:-(.*?)\}"', SCRIPT.read_text(), flags=re.M)
    assert linear, "LINEAR_TESTS's default not found in gpu_check.sh"
    gpu_tests = set(listed.group(1).replace("\\\n", " ").split()) | set(linear.group(1).split())
    found = files_with_gpu_tests()
    assert {"tests/ops/test_gpu_kernels.py", "tests/ops/test_gpu_linear.py", "tests/ops/test_logprob_op.py",
            "tests/ops/test_linear_logprobs.py"} <= found
    assert found - gpu_tests == set(), ("benchmarks/gpu_check.sh's GPU_TESTS and LINEAR_TESTS miss these files' gpu "
                                        "cases")


@pytest.mark.slow  # the benchmark end to end, in processes of its own
@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and timeout")
def test_dry_run_goes_through_every_step_within_budget(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, CPU_TESTS="tests/ops/test_logprob_errors.py",
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
                "roofline": "skipped", "bench": "ok", "step": "skipped",
                "registers": "ok" if shutil.which("nvcc") else "skipped"}
    assert {step: status[step] for step in expected} == expected, summary
    log = (out / "gpu_check.log").read_text()
    assert "skipped (dry run): no CUDA build" in log and "skipped (dry run): needs a CUDA device" in log
    # pytest-xdist (a test dependency) is importable: the tests step runs in one worker, which a crash cannot end
    assert "the CPU op tests instead of the GPU tests (pytest-xdist: -n 1)" in log
    assert "skipped (dry run): needs a CUDA device; tests/bench/test_bench_step.py runs it" in log
    linear = log.split("linear (budget")[1].split("runner (budget")[0]
    skipped = re.search(r"(\d+) skipped", linear)
    assert skipped and int(skipped.group(1)) >= 4, linear  # collected, and every one skipped without CUDA
    assert " passed" not in linear and " failed" not in linear and "error" not in linear.lower(), linear
    assert "megatron vocab_parallel_cross_entropy not measured: ModuleNotFoundError" in log
    with tarfile.open(out / "bench.tgz") as tar:  # the quick CPU benchmark, megatron-core hidden
        saved = json.loads(tar.extractfile("bench/logprob_cpu_quick.json").read())
        report = tar.extractfile("bench/logprob_cpu_quick.md").read().decode()
    assert "No module named 'megatron'" in saved["missing_peers"][MEGATRON]
    assert {r["method"] for r in saved["results"]} == {"fused", "fused (inplace_backward)", FUSED_EXP, "torch kernels",
                                                       "naive torch"}
    assert f"- not measured: {MEGATRON}: ModuleNotFoundError" in report
    assert "| fused | " in report and f"| {MEGATRON} |" not in report
    if shutil.which("nvcc"):
        assert "Used" in (out / "ptxas.txt").read_text()
    assert len(list(out.rglob("*"))) <= 8
