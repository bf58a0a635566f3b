"""Sampling rollouts from a tensor- and pipeline-parallel policy.

The policy is any callable mapping `input_ids [B, S]` (on the CPU) to this rank's vocab shard of the last
position's logits `[B, V_local]` (on its own device, so the TP gather runs where the backend wants it), or to
None on a rank that holds no logits (a pipeline stage before the last). Each decoding step gathers the shards
over the TP group (a `[B, V]` tensor, tiny next to the forward pass), drops Megatron's padded vocab columns, and
samples on the CPU from the tempered, top-k/top-p filtered distribution (a `SamplingDistribution`, the one the
training logprobs use, filtered by `megatron_grpo.ops.filtering`, the ops' own filter). `share_draws` then hands the sampling ranks'
tokens to the ranks without logits.

Every group of rows (the samples of one prompt) draws from its own generator, which the caller keys by the
prompt's global index: the TP ranks draw the same tokens without another collective, and a prompt's samples do
not depend on which data-parallel rank holds it. The log-probability of each drawn token under that same
sampling distribution is returned as `generation_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.filtering import kept_threshold, mask_filtered

LogitsFn = Callable[[torch.Tensor], Optional[torch.Tensor]]
ShareDraws = Callable[[torch.Tensor], torch.Tensor]  # [2, B] float64 (tokens, logprobs): the sampling ranks' on all


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    distribution: SamplingDistribution  # what each token is drawn from (and the policy training trains)
    eos_id: int
    pad_id: int  # written after <eos>; never trained


@dataclass(frozen=True)
class Rollout:
    """Prompts with their sampled responses; every tensor is `[B, S]` and aligned with `input_ids`."""

    input_ids: torch.Tensor  # int64: prompt, response, then pad_id after <eos>
    token_mask: torch.Tensor  # float32: 1 on response tokens up to and including <eos>
    generation_logprobs: torch.Tensor  # float32: log p_sampling(token); 0 outside token_mask
    prompt_length: int

    @property
    def responses(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_length :]


def gather_vocab(logits_shard: torch.Tensor, true_vocab_size: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Full-vocab logits `[..., true_vocab_size]` from this rank's shard `[..., V_local]`; padding dropped."""
    if group is not None and dist.get_world_size(group) > 1:
        shards = [torch.empty_like(logits_shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, logits_shard.contiguous(), group=group)
        logits_shard = torch.cat(shards, dim=-1)
    return logits_shard[..., :true_vocab_size]


def sampling_log_probs(logits: torch.Tensor, distribution: SamplingDistribution) -> torch.Tensor:
    """Log-probabilities `[B, V]` of the sampling distribution: softmax(logit_scale * logits) over the tokens that
    top-k and then top-p keep (`megatron_grpo.ops.filtering`); filtered tokens get -inf. The scaled logits are
    formed in fp32 as the kernels form them."""
    scaled = logits.to(torch.float32) * distribution.logit_scale
    threshold = kept_threshold(scaled, distribution, true_vocab_size=scaled.shape[-1], scaled=True)
    return torch.log_softmax(mask_filtered(scaled, threshold), dim=-1)


@torch.no_grad()
def generate(
    logits_fn: LogitsFn,
    prompts: torch.Tensor,
    params: SamplingParams,
    *,
    true_vocab_size: int,
    generators: Sequence[torch.Generator],
    tp_group: Optional[dist.ProcessGroup] = None,
    share_draws: Optional[ShareDraws] = None,
) -> Rollout:
    """Samples one response per prompt row until <eos> or `max_new_tokens`, whichever comes first.

    All prompts share one length. The rows split into `len(generators)` equal groups of consecutive rows; group
    `i` draws from `generators[i]`. Every TP rank must pass the same prompts and generators in the same state;
    the result is then identical on every rank and deterministic for a given seed. `share_draws` (needed where
    `logits_fn` returns None on some ranks) maps this rank's draws to the sampling ranks' draws.
    """
    batch, prompt_length = prompts.shape
    if not generators or batch % len(generators):
        raise ValueError(f"generators: {batch} prompt rows do not split into {len(generators)} equal groups")
    group_rows = batch // len(generators)
    input_ids = prompts.clone()
    logprobs = torch.zeros(batch, prompt_length)
    token_mask = torch.zeros(batch, prompt_length)
    finished = torch.zeros(batch, dtype=torch.bool)
    for _ in range(params.max_new_tokens):
        draws = torch.zeros(2, batch, dtype=torch.float64)  # tokens, their logprobs: exact in float64
        logits = logits_fn(input_ids)
        if logits is not None:
            last_logits = gather_vocab(logits, true_vocab_size, tp_group).to("cpu")
            log_probs = sampling_log_probs(last_logits, params.distribution)
            tokens = torch.cat([torch.multinomial(log_probs[start:start + group_rows].exp(), 1, generator=generator)
                                for start, generator in zip(range(0, batch, group_rows), generators)]).squeeze(1)
            draws = torch.stack([tokens.double(), log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).double()])
        if share_draws is not None:
            draws = share_draws(draws)
        tokens, token_logprobs = draws[0].long(), draws[1].float()
        tokens = tokens.masked_fill(finished, params.pad_id)
        input_ids = torch.cat([input_ids, tokens.unsqueeze(1)], dim=1)
        logprobs = torch.cat([logprobs, token_logprobs.masked_fill(finished, 0.0).unsqueeze(1)], dim=1)
        token_mask = torch.cat([token_mask, (~finished).to(torch.float32).unsqueeze(1)], dim=1)
        finished |= tokens == params.eos_id
        if bool(finished.all()):
            break
    return Rollout(
        input_ids=input_ids, token_mask=token_mask, generation_logprobs=logprobs, prompt_length=prompt_length
    )
