"""How the ops cut their rows: the one chunking policy.

Everything that works on rows a piece at a time takes its piece size from here, so that the temporaries stay bounded
whatever the number of tokens, and every TP rank cuts the same pieces (each piece may run its own collectives: ranks
cutting differently run different numbers and shapes of them, and gloo aborts, NCCL hangs).

- *Pieces* (`piece_rows`): the plain-torch kernels and top-p's threshold search work on about `PIECE_LOGITS` logits
  per rank at a time (their fp32 / fp64 temporaries are some 20 bytes per logit).
- *GEMM chunks* (`chunk_rows_for`): the fused linear paths cut their trained rows into chunks whose logits are one
  reused buffer (`gemm.chunk_buffer`), at most `CHUNK_BYTES`, at least `MIN_CHUNKS` per call, so that one chunk's
  logits are at most 1/16 of the call's: 6.25% of what the materialised path holds with its gradient written in
  place, which leaves room for the per-row vectors under the fused paths' 10% budget (docs/ops.md, "Memory").
- *The loss-fused head's chunks* (`head_min_chunks`): its baseline, the materialised loss step with the gradient
  written over the logits, holds the call's logits once, and the head's extra memory is its chunk buffers and some
  bytes per trained row. The chunk buffers take what `HEAD_EXTRA_SHARE` of the logits leaves beside those bytes: 12
  chunks at a 16K-column bf16 shard, not 16, which the CPU's GEMMs need (each chunk GEMM packs the whole weight
  again). Where top-p's threshold search runs on each chunk in stages (over TP ranks, on CUDA, in plain torch), its
  temporaries (up to a third of the chunk's bf16 buffer) share that budget (15 chunks there); where the vocab share
  is small, the op's 16.
- *Sequence chunks* (`sequence_chunks`): where a loss term couples a sequence's tokens, the loss-fused head groups
  whole sequences into chunks of at most that many trained rows, so the term stays exact.
- *Threshold pieces within a chunk* (`threshold_piece_rows`): top-p's search over a fused path's chunk works on a
  piece of the chunk's rows at a time, so that its temporaries stay a fraction of the chunk buffer whatever the
  vocab: 1/16 of the rows in plain torch (20-32 bytes per logit: at most 2 bytes per chunk logit); with the fused
  kernels, whose temporaries are per row (two histograms and the keys of at most 1024 candidates, 8 KiB), as many
  rows as keep them within a third of the chunk's bf16 buffer (the whole chunk from a vocab share of 12.3K
  columns), in as few pieces of even size as that allows.
"""

from __future__ import annotations

import math

import torch

# The plain-torch kernels and top-p's selection work on pieces of rows of about this many logits per rank.
PIECE_LOGITS = 2**23
# Default budget for one chunk of logits (in the hidden states' dtype): large enough that each GEMM is big,
# small enough to be negligible next to the `[T, V_local]` logits the fused op avoids. Read at each call, so a test
# may lower it.
CHUNK_BYTES = 256 * 2**20
MIN_CHUNKS = 16
MIN_CHUNK_ROWS = 64
# The loss-fused head's chunk buffers and its per-row vectors (the rows' values, indices and gradient terms: at most
# HEAD_ROW_BYTES a trained row, tests/loss/test_fused_head_memory.py) together within this share of its baseline's
# logits: a margin under the fused paths' 10% target for the rounding of the rows per chunk.
HEAD_EXTRA_SHARE = 0.095
HEAD_ROW_BYTES = 160
# A chunk buffer's row stride is a multiple of this many elements (128 bytes of bf16), so every GEMM row starts
# aligned whatever the shard's valid width; the kernels take any row stride.
ROW_ALIGN = 64


def piece_rows(cols: int) -> int:
    """Rows per piece of `cols` logits each: about `PIECE_LOGITS` logits. Pass a width that is the same on every TP
    rank where the pieces run collectives (top-p passes each rank's share of the true vocab)."""
    return max(1, PIECE_LOGITS // max(1, cols))


def pieces(rows: int, per_piece: int) -> list[slice]:
    """`range(rows)` cut into consecutive slices of `per_piece` rows (the last one shorter)."""
    return [slice(start, start + per_piece) for start in range(0, rows, per_piece)]


def aligned_width(cols: int) -> int:
    """`cols` rounded up to a multiple of `ROW_ALIGN`: the row stride of a chunk buffer."""
    return -(-cols // ROW_ALIGN) * ROW_ALIGN


def chunk_rows_for(rows: int, shard_cols: int, dtype: torch.dtype, budget_bytes: int | None = None,
                   buffers: int = 1, min_chunks: int = MIN_CHUNKS) -> int:
    """Rows per GEMM chunk when the caller gives none: a call of `rows` trained rows is cut into at least
    `min_chunks` chunks (`MIN_CHUNKS`: the chunk buffers' logits are at most 1/16 of the whole call's, the fused
    paths' extra memory; the loss-fused head passes `head_min_chunks`), each of at least `MIN_CHUNK_ROWS` rows (so
    each GEMM stays large) and at most `budget_bytes` (default
    `CHUNK_BYTES`) of logits rows of `shard_cols` columns (256 MiB: 2048 rows of a 65536-column bf16 shard, 441 of
    a 152064-column fp32 one). `buffers` chunk buffers alive at once share that budget and that 1/16 (the loss-fused
    head keeps two where chunks overlap on CUDA streams, or where a KL under a filter needs a second gradient).

    `shard_cols` must be the same on every rank of the TP group: the shard's whole width (`weight.shape[0]`,
    padding included), never its valid columns, which are fewer on the rank holding the padding."""
    budget = CHUNK_BYTES if budget_bytes is None else budget_bytes
    row_bytes = max(aligned_width(shard_cols), 1) * torch.empty((), dtype=dtype).element_size() * buffers
    by_budget = max(1, budget // row_bytes)
    by_share = max(MIN_CHUNK_ROWS, -(-rows // (min_chunks * buffers)))
    return max(1, min(by_budget, by_share))


def head_min_chunks(shard_cols: int, dtype: torch.dtype, search_temporaries: bool) -> int:
    """The loss-fused head's least number of chunks per call, for a shard of `shard_cols` columns (its whole width,
    the same on every TP rank) in `dtype`: as few as keep the chunk buffers and `HEAD_ROW_BYTES` per row within
    `HEAD_EXTRA_SHARE` of the logits, at most `MIN_CHUNKS`; with `search_temporaries` (top-p's threshold search runs
    on each chunk in stages, over TP ranks, on CUDA or in plain torch, and holds temporaries per row of the chunk)
    they take up to a third of the chunk buffer more. (The CPU's one-call search on one rank holds per-thread
    temporaries only.)"""
    share = HEAD_EXTRA_SHARE - HEAD_ROW_BYTES / (max(shard_cols, 1) * torch.empty((), dtype=dtype).element_size())
    if search_temporaries:
        share *= 3 / 4
    return MIN_CHUNKS if share <= 1 / MIN_CHUNKS else math.ceil(1 / share)


def threshold_piece_rows(chunk_rows: int, cols: int, fused_row_bytes: int | None = None) -> int:
    """Rows per piece of top-p's threshold search over a chunk of `chunk_rows` rows of `cols` columns: in plain
    torch (`fused_row_bytes` None) 1/16 of them; with the fused kernels, whose temporaries are `fused_row_bytes` per
    row, as many rows as keep them within a third of the chunk's bf16 buffer (`2 cols / 3` bytes per row), the chunk
    then cut into as few pieces of even size as that allows. At least 1, at most the chunk. Pass a `cols` that is
    the same on every TP rank (each rank's share of the true vocab), so that the pieces and their collectives are
    too."""
    if fused_row_bytes is None:
        return max(1, -(-chunk_rows // MIN_CHUNKS))
    most = max(1, min(chunk_rows, chunk_rows * cols * 2 // 3 // max(1, fused_row_bytes)))
    return -(-chunk_rows // -(-chunk_rows // most))  # as few pieces as that allows, of even size


def row_chunks(rows: int, chunk_rows: int) -> list[slice]:
    """`range(rows)` cut into consecutive chunks of `chunk_rows` rows (the last one shorter), each slice within it."""
    step = max(1, chunk_rows)
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def sequence_chunks(trained_rows_per_sequence: list[int], chunk_rows: int) -> list[slice]:
    """Consecutive sequences grouped so each group has at most `chunk_rows` trained rows (a longer sequence is a
    group of its own: a chunk of whole sequences may exceed the budget); sequences without a trained row join their
    neighbours."""
    chunks, start, rows = [], 0, 0
    for index, count in enumerate(trained_rows_per_sequence):
        if rows and rows + count > chunk_rows:
            chunks.append(slice(start, index))
            start, rows = index, 0
        rows += count
    if start < len(trained_rows_per_sequence):
        chunks.append(slice(start, len(trained_rows_per_sequence)))
    return chunks
