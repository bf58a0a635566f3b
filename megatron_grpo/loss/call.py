"""`LossCall`: everything a training step tells its loss about one microbatch besides the model's output and the
batch; `StepLoss`: what every loss the Megatron step accepts provides.

One typed value carried from the step to the loss, as `VocabShard` and `SamplingDistribution` are carried from the
API to the kernels: each option has its default here, once, and a new option is one field, read where it is used.
`ClippedPGLoss`'s keyword API (`loss_fn(logits, batch, global_valid_tokens=..., ...)`) builds one from its keywords.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import torch

from megatron_grpo.loss.logprob_error_mask import check_threshold
from megatron_grpo.loss.metrics import Aggregation
from megatron_grpo.loss.prev_approximation import PrevApproximation, StepVersions
from megatron_grpo.loss.reductions import Count
from megatron_grpo.ops.context_shard import ContextShard
from megatron_grpo.ops.core.backends import Implementation
from megatron_grpo.ops.current import ModelOutput
from megatron_grpo.ops.distribution import SamplingDistribution
from megatron_grpo.ops.vocab_shard import VocabShard


@dataclass(frozen=True)
class PrevSource:
    """Where the loss's prev logprobs come from: the batch's `prev_logprobs` (a prev pass) unless one of these says
    otherwise. The Megatron step builds it from the plan (`megatron.step.prev_source`)."""

    from_current: bool | None = None  # prev = curr.detach(); None: exactly when loss_fn.force_on_policy_ratio is set
    approximation: PrevApproximation | None = None  # the generation logprobs, or AReaL's interpolation
    compare_with: StepVersions | None = None  # with prev from the batch: log each approximation's error against it


@dataclass(frozen=True)
class LossCall:
    """How to compute one microbatch's loss: its normalisation, the vocab shard and the trained distribution, where
    prev comes from, which sequences a logprob error masks, this rank's share of the sequences under context
    parallelism, and how the current logprobs are computed. Only the two global counts have no default; they are
    None exactly when the normalisation is deferred."""

    global_valid_tokens: Count | None  # trained tokens of the whole optimizer step: all microbatches, all DP ranks
    global_valid_seqs: Count | None  # sequences with a trained token, likewise
    shard: VocabShard = field(default_factory=VocabShard)  # where the logits' vocab columns sit; default unsharded
    distribution: SamplingDistribution = field(default_factory=SamplingDistribution)  # the policy trained: the
    #   one the rollouts were sampled from (1 / temperature, top-k / top-p); default softmax(logits)
    prev: PrevSource = field(default_factory=PrevSource)
    seq_logprob_error_threshold: float | None = None  # NeMo-RL's sequence mask, applied in the loss
    #   (`loss.logprob_error_mask`): a sequence whose mean exp(|generation - prev|) exceeds it leaves the loss and the
    #   counts; prev is the batch's `prev_logprobs` when it carries them (a prev pass), else curr.detach(). The
    #   counts are then known only after every forward: it needs `defer_normalisation`
    defer_normalisation: bool = False  # the step normalises once, after the last forward: the loss returns its sums
    #   (the global counts are None) and reports the count they are to be divided by (`metrics.NORMALISER`), and
    #   every normalised-sum metric is a sum too (`megatron.apply_deferred_normalisation` divides gradients and
    #   metrics)
    context: ContextShard | None = None  # this CP rank's share of each sequence (the batch is row-aligned)
    inplace_backward: bool = False  # the logits are this call's alone (a Megatron forward step's are): backward may
    #   write their gradient into their buffer; used where exactly one op reads them
    check_inputs: bool = True  # check the values that cost a host sync (target ids, finite advantages, the counts)
    loss_fused: bool = True  # from hidden states: the loss-fused head (its gradient in forward, 3 GEMMs, not 4)
    chunk_rows: int | None = None  # from hidden states: trained rows per chunk; None: the ops' default
    implementation: Implementation = "auto"  # the kernels: "auto", "fused" or "torch"
    upstream_gradient: float | torch.Tensor | None = None  # the loss-fused head: d(objective)/d(loss), the gradient
    #   backward will bring to this loss, known up front (the Megatron step binds it: its loss scale times what
    #   Megatron's schedule multiplies the loss by): dH and dW are written final in forward, dW straight into Megatron
    #   DDP's main_grad; backward checks it. None: 1, read back in backward (one host sync), else a pass over dH, dW
    kept_set_metrics: bool = True  # with kept sets in the batch: kept_set_mass and kept_set_differs (forward-only op
    #   calls: two when the loss trains on one of the sets, three on the loss-fused head)

    def __post_init__(self) -> None:
        counts = ("global_valid_tokens", "global_valid_seqs")
        given = [name for name in counts if getattr(self, name) is not None]
        if self.defer_normalisation and given:
            raise ValueError(f"{' and '.join(given)}: given with defer_normalisation=True, where the step divides by "
                             "the counts the forwards report; pass None")
        if not self.defer_normalisation and len(given) < len(counts):
            missing = [name for name in counts if name not in given]
            raise ValueError(f"{' and '.join(missing)}: required (the step's global count), unless "
                             "defer_normalisation=True")
        for name in given:
            check_count(name, getattr(self, name))
        check_threshold(self.seq_logprob_error_threshold)
        if self.seq_logprob_error_threshold is not None and not self.defer_normalisation:
            raise ValueError("seq_logprob_error_threshold: the mask drops sequences in the forward, so the step's "
                             "counts are known only after its last forward; it needs defer_normalisation=True")

    @classmethod
    def of(cls, global_valid_tokens: Count | None, global_valid_seqs: Count | None, **options: Any) -> LossCall:
        """A call from keyword options, where None means the field's default (a keyword API's unset argument)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"LossCall: unknown option(s) {', '.join(unknown)}")
        return cls(global_valid_tokens, global_valid_seqs, **{k: v for k, v in options.items() if v is not None})


def check_count(name: str, count: Count) -> None:
    """A global count is a finite number >= 0 (a tensor's value is read later, with the batch's, when checked). 0 is
    an empty step: every microbatch of it has nothing to train, which the loss checks."""
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.dtype == torch.bool or count.dtype.is_complex:
            raise ValueError(f"{name}: expected a number or a one-element real tensor, got a {count.dtype} tensor "
                             f"of shape {list(count.shape)}")
        return
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        raise ValueError(f"{name}: expected a number (the step's global count), got {type(count).__name__}")
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"{name}: must be a finite count >= 0 over the whole optimizer step, got {count!r}")


class StepLoss(Protocol):
    """What `megatron_grpo.megatron.make_forward_step` and `train_step` need of a loss (`ClippedPGLoss` is one).

    `step_loss` returns this microbatch's share of the optimizer step's loss, already normalised by the call's global
    counts (so the shares of all microbatches and DP ranks add up to the step's loss), and its detached metrics:
    `"loss"` (the share's value) and `"curr_logprobs"` (`[B, S]`, the batch's layout: the step hands them back), with
    `"prev_logprobs"` too when prev is approximated. With `call.defer_normalisation` the share is an unnormalised sum
    and the metrics hold `metrics.NORMALISER`, the count it is to be divided by (summed over microbatches and ranks).
    `metric_aggregation` says how each metric aggregates over microbatches and DP ranks."""

    @property
    def metric_aggregation(self) -> Mapping[str, Aggregation]: ...

    def step_loss(self, output: ModelOutput, batch: Mapping[str, torch.Tensor],
                  call: LossCall) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...
