"""The batch's sequence layout: padded `[B, S]` (one sequence per row) or packed (THD: `[1, T]` with `cu_seqlens`).

A packed batch is the padded batch's dict with every per-token tensor `[1, T]`, its sequences laid end to end, and
`cu_seqlens`, int32 `[N + 1]`: sequence `i` holds tokens `cu_seqlens[i]:cu_seqlens[i + 1]` (Megatron's
`PackedSeqParams` convention; strictly increasing from 0, ending at T). Per-sequence tensors (`sample_mask`,
per-sequence `advantages`, `rewards`, `rollout_weight_version`) are `[N]`. A layout that needs each sequence to
span a multiple of some length pads the sequence at its end (Megatron's `cu_seqlens_padded`): the padding tokens
belong to the sequence and are untrained (`token_mask` 0).

`SequenceLayout` owns this: the checks, which sequence each token belongs to, each sequence's first token (it has
no logprob: the next-token shift never crosses a boundary), and the per-sequence reductions. The padded layout is
its special case, one sequence per row, so the loss's sequence-level code runs one path for both:
`layout.rows(values)` is `[N, L]`, sequence `i`'s tokens in row `i` (the `[B, S]` tensor itself when padded; a
gather into zero-filled rows of the longest sequence's length when packed), and every per-sequence sum is a row
sum of it. Gathering instead of scattering (`index_add_`) keeps the reductions deterministic on every device.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

import torch

from megatron_grpo.loss.kept_set_batch import as_positions, with_kept_set

CU_SEQLENS = "cu_seqlens"
POSITION_IDS = "position_ids"  # optional [1, T] positions of a packed batch (default: restarting per sequence)


class SequenceLayout:
    """Where each of a batch's `num_sequences` sequences lies among its per-token positions `token_shape`."""

    def __init__(self, token_shape: tuple[int, int], device: torch.device, cu_seqlens: torch.Tensor | None = None,
                 max_seqlen: int | None = None) -> None:
        """Use `padded`, `packed` or `of_batch`: they check what they are given."""
        self.token_shape = tuple(token_shape)
        self.device = device
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = token_shape[1] if cu_seqlens is None else max_seqlen
        self.num_sequences = token_shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1

    @classmethod
    def padded(cls, batch_size: int, seq_len: int, device: torch.device | str = "cpu") -> SequenceLayout:
        return cls((batch_size, seq_len), torch.device(device))

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, num_tokens: int) -> SequenceLayout:
        """The layout of `[1, num_tokens]` tokens cut by `cu_seqlens`; a bad `cu_seqlens` is a ValueError naming it
        (one host sync, which also reads the longest sequence's length)."""
        key = f"batch[{CU_SEQLENS!r}]"
        if not isinstance(cu_seqlens, torch.Tensor):
            raise ValueError(f"{key}: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype != torch.int32:
            raise ValueError(f"{key}: expected dtype torch.int32 (Megatron's PackedSeqParams), got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"{key}: expected shape [N + 1] (N >= 0 sequences), got {list(cu_seqlens.shape)}")
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if lengths.numel():
            first, last, shortest, longest = torch.stack(
                [cu_seqlens[0], cu_seqlens[-1], lengths.min(), lengths.max()]).tolist()
        else:
            first = last = int(cu_seqlens[0])
            shortest = longest = 0
        if first != 0:
            raise ValueError(f"{key}: must start at 0, starts at {first}")
        if last != num_tokens:
            raise ValueError(f"{key}: must end at T = {num_tokens} (the tokens of input_ids [1, T]), ends at {last}")
        if lengths.numel() and shortest <= 0:
            raise ValueError(f"{key}: must be strictly increasing (every sequence holds a token), got "
                             f"{cu_seqlens.tolist()}")
        return cls((1, num_tokens), cu_seqlens.device, cu_seqlens, int(longest))

    @classmethod
    def of_batch(cls, batch: Mapping[str, torch.Tensor]) -> SequenceLayout:
        """The layout of `batch`: packed when it holds `cu_seqlens`, else padded, from `input_ids`' shape."""
        input_ids = batch.get("input_ids")
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError("batch['input_ids'] is missing" if input_ids is None else
                             f"batch['input_ids']: expected a torch.Tensor, got {type(input_ids).__name__}")
        if input_ids.dim() != 2:
            raise ValueError(f"batch['input_ids']: expected shape [B, S] (or [1, T] packed), got "
                             f"{list(input_ids.shape)}")
        if CU_SEQLENS not in batch:
            return cls.padded(*input_ids.shape, device=input_ids.device)
        if input_ids.shape[0] != 1:
            raise ValueError(f"batch['input_ids']: a packed batch (with cu_seqlens) is [1, T], got "
                             f"{list(input_ids.shape)}")
        return cls.packed(batch[CU_SEQLENS], input_ids.shape[1])

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    @cached_property
    def sequence_ids(self) -> torch.Tensor:
        """int64 `token_shape`: the sequence of each token."""
        rows, cols = self.token_shape
        if not self.is_packed:
            return torch.arange(rows, device=self.device)[:, None].expand(rows, cols)
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64)
        ids = torch.arange(self.num_sequences, device=self.device)
        return ids.repeat_interleave(lengths, output_size=cols)[None]

    @cached_property
    def positions(self) -> torch.Tensor:
        """int64 `token_shape`: each token's position in its own sequence (restarting at 0 in every sequence)."""
        rows, cols = self.token_shape
        positions = torch.arange(cols, device=self.device).expand(rows, cols)
        if not self.is_packed:
            return positions
        return positions - self.cu_seqlens[:-1].to(torch.int64)[self.sequence_ids]

    @cached_property
    def sequence_starts(self) -> torch.Tensor:
        """bool `token_shape`: True at each sequence's first token (it has no logprob)."""
        starts = torch.zeros(self.token_shape, dtype=torch.bool, device=self.device)
        if not self.is_packed:
            starts[:, 0] = True
        elif self.num_sequences:
            starts[0, self.cu_seqlens[:-1].to(torch.int64)] = True
        return starts

    @cached_property
    def _gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`[N, L]` flat token indices of each sequence's tokens, and where they are real (not past its end)."""
        starts = self.cu_seqlens[:-1].to(torch.int64)[:, None]
        ends = self.cu_seqlens[1:].to(torch.int64)[:, None]
        index = starts + torch.arange(self.max_seqlen, device=self.device)[None]
        inside = index < ends
        return torch.where(inside, index, torch.zeros((), dtype=torch.int64, device=self.device)), inside

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """`[N, L]`: sequence `i`'s per-token `values` in row `i`, zeros past its end (padded: `values` itself)."""
        self._check_per_token("values", values)
        if not self.is_packed:
            return values
        index, inside = self._gather
        return torch.where(inside, values.reshape(-1)[index], torch.zeros((), dtype=values.dtype, device=values.device))

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`[N]`: each sequence's sum of its per-token `values`."""
        return self.rows(values).sum(dim=-1)

    def broadcast(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """`token_shape`: each token carries its sequence's value of `per_sequence` `[N]` (padded: a view)."""
        if not self.is_packed:
            return per_sequence[:, None].expand(self.token_shape)
        return per_sequence[self.sequence_ids]

    def check_per_sequence(self, key: str, tensor: torch.Tensor) -> None:
        """A per-sequence batch tensor must be `[N]`: a ValueError naming `key` otherwise."""
        if tuple(tensor.shape) != (self.num_sequences,):
            if not self.is_packed and self.token_shape[0] == 1 and tensor.dim() == 1 and tensor.numel() > 1:
                raise ValueError(f"batch['cu_seqlens'] is missing: batch[{key!r}] holds {tensor.numel()} values, one "
                                 f"per sequence, but the per-token tensors are one row {list(self.token_shape)}; a "
                                 "packed batch says where its sequences lie with cu_seqlens (int32 [N + 1])")
            what = "sequences (cu_seqlens)" if self.is_packed else "rows"
            raise ValueError(f"batch[{key!r}]: expected shape [{self.num_sequences}] (one value per sequence: "
                             f"{self.num_sequences} {what}), got {list(tensor.shape)}")

    def token_spans(self, runs: list[slice]) -> list[tuple[int, int]]:
        """The flat token positions `[start, stop)` of each run of consecutive sequences (one host read when
        packed)."""
        if not self.is_packed:
            seq_len = self.token_shape[1]
            return [(run.start * seq_len, run.stop * seq_len) for run in runs]
        bounds = self.cu_seqlens.tolist() if runs else []
        return [(bounds[run.start], bounds[run.stop]) for run in runs]

    def select(self, batch: Mapping[str, torch.Tensor], sequences: slice, span: tuple[int, int] | None = None
               ) -> dict[str, torch.Tensor]:
        """The batch of consecutive `sequences` alone, in the same layout: per-token tensors (`token_shape` first)
        cut to their tokens (`span`, from `token_spans`, or read here), per-sequence ones (`[N]`) to their entries,
        `cu_seqlens` rebased to 0; kept sets (`loss.kept_set_batch`) to those of their tokens."""
        batch, kept = as_positions(batch)
        if not self.is_packed:
            return with_kept_set({key: value[sequences] for key, value in batch.items()}, kept)
        start, stop = span if span is not None else self.token_spans([sequences])[0]
        selected = {}
        for key, value in batch.items():
            if key == CU_SEQLENS:
                selected[key] = value[sequences.start:sequences.stop + 1] - start
            elif value.dim() >= 2 and tuple(value.shape[:2]) == self.token_shape:
                selected[key] = value[:, start:stop]
            elif tuple(value.shape) == (self.num_sequences,):
                selected[key] = value[sequences]
            else:
                raise ValueError(f"batch[{key!r}]: neither per-token {list(self.token_shape)} nor per-sequence "
                                 f"[{self.num_sequences}], got {list(value.shape)}")
        return with_kept_set(selected, kept)

    def _check_per_token(self, key: str, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape[:2]) != self.token_shape:
            raise ValueError(f"{key}: expected shape {list(self.token_shape)}, got {list(tensor.shape)}")


def next_token_targets_of(input_ids: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
    """The ops' `shift=True` targets for `input_ids` in `layout`: the ids, with -1 (not scored) at each sequence's
    first token. Then the op's row before a boundary (a sequence's last token) scores nothing, so no logprob crosses
    from one packed sequence into the next, and each first token's output is 0, as position 0's is."""
    return input_ids.masked_fill(layout.sequence_starts, -1)


def is_per_token(value: torch.Tensor, token_shape: tuple[int, ...]) -> bool:
    return value.dim() >= 2 and tuple(value.shape[:2]) == tuple(token_shape)


def row_lengths(batch: Mapping[str, torch.Tensor]) -> list[int]:
    """Each row's length for packing a padded `[B, S]` batch: up to its last token with `token_mask` set (a causal
    model's outputs there never read the tokens after it), at least 1. One host read."""
    token_mask = batch["token_mask"] != 0
    seq_len = token_mask.shape[1]
    positions = torch.arange(1, seq_len + 1, device=token_mask.device)
    return (token_mask * positions).amax(dim=1).clamp(min=1).tolist() if seq_len else [1] * token_mask.shape[0]


def pack_rows(batch: Mapping[str, torch.Tensor], rows: list[int], lengths: list[int], *, pad_multiple: int = 1,
              num_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """The packed batch of padded `batch`'s `rows` (in this order), row `r` cut to its first `lengths[r]` tokens
    and padded at its end to a multiple of `pad_multiple` (zeros: untrained). `num_tokens`: pad the last sequence
    further so the batch holds exactly that many tokens (e.g. one length for every microbatch of a pipeline).
    The packed batch carries `position_ids` `[1, T]`: each sequence's positions from 0, and 0 on its padding, so
    that no padding reaches past the model's position embeddings. Kept sets (`loss.kept_set_batch`) follow their
    tokens; padding has none."""
    batch, kept = as_positions(batch)
    token_shape = tuple(batch["input_ids"].shape)
    spans = [-(-lengths[r] // pad_multiple) * pad_multiple for r in rows]
    total = sum(spans)
    if num_tokens is not None:
        if num_tokens < total or (num_tokens > total and not rows):
            raise ValueError(f"num_tokens: {num_tokens} cannot hold the {total} packed tokens of rows {rows}")
        spans[-1] += num_tokens - total if rows else 0
        total = num_tokens
    device = batch["input_ids"].device
    packed: dict[str, torch.Tensor] = {}
    for key, value in batch.items():
        if key == CU_SEQLENS:
            raise ValueError(f"batch[{key!r}]: the batch is packed already")
        if is_per_token(value, token_shape):
            out = value.new_zeros((1, total, *value.shape[2:]))
            start = 0
            for r, span in zip(rows, spans):
                keep = min(lengths[r], token_shape[1])
                out[0, start:start + keep] = value[r, :keep]
                start += span
            packed[key] = out
        elif tuple(value.shape[:1]) == token_shape[:1]:
            packed[key] = value[rows]
        else:
            raise ValueError(f"batch[{key!r}]: neither per-token {list(token_shape)} nor per-sequence "
                             f"[{token_shape[0]}], got {list(value.shape)}")
    cu = [0]
    positions = torch.zeros(1, total, dtype=torch.int64, device=device)
    for row, span in zip(rows, spans):
        keep = min(lengths[row], token_shape[1])
        positions[0, cu[-1]:cu[-1] + keep] = torch.arange(keep, device=device)
        cu.append(cu[-1] + span)
    packed[CU_SEQLENS] = torch.tensor(cu, dtype=torch.int32, device=device)
    packed[POSITION_IDS] = positions
    return with_kept_set(packed, kept)


def first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Row indices in bins of at most `max_tokens` tokens: longest first, each into the first bin it fits (as verl
    and NeMo-RL pack); each bin's rows in their original order. A row longer than `max_tokens` is a ValueError."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch: must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        if lengths[row] > max_tokens:
            raise ValueError(f"max_tokens_per_microbatch: row {row} holds {lengths[row]} tokens, more than "
                             f"{max_tokens}")
        for index, free in enumerate(room):
            if lengths[row] <= free:
                bins[index].append(row)
                room[index] -= lengths[row]
                break
        else:
            bins.append([row])
            room.append(max_tokens - lengths[row])
    return [sorted(b) for b in bins]


def balanced_first_fit_decreasing(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """As many bins as `first_fit_decreasing` needs, the rows spread evenly over them: longest first, each into the
    bin holding the fewest tokens (Graham's longest-processing-time rule), so that the fullest bin, which sets the
    step's peak memory, holds about the mean instead of `max_tokens`. First-fit decreasing's own bins where a row
    would overflow its bin, or where they are the more even. Each bin's rows in their original order."""
    bins = first_fit_decreasing(lengths, max_tokens)
    spread: list[list[int]] = [[] for _ in bins]
    load = [0] * len(bins)
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        lightest = min(range(len(bins)), key=lambda index: (load[index], index))
        if load[lightest] + lengths[row] > max_tokens:
            return bins
        spread[lightest].append(row)
        load[lightest] += lengths[row]

    def fullest(candidate: list[list[int]]) -> int:
        return max((sum(lengths[r] for r in rows) for rows in candidate), default=0)

    return min([sorted(rows) for rows in spread], bins, key=fullest)


# `policy.sequence_packing.algorithm`: how a batch's rows go into token-budget microbatches.
PACKING_ALGORITHMS = {"first_fit_decreasing": first_fit_decreasing,  # NeMo-RL's, by its name
                      "balanced_first_fit_decreasing": balanced_first_fit_decreasing}


class PackedMicrobatches:
    """A padded `[B, S]` batch packed into microbatches of at most `max_tokens` tokens (first-fit decreasing), and
    the way back: `unpack` puts per-token outputs of the packed microbatches at the rows' positions."""

    def __init__(self, batch: Mapping[str, torch.Tensor], max_tokens: int, *, pad_multiple: int = 1,
                 same_length: bool = False, algorithm: str = "first_fit_decreasing") -> None:
        """`pad_multiple`: each sequence spans a multiple of it. `same_length`: every microbatch holds as many
        tokens as the longest (a pipeline's stages exchange activations of one shape). `algorithm`: a name of
        `PACKING_ALGORITHMS`."""
        if pad_multiple < 1:
            raise ValueError(f"pad_multiple: must be >= 1, got {pad_multiple}")
        if algorithm not in PACKING_ALGORITHMS:
            raise ValueError(f"algorithm: one of {sorted(PACKING_ALGORITHMS)}, got {algorithm!r}")
        self.shape = tuple(batch["input_ids"].shape)
        self.lengths = row_lengths(batch)
        spans = [-(-length // pad_multiple) * pad_multiple for length in self.lengths]
        self.rows = PACKING_ALGORITHMS[algorithm](spans, max_tokens)
        longest = max((sum(spans[r] for r in rows) for rows in self.rows), default=0)
        self.microbatches = [pack_rows(batch, rows, self.lengths, pad_multiple=pad_multiple,
                                       num_tokens=longest if same_length else None) for rows in self.rows]

    def unpack(self, per_microbatch: list[torch.Tensor]) -> torch.Tensor:
        """`[B, S, ...]` from each microbatch's `[1, T, ...]` per-token tensor; 0 past each row's packed length."""
        first = per_microbatch[0]
        out = first.new_zeros((*self.shape, *first.shape[2:]))
        for rows, values, batch in zip(self.rows, per_microbatch, self.microbatches, strict=True):
            starts = batch[CU_SEQLENS][:-1].tolist()
            for row, start in zip(rows, starts):
                keep = min(self.lengths[row], self.shape[1])
                out[row, :keep] = values[0, start:start + keep]
        return out
