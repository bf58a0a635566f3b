"""The next-token shift, as an option of the ops (`shift=True`): logits at position `t` score token `t + 1`.

With `shift`, the targets are the sequence's own token ids `[..., S]` (< 0 where a token is not trained) and
the outputs are aligned with them: position `t` holds the logprob of `targets[..., t]` under the logits at
`t - 1`, and position 0, which has no logits before it, is 0. The logits are never sliced or copied: the
targets move left instead, and the per-row outputs right.
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
