"""The batch's kept sets: the rollout engine's top-k / top-p survivors of every token, as two batch keys.

`kept_set_offsets` int64 `[T + 1]` and `kept_set_ids` int64, an `ops.KeptSet` over the batch's token positions:
`[B, S]` flattened (padded) or `[1, T]` (packed), aligned with `input_ids` as every per-token tensor is (position `t`
holds the set token `t` was drawn from). A position that is not a response token (`token_mask` 0, or a sequence's
first token) holds an empty set. The batch carries them for `SamplingDistribution(replay_kept_set=True)` (train on
them) and for the kept-set metrics.

They are not shaped like the per-token tensors, so the code that cuts a batch into microbatches, packs it or splits
it over context-parallel ranks moves them with `as_positions` / `with_kept_set`: the CSR becomes a per-token
position tensor that the generic per-token code carries like any other (padding and shifted-out positions get 0:
no set), and is cut back into a CSR for the positions that arrive.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from megatron_grpo.ops.kept_set import KeptSet

KEPT_SET_OFFSETS = "kept_set_offsets"
KEPT_SET_IDS = "kept_set_ids"
KEPT_SET_KEYS = (KEPT_SET_OFFSETS, KEPT_SET_IDS)
BATCH_NAMES = (f"batch[{KEPT_SET_OFFSETS!r}]", f"batch[{KEPT_SET_IDS!r}]")
_POSITION = "kept_set_position"  # while a batch is cut: each token's 1-based position in the kept set, 0 = none

Batch = Mapping[str, torch.Tensor]


def kept_set_of(batch: Batch) -> KeptSet | None:
    """The batch's `KeptSet` (its form checked against the batch's tokens), or None when it carries none."""
    present = [key in batch for key in KEPT_SET_KEYS]
    if not any(present):
        return None
    if not all(present):
        missing = KEPT_SET_KEYS[present.index(False)]
        raise ValueError(f"batch[{missing!r}] is missing: a batch's kept sets are both {KEPT_SET_OFFSETS} and "
                         f"{KEPT_SET_IDS}")
    kept = KeptSet(batch[KEPT_SET_OFFSETS], batch[KEPT_SET_IDS])
    input_ids = batch["input_ids"]
    kept.check_form(input_ids.numel(), input_ids.device, BATCH_NAMES)
    return kept


def without_kept_set(batch: Batch) -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch.items() if key not in KEPT_SET_KEYS}


def as_positions(batch: Batch) -> tuple[dict[str, torch.Tensor], KeptSet | None]:
    """`batch` with its kept sets replaced by a per-token position tensor (which per-token code cuts, packs and
    shifts like any other), and the kept sets; the batch itself and None when it carries none."""
    kept = kept_set_of(batch)
    if kept is None:
        return dict(batch), None
    input_ids = batch["input_ids"]
    positions = torch.arange(1, input_ids.numel() + 1, device=input_ids.device).view(input_ids.shape)
    return {**without_kept_set(batch), _POSITION: positions}, kept


def with_kept_set(batch: Batch, kept: KeptSet | None) -> dict[str, torch.Tensor]:
    """The inverse of `as_positions` for a batch cut from it: its kept sets are those of the positions it holds."""
    if kept is None:
        return dict(batch)
    batch = dict(batch)
    positions = batch.pop(_POSITION)
    taken = kept.take(positions.reshape(-1) - 1)
    return {**batch, KEPT_SET_OFFSETS: taken.offsets, KEPT_SET_IDS: taken.ids}


def check_kept_set_values(batch: Batch, targets: torch.Tensor, response: torch.Tensor,
                          true_vocab_size: int | None) -> None:
    """The batch contract's checks of its kept sets, each a ValueError naming its key: the values
    `ops.KeptSet.check_values` reads (one host read), with every trained token of `targets` (aligned with the sets,
    -1 where not trained) in its set, and no set where `response` (bool, per token) is False (one more). Without
    `true_vocab_size` only the latter: the ops check the rest where they read the sets."""
    kept = kept_set_of(batch)
    if kept is None:
        return
    if true_vocab_size is not None:
        kept.check_values(targets.reshape(-1), true_vocab_size, BATCH_NAMES)
    lengths = kept.lengths()
    stray = (lengths > 0) & ~response.reshape(-1)
    where = torch.arange(stray.numel(), device=stray.device)
    first = int(torch.where(stray, where, stray.numel()).min()) if stray.numel() else 0
    if first < stray.numel():
        row, column = divmod(first, targets.shape[-1])
        raise ValueError(f"{BATCH_NAMES[0]}: position {first} (row {row}, column {column}) is not a response token "
                         f"(token_mask 0, or a sequence's first token) but carries a kept set of {int(lengths[first])} "
                         "ids; only sampled tokens have one")
