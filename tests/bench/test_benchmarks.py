"""The kernel benchmark runs end to end on tiny shapes and writes its report (timings are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_grpo.bench.logprob import MEGATRON, main


@pytest.mark.slow  # the benchmark end to end, in processes of its own
def test_logprob_benchmark_writes_markdown_json_and_plot(tmp_path):
    assert main(["--quick", "--tp", "1", "--dtypes", "fp32", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "logprob_cpu_quick.md").read_text()
    for method in ("fused", "fused (inplace_backward)", "torch kernels", "naive torch", MEGATRON):
        assert f"| {method} |" in report
    saved = json.loads((tmp_path / "logprob_cpu_quick.json").read_text())
    assert MEGATRON not in saved["missing_peers"]
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in saved["results"])
    assert (tmp_path / "logprob_cpu_quick.png").stat().st_size > 0


def test_bench_help_exits_0_and_lists_the_benchmarks():
    done = subprocess.run([sys.executable, "-m", "megatron_grpo", "bench", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(
        "usage: megatron-grpo bench {logprob,scheduler,linear,packing,roofline,step,replay}")
    assert all(f"{name} " in done.stdout for name in ("logprob", "scheduler", "linear", "packing", "step", "replay"))


def test_bench_without_a_name_exits_2_with_the_usage():
    done = subprocess.run([sys.executable, "-m", "megatron_grpo", "bench"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.startswith("usage: megatron-grpo bench")
