"""Rows and tokens: the next-token shift, the per-row outputs of the ops and the gradients that come back to them.

The ops reduce rows (one row of logits each); the logprob op, the linear op and the loss-fused head all reach the same
backward kernel through `upstream_gradients`.

The shift is an option of the ops (`shift=True`): logits at position `t` score token `t + 1`. With it, the targets
are the sequence's own token ids `[..., S]` (< 0 where a token is not trained) and the outputs are aligned with them:
position `t` holds the logprob of `targets[..., t]` under the logits at `t - 1`, and position 0, which has no logits
before it, is 0. The logits are never sliced or copied: the targets move left instead, and the per-row outputs
right.
"""

from __future__ import annotations

import torch


def next_token_targets(targets: torch.Tensor) -> torch.Tensor:
    """Row `t`'s target: `targets[..., t + 1]`, and -1 (ignore) at the last position."""
    shifted = torch.full_like(targets, -1)
    shifted[..., :-1] = targets[..., 1:]
    return shifted


def aligned_with_tokens(per_row: torch.Tensor) -> torch.Tensor:
    """Row `t` (about token `t + 1`) moved to position `t + 1`; position 0 is 0."""
    return torch.nn.functional.pad(per_row[..., :-1], (1, 0))


def check_shiftable(targets: torch.Tensor) -> None:
    if targets.dim() < 1 or targets.shape[-1] < 1:
        raise ValueError(f"shift=True needs targets with a sequence dim (last dim >= 1), got shape "
                         f"{tuple(targets.shape)}")



def row_gradient(grad: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The upstream gradient of a per-row output as a contiguous `[rows]` tensor in `like`'s dtype (zeros for
    None: an output nothing differentiated)."""
    if grad is None:
        return torch.zeros(rows, dtype=like.dtype, device=like.device)
    return grad.reshape(rows).to(like.dtype).contiguous()


def upstream_gradients(grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None, lse: torch.Tensor,
                       mean_x: torch.Tensor | None, logprob: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward kernel's `(grad_logprob, mean_x, grad_entropy)` for rows with these forward statistics.

    `logprob` is given under a top-k / top-p filter: a target outside the kept set has logprob -inf, a constant,
    and passes no gradient back. `mean_x` and `grad_entropy` are both None without an entropy, or with one that is
    only logged (its upstream gradient is None), so the kernel skips the entropy term.
    """
    rows = lse.shape[0]
    grad_logprob = row_gradient(grad_logprob, rows, lse)
    if logprob is not None:
        grad_logprob = grad_logprob.masked_fill(logprob == float("-inf"), 0.0)
    if mean_x is None or grad_entropy is None:
        return grad_logprob, None, None
    return grad_logprob, mean_x, row_gradient(grad_entropy, rows, lse)


def per_token(values: tuple[torch.Tensor, ...], batch_shape: torch.Size, shift: bool) -> tuple[torch.Tensor, ...]:
    """Per-row outputs in the targets' shape, moved to the tokens' positions with `shift`."""
    values = tuple(v.reshape(batch_shape) for v in values)
    return tuple(aligned_with_tokens(v) for v in values) if shift else values
