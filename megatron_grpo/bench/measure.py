"""Measurement primitives for the benchmarks: median wall time, peak memory of one call, memory bandwidth, the
machine's description, and `run_ranks`, which runs one benchmark body on N fresh TP ranks and never hangs.

Peak memory on the CPU is the process's resident high-water mark (VmHWM), reset before each call through
/proc/self/clear_refs, after glibc's `malloc_trim(0)` has handed its free heap memory back: glibc serves tensors
below its mmap threshold (which it raises up to 32 MiB as it frees larger blocks) from a heap it keeps, and a call
that reuses memory an earlier one freed would otherwise not raise RSS at all. On CUDA it is torch's allocator peak.
`LiveTensorBytes` counts the bytes of tensor storages alive at once instead, at the dispatcher: deterministic on any
device and independent of the allocator (what the memory tests hold).
"""

from __future__ import annotations

import ctypes
import os
import platform
import queue as queue_module
import socket
import statistics
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_grpo.megatron.notices import quiet_megatron_notices


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


def glibc() -> ctypes.CDLL | None:
    """The process's glibc (for its allocator's `malloc_trim` and `mallopt`), or None where the C library is not
    glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def _malloc_trim() -> None:
    """glibc's `malloc_trim(0)`: its free heap memory back to the system, so that RSS is what is live (a no-op
    without glibc)."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


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
            _malloc_trim()
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


class LiveTensorBytes(TorchDispatchMode):
    """The peak bytes of tensor storages alive at once during a region, beyond those alive when it began:
    `with LiveTensorBytes() as live: ...`, then `live.peak_bytes`.

    Every op's outputs are seen at the dispatcher, autograd's backward included, and so are the ops run inside the
    project's `torch.library` ops (their Python bodies run under the mode; a mode otherwise sees a custom op as one
    call). A storage counts from the op that first returns it until it is freed (a weakref finalizer on the storage),
    once however many views it has; a storage an op only reads or writes in place, and one that lived before the
    region (the inputs), never counts. Temporaries inside a C++ kernel that never leave it are not seen.
    Deterministic: independent of the allocator, its caches and page residency, so a test can hold a bound with it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counted: dict[int, int] = {}

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in self._counted:
            return
        self._counted[key] = size
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.live_bytes -= self._counted.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = f"{func.namespace}::{func._opname}"
        if name.startswith("megatron_grpo::") and name in OPDEFS:
            with self:  # the op's Python body, op by op
                out = OPDEFS[name]._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        read = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read:
                self._count(t.untyped_storage())
        return out


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


def cpu_kernel_isa() -> str:
    """The instruction set the CPU kernels run with: `megatron_grpo.ops.core.backends.cpu_kernel_isa()` where this
    build has it, else torch's CPU capability (what the kernels' x86-64-v3 check reads)."""
    from megatron_grpo.ops.core import backends

    isa = getattr(backends, "cpu_kernel_isa", None)
    if callable(isa):
        return f"{isa()} (megatron_grpo kernels)"
    return f"{torch.backends.cpu.get_cpu_capability()} (torch CPU capability)"


def machine_description(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    cpu = platform.processor() or platform.machine()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}, "
            f"CPU ISA {cpu_kernel_isa()}")


def load_average() -> str:
    """The machine's 1, 5 and 15-minute load averages (`uptime`'s), with its core count: what a shared machine's
    figures are read against."""
    try:
        one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return "unknown"
    return f"{one}, {five}, {fifteen} (1, 5, 15 min) on {os.cpu_count()} cores"


# Where a benchmark writes when `--out` names no place: ignored by git, so a run never changes the committed
# results in benchmarks/results/, which `make bench` and `make bench-linear` refresh (they pass --out).
DEFAULT_OUT = Path("runs") / "bench"
OUT_HELP = ("directory for the report (.md), data (.json) and plot (.png) (default: runs/bench; `make bench` and "
            "`make bench-linear` write the committed benchmarks/results)")


def write_results(out: Path, stem: str, markdown: str, payload: dict, plot: Callable[[Path], None], *,
                  alt: str) -> Path:
    """Writes `<stem>.md` (linking the plot, `alt` its alt text: what the plot shows), `<stem>.json` and
    `<stem>.png` under `out`; returns the .md path."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(markdown + f"\n![{alt}]({stem}.png)\n")
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    plot(out / f"{stem}.png")
    return out / f"{stem}.md"


def grouped_bar_plot(groups: list[str], series: dict[str, list[float | None]], ylabel: str, path: Path) -> None:
    """One bar per series in each group (log scale; a None value leaves a gap), saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(groups)), 4))
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        points = [(j + i * width, v) for j, v in enumerate(values) if v is not None]
        ax.bar([x for x, _ in points], [v for _, v in points], width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- TP ranks in child processes ----
# A benchmark body `work(device, group) -> (results, missing)` runs on every rank of a fresh gloo (CPU) or NCCL
# (CUDA) group; rank 0 sends its results back, any rank its traceback. The parent never waits without a timeout.

RankWork = Callable[[torch.device, Any], tuple[list, dict]]


def megatron_tp_group(world: int):
    """Megatron's TP group where megatron-core imports (its cross entropy reads parallel_state), else WORLD."""
    try:
        from megatron.core import parallel_state
    except Exception:  # noqa: BLE001 - the Megatron peer is then reported missing
        return dist.group.WORLD, None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    return parallel_state.get_tensor_model_parallel_group(), parallel_state


def _rank_main(rank: int, world: int, port: int, device_type: str, threads: int, work: RankWork, queue,
               verbose: bool = False) -> None:
    """One TP rank: joins the group, runs `work`; rank 0 reports (or any rank its error)."""
    try:
        quiet_megatron_notices(verbose=verbose, cuda_available=device_type == "cuda")
        torch.set_num_threads(threads)
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group, parallel_state = megatron_tp_group(world)
        results, missing = work(device, group)
        if rank == 0:
            queue.put(("ok", results, missing))
        if parallel_state is not None:
            parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}", None))
        raise


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=10)


def collect(queue, procs, timeout_s: float, poll_s: float = 1.0):
    """Rank 0's results, waiting at most `timeout_s`; fails at once, naming the rank, when a rank errs or dies.

    Never blocks on the queue without a timeout: a child that dies before reporting must not hang the parent.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        # Read before the wait: whatever a rank sent before it exited is in the queue by the end of the wait.
        exit_codes = [p.exitcode for p in procs]
        try:
            status, payload, missing = queue.get(timeout=poll_s)
        except queue_module.Empty as empty:
            dead = [(i, code) for i, code in enumerate(exit_codes) if code not in (None, 0)]
            if dead:
                _stop(procs)
                raise RuntimeError("benchmark rank(s) died before reporting: " + ", ".join(
                    f"rank {i} exit code {code}" for i, code in dead)) from empty
            if all(code == 0 for code in exit_codes):
                raise RuntimeError("benchmark ranks exited without reporting results") from empty
            if time.monotonic() > deadline:
                _stop(procs)
                raise TimeoutError(f"benchmark ranks gave no result within {timeout_s:.0f} s") from empty
            continue
        if status == "error":
            _stop(procs)
            raise RuntimeError(f"benchmark failed on {payload}")
        return payload, missing


def run_ranks(world: int, work: RankWork, device_type: str, timeout_s: float = 3600.0,
              name: str = "benchmark", verbose: bool = False) -> tuple[list, dict]:
    """Runs `work` (picklable: a module-level function or a functools.partial of one) on `world` fresh processes,
    a gloo or NCCL group even for world 1, each with its share of the CPU threads; returns rank 0's results.
    Megatron-Core's known notices are filtered in the ranks unless `verbose`."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = max(1, torch.get_num_threads() // world) if device_type == "cpu" else 1
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, device_type, threads, work, queue, verbose))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results, missing = collect(queue, procs, timeout_s)
    except BaseException:
        _stop(procs)
        raise
    for p in procs:
        p.join(timeout=60)
    failed = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (0, None)]
    stuck = [i for i, p in enumerate(procs) if p.exitcode is None]
    _stop(procs)
    if failed:
        raise RuntimeError("benchmark rank(s) failed after reporting: " + ", ".join(
            f"rank {i} exit code {code}" for i, code in failed))
    if stuck:
        print(f"{name}: rank(s) {stuck} still running 60 s after reporting; stopped", file=sys.stderr)
    return results, missing
