"""`bench logprob` can never hang, and copes with missing peers.

The parent reads its children's results with a timeout and a liveness check (`collect`), and a peer that does
not import (megatron-core hidden, as on a bare GPU image) is reported as missing instead of killing the run: the
whole benchmark so is run by test_bench_gpu_check.py's dry run of benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time

import pytest

from megatron_grpo.bench.logprob import MEGATRON, report
from megatron_grpo.bench.measure import collect


def _rows(method: str, ms: float) -> dict:
    return {"setup": {"tp": 1, "dtype": "fp32", "tokens": 4, "v_local": 8}, "method": method, "forward_ms": ms,
            "forward_backward_ms": 2 * ms, "peak_extra_mib": 0.0, "gradient_mib": 0.0}


def test_report_copes_with_absent_methods():
    import torch

    text = report([_rows("naive torch", 2.0), _rows("torch kernels", 4.0)], torch.device("cpu"), 1e9, 3, True,
                  missing={MEGATRON: "ModuleNotFoundError: No module named 'megatron'"})
    assert "| torch kernels | 4.0 | 8.0 | - | 0.50x |" in text  # no Megatron column value, naive present
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
