"""GRPO group-relative advantages.

Each prompt is sampled `group_size` times; a sample's advantage is its reward minus a baseline from its own
group, optionally divided by the group's reward spread. Turning the division off gives Dr. GRPO, which avoids
up-weighting prompts that are already almost always right or wrong. The leave-one-out baseline excludes the
sample itself, so its reward does not shrink its own advantage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-6


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: torch.Tensor  # [N] float32, N = num_groups * group_size, grouped contiguously
    groups_without_variance: int  # groups whose samples all got the same reward: no learning signal


def group_relative_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    normalize_by_std: bool,
    leave_one_out: bool,
    eps: float = STD_EPS,
) -> GroupAdvantages:
    """Advantages of `rewards` `[N]`, whose consecutive runs of `group_size` share a prompt.

    - plain: `(r - mean(group)) / (std(group) + eps)`, std unbiased over the group;
    - `leave_one_out`: the baseline and std of sample `i` come from the other `group_size - 1` samples;
    - `normalize_by_std=False` (Dr. GRPO): no division.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards: expected [num_groups * {group_size}], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size: a group needs >= 2 samples for a baseline, got {group_size}")
    grouped = rewards.to(torch.float32).view(-1, group_size)
    if leave_one_out:
        others = _leave_one_out_views(grouped)  # [G, n, n-1]
        baseline = others.mean(dim=-1)
        spread = others.std(dim=-1) if normalize_by_std else None
    else:
        baseline = grouped.mean(dim=1, keepdim=True)
        spread = grouped.std(dim=1, keepdim=True) if normalize_by_std else None
    advantages = grouped - baseline
    if spread is not None:
        advantages = advantages / (spread + eps)
    no_variance = int((grouped.max(dim=1).values == grouped.min(dim=1).values).sum())
    return GroupAdvantages(advantages=advantages.reshape(-1), groups_without_variance=no_variance)


def _leave_one_out_views(grouped: torch.Tensor) -> torch.Tensor:
    """For each sample, the rewards of the other samples of its group: `[G, n] -> [G, n, n-1]`."""
    n = grouped.shape[1]
    keep = ~torch.eye(n, dtype=torch.bool)
    return grouped.unsqueeze(1).expand(-1, n, -1)[:, keep].view(grouped.shape[0], n, n - 1)
