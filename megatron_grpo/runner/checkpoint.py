"""Training checkpoints in Megatron's distributed format: model, Adam state, RNG and step, published atomically.

Megatron's side (sharded state dicts, the `dist_checkpointing` writer and reader) is
`megatron_grpo.megatron.checkpointing`; this module decides what is saved, publishes and verifies it, and
resumes. The checkpoint holds the model's `sharded_state_dict()` and the optimizer's state: on CUDA Megatron's
distributed optimizer shards its own (fully reshardable); on the CPU the plain `torch.optim` Adam has its moments
sharded like their parameters, and its step count, shared by every parameter, saved once. Each rank's RNG state is a
per-rank object, and so are its rollouts in flight when `grpo.max_rollout_staleness` > 0 (the queue is part of the
checkpoint, not regenerated: the older weights that made it are gone). A checkpoint therefore loads into another
tensor-parallel size too (unless rollouts are in flight: they belong to the saved ranks), and resumes bit-exactly
into the same one.

Each checkpoint is a dist_checkpointing directory `<dir>/step_00000050/`, published with the checksum of every
file once every rank's shards are on disk (see `checkpoint_dir`). On load the checksums are verified first
(`checkpoint.verify_checksums`), each rank hashing its share of the files. An unreadable or altered checkpoint
is a `CheckpointError` naming it: the run never silently restarts from scratch or trains on wrong weights. A
save that fails on an OS error is a `CheckpointSaveError`: one sentence with the path, the errno, and what is
still loadable.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from megatron_grpo.megatron import (
    Optimizer,
    is_megatron_optimizer,
    last_error_line,
    load_sharded,
    per_rank_object,
    save_sharded,
    sharded_model_and_optimizer,
)
from megatron_grpo.runner.checkpoint_dir import (
    AgreedCheckpointError,
    CheckpointError,
    describe_os_error,
    loadable_sentence,
    publish,
    saved_world_size,
    step_dir_name,
    unpublish,
    verify_checksums,
)
from megatron_grpo.runner.rollout_queue import RolloutQueue

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
QUOTED_OS_ERROR = re.compile(r"\[Errno (?P<errno>\d+)\] (?P<strerror>[^:\n]+)(?:: '(?P<filename>[^'\n]+)')?")


def save_checkpoint(
    directory: Path,
    *,
    steps_done: int,
    model: torch.nn.Module,
    optimizer: Optimizer,
    rank: int,
    world_size: int,
    barrier: Callable[[], None],
    rollouts: Optional[RolloutQueue] = None,
) -> Path:
    """Saves the training state after `steps_done` optimizer steps, with this rank's `rollouts` in flight if
    given; every rank must call it together.

    An OS error on the way (unwritable, full) is a `CheckpointSaveError` that says what is still loadable."""
    step_dir = Path(directory) / step_dir_name(steps_done)
    writer_errors: list[str] = []  # the lines Megatron's writer logs: the only place naming some errors' errno
    try:
        if rank == 0:
            step_dir.mkdir(parents=True, exist_ok=True)
            unpublish(step_dir)
        barrier()
        state = _sharded_training_state(model, optimizer, rank, world_size)
        state["steps_done"] = steps_done
        state.update(_rollout_state(rollouts.state_dict() if rollouts is not None else None, rank, world_size))
        save_sharded(state, step_dir, logged_errors=writer_errors)
        barrier()
        if rank == 0:
            publish(step_dir, world_size)
        barrier()
    except (Exception, CheckpointException) as err:  # dist_checkpointing wraps a rank's OSError in its own types
        os_error = find_os_error(err) or first_quoted_os_error(writer_errors)
        if os_error is None:
            raise
        raise CheckpointSaveError(f"rank {rank}: could not save checkpoint {step_dir}: {describe_os_error(os_error)}; "
                                  f"{loadable_sentence(Path(directory))}") from err
    return step_dir


def quoted_os_error(text: str) -> Optional[OSError]:
    """An OSError quoted in a message (`[Errno 28] No space left on device: '<path>'`), rebuilt from its text."""
    quoted = QUOTED_OS_ERROR.search(text)
    if quoted is None:
        return None
    return OSError(int(quoted["errno"]), quoted["strerror"], quoted["filename"])


def first_quoted_os_error(messages: list[str]) -> Optional[OSError]:
    """The first OSError quoted in `messages`, rebuilt from its text; None if there is none."""
    return next((error for error in map(quoted_os_error, messages) if error is not None), None)


class CheckpointSaveError(CheckpointError):
    """Saving a checkpoint failed on an OS error; the message names the path and the errno."""


def find_os_error(err: BaseException) -> Optional[OSError]:
    """The OSError behind `err`: itself, its cause or context, or a failed rank's error inside torch's
    CheckpointException. The ranks' errors reach that one pickled, without their causes: an OSError quoted in a
    message (`[Errno 28] No space left on device: '<path>'`) is rebuilt from its text."""
    seen: set[int] = set()
    pending = [err]
    while pending:
        current = pending.pop(0)
        if isinstance(current, tuple):  # torch's wrapped failure: (exception, stack summary)
            pending += list(current)
            continue
        if not isinstance(current, BaseException) or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        quoted = quoted_os_error(str(current))
        if quoted is not None:
            return quoted
        pending += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += list(failures.values())
    return None


def load_checkpoint(
    step_dir: Path, *, model: torch.nn.Module, optimizer: Optimizer, rank: int, world_size: int,
    verify: bool = True, rollouts: Optional[RolloutQueue] = None,
) -> int:
    """Restores model, optimizer, this rank's RNG and (into `rollouts`) its rollouts in flight from `step_dir`;
    returns the number of steps done.

    With `verify`, first checks every file against the checksums of the COMPLETE marker (every rank must
    call this together). Into another world size (another TP size), model and optimizer are resharded; the
    per-rank RNG states then have no owner and are not restored, and rollouts in flight are an error.
    """
    if verify:
        verify_shared(step_dir, rank, world_size)
    megatron_optimizer = is_megatron_optimizer(optimizer)
    if not megatron_optimizer:
        _materialise_adam_state(optimizer)  # the sharded templates need tensors to load into
    template = _sharded_training_state(model, optimizer, rank, world_size, is_loading=True)
    template["steps_done"] = 0
    same_world = saved_world_size(step_dir) == world_size
    template.update(_rollout_state(rollouts.state_dict() if rollouts is not None else None, rank, world_size))
    if not same_world:
        del template["rng"], template["rollouts"]
    try:
        state = load_sharded(template, step_dir)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"] if megatron_optimizer
                                  else _with_adam_step(state["optimizer"], state["adam_step"]))
    except (Exception, CheckpointException) as err:  # many types for missing, truncated or garbled files
        raise CheckpointError(f"cannot resume: {step_dir} is corrupt or does not fit this model: "
                              f"{type(err).__name__}: {last_error_line(err)}") from err
    _check_rollout_staleness(step_dir, state["rollout_staleness"], rollouts, same_world)
    if same_world:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if rollouts is not None:
            rollouts.load_state_dict(state["rollouts"])
    return int(state["steps_done"])


def _rollout_state(queue_state: Optional[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """The checkpoint entries of one rank's rollout queue: its staleness (common) and its rollouts (per rank)."""
    queue_state = queue_state if queue_state is not None else {"max_staleness": 0, "pending": []}
    return {
        "rollout_staleness": queue_state["max_staleness"],
        "rollouts": per_rank_object("rollouts", queue_state, rank, world_size),
    }


def _check_rollout_staleness(step_dir: Path, saved: int, rollouts: Optional[RolloutQueue], same_world: bool) -> None:
    """Rollouts in flight resume only into the same staleness and the same ranks that made them."""
    wanted = rollouts.max_staleness if rollouts is not None else 0
    if saved != wanted:
        raise CheckpointError(f"cannot resume: {step_dir} was saved with grpo.max_rollout_staleness = {saved}, this "
                              f"run has {wanted}; resume with the same value, or start over with --fresh")
    if saved > 0 and not same_world:
        raise CheckpointError(f"cannot resume: {step_dir} holds rollouts in flight (grpo.max_rollout_staleness = "
                              f"{saved}) made by {saved_world_size(step_dir)} ranks, and this run has a different "
                              f"number of ranks; resume with the saved layout, or start over with --fresh")


def verify_shared(step_dir: Path, rank: int, world_size: int) -> None:
    """Verifies the checksums of `step_dir`, each rank hashing every `world_size`-th file; every rank raises the
    same `CheckpointError` if any file fails."""
    try:
        verify_checksums(step_dir, share=(rank, world_size))
        problem = ""
    except CheckpointError as err:
        problem = str(err)
    problems = [problem]
    if world_size > 1 and dist.is_initialized():
        problems = [""] * world_size
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), "")
    if first:
        raise AgreedCheckpointError(f"checkpoint.verify_checksums: {first}")


def _sharded_training_state(
    model: torch.nn.Module, optimizer: Optimizer, rank: int, world_size: int, *, is_loading: bool = False
) -> dict[str, Any]:
    """The sharded state dict of model, optimizer and this rank's RNG. A `torch.optim` Adam's moments are sharded
    like their parameters and its step, shared by every parameter, saved once; Megatron's optimizer shards
    itself, its step included."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if is_megatron_optimizer(optimizer):
        return {**sharded_model_and_optimizer(model, optimizer, is_loading=is_loading),
                "rng": per_rank_object("rng", rng, rank, world_size)}
    return {
        **sharded_model_and_optimizer(model, optimizer, unsharded_keys=("step",)),
        "adam_step": _common_adam_step(optimizer.state_dict()),
        "rng": per_rank_object("rng", rng, rank, world_size),
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

