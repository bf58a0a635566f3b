"""Megatron's distributed checkpoint format: the sharded state of model, optimizer and per-rank objects, saved
and loaded with `megatron.core.dist_checkpointing`.

What is saved, when, and how a step directory is published and verified is the runner's business
(`megatron_grpo.runner.checkpoint`); this module only speaks Megatron's format:

- `sharded_model_and_optimizer`: the model's `sharded_state_dict()`, and the optimizer's: Megatron's own
  (CUDA) shards itself; a plain `torch.optim` optimizer's state (the CPU) has each per-parameter tensor sharded
  like its parameter, with Megatron's own helpers, exactly as Megatron's FP32 optimizer does.
- `per_rank_object`: a value that belongs to one rank (its RNG, its rollouts in flight), one slot per rank.
- `save_sharded` / `load_sharded`: a synchronous save with the `torch_dist` writer, and a load into a template.
- `load_model_weights`: a pretrained model's weights (a plain `dist_checkpointing.save(model.sharded_state_dict(),
  dir)`, or the model part of a runner step directory), saved at any TP/PP, checked against this model first.
"""

from __future__ import annotations

import logging
import queue
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer import MegatronOptimizer
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

from megatron_grpo.megatron.ddp import unwrapped

VOCAB_TENSOR_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")  # dim 0 is the padded vocab


class ModelCheckpointError(ValueError):
    """A model checkpoint that cannot be loaded into this model; the message names the directory."""


class CheckpointMismatchError(ModelCheckpointError):
    """The checkpoint does not hold this model: a tensor is missing or has another global shape."""


def sharded_model_and_optimizer(
    model: torch.nn.Module, optimizer: Any, *, unsharded_keys: tuple[str, ...] = (), is_loading: bool = False
) -> dict[str, Any]:
    """`{"model": ..., "optimizer": ...}`: the model's sharded state dict, and the optimizer's.

    A `torch.optim` optimizer's state dict has every per-parameter tensor (Adam's moments) sharded like its
    parameter; the per-parameter entries named in `unsharded_keys` (Adam's `step`, a scalar every parameter
    shares) are left out: the caller saves them some other way. Megatron's optimizer shards its own state
    (`sharded_state_dict`; the distributed optimizer in its fully reshardable form), and `is_loading` tells it
    that the result is a template to load into. Either result loads into another TP/PP/DP layout too."""
    model_state = unwrapped(model).sharded_state_dict()  # the GPTModel's keys, wrapped in DDP or not
    if isinstance(optimizer, MegatronOptimizer):
        return {"model": model_state, "optimizer": optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})}
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


def load_model_weights(model: torch.nn.Module, directory: str | Path, *, true_vocab_size: int | None = None) -> None:
    """Loads the model weights of the `dist_checkpointing` checkpoint `directory` into this rank's `model` (a
    GPTModel); every rank must call it together. `true_vocab_size`, the tokenizer's, sharpens the hint of a
    padded-vocab mismatch.

    The checkpoint may have been saved at any TP/PP: `sharded_state_dict()` addresses tensors by global shape and
    global layer index, so they are resharded to this rank's layout. Keys other than the model's (a runner step
    directory's optimizer, RNG, rollouts) are not read. Before anything is loaded, the model's tensors are compared
    with the checkpoint's metadata; the first missing or differently shaped one is a `CheckpointMismatchError`
    (the same on every rank), and a directory that is not such a checkpoint a `ModelCheckpointError`."""
    directory = Path(directory)
    problem = _agreed(_model_checkpoint_problem(model, directory, true_vocab_size))
    if problem is not None:
        raise problem
    template = model.sharded_state_dict()
    try:
        state = load_sharded(template, directory)
    except (CheckpointingException, CheckpointException) as err:  # missing or garbled files
        raise ModelCheckpointError(f"{directory}: cannot load the model weights: {type(err).__name__}: "
                                   f"{last_error_line(err)}") from err
    model.load_state_dict({key: state[key] for key in template})  # without a step directory's other common keys


def _model_checkpoint_problem(model: torch.nn.Module, directory: Path,
                              true_vocab_size: int | None) -> Optional[ModelCheckpointError]:
    """Why `directory` cannot load into `model` (not a checkpoint, or its first mismatching tensor); None if it
    can. Reads only the checkpoint's metadata."""
    if not directory.is_dir() or not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        return ModelCheckpointError(f"{directory} is not a Megatron-Core dist_checkpointing checkpoint (no "
                                    "metadata.json there); save one with "
                                    "dist_checkpointing.save(model.sharded_state_dict(), directory)")
    try:
        saved = dist_checkpointing.load_tensors_metadata(str(directory))
    except (CheckpointingException, CheckpointException, OSError) as err:  # e.g. the `.metadata` file missing
        return ModelCheckpointError(f"{directory}: cannot read the checkpoint's tensor metadata: "
                                    f"{type(err).__name__}: {last_error_line(err)}")
    for tensor in _sharded_tensors(model.sharded_state_dict()):
        if tensor.key not in saved:
            return CheckpointMismatchError(f"{directory}: the model's tensor {tensor.key} (global shape "
                                           f"{tuple(tensor.global_shape)}) is missing from the checkpoint")
        saved_shape = tuple(saved[tensor.key].global_shape)
        if saved_shape != tuple(tensor.global_shape):
            return CheckpointMismatchError(
                f"{directory}: tensor {tensor.key} has global shape {saved_shape} in the checkpoint and "
                f"{tuple(tensor.global_shape)} in this model{_vocab_hint(true_vocab_size, tensor, saved_shape)}")
    return None


def _vocab_hint(vocab: int | None, tensor: ShardedTensor, saved_shape: tuple[int, ...]) -> str:
    """For a padded-vocab mismatch of the embedding or output layer: Megatron's padding rule and the setting that
    gives the checkpoint's padded size (for `vocab` real tokens, when known); else nothing."""
    shape = tuple(tensor.global_shape)
    if tensor.key not in VOCAB_TENSOR_KEYS or len(shape) != len(saved_shape) or shape[1:] != saved_shape[1:]:
        return ""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    saved_padded = saved_shape[0]
    tokens = "tokens" if vocab is None else f"{vocab} tokens"
    rule = (f". Dimension 0 is the padded vocabulary: Megatron pads the {tokens} up to a multiple of "
            f"policy.model.make_vocab_size_divisible_by × the tensor-parallel size ({tp} here), which gives "
            f"{shape[0]} in this model and must give the checkpoint's {saved_padded}")
    if saved_padded % tp or (vocab is not None and saved_padded < vocab):
        return f"{rule}; no value does at TP {tp} with {tokens}: the checkpoint has another vocabulary"
    return f"{rule}: set policy.model.make_vocab_size_divisible_by to {saved_padded // tp}"


def _sharded_tensors(state: Any) -> Iterator[ShardedTensor]:
    """The ShardedTensors of a sharded state dict, in its order, factories built."""
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            yield value
        elif isinstance(value, ShardedTensorFactory):
            yield from _sharded_tensors(value.build())


def _agreed(problem: Optional[ModelCheckpointError]) -> Optional[ModelCheckpointError]:
    """The lowest rank's problem, on every rank (pipeline stages check different tensors, and a rank that found
    nothing would otherwise wait in the load's collectives for peers that raised)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return problem
    problems: list[Optional[ModelCheckpointError]] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def last_error_line(err: BaseException) -> str:
    """The gist of an error; torch's CheckpointException carries every rank's whole traceback."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else ""


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
