"""The kernel benchmark runs end to end on tiny shapes and writes its report (timings are not asserted)."""

from __future__ import annotations

import json

from megatron_grpo.bench.logprob import main


def test_logprob_benchmark_writes_markdown_json_and_plot(tmp_path):
    assert main(["--quick", "--tp", "1", "--dtypes", "fp32", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "logprob_cpu_quick.md").read_text()
    for method in ("fused", "fused (inplace_backward)", "reference", "naive torch",
                   "megatron vocab_parallel_cross_entropy"):
        assert f"| {method} |" in report
    results = json.loads((tmp_path / "logprob_cpu_quick.json").read_text())
    assert all(r["forward_ms"] > 0 and r["forward_backward_ms"] > 0 for r in results)
    assert (tmp_path / "logprob_cpu_quick.png").stat().st_size > 0
