"""The loss's batch contract (docs/design.md, data contracts): validation, the trained-token mask, valid counts.

A batch is padded (`[B, S]` per-token tensors, one sequence per row) or packed (`[1, T]` with `cu_seqlens`, see
`megatron_grpo.loss.packing`); `LossBatch.layout` says which, and the sequence-level code reads it alone.

Every problem is a `ValueError` that names the offending batch key. Per-token float inputs come back as float32
with zeros off the trained-token mask, so garbage in padding (e.g. -inf logprobs) can never reach a NaN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from megatron_grpo.loss.kept_set_batch import KEPT_SET_KEYS, check_kept_set_values
from megatron_grpo.loss.packing import SequenceLayout
from megatron_grpo.ops.current import HiddenStates

OPTIONAL_LOGPROB_KEYS = ("generation_logprobs", "prev_logprobs", "reference_policy_logprobs")


@dataclasses.dataclass(frozen=True)
class BatchRequirements:
    """Which optional per-token inputs this loss call needs, each with the reason shown when it is missing."""

    prev_logprobs: str | None
    generation_logprobs: str | None
    reference_policy_logprobs: str | None
    rewards: str | None = None  # [N] per-sequence rewards (VAPO's positive-example NLL)


@dataclasses.dataclass(frozen=True)
class LossBatch:
    """A validated batch, all per-token tensors aligned with `input_ids` (`[B, S]`, or `[1, T]` packed)."""

    input_ids: torch.Tensor  # int64
    mask: torch.Tensor  # float32, 1 where a token is trained; each sequence's first token is 0 (token-aligned)
    advantages: torch.Tensor  # float32, broadcast over tokens when given per sequence
    prev_logprobs: torch.Tensor | None  # float32
    generation_logprobs: torch.Tensor | None  # float32
    reference_policy_logprobs: torch.Tensor | None  # float32
    rewards: torch.Tensor | None = None  # float32 [N], only when required
    layout: SequenceLayout | None = None  # where each sequence lies; set by validate_batch
    labels: torch.Tensor | None = None  # int64, a row-aligned batch's targets (context parallelism), else None

    @property
    def targets(self) -> torch.Tensor:
        """The ops' targets, -1 off the trained-token mask: the tokens themselves (token-aligned, for the ops'
        `shift=True`) or the labels (row-aligned, `shift=False`)."""
        return trained_token_targets(self.input_ids if self.labels is None else self.labels, self.mask)

    @property
    def row_aligned(self) -> bool:
        return self.labels is not None


def validate_batch(
    batch: Mapping[str, torch.Tensor], output: torch.Tensor | HiddenStates | None, requirements: BatchRequirements,
    *, current: Mapping[str, torch.Tensor] | None = None, check_values: bool = True, row_aligned: bool = False,
) -> LossBatch:
    """Checks `batch` against the model's `output` (logits `[B, S, V_local]`, or `HiddenStates` of `[B, S, H]`), or
    against the precomputed `[B, S]` per-token tensors of `current` (name -> tensor) when there is no output, and
    returns it in the loss's working form.

    `check_values=False` skips the checks that read values (finite advantages and rewards: host syncs), for a caller
    that checked them once already; keys, shapes and dtypes are always checked.

    `row_aligned`: a context-parallel rank's share of a padded or packed batch, its targets shifted before the split
    (Megatron's `labels` convention): `batch['labels']` (`input_ids`' shape, int64) holds each row's target, and
    every per-token tensor describes that target (see `trained_token_mask`)."""
    mask, layout = _mask_and_layout(batch, row_aligned)
    batch_size, seq_len = mask.shape
    if output is not None:
        name, tensor, last = (("hidden", output.hidden, "H") if isinstance(output, HiddenStates)
                              else ("logits", output, "V_local"))
        if tensor.dim() != 3 or tuple(tensor.shape[:2]) != (batch_size, seq_len):
            raise ValueError(
                f"{name}: expected shape [{batch_size}, {seq_len}, {last}] to match input_ids, got {_shape(tensor)}"
            )
        if not tensor.dtype.is_floating_point:
            raise ValueError(f"{name}: expected a floating dtype, got {tensor.dtype}")
    for key, tensor in (current or {}).items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{key}: expected a tensor, got {type(tensor).__name__}")
        _check_shape(key, tensor, [(batch_size, seq_len)])
        _check_floating(key, tensor)
    advantages = _advantages(batch, layout, check_values)
    logprobs = {}
    for key in OPTIONAL_LOGPROB_KEYS:
        reason = getattr(requirements, key)
        if key not in batch:
            if reason is not None:
                raise ValueError(f"batch[{key!r}] is missing: it is required {reason}")
            logprobs[key] = None
            continue
        tensor = _tensor(batch, key)
        _check_shape(key, tensor, [(batch_size, seq_len)])
        _check_floating(key, tensor)
        logprobs[key] = _on_mask(tensor, mask)
    rewards = _rewards(batch, layout, requirements.rewards, check_values) if requirements.rewards is not None \
        else None
    labels = None
    if row_aligned:
        labels = _tensor(batch, "labels")
        _check_shape("labels", labels, [(batch_size, seq_len)])
        if labels.dtype != torch.int64:
            raise ValueError(f"batch['labels']: expected dtype torch.int64, got {labels.dtype}")
    if check_values:  # (the kept sets' form is checked wherever they are read)
        check_kept_set_values(batch, trained_token_targets(batch["input_ids"] if labels is None else labels, mask),
                              response_tokens(batch, layout, row_aligned), None)
    return LossBatch(
        input_ids=batch["input_ids"], mask=mask, advantages=_on_mask(advantages, mask), rewards=rewards, **logprobs,
        layout=layout, labels=labels,
    )


def check_batch_values(batch: Mapping[str, torch.Tensor], true_vocab_size: int) -> None:
    """The checks of a batch's values, in one host sync: token ids in `[0, true_vocab_size)`, finite advantages (and
    rewards, when given); and the kept sets' (`loss.kept_set_batch`, two more) where the batch carries them. For a
    caller that then runs the loss and the ops with `check_inputs=False` (the Megatron train step checks its rollout
    once, not each microbatch of each pass). A bad value is a `ValueError` naming its key."""
    input_ids, advantages = _tensor(batch, "input_ids"), _tensor(batch, "advantages")
    if input_ids.numel() == 0:
        return
    _check_ids_and_advantages(batch, input_ids, advantages, true_vocab_size)
    if any(key in batch for key in KEPT_SET_KEYS):
        mask, layout = _mask_and_layout(batch)
        check_kept_set_values(batch, trained_token_targets(input_ids, mask), response_tokens(batch, layout),
                              true_vocab_size)


def response_tokens(batch: Mapping[str, torch.Tensor], layout: SequenceLayout, row_aligned: bool = False
                    ) -> torch.Tensor:
    """bool, per token: the positions that may carry a kept set: `token_mask` set, a sequence's first token
    excluded (`row_aligned`, a context-parallel share: row `t`'s target's, none excluded)."""
    response = _tensor(batch, "token_mask") != 0
    return response if row_aligned else response & ~layout.sequence_starts


def _check_ids_and_advantages(batch: Mapping[str, torch.Tensor], input_ids: torch.Tensor, advantages: torch.Tensor,
                              true_vocab_size: int) -> None:
    rewards = batch.get("rewards")
    finite = [torch.isfinite(advantages).all()]
    if isinstance(rewards, torch.Tensor):
        finite.append(torch.isfinite(rewards).all())
    smallest, largest, *all_finite = torch.stack([input_ids.min().double(), input_ids.max().double(),
                                                  *(flag.double() for flag in finite)]).tolist()
    if smallest < 0 or largest >= true_vocab_size:
        bad = int(smallest) if smallest < 0 else int(largest)
        raise ValueError(f"batch['input_ids']: contains token id {bad}, outside the vocab [0, {true_vocab_size})")
    for key, ok in zip(("advantages", "rewards"), all_finite):
        if not ok:
            raise ValueError(f"batch[{key!r}]: contains NaN or infinite values")


def trained_token_targets(input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`input_ids` with -1 (ignore) where `mask` is 0: the targets of the ops' next-token mode (`shift=True`)."""
    return input_ids.masked_fill(mask == 0, -1)


def trained_token_mask(batch: Mapping[str, torch.Tensor], *, row_aligned: bool = False) -> torch.Tensor:
    """float32, `input_ids`' shape: `token_mask * sample_mask`, each sequence's first token excluded (it has no
    logprob).

    `row_aligned` (a context-parallel rank's share, targets shifted before the split): position `j` is row `j`'s
    target, whose mask the split batch already carries (the row before a sequence's first token never is one), so
    no position is excluded."""
    return _mask_and_layout(batch, row_aligned)[0]


def count_valid(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(trained tokens, sequences with at least one trained token) of one microbatch, padded or packed, as float32
    scalars.

    Sum these over the microbatches and data-parallel ranks of an optimizer step to get the loss's
    `global_valid_tokens` and `global_valid_seqs`.
    """
    mask, layout = _mask_and_layout(batch)
    return mask.sum(), (layout.sum(mask) > 0).sum().to(torch.float32)


def _mask_and_layout(batch: Mapping[str, torch.Tensor], row_aligned: bool = False
                     ) -> tuple[torch.Tensor, SequenceLayout]:
    input_ids = _tensor(batch, "input_ids")
    layout = SequenceLayout.of_batch(batch)
    if input_ids.dtype != torch.int64:
        raise ValueError(f"batch['input_ids']: expected dtype torch.int64, got {input_ids.dtype}")
    token_mask = _tensor(batch, "token_mask")
    sample_mask = _tensor(batch, "sample_mask")
    _check_shape("token_mask", token_mask, [layout.token_shape])
    layout.check_per_sequence("sample_mask", sample_mask)
    for key, tensor in (("token_mask", token_mask), ("sample_mask", sample_mask)):
        if tensor.dtype.is_complex:
            raise ValueError(f"batch[{key!r}]: expected a bool, integer or floating dtype, got {tensor.dtype}")
    mask = (token_mask != 0) & layout.broadcast(sample_mask != 0)
    if not row_aligned:
        mask &= ~layout.sequence_starts
    return mask.to(torch.float32), layout


def _advantages(batch: Mapping[str, torch.Tensor], layout: SequenceLayout, check_values: bool) -> torch.Tensor:
    advantages = _tensor(batch, "advantages")
    if advantages.dim() == 1:
        layout.check_per_sequence("advantages", advantages)
    else:
        _check_shape("advantages", advantages, [layout.token_shape, (layout.num_sequences,)])
    _check_floating("advantages", advantages)
    if check_values and not bool(torch.isfinite(advantages).all()):
        raise ValueError("batch['advantages']: contains NaN or infinite values")
    return layout.broadcast(advantages) if advantages.dim() == 1 else advantages


def _rewards(batch: Mapping[str, torch.Tensor], layout: SequenceLayout, reason: str, check_values: bool
             ) -> torch.Tensor:
    if "rewards" not in batch:
        raise ValueError(f"batch['rewards'] is missing: it is required {reason}")
    rewards = _tensor(batch, "rewards")
    layout.check_per_sequence("rewards", rewards)
    _check_floating("rewards", rewards)
    if check_values and not bool(torch.isfinite(rewards).all()):
        raise ValueError("batch['rewards']: contains NaN or infinite values")
    return rewards.to(torch.float32)


def _on_mask(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """float32 copy of `tensor` with zeros where `mask` is 0, whatever was there (NaN and inf included)."""
    return torch.where(mask.bool(), tensor.to(torch.float32), torch.zeros((), dtype=torch.float32, device=mask.device))


def _tensor(batch: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in batch:
        raise ValueError(f"batch[{key!r}] is missing")
    value = batch[key]
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"batch[{key!r}]: expected a torch.Tensor, got {type(value).__name__}")
    return value


def _check_shape(key: str, tensor: torch.Tensor, allowed: list[tuple[int, ...]]) -> None:
    if tuple(tensor.shape) not in allowed:
        expected = " or ".join(str(list(shape)) for shape in allowed)
        raise ValueError(f"batch[{key!r}]: expected shape {expected}, got {_shape(tensor)}")


def _check_floating(key: str, tensor: torch.Tensor) -> None:
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"batch[{key!r}]: expected a floating dtype, got {tensor.dtype}")


def _shape(tensor: torch.Tensor) -> list[int]:
    return list(tensor.shape)
