"""Plain-torch kernels with the exact contract of the fused ones (csrc/logprob_common.h).

Used when `megatron_grpo._C` cannot be loaded, for float64 logits, and as the anchor of the kernel tests. Rows
are processed in chunks so the fp32 temporaries stay bounded whatever the number of tokens.
"""

from __future__ import annotations

import torch

from .partials import Partials

ROWS_PER_CHUNK = 1024


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _local_target_column(targets: torch.Tensor, vocab_start: int, valid_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each target in this shard, and whether this shard owns it (see local_target_column)."""
    col = targets - vocab_start
    owned = (targets >= 0) & (col >= 0) & (col < valid_cols)
    return col.clamp(0, max(valid_cols - 1, 0)), owned


def _filtered(x: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """x with the logits below the row's threshold set to -inf (NaN stays NaN, so it still poisons its row)."""
    if threshold is None:
        return x
    return x.masked_fill(x < threshold.to(x.dtype)[:, None], float("-inf"))


def logprob_partials(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stacked partials [rows, k]: max m, sum exp(x - m), target logit, (sum exp(x - m) * (x - m)). See `Partials`.

    With a per-row `threshold` ([rows]), only logits `>=` it take part; a target below it has logit -inf.
    """
    dtype = _compute_dtype(logits)
    rows = logits.shape[0]
    out = torch.empty(rows, Partials.width(with_entropy), dtype=dtype, device=logits.device)
    for start in range(0, rows, ROWS_PER_CHUNK):
        sl = slice(start, start + ROWS_PER_CHUNK)
        out[sl] = _chunk_partials(logits[sl], targets[sl], vocab_start, valid_cols, with_entropy, dtype,
                                  None if threshold is None else threshold[sl])
    return out


def _chunk_partials(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, with_entropy: bool,
    dtype: torch.dtype, threshold: torch.Tensor | None,
) -> torch.Tensor:
    rows = logits.shape[0]
    out = torch.empty(rows, Partials.width(with_entropy), dtype=dtype, device=logits.device)
    x = _filtered(logits[:, :valid_cols].to(dtype), threshold)
    if valid_cols == 0:
        out[:, Partials.MAX] = float("-inf")
        out[:, Partials.SUM_EXP] = 0.0
        if with_entropy:
            out[:, Partials.SUM_EXP_X] = 0.0
    else:
        m = x.amax(dim=-1)
        shift = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        z = x - shift[:, None]
        e = torch.exp(z)
        out[:, Partials.MAX] = m
        out[:, Partials.SUM_EXP] = e.sum(dim=-1)
        if with_entropy:
            out[:, Partials.SUM_EXP_X] = torch.where(e == 0, torch.zeros_like(e), e * z).sum(dim=-1)
    col, owned = _local_target_column(targets, vocab_start, valid_cols)
    target_logit = x.gather(1, col[:, None]).squeeze(1) if valid_cols else torch.zeros(rows, dtype=dtype, device=logits.device)
    out[:, Partials.TARGET] = torch.where(owned, target_logit, torch.full_like(target_logit, float("-inf")))
    ignored = targets < 0
    out[ignored, Partials.MAX] = 0.0
    out[ignored, Partials.SUM_EXP] = 1.0
    if with_entropy:
        out[ignored, Partials.SUM_EXP_X] = 0.0
    return out


def logprob_backward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_start: int,
    valid_cols: int,
    lse: torch.Tensor,
    mean_x: torch.Tensor | None,
    grad_logprob: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    grad_logits: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> None:
    """Writes dx = g_lp * (1[v = y] - p) + g_H * p * (E[x] - x) into grad_logits (which may alias logits).

    With a per-row `threshold`, logits below it (the target included) get exactly 0.
    """
    for start in range(0, logits.shape[0], ROWS_PER_CHUNK):
        sl = slice(start, start + ROWS_PER_CHUNK)
        grad = _chunk_backward(
            logits[sl], targets[sl], vocab_start, valid_cols, lse[sl],
            None if mean_x is None else mean_x[sl], grad_logprob[sl],
            None if grad_entropy is None else grad_entropy[sl],
            None if threshold is None else threshold[sl],
        )
        grad_logits[sl] = grad.to(grad_logits.dtype)


def _chunk_backward(
    logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, valid_cols: int, lse: torch.Tensor,
    mean_x: torch.Tensor | None, grad_logprob: torch.Tensor, grad_entropy: torch.Tensor | None,
    threshold: torch.Tensor | None,
) -> torch.Tensor:
    dtype = _compute_dtype(logits)
    grad = torch.zeros(logits.shape, dtype=dtype, device=logits.device)
    x = logits[:, :valid_cols].to(dtype)
    kept = None if threshold is None else ~(x < threshold.to(dtype)[:, None])
    p = torch.exp(x - lse[:, None].to(dtype))
    g_lp = grad_logprob.to(dtype)[:, None]
    valid = -g_lp * p
    if grad_entropy is not None:
        entropy_term = grad_entropy.to(dtype)[:, None] * p * (mean_x.to(dtype)[:, None] - x)
        valid = valid + torch.where(p == 0, torch.zeros_like(p), entropy_term)
    col, owned = _local_target_column(targets, vocab_start, valid_cols)
    if valid_cols:
        valid.scatter_add_(1, col[:, None], torch.where(owned, g_lp.squeeze(1), 0.0)[:, None])
    if kept is not None:
        valid = torch.where(kept, valid, torch.zeros_like(valid))
    grad[:, :valid_cols] = valid
    grad[targets < 0] = 0.0
    return grad
