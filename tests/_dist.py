"""Run a test function on N gloo ranks in fresh processes and collect what each rank returns.

Usage: `results = run_on_ranks(world_size, fn, *args)`, where `fn(rank, world_size, *args)` is a module-level
function. Rank 0..N-1 results come back in order; any rank's exception fails the test with its traceback.
"""

from __future__ import annotations

import io
import socket
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120
COLLECTIVES = ["all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast", "reduce",
               "all_to_all", "all_to_all_single", "gather", "scatter", "barrier", "reduce_scatter",
               "reduce_scatter_tensor"]


@contextmanager
def counted_collectives() -> Iterator[dict[str, int]]:
    """Counts the calls of `torch.distributed`'s collectives made inside the block, in `counter["n"]`."""
    counter = {"n": 0}
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counter["n"] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in originals.items():
        setattr(dist, name, counting(fn))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_bytes(value: Any) -> bytes:
    """Results travel as bytes: tensors sent through a queue vanish with the process that shared them."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        queue.put((rank, True, _to_bytes(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` on `world_size` gloo ranks; returns the per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in procs:
            rank, ok, value = queue.get(timeout=TIMEOUT_S)
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]
