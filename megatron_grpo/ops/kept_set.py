"""`KeptSet`: the token ids a rollout engine kept at each position when it sampled (its top-k / top-p survivors), in
CSR form, so that training can replay the engine's own support instead of recomputing the filter.

Position `i`'s set is `ids[offsets[i]:offsets[i + 1]]`: `offsets` int64 `[positions + 1]`, from 0, never decreasing,
ending at `ids.numel()`; `ids` int64, the global token ids of each set in increasing order (no duplicates), each in
`[0, true_vocab_size)`. This is vLLM's form (`SamplingMaskLists(token_ids, offsets)` inside the engine, one list per
generated token in `CompletionOutput.sampling_mask.token_ids`; docs/ops.md converts it). The positions are those
of the targets the set belongs to: the `[B, S]` tokens flattened (a padded batch) or `[1, T]` (a packed one), an
empty set where nothing was sampled.

Cost: 8 bytes per position and 8 per kept id (int64). Top-k keeps at most k ids per token; top-p alone can keep
most of a flat distribution's vocab (up to 8 x 150K bytes for one token of a 150K vocab), which is why vLLM asks
for a top-k bound with its sampling mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NAMES = ("kept_set.offsets", "kept_set.ids")  # how errors call a KeptSet's two tensors (the batch: its keys)


@dataclass(frozen=True)
class KeptSet:
    """The engine's kept ids of every position (see the module docstring). `take` re-cuts it for other positions
    (microbatches, packing, the context-parallel split); the ops read it with `kept_set=`."""

    offsets: torch.Tensor  # int64 [positions + 1]
    ids: torch.Tensor  # int64 [offsets[-1]]

    @property
    def positions(self) -> int:
        return self.offsets.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.offsets.device

    def lengths(self) -> torch.Tensor:
        """int64 `[positions]`: each position's number of kept ids."""
        return self.offsets[1:] - self.offsets[:-1]

    def to(self, device: torch.device | str) -> KeptSet:
        return KeptSet(self.offsets.to(device), self.ids.to(device))

    @classmethod
    def from_lists(cls, sets: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> KeptSet:
        """One set per position, each a sequence of token ids (sorted here; vLLM's `sampling_mask.token_ids`)."""
        lengths = torch.tensor([len(s) for s in sets], dtype=torch.int64)
        offsets = torch.zeros(len(sets) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        ids = torch.tensor([token for s in sets for token in sorted(s)], dtype=torch.int64)
        return cls(offsets.to(device), ids.to(device))

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> KeptSet:
        """The dense form, for small vocabularies: `mask` bool `[..., V]`, True where a token was kept; one
        position per entry of its leading dims, flattened."""
        if mask.dtype != torch.bool or mask.dim() < 1:
            raise ValueError(f"kept_set mask: expected a bool tensor [..., V], got {mask.dtype} of shape "
                             f"{list(mask.shape)}")
        rows = mask.reshape(-1, mask.shape[-1])
        position, ids = rows.nonzero(as_tuple=True)
        counts = torch.bincount(position, minlength=rows.shape[0])
        offsets = torch.zeros(rows.shape[0] + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(counts, 0, out=offsets[1:])
        return cls(offsets, ids)

    def take(self, positions: torch.Tensor) -> KeptSet:
        """The sets of `positions` (int64 `[n]`; -1: an empty set), in that order. One host read (the new total)."""
        positions = positions.reshape(-1).to(device=self.device, dtype=torch.int64)
        chosen = positions >= 0
        at = positions.clamp(min=0, max=max(self.positions - 1, 0))
        lengths = torch.where(chosen, self.offsets[at + 1] - self.offsets[at], 0) if self.positions \
            else torch.zeros_like(positions)
        offsets = torch.zeros(positions.numel() + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        total = int(offsets[-1])
        owner = torch.repeat_interleave(torch.arange(positions.numel(), device=self.device), lengths,
                                        output_size=total)
        source = self.offsets[at][owner] + torch.arange(total, device=self.device) - offsets[:-1][owner]
        return KeptSet(offsets, self.ids[source])

    def check_form(self, positions: int, device: torch.device, names: tuple[str, str] = NAMES) -> None:
        """The free checks (no host read): int64 1-D tensors, `positions + 1` offsets, on `device`. `names`: how the
        errors call the offsets and the ids."""
        for name, value in zip(names, (self.offsets, self.ids)):
            if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 1:
                got = f"{value.dtype} of shape {list(value.shape)}" if isinstance(value, torch.Tensor) \
                    else type(value).__name__
                raise ValueError(f"{name}: expected a 1-D int64 tensor, got {got}")
            if value.device != device:
                raise ValueError(f"{name}: on {value.device}, but the targets are on {device}")
        if self.offsets.numel() != positions + 1:
            raise ValueError(f"{names[0]}: expected {positions + 1} entries (one more than the {positions} "
                             f"positions of the targets), got {self.offsets.numel()}")

    def check_values(self, targets: torch.Tensor, true_vocab_size: int, names: tuple[str, str] = NAMES) -> None:
        """The checks that read values, in one host read, each a ValueError naming what is wrong: the offsets start
        at 0, never decrease and end at the number of ids; every id is in `[0, true_vocab_size)` and each set's ids
        increase; every scored target (`targets` `[positions]`, aligned with the sets; < 0: not scored) is in its
        set, since a token outside it cannot have been sampled from it."""
        offsets, ids = self.offsets, self.ids
        position = torch.searchsorted(offsets, torch.arange(ids.numel(), device=ids.device), right=True) - 1
        decreasing = offsets[1:] < offsets[:-1]
        unsorted = (ids[1:] <= ids[:-1]) & (position[1:] == position[:-1])
        scored = targets >= 0
        owner = position.clamp(0, max(self.positions - 1, 0))
        hits = torch.zeros(self.positions, dtype=torch.int64, device=ids.device)
        if ids.numel() and self.positions:
            on_target = (position >= 0) & (position < self.positions) & (ids == targets[owner])
            hits.index_add_(0, owner, on_target.to(torch.int64))
        missing = scored & (hits == 0)
        none = torch.full((), -1, dtype=torch.int64, device=ids.device)

        def first(flags: torch.Tensor) -> torch.Tensor:
            where = torch.arange(flags.numel(), device=flags.device)
            return torch.where(flags, where, flags.numel()).min() if flags.numel() else none

        values = torch.stack([offsets[0], offsets[-1], first(decreasing), first(unsorted),
                              ids.min() if ids.numel() else none, ids.max() if ids.numel() else none,
                              first(missing)]).tolist()
        start, end, decrease_at, unsorted_at, smallest, largest, missing_at = values
        offsets_name, ids_name = names
        if start != 0:
            raise ValueError(f"{offsets_name}: must start at 0, starts at {start}")
        if 0 <= decrease_at < self.positions:
            raise ValueError(f"{offsets_name}: must not decrease (position i's set is ids[offsets[i]:offsets[i + 1]]); "
                             f"offsets[{decrease_at + 1}] < offsets[{decrease_at}]")
        if end != ids.numel():
            raise ValueError(f"{offsets_name}: must end at the number of ids ({ids.numel()}), ends at {end}")
        if ids.numel() and (smallest < 0 or largest >= true_vocab_size):
            bad = smallest if smallest < 0 else largest
            raise ValueError(f"{ids_name}: contains token id {bad}, outside the vocab [0, {true_vocab_size})")
        if 0 <= unsorted_at < ids.numel() - 1:
            at = int(position[unsorted_at])
            raise ValueError(f"{ids_name}: each set's ids must increase (sorted, no duplicates); position {at}'s do "
                             f"not: {_shortened(ids[offsets[at]:offsets[at + 1]].tolist())}")
        if 0 <= missing_at < self.positions:
            kept = ids[offsets[missing_at]:offsets[missing_at + 1]].tolist()
            raise ValueError(f"{ids_name}: the target {int(targets[missing_at])} at position {missing_at} is not in "
                             f"its kept set {_shortened(kept)}: a token outside the set cannot have been sampled from "
                             "it")


def _shortened(ids: list[int], limit: int = 16) -> str:
    return str(ids) if len(ids) <= limit else f"[{', '.join(map(str, ids[:limit]))}, ... ({len(ids)} ids)]"
