"""Run a test function on N gloo ranks in processes of their own and collect what each rank returns.

Usage: `results = run_on_ranks(world_size, fn, *args)`, where `fn(rank, world_size, *args)` is a module-level
function. Rank 0..N-1 results come back in order; any rank's exception fails the test with its traceback.
"""

from __future__ import annotations

import atexit
import io
import os
import queue as queue_module
import socket
import sys
import traceback
from contextlib import contextmanager
from datetime import timedelta
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


def _run_task(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> tuple[int, bool, Any]:
    """One task on one rank: a fresh gloo group for it on the pool's store at `port`, destroyed after with any
    Megatron groups the task left; the rank's result or its traceback."""
    environment = dict(os.environ)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        return rank, True, _to_bytes(fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        return rank, False, traceback.format_exc()
    finally:
        parallel_state = sys.modules.get("megatron.core.parallel_state")
        if parallel_state is not None:  # a task that set up Megatron's groups and left them
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
        torch.set_default_dtype(torch.float32)


def _serve(rank: int, world_size: int, tasks: Any, results: Any) -> None:
    """A pool rank: runs the tasks it is sent, one at a time, until it is sent None."""
    torch.set_num_threads(1)
    while (task := tasks.get()) is not None:
        results.put(_run_task(rank, world_size, *task))


class _RankPool:
    """`world_size` spawned processes kept for the whole session, so that a test pays for starting Python and
    importing torch and Megatron once per world size, not once per call. A task that fails or times out retires
    the pool (its processes may hold a broken group or a hung collective); the next call starts a fresh one."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, self.tasks[r], self.results))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple) -> tuple[dict[int, Any], list[str]]:
        # The test process serves each call's rendezvous store on a port the OS picks while it binds it, so that
        # no other process (a parallel test worker) can take the port between its choice and its use.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=TIMEOUT_S))
        try:
            return self._collect(store.port, fn, args)
        finally:
            del store

    def _collect(self, port: int, fn: Callable, args: tuple) -> tuple[dict[int, Any], list[str]]:
        for queue in self.tasks:
            queue.put((port, fn, args))
        results: dict[int, Any] = {}
        failures: list[str] = []
        for _ in self.procs:
            try:
                rank, ok, value = self.results.get(timeout=TIMEOUT_S)
            except queue_module.Empty:
                failures.append(f"no result from {self.world_size - len(results) - len(failures)} rank(s) within "
                                f"{TIMEOUT_S} s")
                break
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                failures.append(f"rank {rank} failed:\n{value}")
        return results, failures

    def stop(self) -> None:
        """Asks every rank to exit after its current task."""
        for queue, p in zip(self.tasks, self.procs):
            if p.is_alive():
                try:
                    queue.put(None)
                except (OSError, ValueError):
                    pass

    def close(self, timeout: float = 10) -> None:
        self.stop()
        for p in self.procs:
            p.join(timeout=timeout)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _RankPool] = {}


@atexit.register
def _close_pools() -> None:
    pools = list(_POOLS.values())
    _POOLS.clear()
    for pool in pools:  # every rank of every pool winds down at once
        pool.stop()
    for pool in pools:
        pool.close()


def run_on_ranks(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` on `world_size` gloo ranks; returns the per-rank results.

    The ranks are the session's pool of that size (`_RankPool`): each call gets a fresh process group, its
    environment variables restored after, and a call that fails retires the pool, so one test's failure cannot
    leak into the next. A function that needs a process of its own (import-time state) runs it as a subprocess."""
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(timeout=1)
        pool = _POOLS[world_size] = _RankPool(world_size)
    results, failures = pool.run(fn, args)
    if failures:
        del _POOLS[world_size]
        pool.close(timeout=1)
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]
