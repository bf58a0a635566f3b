"""The op's per-call floor: the whole op per call at small shapes, against `log_softmax` + `gather`, in one process.

At a few tokens the kernels take microseconds and what a call costs is the Python and dispatcher path around them
(the op, its autograd node, the checks). These rows time that path: TP 1, fp32, one thread, `check_inputs=False` (the
train step's setting), each method called back to back in bursts of about `BURST_S`; the methods alternate burst by
burst (interleaved, in one process, so a busy machine slows both alike), and each figure is the median over the
rounds. `torch / op` is the median of the rounds' ratios. "forward + backward" calls the op and
`torch.autograd.grad` of its logprobs (upstream gradient of ones); "forward, no_grad" calls it under
`torch.no_grad()`.

On the CPU each burst is also timed in the calling thread's CPU time (`time.thread_time`: with one thread, torch and
the op and autograd's CPU backward all run there), which a busy shared machine disturbs far less than the wall clock:
the report gives both ratios. glibc's allocator is held steady for the rows (`steady_glibc_heap`): with its dynamic
mmap threshold a method's 4 MiB buffers came from fresh pages (a page fault per 4 KiB) or from the heap depending on
which method ran before, and torch's time at 256 x 4096 alternated between 1.2 and 2.4 ms from one burst to the next.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from megatron_grpo.bench.measure import glibc
from megatron_grpo.ops import vocab_parallel_logprobs

SHAPES = ((8, 64), (256, 4096))
MODES = ("forward + backward", "forward, no_grad")
BURST_S = 0.02


@dataclass
class FloorResult:
    tokens: int
    v_local: int
    mode: str
    op_us: float      # wall time per call, the median over the rounds
    torch_us: float
    torch_over_op: float  # the median of the rounds' wall-time ratios
    op_cpu_us: float | None  # the calling thread's CPU time per call (CPU only)
    torch_cpu_us: float | None
    torch_over_op_cpu: float | None


def _calls(tokens: int, v_local: int, mode: str, device: torch.device) -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, v_local, generator=gen) * 3).to(device)
    targets = torch.randint(0, v_local, (tokens,), generator=gen).to(device)
    leaf = logits.clone().requires_grad_(True)
    ones = torch.ones(tokens, device=device)

    def op(x):
        return vocab_parallel_logprobs(x, targets, check_inputs=False)

    def naive(x):
        return torch.log_softmax(x, dim=-1).gather(-1, targets[:, None]).squeeze(-1)

    if mode == "forward + backward":
        return {name: (lambda f=f: torch.autograd.grad(f(leaf), leaf, ones)) for name, f in (("op", op),
                                                                                              ("torch", naive))}

    def no_grad(f):
        def run():
            with torch.no_grad():
                return f(logits)
        return run

    return {"op": no_grad(op), "torch": no_grad(naive)}


def _burst(run: Callable[[], object], calls: int, device: torch.device) -> tuple[float, float]:
    """(wall, calling thread's CPU) seconds per call of `calls` back-to-back calls."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, start_cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls, (time.thread_time() - start_cpu) / calls


def interleaved(runs: dict[str, Callable[[], object]], rounds: int, device: torch.device
                ) -> dict[str, list[tuple[float, float]]]:
    """Per-call (wall, CPU) seconds of each run, one burst of about `BURST_S` per run and round, the runs alternating
    (their order reversed every other round)."""
    calls = {}
    for name, run in runs.items():
        run()  # warm-up
        once = max(_burst(run, 1, device)[0], 1e-7)
        calls[name] = max(1, int(BURST_S / once))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    names = list(runs)
    for index in range(rounds):
        for name in (names if index % 2 == 0 else names[::-1]):
            times[name].append(_burst(runs[name], calls[name], device))
    return times


# glibc's mallopt parameters, and the values the rows run with: every buffer from the heap, which is never trimmed.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
STEADY_THRESHOLD = 2**30


def steady_glibc_heap() -> bool:
    """Fixes glibc's mmap and trim thresholds for this process (both methods then reuse heap memory, whatever ran
    before); False where the C library is not glibc (nothing changed)."""
    libc = glibc()
    if libc is None:
        return False
    return (bool(libc.mallopt(M_MMAP_THRESHOLD, STEADY_THRESHOLD))
            and bool(libc.mallopt(M_TRIM_THRESHOLD, STEADY_THRESHOLD)))


def per_call_floor(device: torch.device, rounds: int) -> list[FloorResult]:
    """The floor rows: every shape of `SHAPES` in both `MODES`, on one thread, glibc's heap held steady."""
    steady_glibc_heap()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = []
        for tokens, v_local in SHAPES:
            for mode in MODES:
                times = interleaved(_calls(tokens, v_local, mode, device), rounds, device)
                wall = {name: [w for w, _ in runs] for name, runs in times.items()}
                cpu = {name: [c for _, c in runs] for name, runs in times.items()}
                on_cpu = device.type == "cpu"
                results.append(FloorResult(
                    tokens, v_local, mode, 1e6 * statistics.median(wall["op"]), 1e6 * statistics.median(wall["torch"]),
                    _median_ratio(wall["torch"], wall["op"]),
                    1e6 * statistics.median(cpu["op"]) if on_cpu else None,
                    1e6 * statistics.median(cpu["torch"]) if on_cpu else None,
                    _median_ratio(cpu["torch"], cpu["op"]) if on_cpu else None))
        return results
    finally:
        torch.set_num_threads(threads)


def _median_ratio(numerators: list[float], denominators: list[float]) -> float:
    return statistics.median(n / d for n, d in zip(numerators, denominators))


def floor_report(results: list[dict], rounds: int) -> list[str]:
    """The Markdown section of the floor rows."""
    lines = [
        "## Per call at small shapes: the op against log_softmax + gather (TP=1, fp32, one thread)",
        "",
        f"The whole op per call (not the kernels alone), median of {rounds} interleaved rounds of about "
        f"{1e3 * BURST_S:.0f} ms of back-to-back calls each; `torch / op` is the median of the rounds' ratios "
        "(> 1: the op is faster), in wall time and in the calling thread's CPU time. check_inputs=False. glibc's "
        "mmap and trim thresholds fixed (`mallopt`), so that neither method's buffers page-fault for the other's.",
        "",
        "| T x V | measures | op us per call | log_softmax + gather us | torch / op | op CPU us | torch CPU us | "
        "torch / op (CPU) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in results:
        lines.append(f"| {r['tokens']} x {r['v_local']} | {r['mode']} | {r['op_us']:.1f} | {r['torch_us']:.1f} | "
                     f"{r['torch_over_op']:.2f} | {number(r['op_cpu_us'], 1)} | {number(r['torch_cpu_us'], 1)} | "
                     f"{number(r['torch_over_op_cpu'], 2)} |")
    lines.append("")
    return lines
