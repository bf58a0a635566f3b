"""Context parallelism (CP) for `[B, S]` batches: the split with Megatron's own helper, and its inverse.

Every CP rank of a DP rank is handed the same full microbatch (as Megatron's `get_batch` loads it). The targets are
shifted on the full sequence, before the split, so the last row of a chunk takes its target from the next chunk:
`split_for_context_parallel` makes every per-token tensor row-aligned (Megatron's `labels` convention: position `t`
describes the target of row `t`, token `t + 1`), adds `labels` and the global `position_ids`, and then splits them
with `megatron.core.utils.get_batch_on_this_cp_rank` (zigzag: rank `r` holds chunks `r` and `2·CP−1−r` of the
`2·CP` equal chunks of every row). Per-sequence tensors (`[B]`) are not split. The loss reads such a share with an
`ops.ContextShard` (`context_shard()`); `gather_from_context_parallel` undoes the split of a per-row result and
returns it token-aligned, as the passes' logprobs are stored.
"""

from __future__ import annotations

import inspect
from typing import Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_grpo.ops.context_shard import PACKED_WITH_CONTEXT_PARALLEL, ContextShard
from megatron_grpo.ops.packing import CU_SEQLENS
from megatron_grpo.ops.shift import aligned_with_tokens

Batch = Mapping[str, torch.Tensor]

# Megatron-Core 0.19 added a required `is_hybrid_cp` (False: the per-sequence zigzag of 0.16).
_HYBRID_ARGUMENT = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters


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


def split_for_context_parallel(batch: Batch) -> dict[str, torch.Tensor]:
    """This CP rank's row-aligned share of a full `[B, S]` batch (see the module docstring): `input_ids` (the model's
    input) and `position_ids` (their global positions), `labels`, and every other per-token tensor (those shaped like
    `input_ids`) shifted so position `t` belongs to `labels[t] = input_ids[t + 1]`; per-sequence tensors unchanged.
    `S` must be a multiple of 2·CP (Megatron's zigzag), else a ValueError naming `batch['input_ids']`; a packed
    batch (`cu_seqlens`) is a ValueError (not supported under CP)."""
    if CU_SEQLENS in batch:
        raise ValueError(f"batch['cu_seqlens']: {PACKED_WITH_CONTEXT_PARALLEL}")
    input_ids = batch["input_ids"]
    size = context_parallel_size()
    if input_ids.dim() != 2 or input_ids.shape[1] % (2 * size):
        raise ValueError(f"batch['input_ids']: context parallelism ({size} ranks) splits each sequence into 2·CP = "
                         f"{2 * size} equal chunks; its length must be a multiple of {2 * size}, got shape "
                         f"{list(input_ids.shape)} (pad the sequences)")
    per_token = {key: _next_row(value) for key, value in batch.items()
                 if isinstance(value, torch.Tensor) and value.shape[:2] == input_ids.shape and value.dim() >= 2
                 and key != "input_ids"}
    per_token["labels"] = _next_row(input_ids)
    per_token["input_ids"] = input_ids
    per_token["position_ids"] = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    group = parallel_state.get_context_parallel_group()
    hybrid = {"is_hybrid_cp": False} if _HYBRID_ARGUMENT else {}
    local = get_batch_on_this_cp_rank(per_token, **hybrid, cp_group=group)
    return {**{key: value for key, value in batch.items() if key not in local}, **local}


def gather_from_context_parallel(local: torch.Tensor) -> torch.Tensor:
    """The full `[B, S]` per-token tensor, token-aligned (position 0 is 0), from every CP rank's row-aligned
    `[B, S / CP]` share of it (as `split_for_context_parallel` splits): one all-gather over the CP group, the zigzag
    undone, the rows moved to their targets' positions. Without CP, `local` itself."""
    size = context_parallel_size()
    if size == 1:
        return local
    shares = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(shares, local.contiguous(), group=parallel_state.get_context_parallel_group())
    chunk = local.shape[1] // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * size)
    for rank, share in enumerate(shares):
        chunks[rank], chunks[2 * size - 1 - rank] = share[:, :chunk], share[:, chunk:]
    return aligned_with_tokens(torch.cat(chunks, dim=1))
