"""`bench logprob` can never hang, and copes with missing peers.

The parent reads its children's results with a timeout and a liveness check (`collect`), and a peer that does
not import (megatron-core hidden, as on a bare GPU image) is reported as missing instead of killing the run: the
whole benchmark so is run by test_bench_gpu_check.py's dry run of benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import multiprocessing as mp
import platform
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


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt: this C library is not glibc")
def test_per_call_rows_run_with_glibcs_heap_held_steady():
    """The per-call rows (one round, in a child: `mallopt` changes the whole process's allocator) hold glibc's
    thresholds fixed and report every shape and mode with positive times."""
    import json
    import subprocess

    code = ("import json, torch; from megatron_grpo.bench.floor import per_call_floor, steady_glibc_heap; "
            "rows = per_call_floor(torch.device('cpu'), 1); "
            "print(json.dumps([steady_glibc_heap(), [(r.tokens, r.mode, r.op_us, r.torch_us) for r in rows]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    steady, rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert steady is True
    assert {(tokens, mode) for tokens, mode, _, _ in rows} == {(8, "forward + backward"), (8, "forward, no_grad"),
                                                               (256, "forward + backward"), (256, "forward, no_grad")}
    assert all(op > 0 and torch > 0 for _, _, op, torch in rows)
