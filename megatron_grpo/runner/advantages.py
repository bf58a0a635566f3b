"""GRPO group-relative advantages.

Each prompt is sampled `group_size` times; a sample's advantage is its reward minus a baseline from its own
group, optionally divided by the group's reward spread. Turning the division off gives Dr. GRPO, which avoids
up-weighting prompts that are already almost always right or wrong. The leave-one-out baseline (RLOO) excludes
the sample itself, so its reward does not shrink its own advantage; the spread stays the whole group's, as in
RLOO/GRPO implementations: the std of the other samples alone is 0 for a lone winner (rewards [1, 0, 0, 0]
would give an advantage of 1 / eps) and undefined for a group of two.
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
    - `leave_one_out`: the baseline of sample `i` is the mean of the other `group_size - 1` samples; the std
      is still the whole group's;
    - `normalize_by_std=False` (Dr. GRPO): no division.

    A group needs >= 2 samples (the runner's checks reject fewer), so both the baseline and the unbiased std
    are always defined; a group whose rewards are all equal gets advantage 0. With the division, |advantage|
    is at most sqrt(group_size).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards: expected [num_groups * {group_size}], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size: a group needs >= 2 samples for a baseline, got {group_size}")
    grouped = rewards.to(torch.float64).view(-1, group_size)  # float64: equal rewards cancel exactly
    group_sum = grouped.sum(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (group_sum - grouped) / (group_size - 1)  # mean of the other samples
    else:
        baseline = group_sum / group_size
    advantages = grouped - baseline
    if normalize_by_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + eps)
    without_variance = grouped.max(dim=1).values == grouped.min(dim=1).values
    advantages[without_variance] = 0.0  # no learning signal, and no rounding residue divided by eps
    return GroupAdvantages(advantages=advantages.to(torch.float32).reshape(-1),
                           groups_without_variance=int(without_variance.sum()))
