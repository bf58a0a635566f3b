"""Sampling rollouts from a tensor- and pipeline-parallel policy.

The policy is any callable mapping `input_ids [B, S]` (on the CPU) to this rank's vocab shard of the last
position's logits `[B, V_local]` (on its own device, so the TP gather runs where the backend wants it; with
ragged prompts, called with `last_positions=[B]`, each row's own last position's), or to None on a rank that holds
no logits (a pipeline stage before the last). Each decoding step gathers the shards
over the TP group (a `[B, V]` tensor, tiny next to the forward pass), drops Megatron's padded vocab columns, and
samples on the CPU from the tempered, top-k/top-p filtered distribution (a `SamplingDistribution`, the one the
training logprobs use, filtered by `megatron_grpo.ops.core.filtering`, the ops' own filter). `share_draws` then
hands the sampling ranks' tokens to the ranks without logits.

Every group of rows (the samples of one prompt) draws from its own generator, which the caller keys by the
prompt's global index: the TP ranks draw the same tokens without another collective, and a prompt's samples do
not depend on which data-parallel rank holds it. The log-probability of each drawn token under that same
sampling distribution is returned as `generation_logprobs`, and, where the distribution is filtered (top-k / top-p),
the kept set each token was drawn from (`Rollout.kept_set`, an `ops.KeptSet` over the rollout's positions), which
training replays with `generation.replay_kept_set`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_grpo.ops.core.filtering import kept_threshold, mask_filtered
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet

LogitsFn = Callable[..., Optional[torch.Tensor]]  # (input_ids [B, S], last_positions=[B] when ragged)
ShareDraws = Callable[[torch.Tensor], torch.Tensor]  # the sampling ranks' tensor on every rank: [2, B] float64 draws
#   (tokens, logprobs), and [B, V] uint8 kept masks where the distribution is filtered


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    distribution: SamplingDistribution  # what each token is drawn from (and the policy training trains)
    eos_id: int
    pad_id: int  # written after <eos>; never trained


@dataclass(frozen=True)
class Rollout:
    """Prompts with their sampled responses; every tensor is `[B, S]` and aligned with `input_ids`.

    Row `i` holds its prompt, then its response right after it, then `pad_id`: with prompts of one length
    (`prompt_lengths` None) every response starts at column `prompt_length`; with ragged prompts
    (`prompt_lengths` `[B]`), row `i`'s at column `prompt_lengths[i]`, and `prompt_length` is the longest."""

    input_ids: torch.Tensor  # int64: prompt, response, then pad_id after <eos>
    token_mask: torch.Tensor  # float32: 1 on response tokens up to and including <eos>
    generation_logprobs: torch.Tensor  # float32: log p_sampling(token); 0 outside token_mask
    prompt_length: int
    prompt_lengths: Optional[torch.Tensor] = None  # [B] int64: each row's prompt length; None: all prompt_length
    routed_experts: Optional[torch.Tensor] = None  # [B, S, L, k] int64: an MoE policy's routes of each token, as the
    #   sampler's forwards chose them (`megatron.routing_replay.RouteRecorder`); None: not recorded
    kept_set_offsets: Optional[torch.Tensor] = None  # the kept sets (`kept_set`), where the distribution is filtered
    kept_set_ids: Optional[torch.Tensor] = None

    @property
    def kept_set(self) -> Optional[KeptSet]:
        """The kept set each response token was drawn from, over the `[B, S]` positions flattened (empty elsewhere);
        None where the sampling distribution has no filter."""
        return None if self.kept_set_offsets is None else KeptSet(self.kept_set_offsets, self.kept_set_ids)

    @property
    def responses(self) -> torch.Tensor:
        """`[B, S - prompt_length]`: each row's response from its first generated token, then padding."""
        if self.prompt_lengths is None:
            return self.input_ids[:, self.prompt_length :]
        width = self.input_ids.shape[1] - self.prompt_length
        columns = self.prompt_lengths[:, None] + torch.arange(width)[None]  # in range: prompt_lengths <= prompt_length
        return self.input_ids.gather(1, columns)


def gather_vocab(logits_shard: torch.Tensor, true_vocab_size: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Full-vocab logits `[..., true_vocab_size]` from this rank's shard `[..., V_local]`; padding dropped."""
    if group is not None and dist.get_world_size(group) > 1:
        shards = [torch.empty_like(logits_shard) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shards, logits_shard.contiguous(), group=group)
        logits_shard = torch.cat(shards, dim=-1)
    return logits_shard[..., :true_vocab_size]


def sampling_log_probs(logits: torch.Tensor, distribution: SamplingDistribution) -> torch.Tensor:
    """Log-probabilities `[B, V]` of the sampling distribution: softmax(logit_scale * logits) over the tokens that
    top-k and then top-p keep (`megatron_grpo.ops.core.filtering`); filtered tokens get -inf. The scaled logits are
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
    prompt_lengths: Optional[torch.Tensor] = None,
) -> Rollout:
    """Samples one response per prompt row until <eos> or `max_new_tokens`, whichever comes first.

    The prompts share one length, or (`prompt_lengths` `[B]`, the prompts right-padded to the longest) row `i`'s
    prompt is its first `prompt_lengths[i]` tokens and its response is written right after them. Each decoding
    step then reads the logits of each row's own last token (`logits_fn(input_ids, last_positions=[B])`): under
    causal attention the padding after it changes nothing, so a ragged batch samples as its rows would alone.
    The rows split into `len(generators)` equal groups of consecutive rows; group `i` draws from
    `generators[i]`. Every TP rank must pass the same prompts and generators in the same state; the result is
    then identical on every rank and deterministic for a given seed. `share_draws` (needed where `logits_fn`
    returns None on some ranks) maps this rank's draws (and, with a filter, kept masks) to the sampling ranks'.
    With a top-k / top-p filter the rollout records each token's kept set (`Rollout.kept_set`).
    """
    batch, prompt_length = prompts.shape
    if not generators or batch % len(generators):
        raise ValueError(f"generators: {batch} prompt rows do not split into {len(generators)} equal groups")
    ragged = prompt_lengths is not None and bool((prompt_lengths != prompt_length).any())
    if prompt_lengths is not None and (tuple(prompt_lengths.shape) != (batch,) or int(prompt_lengths.min()) < 1
                                       or int(prompt_lengths.max()) > prompt_length):
        raise ValueError(f"prompt_lengths: expected [{batch}] lengths in [1, {prompt_length}], got "
                         f"{prompt_lengths.tolist()}")
    group_rows = batch // len(generators)
    width = prompt_length + params.max_new_tokens
    input_ids = torch.full((batch, width), params.pad_id, dtype=prompts.dtype)
    input_ids[:, :prompt_length] = prompts
    logprobs = torch.zeros(batch, width)
    token_mask = torch.zeros(batch, width)
    ends = prompt_lengths.clone() if ragged else torch.full((batch,), prompt_length, dtype=torch.int64)
    rows = torch.arange(batch)
    finished = torch.zeros(batch, dtype=torch.bool)
    steps = 0
    filtered = params.distribution.recomputed().recomputes_filter
    kept = _KeptSets()
    for _ in range(params.max_new_tokens):
        draws = torch.zeros(2, batch, dtype=torch.float64)  # tokens, their logprobs: exact in float64
        kept_mask = torch.zeros(batch, true_vocab_size, dtype=torch.uint8) if filtered else None
        seen = input_ids[:, :prompt_length + steps].contiguous()
        logits = logits_fn(seen, last_positions=ends - 1) if ragged else logits_fn(seen)
        if logits is not None:
            last_logits = gather_vocab(logits, true_vocab_size, tp_group).to("cpu")
            log_probs = sampling_log_probs(last_logits, params.distribution)
            tokens = torch.cat([torch.multinomial(log_probs[start:start + group_rows].exp(), 1, generator=generator)
                                for start, generator in zip(range(0, batch, group_rows), generators)]).squeeze(1)
            draws = torch.stack([tokens.double(), log_probs.gather(1, tokens.unsqueeze(1)).squeeze(1).double()])
            if filtered:
                kept_mask = torch.isfinite(log_probs).to(torch.uint8)
        if share_draws is not None:
            draws = share_draws(draws)
            kept_mask = share_draws(kept_mask) if filtered else None
        if filtered:
            kept.add(kept_mask.bool() & ~finished[:, None], ends)
        tokens, token_logprobs = draws[0].long(), draws[1].float()
        input_ids[rows, ends] = tokens.masked_fill(finished, params.pad_id)
        logprobs[rows, ends] = token_logprobs.masked_fill(finished, 0.0)
        token_mask[rows, ends] = (~finished).to(torch.float32)
        finished |= tokens == params.eos_id
        ends += 1
        steps += 1
        if bool(finished.all()):
            break
    width = prompt_length + steps
    kept_set = kept.csr(batch, width) if filtered else None
    return Rollout(
        input_ids=input_ids[:, :width], token_mask=token_mask[:, :width], generation_logprobs=logprobs[:, :width],
        prompt_length=prompt_length, prompt_lengths=prompt_lengths.clone() if ragged else None,
        kept_set_offsets=None if kept_set is None else kept_set.offsets,
        kept_set_ids=None if kept_set is None else kept_set.ids,
    )


class _KeptSets:
    """Each decoding step's kept ids, gathered as (row, column, id) triples, O(kept), and cut into a CSR at the
    end, when the rollout's width is known."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []
        self.columns: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []

    def add(self, mask: torch.Tensor, columns: torch.Tensor) -> None:
        """`mask` `[B, V]`: the tokens kept for the token each row draws now, at column `columns[b]`."""
        row, token = mask.nonzero(as_tuple=True)
        self.rows.append(row)
        self.columns.append(columns[row])
        self.ids.append(token)

    def csr(self, batch: int, width: int) -> KeptSet:
        """The `KeptSet` over the `[batch, width]` positions flattened (ids ascending within a position)."""
        empty = torch.zeros(0, dtype=torch.int64)
        position = torch.cat(self.rows) * width + torch.cat(self.columns) if self.rows else empty
        ids = torch.cat(self.ids) if self.ids else empty
        order = torch.sort(position, stable=True).indices
        offsets = torch.zeros(batch * width + 1, dtype=torch.int64)
        torch.cumsum(torch.bincount(position, minlength=batch * width), 0, out=offsets[1:])
        return KeptSet(offsets, ids[order].to(torch.int64))
