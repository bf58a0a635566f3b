"""`bench logprob` can never hang, and copes with missing peers.

The parent reads its children's results with a timeout and a liveness check (`collect`), and a peer that does
not import (megatron-core hidden, as on a bare GPU image) is reported as missing instead of killing the run.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_grpo.bench.logprob import FUSED_EXP, MEGATRON, report
from megatron_grpo.bench.measure import collect

REPO = Path(__file__).resolve().parents[2]
HIDE_MEGATRON = REPO / "benchmarks" / "hide_megatron"


def test_quick_benchmark_without_megatron_finishes_and_reports_it_missing(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HIDE_MEGATRON), os.environ.get("PYTHONPATH", "")]))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "megatron_grpo", "bench", "logprob", "--quick", "--tp", "1", "--dtypes", "fp32",
         "--repeats", "1", "--timeout", "120", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - start < 200
    saved = json.loads((tmp_path / "logprob_cpu_quick.json").read_text())
    assert "No module named 'megatron'" in saved["missing_peers"][MEGATRON]
    assert {r["method"] for r in saved["results"]} == {"fused", "fused (inplace_backward)", FUSED_EXP, "reference",
                                                       "naive torch"}
    text = (tmp_path / "logprob_cpu_quick.md").read_text()
    assert f"- not measured: {MEGATRON}: ModuleNotFoundError" in text
    assert "| fused | " in text and f"| {MEGATRON} |" not in text
    assert f"{MEGATRON} not measured" in done.stderr


def _rows(method: str, ms: float) -> dict:
    return {"setup": {"tp": 1, "dtype": "fp32", "tokens": 4, "v_local": 8}, "method": method, "forward_ms": ms,
            "forward_backward_ms": 2 * ms, "peak_extra_mib": 0.0, "gradient_mib": 0.0}


def test_report_copes_with_absent_methods():
    import torch

    text = report([_rows("naive torch", 2.0), _rows("reference", 4.0)], torch.device("cpu"), 1e9, 3, True,
                  missing={MEGATRON: "ModuleNotFoundError: No module named 'megatron'"})
    assert "| reference | 4.0 | 8.0 | - | 0.50x |" in text  # no Megatron column value, naive present
    assert "Fused forward" not in text  # the bandwidth line needs the fused method
    assert f"- not measured: {MEGATRON}: ModuleNotFoundError" in text


@pytest.fixture
def fork():
    return mp.get_context("fork")


def test_collect_fails_at_once_when_a_rank_dies_before_reporting(fork):
    queue = fork.Queue()
    procs = [fork.Process(target=time.sleep, args=(60,)), fork.Process(target=sys.exit, args=(3,))]
    for p in procs:
        p.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exit code 3"):
        collect(queue, procs, timeout_s=60, poll_s=0.1)
    assert time.monotonic() - start < 20
    assert not procs[0].is_alive(), "the surviving rank must be stopped"


def test_collect_gives_up_after_its_timeout(fork):
    queue = fork.Queue()
    procs = [fork.Process(target=time.sleep, args=(60,))]
    procs[0].start()
    with pytest.raises(TimeoutError, match="no result within 1 s"):
        collect(queue, procs, timeout_s=1, poll_s=0.1)
    assert not procs[0].is_alive()


def test_collect_reports_a_rank_error_with_its_traceback(fork):
    queue = fork.Queue()
    queue.put(("error", "rank 0:\nTraceback ...\nValueError: bad shape", None))
    procs = [fork.Process(target=time.sleep, args=(60,))]
    procs[0].start()
    with pytest.raises(RuntimeError, match="benchmark failed on rank 0:(.|\n)*ValueError: bad shape"):
        collect(queue, procs, timeout_s=60, poll_s=0.1)
    assert not procs[0].is_alive()


def _report_and_exit(queue) -> None:
    queue.put(("ok", [_rows("fused", 1.0)], {MEGATRON: "missing"}))


def test_collect_returns_what_a_rank_sent_before_it_exited(fork):
    queue = fork.Queue()
    procs = [fork.Process(target=_report_and_exit, args=(queue,))]
    procs[0].start()
    procs[0].join(timeout=30)
    assert procs[0].exitcode == 0
    results, missing = collect(queue, procs, timeout_s=30, poll_s=0.1)
    assert [r["method"] for r in results] == ["fused"] and missing == {MEGATRON: "missing"}
