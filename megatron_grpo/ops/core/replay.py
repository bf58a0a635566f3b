"""Replaying a rollout engine's kept sets (`ops.KeptSet`) in the kernels: exact on a TP-sharded vocab, on every path.

Each rank reduces its shard's kept logits of a row to the usual partials (`partials.Partials`), so the all-gather and
`combine_partials` are the ops' own and the result is the softmax renormalised over exactly the kept set. A row's
partials come one of two ways, which agree up to rounding:

- *by threshold*: where this rank's kept ids of a row are exactly its logits at or above the smallest kept one, the
  kernels take that logit as a top-k / top-p threshold. A set equal to the filter's recomputed one is always such a
  set, so replaying it gives the filter's results bit for bit. Finding out costs one pass that counts each row's
  logits at or above that threshold (in pieces of rows, `chunking.piece_rows`).
- *by gathering*, every other row: its kept logits are gathered (O(kept)) and reduced with segment max / sums in
  entry order (deterministic); the kernels run such a row with threshold +inf (nothing kept, gradient 0 everywhere)
  and backward then writes the kept columns' gradient.

No dense mask of the vocab is built. A NaN or +inf logit anywhere in a scored row makes it NaN, as under a filter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.ops.core.backends import Kernels
from megatron_grpo.ops.core.chunking import piece_rows, pieces
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.core.partials import Partials
from megatron_grpo.ops.kept_set import KeptSet


@dataclass(frozen=True)
class RowSets:
    """The kept ids of a block of `rows` rows, entry by entry: entry `e` is token `ids[e]`, kept at block row
    `row_of[e]` (-1: a row outside the block). A row's entries are consecutive and rows come in increasing order;
    -1 entries may sit anywhere and take no part."""

    ids: torch.Tensor  # int64 [entries]
    row_of: torch.Tensor  # int64 [entries]
    rows: int

    @classmethod
    def of_rows(cls, kept: KeptSet, rows: int, next_token: bool) -> RowSets:
        """The sets of a block whose row `r` scores position `r + 1` of `kept` (`next_token`: the ops' shift, whose
        last row of a `[B, S]` sequence then meets position 0 of the next, which holds no set) or position `r`."""
        entries = torch.arange(kept.ids.numel(), device=kept.device)
        position = torch.searchsorted(kept.offsets, entries, right=True) - 1
        row = position - int(next_token)
        inside = (row >= 0) & (row < rows) & (position < kept.positions)
        return cls(kept.ids, torch.where(inside, row, -1), rows)

    @classmethod
    def of_groups(cls, kept: KeptSet, index: torch.Tensor, groups: list[slice], next_token: bool) -> list[RowSets]:
        """The sets of the fused paths' chunks: block `g` holds the rows `index[groups[g]]` (`index`: sorted row
        indices, the trained rows), numbered from 0 within it. One host read for every block."""
        filled = [g for g in groups if g.stop > g.start]
        shift = int(next_token)
        ends = [index[[g.start for g in filled]], index[[g.stop - 1 for g in filled]] + 1] if filled else []
        bounds = kept.offsets[(torch.cat(ends) + shift).clamp(max=kept.positions)].tolist() if filled else []
        blocks, number = [], 0
        for group in groups:
            if group.stop <= group.start:
                blocks.append(cls(kept.ids[:0], kept.ids[:0], 0))
                continue
            start, stop = bounds[number], bounds[len(filled) + number]
            number += 1
            entries = torch.arange(start, stop, device=kept.device)
            row = torch.searchsorted(kept.offsets, entries, right=True) - 1 - shift
            at = torch.searchsorted(index, row).clamp(max=index.numel() - 1)
            member = (index[at] == row) & (at >= group.start) & (at < group.stop)
            rows = group.stop - group.start
            blocks.append(cls(kept.ids[start:stop], torch.where(member, at - group.start, -1), rows))
        return blocks


@dataclass(frozen=True)
class _ShardEntries:
    """A block's entries on this rank's shard: the row and local column of each (clamped into range: read them only
    where `live`), whether it is live (a scored row's, in this shard's real columns) and whether it is the row's
    target, and the entries per row (`segments[0]`: those before the block's first row)."""

    row: torch.Tensor
    col: torch.Tensor
    live: torch.Tensor
    is_target: torch.Tensor
    segments: torch.Tensor  # int64 [rows + 1]


def _shard_entries(sets: RowSets, targets: torch.Tensor, vocab_start: int, valid_cols: int) -> _ShardEntries:
    row_of = sets.row_of
    segment = torch.cummax(row_of, 0).values if row_of.numel() else row_of  # -1 entries join the row before them
    # (an index_add, not bincount, whose output size would be read from the device)
    segments = torch.zeros(sets.rows + 1, dtype=torch.int64, device=row_of.device).index_add_(
        0, segment + 1, torch.ones_like(segment))
    row = row_of.clamp(min=0)
    col = sets.ids - vocab_start
    live = (row_of >= 0) & (col >= 0) & (col < valid_cols)
    target = targets[row] if sets.rows else torch.full_like(row, -1)
    live &= target >= 0
    return _ShardEntries(row=row, col=col.clamp(0, max(valid_cols - 1, 0)), live=live,
                         is_target=live & (sets.ids == target), segments=segments)


def _per_row(values: torch.Tensor, entries: _ShardEntries, reduce: str, initial: float) -> torch.Tensor:
    """`[rows]`: each row's segment of `values` (one per entry) reduced in entry order."""
    return torch.segment_reduce(values, reduce, lengths=entries.segments, initial=initial, unsafe=True)[1:]


def _kept_logits(logits: torch.Tensor, entries: _ShardEntries, logit_scale: float) -> torch.Tensor:
    """z = logit_scale * logit of every entry, in the compute dtype as the kernels round it (dead entries: any)."""
    dtype = compute_dtype(logits.dtype)
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        return torch.zeros(entries.row.shape, dtype=dtype, device=logits.device)
    z = logits[entries.row, entries.col].to(dtype)
    return z if logit_scale == 1.0 else z * logit_scale


def _count_at_or_above(logits: torch.Tensor, valid_cols: int, threshold: torch.Tensor, logit_scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, how many real logits have z `>=` its threshold, and whether it holds a NaN or +inf z."""
    rows, dtype = logits.shape[0], threshold.dtype
    count = torch.zeros(rows, dtype=dtype, device=logits.device)
    poisoned = torch.zeros(rows, dtype=torch.bool, device=logits.device)
    if valid_cols == 0:
        return count, poisoned
    for sl in pieces(rows, piece_rows(valid_cols)):
        z = logits[sl, :valid_cols].to(dtype)
        z = z if logit_scale == 1.0 else z * logit_scale
        count[sl] = (z >= threshold[sl, None]).sum(dim=-1).to(dtype)
        poisoned[sl] = (torch.isnan(z) | torch.isposinf(z)).any(dim=-1)
    return count, poisoned


def replay_partials(logits: torch.Tensor, targets: torch.Tensor, sets: RowSets, kernels: Kernels, vocab_start: int,
                    valid_cols: int, with_entropy: bool, logit_scale: float = 1.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(partials, threshold)` of `[rows, V_local]` logits over the kept sets `sets` (see the module docstring): the
    `[rows, 3|4]` partials the combine takes, and the `[rows]` threshold the kernels ran with (+inf on the gathered
    rows), which backward hands back to `replay_gradient`."""
    entries = _shard_entries(sets, targets, vocab_start, valid_cols)
    z = _kept_logits(logits, entries, logit_scale)
    inf = torch.full((), float("inf"), dtype=z.dtype, device=z.device)
    smallest = _per_row(torch.where(entries.live, z, inf), entries, "min", float("inf"))
    local = _per_row(entries.live.to(z.dtype), entries, "sum", 0.0)
    at_or_above, poisoned = _count_at_or_above(logits, valid_cols, smallest, logit_scale)
    by_threshold = (at_or_above == local) | poisoned
    threshold = torch.where(by_threshold, smallest, inf).contiguous()
    partials = kernels.logprob_partials(logits, targets, vocab_start, valid_cols, with_entropy, threshold,
                                        logit_scale=logit_scale)
    gathered = ~by_threshold & (targets >= 0)
    use = entries.live & gathered[entries.row] if sets.rows else entries.live
    return torch.where(gathered[:, None], _gathered_partials(z, entries, use, with_entropy), partials), threshold


def _gathered_partials(z: torch.Tensor, entries: _ShardEntries, use: torch.Tensor, with_entropy: bool) -> torch.Tensor:
    """`[rows, 3|4]` partials of the entries `use`: max m, sum exp(z - m), the target's z, sum exp(z - m) (z - m)."""
    neg_inf = float("-inf")
    m = _per_row(torch.where(use, z, neg_inf), entries, "max", neg_inf)
    shift = torch.where(m == neg_inf, torch.zeros_like(m), m)
    centered = z - shift[entries.row] if m.numel() else z
    e = torch.where(use, torch.exp(centered), 0.0)
    columns = [m, _per_row(e, entries, "sum", 0.0),
               _per_row(torch.where(use & entries.is_target, z, neg_inf), entries, "max", neg_inf)]
    if with_entropy:
        columns.append(_per_row(torch.where(e == 0, 0.0, e * centered), entries, "sum", 0.0))
    out = torch.stack(columns, dim=1)
    assert out.shape[1] == Partials.width(with_entropy)
    return out


@dataclass(frozen=True)
class GradientPatch:
    """The gathered rows' gradient at their kept columns, computed before the backward kernel (which may overwrite
    the logits) and written after it (`write`); dead entries add 0."""

    row: torch.Tensor
    col: torch.Tensor
    values: torch.Tensor

    def write(self, grad_logits: torch.Tensor) -> None:
        grad_logits.index_put_((self.row, self.col), self.values.to(grad_logits.dtype), accumulate=True)


def replay_gradient(logits: torch.Tensor, targets: torch.Tensor, sets: RowSets, threshold: torch.Tensor,
                    lse: torch.Tensor, mean_x: torch.Tensor | None, grad_logprob: torch.Tensor,
                    grad_entropy: torch.Tensor | None, vocab_start: int, valid_cols: int, logit_scale: float = 1.0
                    ) -> GradientPatch | None:
    """The gradient of the rows `replay_partials` gathered (threshold +inf): `d = s (g_lp (1[v = y] - p) + g_H p (E[z]
    - z))` at their kept columns, `p = exp(z - lse)`; the kernel, run with the same thresholds, writes the rest (and
    0 on those rows). `grad_logprob`, `mean_x`, `grad_entropy` as `rows.upstream_gradients` gives them."""
    if logits.shape[0] == 0 or valid_cols == 0:
        return None
    entries = _shard_entries(sets, targets, vocab_start, valid_cols)
    z = _kept_logits(logits, entries, logit_scale)
    gathered = (threshold == float("inf")) & (targets >= 0)
    use = entries.live & gathered[entries.row]
    row = entries.row
    p = torch.exp(z - lse[row].to(z.dtype))
    grad = grad_logprob[row].to(z.dtype) * logit_scale * (entries.is_target.to(z.dtype) - p)
    if grad_entropy is not None:
        entropy_term = grad_entropy[row].to(z.dtype) * logit_scale * p * (mean_x[row].to(z.dtype) - z)
        grad = grad + torch.where(p == 0, 0.0, entropy_term)
    return GradientPatch(row=row, col=entries.col, values=torch.where(use, grad, 0.0))
