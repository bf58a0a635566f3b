"""The current policy's per-token tensors from a model's output: the one place that computes them.

`ClippedPGLoss` (from logits, or from hidden states with the op) and the Megatron logprob passes call
`current_logprobs`; the loss-fused path (`loss_fused_linear`) reaches the same partials, combine and backward kernel
chunk by chunk. Given the model's output (its logits, or its final hidden states and output weight shard), the
tokens, the `VocabShard` and the `SamplingDistribution`, it returns the next-token logprobs, the entropies and, where
a KL to the unfiltered reference needs them under a top-k / top-p filter, the unfiltered logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.ops.core.backends import Implementation
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.linear_logprobs import vocab_parallel_linear_logprobs
from megatron_grpo.ops.vocab_parallel import vocab_parallel_logprobs
from megatron_grpo.ops.vocab_shard import VocabShard


@dataclass(frozen=True)
class HiddenStates:
    """A model's output before its output layer: final hidden states `[..., H]` (after the final norm, replicated
    over the TP group) and this rank's `[V_local, H]` output weight shard (or tied embedding)."""

    hidden: torch.Tensor
    weight: torch.Tensor


ModelOutput = torch.Tensor | HiddenStates  # logits `[..., V_local]`, or hidden states and the output weight


@dataclass(frozen=True)
class CurrentLogprobs:
    """Per-token tensors aligned with the tokens (position 0 and untrained tokens are 0)."""

    logprobs: torch.Tensor  # under the distribution (-inf for a target outside a filter's kept set)
    entropy: torch.Tensor | None  # of the distribution, when asked for
    unfiltered_logprobs: torch.Tensor | None = None  # under distribution.unfiltered(), when asked for and filtered


def current_logprobs(
    output: ModelOutput,
    tokens: torch.Tensor,
    *,
    shard: VocabShard | None = None,
    distribution: SamplingDistribution | None = None,
    with_entropy: bool = True,
    with_unfiltered: bool = False,
    inplace_backward: bool = False,
    check_inputs: bool = True,
    chunk_rows: int | None = None,
    implementation: Implementation = "auto",
    shift: bool = True,
) -> CurrentLogprobs:
    """The next-token logprobs of `tokens` (`[...]` token ids, < 0 where a token is not scored) under
    `distribution`, from `output` at the position before each token (the ops' `shift=True`).

    `with_unfiltered`: also the logprobs under `distribution.unfiltered()` when the distribution is filtered
    (without a filter they are `logprobs`, and `unfiltered_logprobs` stays None). `inplace_backward` (logits only):
    backward writes the logits' gradient into their buffer (`vocab_parallel_logprobs`); for logits the caller's alone,
    read by one op: with unfiltered logprobs as well, two ops read them and it is not used. `chunk_rows` (hidden
    states only) as in `vocab_parallel_linear_logprobs`. `shift=False`: `tokens` are each row's own targets
    (already shifted, as a context-parallel rank's labels are) and the outputs stay with the rows.
    """
    distribution = SamplingDistribution() if distribution is None else distribution
    unfiltered = with_unfiltered and distribution.filtered
    if isinstance(output, HiddenStates):
        def logprobs(of: SamplingDistribution, entropy: bool, check: bool):
            return vocab_parallel_linear_logprobs(output.hidden, output.weight, tokens, shard=shard, distribution=of,
                                                  shift=shift, with_entropy=entropy, chunk_rows=chunk_rows,
                                                  check_inputs=check, implementation=implementation)
    else:
        in_place = inplace_backward and not unfiltered

        def logprobs(of: SamplingDistribution, entropy: bool, check: bool):
            return vocab_parallel_logprobs(output, tokens, shard=shard, distribution=of, shift=shift,
                                           with_entropy=entropy, inplace_backward=in_place, check_inputs=check,
                                           implementation=implementation)

    out = logprobs(distribution, with_entropy, check_inputs)
    curr, entropy = out if with_entropy else (out, None)
    # The same tokens, checked above.
    unfiltered_logprobs = logprobs(distribution.unfiltered(), False, False) if unfiltered else None
    return CurrentLogprobs(logprobs=curr, entropy=entropy, unfiltered_logprobs=unfiltered_logprobs)
