"""The ops' argument checks, each a `ValueError` naming what is wrong. Shape, dtype and device checks are free and
always run; `check_target_ids` reads values (a host sync) and runs with `check_inputs=True`."""

from __future__ import annotations

import torch

from megatron_grpo.ops.core.dtypes import LOGITS_DTYPES
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet
from megatron_grpo.ops.vocab_shard import VocabShard

INPLACE_BACKWARD_MODES = (False, True, "exp")


def check_target_ids(targets: torch.Tensor, shard: VocabShard) -> bool:
    """Target ids beyond the true vocab are an error, never a silent -inf (a host sync). Returns whether some
    target is ignored (< 0), read in the same sync."""
    if targets.numel() == 0:
        return False
    smallest, largest = (int(v) for v in torch.stack([targets.min(), targets.max()]).tolist())
    if largest >= shard.true_vocab_size:
        raise ValueError(
            f"targets contain token id {largest}, which is >= true_vocab_size={shard.true_vocab_size} "
            f"(ids at or beyond it are vocab padding and cannot be targets)"
        )
    return smallest < 0


def check_kept_set_argument(kept_set: KeptSet | None, distribution: SamplingDistribution, targets: torch.Tensor,
                            inplace_backward: bool | str = False) -> None:
    """An op's `kept_set=` goes with a distribution that replays it (`replay_kept_set`), and only so; its form (free
    checks) must fit the targets."""
    if distribution.replay_kept_set and kept_set is None:
        raise ValueError("kept_set: required by distribution.replay_kept_set (the engine's kept set of every "
                         "position of the targets, ops.KeptSet)")
    if kept_set is None:
        return
    if not distribution.replay_kept_set:
        raise ValueError("kept_set: given, but the distribution recomputes its filter; pass "
                         "distribution=distribution.replayed() (SamplingDistribution(replay_kept_set=True)) to "
                         "replay it")
    if not isinstance(kept_set, KeptSet):
        raise ValueError(f"kept_set: expected an ops.KeptSet, got {type(kept_set).__name__}")
    if inplace_backward == "exp":
        raise ValueError("kept_set: inplace_backward='exp' has no replay of a kept set; use inplace_backward=True")
    kept_set.check_form(targets.numel(), targets.device)


def check_kept_values(kept: KeptSet, row_targets: torch.Tensor, shard: VocabShard, next_token: bool) -> None:
    """`KeptSet.check_values` for an op's rows (one host read): with `next_token` row `r` scores position `r + 1`,
    so position `p` holds the target of row `p - 1`."""
    targets = row_targets
    if next_token and targets.numel():
        targets = torch.cat([row_targets.new_full((1,), -1), row_targets[:-1]])
    kept.check_values(targets, shard.true_vocab_size)


def check_integer_targets(targets: torch.Tensor) -> None:
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids, got dtype {targets.dtype}")


def check_logits_inputs(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """`vocab_parallel_logprobs`'s tensors: logits `[..., V_local]` of a supported dtype, targets `[...]`."""
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ValueError("logits and targets must be torch.Tensors")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    check_integer_targets(targets)
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal the logits shape without its vocab dim, "
            f"got logits {tuple(logits.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocab dim (V_local = 0)")
    if logits.device != targets.device:
        raise ValueError(f"logits are on {logits.device} but targets on {targets.device}")


def check_linear_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        chunk_rows: int | None) -> None:
    """`vocab_parallel_linear_logprobs`'s tensors: hidden `[..., H]`, weight `[V_local, H]` of the same dtype and
    device, targets `hidden.shape[:-1]`; `chunk_rows` None or an int >= 1."""
    for name, value in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V_local, H], got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocab dim (V_local = 0)")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} has H = "
                         f"{hidden.shape[-1] if hidden.dim() else None}, weight {tuple(weight.shape)} has H = "
                         f"{weight.shape[1]}")
    if hidden.device != weight.device or targets.device != hidden.device:
        raise ValueError(f"hidden, weight and targets must be on one device, got hidden on {hidden.device}, "
                         f"weight on {weight.device}, targets on {targets.device}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must have the same dtype, got hidden {hidden.dtype} and "
                         f"weight {weight.dtype}")
    if hidden.dtype not in LOGITS_DTYPES:
        raise ValueError(f"hidden and weight must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    check_integer_targets(targets)
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = "
                         f"{tuple(hidden.shape[:-1])}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                   or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be an int >= 1 (or None), got {chunk_rows!r}")


def check_inplace_backward(inplace_backward: bool | str) -> None:
    if not any(inplace_backward is mode or (isinstance(mode, str) and inplace_backward == mode)
               for mode in INPLACE_BACKWARD_MODES):
        raise ValueError(f"inplace_backward must be False, True or 'exp', got {inplace_backward!r}")
