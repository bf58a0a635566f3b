"""Context parallelism (CP) for padded `[B, S]` and packed (THD) batches: the split, and its inverse.

Every CP rank of a DP rank is handed the same full microbatch (as Megatron's `get_batch` loads it). The targets are
shifted on the full sequences, before the split, so the last row of a chunk takes its target from the next chunk:
`split_for_context_parallel` makes every per-token tensor row-aligned (Megatron's `labels` convention: position `t`
describes the target of row `t`, token `t + 1` of the same sequence; a sequence's last row has none), adds `labels`
and the tokens' `position_ids`, and then splits them: each sequence into `2·CP` equal chunks, rank `r` keeping
chunks `r` and `2·CP−1−r` (the zigzag). The per-token tensors that describe the input tokens themselves, an MoE
model's `routed_experts` and `moe_padding_mask` (`routing_replay.INPUT_ALIGNED_KEYS`), are split like `input_ids`,
unshifted: the routes of the tokens each rank feeds its routers. A padded batch is split with Megatron's
`get_batch_on_this_cp_rank`. A packed batch (`cu_seqlens`, each sequence a multiple of 2·CP long) is split sequence
by sequence, as Megatron's `get_thd_batch_on_this_cp_rank` does with Transformer Engine's
`thd_get_partitioned_indices` (used where TE is importable; elsewhere `zigzag_positions` computes the same
indices); the rank's share is a packed batch of the same sequences, each `1 / CP` as long (`cu_seqlens // CP`).
Per-sequence tensors (`[B]` or `[N]`) are not split. The loss reads such a share with an `ops.ContextShard`
(`context_shard()`); `gather_from_context_parallel` undoes the split of a per-row result and returns it
token-aligned, as the passes' logprobs are stored.
"""

from __future__ import annotations

import inspect
from typing import Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_grpo.loss.kept_set_batch import as_positions, with_kept_set
from megatron_grpo.loss.packing import CU_SEQLENS, POSITION_IDS, SequenceLayout
from megatron_grpo.megatron.routing_replay import (
    INPUT_ALIGNED_KEYS,
    MOE_PADDING_MASK,
    ROUTED_EXPERTS,
    placeholder_routes,
)
from megatron_grpo.megatron.transformer_engine import transformer_engine_usable
from megatron_grpo.ops.context_shard import ContextShard

Batch = Mapping[str, torch.Tensor]

# Megatron-Core 0.19 added a required `is_hybrid_cp` (False: the per-sequence zigzag of 0.16).
_HYBRID_ARGUMENT = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
# Megatron-Core 0.16 has `get_thd_batch_on_this_cp_rank`; 0.19 splits THD in `get_batch_on_this_cp_rank` instead.
_THD_HELPER = getattr(megatron_utils, "get_thd_batch_on_this_cp_rank", None)


def context_parallel_size() -> int:
    return parallel_state.get_context_parallel_world_size()


def context_shard() -> ContextShard | None:
    """This rank's `ContextShard` (Megatron's CP group), or None without context parallelism."""
    if context_parallel_size() == 1:
        return None
    return ContextShard(parallel_state.get_context_parallel_group())


def _next_row(tensor: torch.Tensor) -> torch.Tensor:
    """Position `t` takes position `t + 1`'s value (the row's target's); the last position, which has no target, 0."""
    return torch.cat([tensor[:, 1:], torch.zeros_like(tensor[:, :1])], dim=1)


def _next_row_in_sequence(tensor: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """`_next_row` within each packed sequence: a sequence's last position, which has no target, is 0 (it never
    takes the next sequence's first token)."""
    ends = layout.sequence_starts.roll(-1, dims=1)
    return _next_row(tensor).masked_fill(ends.view(*ends.shape, *[1] * (tensor.dim() - 2)), 0)


def split_for_context_parallel(batch: Batch) -> dict[str, torch.Tensor]:
    """This CP rank's row-aligned share of a full `[B, S]` or packed `[1, T]` batch (see the module docstring):
    `input_ids` (the model's input) and `position_ids` (their positions in their sequence), `labels`, and every
    other per-token tensor (those shaped like `input_ids`) shifted so position `t` belongs to `labels[t] =
    input_ids[t + 1]` (except `routing_replay.INPUT_ALIGNED_KEYS`, split unshifted like `input_ids`); per-sequence
    tensors unchanged. Padded: `S` must be a multiple of 2·CP (Megatron's zigzag),
    else a ValueError naming `batch['input_ids']`. Packed: every sequence's length must be a multiple of 2·CP, else
    a ValueError naming `batch['cu_seqlens']`; the share's `cu_seqlens` are the local ones (`cu_seqlens // CP`).
    Kept sets (`loss.kept_set_batch`) are shifted and split with the per-token tensors: row `t` holds token
    `t + 1`'s."""
    batch, kept = as_positions(batch)
    return with_kept_set(_split_packed(batch) if CU_SEQLENS in batch else _split_padded(batch), kept)


def _split_padded(batch: Batch) -> dict[str, torch.Tensor]:
    """`split_for_context_parallel` of a padded batch: the shift, then Megatron's zigzag."""
    input_ids = batch["input_ids"]
    size = context_parallel_size()
    if input_ids.dim() != 2 or input_ids.shape[1] % (2 * size):
        raise ValueError(f"batch['input_ids']: context parallelism ({size} ranks) splits each sequence into 2·CP = "
                         f"{2 * size} equal chunks; its length must be a multiple of {2 * size}, got shape "
                         f"{list(input_ids.shape)} (pad the sequences)")
    per_token = {key: value if key in INPUT_ALIGNED_KEYS else _next_row(value) for key, value in batch.items()
                 if isinstance(value, torch.Tensor) and value.shape[:2] == input_ids.shape and value.dim() >= 2
                 and key != "input_ids"}
    per_token["labels"] = _next_row(input_ids)
    per_token["input_ids"] = input_ids
    per_token["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    group = parallel_state.get_context_parallel_group()
    hybrid = {"is_hybrid_cp": False} if _HYBRID_ARGUMENT else {}
    local = get_batch_on_this_cp_rank(per_token, **hybrid, cp_group=group)
    return {**{key: value for key, value in batch.items() if key not in local}, **local}


def padded_for_context_parallel(batch: Batch) -> Batch:
    """A padded `[B, S]` batch with every per-token tensor (shaped like `input_ids`) extended with zeros to the next
    multiple of 2·CP, the length the zigzag split needs: untrained positions after every row's end, which causal
    attention never lets a real token see (`train_step` and `compute_logprobs` cut the results back to `S`); kept
    sets follow their tokens, and the added positions hold none; an MoE model's routes there are placeholders and its
    padding mask marks them padding. A packed batch (its sequences padded when packed)
    or CP 1: `batch` itself."""
    multiple = 2 * context_parallel_size()
    input_ids = batch["input_ids"]
    missing = -input_ids.shape[1] % multiple
    if multiple == 2 or CU_SEQLENS in batch or not missing:
        return batch
    batch, kept = as_positions(batch)  # the kept sets follow their tokens; the added positions hold none
    return with_kept_set({key: torch.cat([value, _filler(key, value, missing)], dim=1)
                          if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == input_ids.shape
                          else value for key, value in batch.items()}, kept)


def _filler(key: str, value: torch.Tensor, missing: int) -> torch.Tensor:
    """The `missing` positions added after every row of `value`: zeros, except an MoE model's routes (`0 .. k-1`,
    k distinct experts, as for positions never routed) and its padding mask (True: padding)."""
    shape = (value.shape[0], missing, *value.shape[2:])
    if key == ROUTED_EXPERTS:
        return placeholder_routes(shape[:-1], shape[-1], value.device).to(value.dtype)
    if key == MOE_PADDING_MASK:
        return value.new_ones(shape)
    return value.new_zeros(shape)


def _split_packed(batch: Batch) -> dict[str, torch.Tensor]:
    """`split_for_context_parallel` of a packed batch: the targets shifted within each sequence, then every
    per-token tensor cut to this rank's two chunks of each sequence (`_thd_partition`)."""
    layout = SequenceLayout.of_batch(batch)
    size = context_parallel_size()
    _check_packed_lengths(batch[CU_SEQLENS], size)
    input_ids = batch["input_ids"]
    positions = batch.get(POSITION_IDS)
    if positions is None:  # restarting at 0 in every sequence, as model_forward numbers a packed batch
        positions = layout.positions
    per_token = {key: value if key in INPUT_ALIGNED_KEYS else _next_row_in_sequence(value, layout)
                 for key, value in batch.items()
                 if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == input_ids.shape
                 and key not in ("input_ids", POSITION_IDS)}
    per_token["labels"] = _next_row_in_sequence(input_ids, layout)
    per_token["input_ids"] = input_ids
    per_token[POSITION_IDS] = positions
    index = _thd_partition(batch[CU_SEQLENS], input_ids.shape[1])
    local = {key: value.index_select(1, index) for key, value in per_token.items()}
    local[CU_SEQLENS] = torch.div(batch[CU_SEQLENS], size, rounding_mode="floor").to(torch.int32)
    return {**{key: value for key, value in batch.items() if key not in local}, **local}


def _check_packed_lengths(cu_seqlens: torch.Tensor, size: int) -> None:
    """Every packed sequence must split into 2·CP equal chunks: a ValueError naming `batch['cu_seqlens']`."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if any(length % (2 * size) for length in lengths):
        raise ValueError(f"batch['cu_seqlens']: context parallelism ({size} ranks) splits each packed sequence into "
                         f"2·CP = {2 * size} equal chunks; every sequence's length must be a multiple of {2 * size}, "
                         f"got lengths {lengths} (pad each sequence at its end to a multiple of {2 * size}, as "
                         "Megatron's cu_seqlens_padded does)")


def _thd_partition(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 `[T / CP]`: the packed positions this CP rank holds, chunks `r` and `2·CP−1−r` of each sequence, in
    sequence order: Megatron's THD split (Transformer Engine's `thd_get_partitioned_indices`) where TE is
    importable, else `zigzag_positions`."""
    group = parallel_state.get_context_parallel_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if not transformer_engine_usable():
        return zigzag_positions(cu_seqlens, num_tokens, size, rank)
    # Megatron's helper splits a batch's tokens; splitting the positions themselves gives the indices.
    positions = {"tokens": torch.arange(num_tokens, device=cu_seqlens.device)[None]}
    if _THD_HELPER is not None:  # Megatron-Core 0.16
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        local, _ = _THD_HELPER(positions, cu_seqlens, cu_seqlens, lengths.max()[None], cp_size=size, cp_rank=rank)
    else:  # Megatron-Core 0.19: its per-document zigzag, cu_seqlens with a leading batch dim
        local = get_batch_on_this_cp_rank({**positions, "cu_seqlens": cu_seqlens[None],
                                           "cu_seqlens_padded": cu_seqlens[None]}, is_hybrid_cp=False, cp_group=group)
    return local["tokens"][0].to(torch.int64)


def zigzag_positions(cu_seqlens: torch.Tensor, num_tokens: int, size: int, rank: int) -> torch.Tensor:
    """int64 `[T / CP]`: the packed positions CP rank `rank` of `size` holds, Megatron's zigzag computed in plain
    torch: Transformer Engine's `thd_get_partitioned_indices` (what `_thd_partition` uses where TE is importable),
    and the order `attention.TorchDotProductAttention` gathers K and V back into. Local position `p` of sequence `i`
    (`o = p − cu_i / CP` into its share, chunk `c = len_i / 2·CP`) is packed position `cu_i + r·c + o` in the first
    chunk, `cu_i + (2·CP−2−r)·c + o` in the second."""
    local_cu = torch.div(cu_seqlens, size, rounding_mode="floor").to(torch.int64)
    sequence = SequenceLayout.packed(local_cu.to(torch.int32), num_tokens // size).sequence_ids[0]
    start, local_start = cu_seqlens.to(torch.int64)[:-1][sequence], local_cu[:-1][sequence]
    chunk = ((local_cu[1:] - local_cu[:-1]) // 2)[sequence]
    offset = torch.arange(num_tokens // size, device=cu_seqlens.device) - local_start
    return start + torch.where(offset >= chunk, (2 * size - 2 - rank) * chunk, rank * chunk) + offset


def gather_from_context_parallel(local: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The full per-token tensor, token-aligned, from every CP rank's row-aligned share of it (as
    `split_for_context_parallel` splits): one all-gather over the CP group, the split undone, the rows moved to
    their targets' positions. Padded: `[B, S]` from `[B, S / CP]`, position 0 is 0. Packed: `cu_seqlens` the full
    batch's (not the share's), `[1, T]` from `[1, T / CP]`, 0 at each sequence's first token (no logprob crosses a
    boundary). Without CP, `local` itself."""
    size = context_parallel_size()
    if size == 1:
        return local
    group = parallel_state.get_context_parallel_group()
    shares = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shares, local.contiguous(), group=group)
    if cu_seqlens is not None:
        return _gather_packed(shares, cu_seqlens, group)
    chunk = local.shape[1] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, share in enumerate(shares):
        chunks[rank], chunks[2 * size - 1 - rank] = share[:, :chunk], share[:, chunk:]
    return _aligned_with_tokens(torch.cat(chunks, dim=1))


def _gather_packed(shares: list[torch.Tensor], cu_seqlens: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The packed `[1, T]` from every rank's share: each put back at the positions its rank's split took (all
    gathered, so the inverse is exactly the split used), then moved one position on within each sequence."""
    num_tokens = shares[0].shape[1] * len(shares)
    index = _thd_partition(cu_seqlens, num_tokens)
    indices = [torch.empty_like(index) for _ in shares]
    dist.all_gather(indices, index, group=group)
    rows = shares[0].new_zeros((1, num_tokens, *shares[0].shape[2:]))
    rows[:, torch.cat(indices)] = torch.cat(shares, dim=1)
    starts = SequenceLayout.packed(cu_seqlens, num_tokens).sequence_starts
    return _aligned_with_tokens(rows).masked_fill(starts.view(*starts.shape, *[1] * (rows.dim() - 2)), 0)


def _aligned_with_tokens(rows: torch.Tensor) -> torch.Tensor:
    """Row `t` (about token `t + 1`) moved to position `t + 1` along the sequence dim (dim 1), position 0 zero: the
    ops' `aligned_with_tokens` for tensors `[B, S, ...]` with trailing dims."""
    return torch.cat([torch.zeros_like(rows[:, :1]), rows[:, :-1]], dim=1)
