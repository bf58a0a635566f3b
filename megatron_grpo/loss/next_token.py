"""Next-token logprobs aligned with `input_ids`: the one place that does the shift by one in docs/design.md."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_grpo.ops import vocab_parallel_linear_logprobs, vocab_parallel_logprobs


def next_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    trained: torch.Tensor | None = None,
    vocab_start_index: int | None = None,
    true_vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 `[B, S]` logprobs of `input_ids[:, t]` under `logits[:, t-1]`, and their entropies if asked.

    Position 0 has no logprob and is 0, as is every position where `trained` (`[B, S]`, optional) is 0. The op
    runs on the whole, contiguous logits with targets shifted left by one and -1 (ignore) where the next token
    is not wanted, so the logits are never sliced, copied or checked where they are not used. `top_k` /
    `top_p` select the filtered distribution of the sampler (see `vocab_parallel_logprobs`): a token outside
    its kept set has logprob -inf.
    """
    next_targets = _next_targets(input_ids, trained)
    out = vocab_parallel_logprobs(
        logits,
        next_targets,
        vocab_start_index=vocab_start_index,
        true_vocab_size=true_vocab_size,
        group=group,
        with_entropy=with_entropy,
        top_k=top_k,
        top_p=top_p,
    )
    return _aligned(out, with_entropy)


def next_token_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    trained: torch.Tensor | None = None,
    vocab_start_index: int | None = None,
    true_vocab_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    with_entropy: bool = False,
    logit_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`next_token_logprobs` from final hidden states `[B, S, H]` and this rank's `[V_local, H]` output weight
    (`vocab_parallel_linear_logprobs`): logits `logit_scale * hidden @ weight.T` are never materialised.

    The same shift: row `t` targets `input_ids[:, t + 1]`, -1 (never computed) where that token is not
    `trained` and at the last position. `hidden`'s gradient is this rank's partial sum over its vocab shard
    (the caller all-reduces it over TP). No top-k / top-p here.
    """
    out = vocab_parallel_linear_logprobs(
        hidden,
        weight,
        _next_targets(input_ids, trained),
        vocab_start_index=vocab_start_index,
        true_vocab_size=true_vocab_size,
        group=group,
        with_entropy=with_entropy,
        logit_scale=logit_scale,
    )
    return _aligned(out, with_entropy)


def _next_targets(input_ids: torch.Tensor, trained: torch.Tensor | None) -> torch.Tensor:
    """Row `t`'s target: `input_ids[:, t + 1]`, or -1 (ignore) where it is not trained and at the last row."""
    next_targets = torch.full_like(input_ids, -1)
    following = input_ids[:, 1:]
    if trained is not None:
        following = following.masked_fill(trained[:, 1:] == 0, -1)
    next_targets[:, :-1] = following
    return next_targets


def _aligned(out, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op's per-row output (logprobs, or logprobs and entropies) moved to the positions of their tokens."""
    logprobs, entropy = out if with_entropy else (out, None)
    return _shift_right(logprobs), (_shift_right(entropy) if entropy is not None else None)


def _shift_right(per_row: torch.Tensor) -> torch.Tensor:
    """Row `t` (about token `t + 1`) moves to position `t + 1`; position 0, which has no logprob, is 0."""
    return torch.nn.functional.pad(per_row[:, :-1], (1, 0))
