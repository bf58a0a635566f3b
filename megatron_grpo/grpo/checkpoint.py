"""Training checkpoints in Megatron's distributed format: model, Adam state, RNG and step, published atomically.

`megatron.core.dist_checkpointing` saves the model's `sharded_state_dict()`. The optimizer is a plain
`torch.optim` Adam on the CPU (Megatron's optimizer needs CUDA), so its moments are mapped onto the model's
sharded tensors with Megatron's own helpers, exactly as Megatron's FP32 optimizer does; Adam's step count is
shared by every parameter and saved once. Each rank's RNG state is a `ShardedObject`. A checkpoint therefore
loads into another tensor-parallel size too, and resumes bit-exactly into the same one.

Each checkpoint is a dist_checkpointing directory `<dir>/step_00000050/`, published once every rank's shards
are on disk (see `checkpoint_dir`). An unreadable checkpoint on resume is a `CheckpointError`: the run never
silently restarts from scratch.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Callable

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from megatron_grpo.grpo.checkpoint_dir import CheckpointError, publish, saved_world_size, step_dir_name, unpublish

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def save_checkpoint(
    directory: Path,
    *,
    steps_done: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
) -> Path:
    """Saves the training state after `steps_done` optimizer steps; every rank must call it together."""
    step_dir = Path(directory) / step_dir_name(steps_done)
    if rank == 0:
        step_dir.mkdir(parents=True, exist_ok=True)
        unpublish(step_dir)
    barrier()
    state = _sharded_training_state(model, optimizer, rank, world_size)
    state["steps_done"] = steps_done
    dist_checkpointing.save(state, str(step_dir))
    barrier()
    if rank == 0:
        publish(step_dir, world_size)
    barrier()
    return step_dir


def load_checkpoint(
    step_dir: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int
) -> int:
    """Restores model, optimizer and this rank's RNG from `step_dir`; returns the number of steps done.

    Into another world size (another TP size), model and optimizer are resharded; the per-rank RNG states
    then have no owner and are not restored.
    """
    _materialise_adam_state(optimizer)  # the sharded templates need tensors to load into
    template = _sharded_training_state(model, optimizer, rank, world_size)
    template["steps_done"] = 0
    same_world = saved_world_size(step_dir) == world_size
    if not same_world:
        del template["rng"]
    try:
        state = dist_checkpointing.load(template, str(step_dir))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(_with_adam_step(state["optimizer"], state["adam_step"]))
    except (Exception, CheckpointException) as err:  # many types for missing, truncated or garbled files
        raise CheckpointError(f"--resume: {step_dir} is corrupt or does not fit this model: "
                              f"{type(err).__name__}: {_last_line(err)}") from err
    if same_world:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
    return int(state["steps_done"])


def _sharded_training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, world_size: int
) -> dict[str, Any]:
    """The sharded state dict of model, optimizer (moments sharded like their parameters) and RNG."""
    model_state = model.sharded_state_dict()
    optimizer_state = optimizer.state_dict()
    adam_step = _common_adam_step(optimizer_state)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    optim_state_to_sharding_state(
        optimizer_state, get_param_id_to_sharded_param_map(model_state, params), exclude_keys=("step",)
    )
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    return {
        "model": model_state,
        "optimizer": optimizer_state,
        "adam_step": adam_step,
        "rng": ShardedObject("rng", rng, global_shape=(world_size,), global_offset=(rank,), replica_id=0),
    }


def _common_adam_step(optimizer_state: dict[str, Any]) -> float:
    """Adam's step count, which every parameter shares; 0 before the first step."""
    steps = {float(param_state["step"]) for param_state in optimizer_state["state"].values()}
    if len(steps) > 1:
        raise ValueError(f"optimizer: parameters are at different Adam steps {sorted(steps)}; cannot checkpoint")
    return steps.pop() if steps else 0.0


def _with_adam_step(optimizer_state: dict[str, Any], adam_step: float) -> dict[str, Any]:
    for param_state in optimizer_state["state"].values():
        param_state["step"] = torch.tensor(adam_step)
    return optimizer_state


def _materialise_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Gives every parameter zero Adam moments, as torch creates them lazily on the first step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                for moment in ADAM_MOMENTS:
                    state[moment] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _last_line(err: BaseException) -> str:
    """The gist of an error; torch's CheckpointException carries every rank's whole traceback."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else ""
