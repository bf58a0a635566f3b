"""Measurement primitives for the benchmarks: median wall time, peak memory of one call, memory bandwidth.

Peak memory on the CPU is the process's resident high-water mark (VmHWM), reset before each call through
/proc/self/clear_refs; large tensors are mmapped by glibc, so they leave RSS as soon as they are freed. On CUDA
it is torch's allocator peak.
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[object], None], prepare: Callable[[], object], device: torch.device,
                   repeats: int, warmup: int = 1) -> float:
    """Median time of `run(prepare())`; `prepare` (fresh inputs) runs outside the timed region."""
    times = []
    for i in range(warmup + repeats):
        inputs = prepare()
        synchronize(device)
        start = time.perf_counter()
        run(inputs)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        del inputs
    return statistics.median(times)


def _read_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """Peak memory of a region above what was live when it began: `with PeakMemory(device) as peak: ...`,
    then `peak.extra_bytes`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.extra_bytes = 0

    def __enter__(self) -> "PeakMemory":
        synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
            self._base = _read_status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc: object) -> None:
        synchronize(self.device)
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _read_status_kib("VmHWM") * 1024
        self.extra_bytes = peak - self._base


def peak_extra_bytes(run: Callable[[object], None], prepare: Callable[[], object], device: torch.device) -> int:
    """Peak memory during `run(prepare())` above what was live when it started (inputs included in the base)."""
    inputs = prepare()
    with PeakMemory(device) as peak:
        run(inputs)
    return peak.extra_bytes


def copy_bandwidth_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> float:
    """Read + write bandwidth of a large tensor copy: the roof a memory-bound kernel is measured against."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda _: dst.copy_(src), lambda: None, device, repeats)
    return 2 * nbytes / seconds


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
