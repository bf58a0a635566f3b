"""Megatron's distributed checkpoint format: the sharded state of model, optimizer and per-rank objects, saved
and loaded with `megatron.core.dist_checkpointing`.

What is saved, when, and how a step directory is published and verified is the runner's business
(`megatron_grpo.grpo.checkpoint`); this module only speaks Megatron's format:

- `sharded_model_and_optimizer`: the model's `sharded_state_dict()`, and a plain `torch.optim` optimizer's
  state with each per-parameter tensor sharded like its parameter, with Megatron's own helpers, exactly as
  Megatron's FP32 optimizer does (Megatron's optimizer needs CUDA; the runner's Adam runs on the CPU).
- `per_rank_object`: a value that belongs to one rank (its RNG, its rollouts in flight), one slot per rank.
- `save_sharded` / `load_sharded`: a synchronous save with the `torch_dist` writer, and a load into a template.
"""

from __future__ import annotations

import logging
import queue
from pathlib import Path
from typing import Any, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_grpo.megatron.ddp import unwrapped


def sharded_model_and_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, unsharded_keys: tuple[str, ...] = ()
) -> dict[str, Any]:
    """`{"model": ..., "optimizer": ...}`: the model's sharded state dict, and the optimizer's state dict with
    every per-parameter tensor (Adam's moments) sharded like its parameter.

    The per-parameter entries named in `unsharded_keys` (Adam's `step`, a scalar every parameter shares) are
    left out: the caller saves them some other way. The result loads into another tensor-parallel size too."""
    model_state = unwrapped(model).sharded_state_dict()  # the GPTModel's keys, wrapped in DDP or not
    optimizer_state = optimizer.state_dict()
    params = [param for group in optimizer.param_groups for param in group["params"]]
    optim_state_to_sharding_state(
        optimizer_state, get_param_id_to_sharded_param_map(model_state, params), exclude_keys=unsharded_keys
    )
    return {"model": model_state, "optimizer": optimizer_state}


def per_rank_object(key: str, value: Any, rank: int, world_size: int) -> ShardedObject:
    """`value` saved as rank `rank`'s own slot of `key` (pickled), one slot per rank of `world_size`: it loads
    back only into the same rank of the same world size."""
    return ShardedObject(key, value, global_shape=(world_size,), global_offset=(rank,), replica_id=0)


def save_sharded(state: dict[str, Any], directory: Path, *, logged_errors: Optional[list[str]] = None) -> None:
    """Saves the sharded `state` into `directory` (which must exist) with Megatron's `torch_dist` writer, every
    rank together, synchronously.

    The error lines the writer logs meanwhile are appended to `logged_errors`: Megatron-Core 0.17+ writes from
    threads and raises only the failed worker's exception class (`AssertionError: <class 'IsADirectoryError'>`),
    so the errno and the path of a failed write appear only in such a line
    (`Local worker 0 encountered an error: [Errno 21] Is a directory: '<path>'`). Errors are Megatron's own."""
    _keep_write_results_in_process()
    with _WriterErrorLog(logged_errors if logged_errors is not None else []):
        dist_checkpointing.save(state, str(directory))


def load_sharded(template: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Loads `directory` into the sharded `template` (the shape of what was saved, or a subset of it; tensors
    are resharded to the template's layout); returns the loaded state. Errors are Megatron's own."""
    return dist_checkpointing.load(template, str(directory))


def _keep_write_results_in_process() -> None:
    """Gives Megatron's `torch_dist` writer an in-process results queue instead of a spawned Manager's.

    The writer collects its results through a queue it makes on first use: a `multiprocessing` Manager, i.e. a
    second interpreter (about 330 MB) that lives as long as the rank and outlived a killed rank, adopted by
    init. That queue exists for asynchronous saves, whose writer runs in another process; a synchronous save
    (`save_sharded`) writes and reads the results in this process, so a plain queue does the same job.
    Versions without that module-level queue are left alone."""
    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


class _WriterErrorLog(logging.Handler):
    """Collects, into `messages`, the error lines Megatron's checkpoint writer logs while a `with` block runs."""

    LOGGER = filesystem_async.__name__  # the writer logs through its module's logger

    def __init__(self, messages: list[str]) -> None:
        super().__init__(level=logging.ERROR)
        self.messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> "_WriterErrorLog":
        logging.getLogger(self.LOGGER).addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger(self.LOGGER).removeHandler(self)
