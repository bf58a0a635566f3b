"""The current policy's per-token tensors from a model's output: the one place that computes them.

`ClippedPGLoss` (from logits, or from hidden states with the op) and the Megatron logprob passes call
`current_logprobs`; the loss-fused path (`loss_fused_linear`) reaches the same partials, combine and backward kernel
chunk by chunk. Given the model's output (its logits, or its final hidden states and output weight shard), the
tokens, the `VocabShard` and the `SamplingDistribution`, it returns the next-token logprobs, the entropies and, where
a KL to the unfiltered reference needs them under a top-k / top-p filter, the unfiltered logprobs; with a rollout
engine's kept sets (`KeptSet`), what they replay and how they fare under this forward (`kept_set_metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_grpo.ops.core.backends import Implementation
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.kept_set import KeptSet
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
class KeptSetMetrics:
    """Per token, aligned like the logprobs: how the rollout engine's kept set (`KeptSet`) fares under the training
    forward."""

    mass: torch.Tensor  # the set's probability under the unfiltered distribution at the sampling temperature
    differs: torch.Tensor  # bool: the filter recomputed from these logits keeps another set (see kept_set_metrics)
    replayed: torch.Tensor  # the logprobs over the engine's set (distribution.replayed())
    recomputed: torch.Tensor  # the logprobs over the recomputed filter's set (distribution.recomputed()); -inf outside


@dataclass(frozen=True)
class CurrentLogprobs:
    """Per-token tensors aligned with the tokens (position 0 and untrained tokens are 0)."""

    logprobs: torch.Tensor  # under the distribution (-inf for a target outside a filter's kept set)
    entropy: torch.Tensor | None  # of the distribution, when asked for
    unfiltered_logprobs: torch.Tensor | None = None  # under distribution.unfiltered(), when asked for and filtered
    kept_set: KeptSetMetrics | None = None  # when asked for, with a kept set


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
    kept_set: KeptSet | None = None,
    with_kept_set_metrics: bool = False,
) -> CurrentLogprobs:
    """The next-token logprobs of `tokens` (`[...]` token ids, < 0 where a token is not scored) under
    `distribution`, from `output` at the position before each token (the ops' `shift=True`).

    `with_unfiltered`: also the logprobs under `distribution.unfiltered()` when the distribution is filtered
    (without a filter they are `logprobs`, and `unfiltered_logprobs` stays None). `inplace_backward` (logits only):
    backward writes the logits' gradient into their buffer (`vocab_parallel_logprobs`); for logits the caller's alone,
    read by one op: with unfiltered logprobs as well, two ops read them and it is not used. `chunk_rows` (hidden
    states only) as in `vocab_parallel_linear_logprobs`. `shift=False`: `tokens` are each row's own targets
    (already shifted, as a context-parallel rank's labels are) and the outputs stay with the rows.
    `kept_set`: the rollout engine's kept sets of the tokens' positions (`KeptSet`), which a distribution with
    `replay_kept_set` trains on; `with_kept_set_metrics` (with a kept set): also `kept_set_metrics`, reusing the
    logprobs computed here (no gradient; the forward-only calls read the logits, so the in-place backward stays).
    """
    distribution = SamplingDistribution() if distribution is None else distribution
    unfiltered = with_unfiltered and distribution.filtered
    in_place = inplace_backward and not unfiltered
    ops = _OpCalls(output, tokens, shard, shift, chunk_rows, implementation)
    replayed = kept_set if distribution.replay_kept_set else None
    out = ops(distribution, replayed, with_entropy, check_inputs, in_place)
    curr, entropy = out if with_entropy else (out, None)
    # The same tokens, checked above.
    unfiltered_logprobs = ops(distribution.unfiltered(), None, False, False) if unfiltered else None
    metrics = None
    if with_kept_set_metrics and kept_set is not None:
        known = {"replayed" if distribution.replay_kept_set else "recomputed": curr.detach()}
        if unfiltered_logprobs is not None:
            known["unfiltered"] = unfiltered_logprobs.detach()
        metrics = _kept_set_metrics(ops, kept_set, distribution, check_inputs=check_inputs, **known)
    return CurrentLogprobs(logprobs=curr, entropy=entropy, unfiltered_logprobs=unfiltered_logprobs, kept_set=metrics)


def kept_set_metrics(
    output: ModelOutput,
    tokens: torch.Tensor,
    kept_set: KeptSet,
    *,
    shard: VocabShard | None = None,
    distribution: SamplingDistribution | None = None,
    check_inputs: bool = True,
    chunk_rows: int | None = None,
    implementation: Implementation = "auto",
    shift: bool = True,
) -> KeptSetMetrics:
    """How the engine's kept sets fare under `output` (no gradient), per token: the set's probability mass under
    `distribution.unfiltered()` (`exp` of the unfiltered logprob minus the replayed one: the target is in its set),
    and whether the filter recomputed from these logits (`distribution.recomputed()`) keeps another set. Equal sets
    give the same logprob bit for bit (`ops.core.replay`); different sets a different one, unless they differ only
    in tokens whose probability rounds to 0, which change nothing. Three forward-only op calls; `current_logprobs`
    reuses what it computed."""
    distribution = SamplingDistribution() if distribution is None else distribution
    ops = _OpCalls(output, tokens, shard, shift, chunk_rows, implementation)
    return _kept_set_metrics(ops, kept_set, distribution, check_inputs=check_inputs)


def _kept_set_metrics(ops: _OpCalls, kept_set: KeptSet, distribution: SamplingDistribution, *, check_inputs: bool,
                      replayed: torch.Tensor | None = None, recomputed: torch.Tensor | None = None,
                      unfiltered: torch.Tensor | None = None) -> KeptSetMetrics:
    with torch.no_grad():
        if replayed is None:
            replayed = ops(distribution.replayed(), kept_set, False, check_inputs)
        if recomputed is None:
            recomputed = ops(distribution.recomputed(), None, False, False)
        if unfiltered is None:
            unfiltered = ops(distribution.unfiltered(), None, False, False)
        return KeptSetMetrics(mass=torch.exp(unfiltered - replayed), differs=replayed != recomputed,
                              replayed=replayed, recomputed=recomputed)


@dataclass(frozen=True)
class _OpCalls:
    """One model output's op calls: `(distribution, kept_set, with_entropy, check_inputs, inplace_backward)`."""

    output: ModelOutput
    tokens: torch.Tensor
    shard: VocabShard | None
    shift: bool
    chunk_rows: int | None
    implementation: Implementation

    def __call__(self, distribution: SamplingDistribution, kept_set: KeptSet | None, with_entropy: bool,
                 check_inputs: bool, inplace_backward: bool = False):
        if isinstance(self.output, HiddenStates):
            return vocab_parallel_linear_logprobs(
                self.output.hidden, self.output.weight, self.tokens, shard=self.shard, distribution=distribution,
                shift=self.shift, with_entropy=with_entropy, chunk_rows=self.chunk_rows, check_inputs=check_inputs,
                implementation=self.implementation, kept_set=kept_set)
        return vocab_parallel_logprobs(self.output, self.tokens, shard=self.shard, distribution=distribution,
                                       shift=self.shift, with_entropy=with_entropy, inplace_backward=inplace_backward,
                                       check_inputs=check_inputs, implementation=self.implementation,
                                       kept_set=kept_set)
