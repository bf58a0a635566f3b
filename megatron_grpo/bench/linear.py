"""Fused linear + logprob benchmark: `megatron-grpo bench linear [--quick] [--tp ..] [--dtypes ..] ...`.

`vocab_parallel_linear_logprobs(hidden, weight, targets)` and the loss-fused head against their peers, forward +
backward w.r.t. the hidden states and this rank's shard of the output weight, for each case (TP size, dtype,
T x H x V_local per rank, the fraction of response rows: the others are prompt rows with target -1, the sequence
length, the sampling filter). Per case: the median step time, the candidates' steps interleaved round by round in
one process (a shared machine's load then weighs on all alike), the ratio against the materialised path and against
Megatron-Core measured in the same run, the peak memory beyond the inputs and their gradients (the bytes of live
tensors, deterministic, and the process's or the allocator's peak), and the fused op's error against a float64
reference.

The candidates: the materialised path (`hidden @ weight.T`, then `vocab_parallel_logprobs`), the fused op with
and without entropy and under Megatron's DDP, Megatron's cross entropy after the same linear, Cut-Cross-Entropy and
Liger-Kernel (its fused linear cross entropy, and its tensor-parallel fused linear with entropy and temperature)
where they run, and the GRPO loss step four ways (materialised, with its in-place backward, the fused op then
`ClippedPGLoss`, and the loss-fused `ClippedPGLoss.on_hidden_states`, also under DDP). A candidate that cannot run
here is reported with the reason, and never fails the run. Peers installed outside the venv are found through
`--peer-path DIR`. The ranks run in child processes, as in `bench logprob`.
"""
# In the code: the candidates are a registry (`CANDIDATES`) of named builders, each returning a `Step` (a forward
# on `(hidden, weight)` and its upstream gradient) or raising with the reason it cannot run; the ranks run through
# `measure.run_ranks`. Peer paths are appended to sys.path after the venv, so its torch is kept.

from __future__ import annotations

import argparse
import datetime
import functools
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from megatron_grpo.bench.measure import (
    DEFAULT_OUT,
    OUT_HELP,
    LiveTensorBytes,
    PeakMemory,
    grouped_bar_plot,
    load_average,
    machine_description,
    run_ranks,
    synchronize,
    write_results,
)
from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_linear_logprobs, vocab_parallel_logprobs
from megatron_grpo.ops.core.chunking import chunk_rows_for
from megatron_grpo.runner.helptext import DefaultsHelpFormatter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SEQUENCE_ROWS = 1024  # default rows per sequence: its prompt rows come first, then its response rows
LOGIT_STD = 3.0

# The targets the op was built to, printed next to the results.
TARGET_SPEED_ALL_ROWS = 0.75      # materialised ms / fused ms at 100% response rows
TARGET_SPEED_QUARTER_ROWS = 2.5   # ... at 25% response rows
TARGET_PEAK_FRACTION = 0.10       # fused extra peak / materialised extra peak
TARGET_LOSS_FUSED = 1.0           # materialised loss step (in-place backward) ms / loss-fused ms at 100% rows


@dataclass(frozen=True)
class Case:
    tp: int
    dtype: str
    tokens: int
    hidden: int
    v_local: int
    response: float  # fraction of rows that have a target
    chunk_rows: int | None = None  # the fused op's rows per chunk; None: the op's default (`chunk_rows_for`)
    sequence: int = SEQUENCE_ROWS  # rows per sequence of the loss candidates (prompt rows first)
    top_k: int | None = None  # the sampling filter of our candidates (the peers have none: skipped)
    top_p: float | None = None

    @property
    def distribution(self) -> SamplingDistribution:
        return SamplingDistribution(top_k=self.top_k, top_p=self.top_p)

    def label(self) -> str:
        chunks = "" if self.chunk_rows is None else f", fused chunk_rows={self.chunk_rows}"
        sequences = "" if self.sequence == SEQUENCE_ROWS else f", sequences of {self.sequence}"
        filters = "".join(f", {name}={value}" for name, value in (("top-k", self.top_k), ("top-p", self.top_p))
                          if value is not None)
        return (f"TP={self.tp}, {self.dtype}, T={self.tokens} x H={self.hidden} x V_local={self.v_local}, "
                f"{100 * self.response:.0f}% response rows{sequences}{filters}{chunks}")


@dataclass
class CaseInputs:
    """One rank's inputs: `hidden` is replicated over the TP group, `weight` is this rank's vocab shard."""

    hidden: torch.Tensor        # [T, H]
    weight: torch.Tensor        # [V_local, H]
    targets: torch.Tensor       # [T] global ids, -1 on prompt rows
    upstream: torch.Tensor      # [T] float32: 1 on response rows, 0 on prompt rows (the loss mask)
    group: dist.ProcessGroup | None
    seed: int                   # for a candidate that needs more inputs (advantages, old logprobs, ...)
    distribution: SamplingDistribution = SamplingDistribution()  # the case's filter, for our candidates


@dataclass(frozen=True)
class Step:
    """What one candidate times: `forward(hidden, weight)` -> a tensor, differentiated with `grad_out` as the
    upstream gradient (None for a scalar loss)."""

    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_out: torch.Tensor | None


@dataclass(frozen=True)
class Candidate:
    """A named benchmark entry: `build(case, inputs)` returns its `Step` or raises with the reason it is skipped.
    `baseline` names the candidate its "vs materialised" ratio is taken against."""

    build: Callable[[Case, CaseInputs], Step]
    description: str
    baseline: str = "materialised"


# ---- candidates ----

def build_materialised(case: Case, inputs: CaseInputs) -> Step:
    def forward(hidden, weight):
        return vocab_parallel_logprobs(hidden @ weight.t(), inputs.targets, shard=VocabShard(group=inputs.group),
                                       distribution=inputs.distribution, check_inputs=False)

    return Step(forward, inputs.upstream)


def build_fused(case: Case, inputs: CaseInputs) -> Step:
    def forward(hidden, weight):
        return vocab_parallel_linear_logprobs(hidden, weight, inputs.targets, shard=VocabShard(group=inputs.group),
                                              distribution=inputs.distribution, chunk_rows=case.chunk_rows,
                                              check_inputs=False)

    return Step(forward, inputs.upstream)


def with_main_grad(inputs: CaseInputs) -> Callable[[torch.Tensor], torch.Tensor]:
    """What Megatron's DDP gives the weight: an fp32 `main_grad` buffer (allocated here, once, before any timed step:
    it counts with the inputs) and the flag `grad_added_to_main_grad`. Returns the function that attaches them to a
    step's fresh weight leaf."""
    main_grad = torch.zeros(inputs.weight.shape, dtype=torch.float32, device=inputs.weight.device)

    def attach(weight: torch.Tensor) -> torch.Tensor:
        weight.main_grad, weight.grad_added_to_main_grad = main_grad, False
        return weight

    return attach


def build_fused_main_grad(case: Case, inputs: CaseInputs) -> Step:
    attach = with_main_grad(inputs)

    def forward(hidden, weight):
        return vocab_parallel_linear_logprobs(hidden, attach(weight), inputs.targets,
                                              shard=VocabShard(group=inputs.group), distribution=inputs.distribution,
                                              chunk_rows=case.chunk_rows, check_inputs=False)

    return Step(forward, inputs.upstream)


def build_fused_entropy(case: Case, inputs: CaseInputs) -> Step:
    def forward(hidden, weight):
        logprob, entropy = vocab_parallel_linear_logprobs(hidden, weight, inputs.targets,
                                                          shard=VocabShard(group=inputs.group), with_entropy=True,
                                                          distribution=inputs.distribution,
                                                          chunk_rows=case.chunk_rows, check_inputs=False)
        return logprob + entropy  # both outputs take the upstream gradient

    return Step(forward, inputs.upstream)


def build_megatron(case: Case, inputs: CaseInputs) -> Step:
    """Megatron's output layer then `vocab_parallel_cross_entropy`, in the `[s, b, ...]` layout it documents
    (batch 1). It overwrites its fp32 input logits in place; here they are the linear's fresh output, which the
    linear's backward does not need, so no clone is due. A target of -1 belongs to no rank: its row gets loss
    lse, and the upstream mask gives it no gradient, as a masked loss would."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    _unfiltered_only(case, "Megatron's vocab_parallel_cross_entropy")
    targets = inputs.targets.view(case.tokens, 1)

    def forward(hidden, weight):
        logits = hidden.view(case.tokens, 1, case.hidden) @ weight.t()
        return -vocab_parallel_cross_entropy(logits, targets)  # TP group: parallel_state, set by run_ranks

    return Step(forward, inputs.upstream.view(case.tokens, 1))


def _one_rank_only(case: Case, name: str) -> None:
    if case.tp != 1:
        raise RuntimeError(f"{name} has no vocab-parallel mode: it needs the whole vocab on one rank")
    _unfiltered_only(case, name)


def _unfiltered_only(case: Case, name: str) -> None:
    if case.distribution.filtered:
        raise RuntimeError(f"{name} has no top-k / top-p")


_PROBED: dict[str, Exception | None] = {}


def _probe(key: str, call: Callable[[], None]) -> None:
    """Runs a peer once per process on tiny tensors and re-raises its error on every later case, so that a peer
    that cannot run here is skipped with its own error, at the cost of one tiny call."""
    if key not in _PROBED:
        try:
            call()
            _PROBED[key] = None
        except Exception as exc:  # noqa: BLE001 - kept, and raised for each case the peer is asked for
            _PROBED[key] = exc
    if _PROBED[key] is not None:
        raise _PROBED[key]


def _tiny(like: torch.Tensor):
    """A tiny case in `like`'s dtype and on its device: a probe on the wrong device would skip a GPU-only peer."""
    hidden = torch.randn(8, 16, dtype=like.dtype, device=like.device, requires_grad=True)
    weight = torch.randn(32, 16, dtype=like.dtype, device=like.device, requires_grad=True)
    targets = torch.tensor([3, -1, 5, 0, 31, 7, -1, 2], device=like.device)
    return hidden, weight, targets


def _build_cce(case: Case, inputs: CaseInputs, impl: str) -> Step:
    _one_rank_only(case, "Cut-Cross-Entropy's linear_cross_entropy")
    from cut_cross_entropy import linear_cross_entropy

    def loss(hidden, weight, targets):
        return linear_cross_entropy(hidden, weight, targets, ignore_index=-1, reduction="none", impl=impl)

    def probe():
        h, w, t = _tiny(inputs.hidden)
        loss(h, w, t).sum().backward()

    _probe(f"cce-{impl}-{inputs.hidden.dtype}-{inputs.hidden.device}", probe)
    return Step(lambda hidden, weight: -loss(hidden, weight, inputs.targets), inputs.upstream)


def build_cce(case: Case, inputs: CaseInputs) -> Step:
    return _build_cce(case, inputs, "cce")


def build_cce_torch_compile(case: Case, inputs: CaseInputs) -> Step:
    return _build_cce(case, inputs, "torch_compile")


def build_liger_tp(case: Case, inputs: CaseInputs) -> Step:
    """Liger-Kernel's tensor-parallel fused linear cross entropy with entropy and temperature (1 here), its vocab
    sharded over the TP group as ours (NCCL and CUDA only), both outputs trained as `fused+entropy`'s."""
    _unfiltered_only(case, "Liger-Kernel's tensor-parallel fused linear cross entropy")
    from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyTPFunction

    group = inputs.group if inputs.group is not None else dist.group.WORLD

    def forward(hidden, weight, targets=inputs.targets):
        nll, entropy = LigerFusedLinearScaledCrossEntropyTPFunction.apply(hidden, weight, targets, group, 1.0, -1, 1,
                                                                          True)
        return entropy - nll

    def probe():
        h, w, t = _tiny(inputs.hidden)
        forward(h, w, t).sum().backward()

    _probe(f"liger-tp-{inputs.hidden.dtype}-{inputs.hidden.device}", probe)
    return Step(lambda hidden, weight: forward(hidden, weight), inputs.upstream)


def build_liger(case: Case, inputs: CaseInputs) -> Step:
    _one_rank_only(case, "Liger-Kernel's fused linear cross entropy")
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def loss(hidden, weight, targets):
        return liger_fused_linear_cross_entropy(hidden, weight, targets, ignore_index=-1, reduction="none")

    def probe():
        h, w, t = _tiny(inputs.hidden)
        loss(h, w, t).sum().backward()

    _probe(f"liger-{inputs.hidden.dtype}-{inputs.hidden.device}", probe)
    return Step(lambda hidden, weight: -loss(hidden, weight, inputs.targets), inputs.upstream)


# ---- the GRPO loss step: ClippedPGLoss on logits, and its loss-fused form on hidden states ----

# A GRPO loss with every key explicit: the clipped ratio against prev logprobs, token-mean, no KL, no entropy bonus.
LOSS_CONFIG = dict(
    ratio_clip_min=0.2, ratio_clip_max=0.28, ratio_clip_c=None, disable_ppo_ratio=False, loss_agg_mode="token-mean",
    max_response_length=None, sequence_level_importance_ratio=False, sequence_level_importance_weight="product",
    reference_policy_kl_penalty=0.0, reference_policy_kl_type="k3", kl_input_clamp_value=None,
    kl_output_clamp_value=None, kl_in_sequence_reward=False, use_on_policy_kl_approximation=False,
    use_importance_sampling_correction=False,
    truncated_importance_sampling={"type": None, "ratio_min": None, "ratio_max": None},
    force_on_policy_ratio=False, use_cispo=False, positive_example_nll_weight=0.0, entropy_coef=0.0,
)


@dataclass(frozen=True)
class LossInputs:
    loss_fn: object  # ClippedPGLoss
    batch: dict[str, torch.Tensor]  # [B, S] with B * S = T; the same response rows as the op's cases
    tokens: torch.Tensor
    seqs: torch.Tensor


def _loss_inputs(case: Case, inputs: CaseInputs) -> LossInputs:
    """A GRPO batch over the case's rows as sequences of `case.sequence` tokens (prompt first), with prev logprobs
    near a uniform policy's, so that ratios spread around 1."""
    from megatron_grpo.loss import ClippedPGLoss, ClippedPGLossConfig, count_valid

    sequence = min(case.tokens, case.sequence)
    if case.tokens % sequence:
        raise ValueError(f"the loss candidates need T ({case.tokens}) to be a multiple of {sequence}")
    batch_size, vocab = case.tokens // sequence, case.v_local * case.tp
    gen = torch.Generator().manual_seed(inputs.seed)
    device = inputs.hidden.device
    ids = torch.randint(0, vocab, (batch_size, sequence), generator=gen)
    # Token t + 1 is trained where row t has a target in the op's cases: the same number of trained rows.
    trained_row = inputs.targets.view(batch_size, sequence).cpu() >= 0
    token_mask = torch.zeros(batch_size, sequence, dtype=torch.int64)
    token_mask[:, 1:] = trained_row[:, :-1]
    batch = {
        "input_ids": ids, "token_mask": token_mask, "sample_mask": torch.ones(batch_size),
        "advantages": torch.randn(batch_size, sequence, generator=gen),
        "prev_logprobs": -math.log(vocab) + 0.3 * torch.randn(batch_size, sequence, generator=gen),
    }
    batch = {key: value.to(device) for key, value in batch.items()}
    tokens, seqs = count_valid(batch)  # this rank's batch is the whole step's here (TP ranks hold the same)
    return LossInputs(ClippedPGLoss(ClippedPGLossConfig(**LOSS_CONFIG)), batch, tokens, seqs)


def build_materialised_loss(case: Case, inputs: CaseInputs) -> Step:
    loss = _loss_inputs(case, inputs)
    shape = (*loss.batch["input_ids"].shape, case.hidden)

    def forward(hidden, weight):
        value, _ = loss.loss_fn(hidden.view(shape) @ weight.t(), loss.batch, global_valid_tokens=loss.tokens,
                                global_valid_seqs=loss.seqs, shard=VocabShard(group=inputs.group),
                                distribution=inputs.distribution)
        return value

    return Step(forward, None)


def build_materialised_loss_inplace(case: Case, inputs: CaseInputs) -> Step:
    loss = _loss_inputs(case, inputs)
    shape = (*loss.batch["input_ids"].shape, case.hidden)

    def forward(hidden, weight):
        value, _ = loss.loss_fn(hidden.view(shape) @ weight.t(), loss.batch, global_valid_tokens=loss.tokens,
                                global_valid_seqs=loss.seqs, shard=VocabShard(group=inputs.group),
                                distribution=inputs.distribution, inplace_backward=True)
        return value

    return Step(forward, None)


def build_recompute_loss(case: Case, inputs: CaseInputs) -> Step:
    from megatron_grpo.loss import trained_token_mask, trained_token_targets

    loss = _loss_inputs(case, inputs)
    shape = (*loss.batch["input_ids"].shape, case.hidden)
    targets = trained_token_targets(loss.batch["input_ids"], trained_token_mask(loss.batch))

    def forward(hidden, weight):
        logprobs, entropy = vocab_parallel_linear_logprobs(
            hidden.view(shape), weight, targets, shard=VocabShard(group=inputs.group), shift=True, with_entropy=True,
            distribution=inputs.distribution, chunk_rows=case.chunk_rows, check_inputs=False)
        value, _ = loss.loss_fn(None, loss.batch, global_valid_tokens=loss.tokens, global_valid_seqs=loss.seqs,
                                curr_logprobs=logprobs, curr_entropy=entropy, distribution=inputs.distribution)
        return value

    return Step(forward, None)


def build_loss_fused(case: Case, inputs: CaseInputs) -> Step:
    loss = _loss_inputs(case, inputs)
    shape = (*loss.batch["input_ids"].shape, case.hidden)

    def forward(hidden, weight):
        value, _ = loss.loss_fn.on_hidden_states(hidden.view(shape), weight, loss.batch,
                                                 global_valid_tokens=loss.tokens, global_valid_seqs=loss.seqs,
                                                 shard=VocabShard(group=inputs.group), distribution=inputs.distribution,
                                                 chunk_rows=case.chunk_rows)
        return value

    return Step(forward, None)


def build_loss_fused_main_grad(case: Case, inputs: CaseInputs) -> Step:
    loss = _loss_inputs(case, inputs)
    shape = (*loss.batch["input_ids"].shape, case.hidden)
    attach = with_main_grad(inputs)

    def forward(hidden, weight):
        value, _ = loss.loss_fn.on_hidden_states(hidden.view(shape), attach(weight), loss.batch,
                                                 global_valid_tokens=loss.tokens, global_valid_seqs=loss.seqs,
                                                 shard=VocabShard(group=inputs.group), distribution=inputs.distribution,
                                                 chunk_rows=case.chunk_rows, upstream_gradient=1.0)
        return value  # differentiated with no upstream gradient: 1, bound up front, so dW goes to main_grad

    return Step(forward, None)


MATERIALISED, FUSED, MEGATRON = "materialised", "fused", "megatron"
FUSED_MAIN_GRAD = "fused-main-grad"
MATERIALISED_LOSS, MATERIALISED_LOSS_INPLACE = "materialised-loss", "materialised-loss-inplace"
LOSS_FUSED, LOSS_FUSED_MAIN_GRAD = "loss-fused", "loss-fused-main-grad"

# The benchmark's entries, in report order. A new one is a builder and one line here; a scalar loss returns
# `Step(forward, None)` (no upstream gradient) and names its own baseline.
CANDIDATES: dict[str, Candidate] = {
    MATERIALISED: Candidate(build_materialised, "`logits = hidden @ weight.T`, then `vocab_parallel_logprobs`"),
    FUSED: Candidate(build_fused, "`vocab_parallel_linear_logprobs`, default chunk_rows (unless --chunk-rows)"),
    FUSED_MAIN_GRAD: Candidate(build_fused_main_grad, "the same under Megatron's DDP: the weight has an fp32 "
                                                      "`main_grad` (allocated with the inputs), and dW goes there"),
    "fused+entropy": Candidate(build_fused_entropy, "the same with `with_entropy=True`, both outputs trained"),
    MEGATRON: Candidate(build_megatron, "the linear in `[s, b, h]`, then Megatron-Core's "
                                        "`vocab_parallel_cross_entropy` (it overwrites fp32 logits in place: here "
                                        "they are the linear's fresh output, so nothing is cloned)"),
    "cce": Candidate(build_cce, "Cut-Cross-Entropy `linear_cross_entropy(..., reduction='none')`, its Triton "
                                "`cce` kernel (Triton runs on GPUs only)"),
    "cce-torch-compile": Candidate(build_cce_torch_compile, "the same with `impl='torch_compile'` (compiled "
                                                            "plain torch: the logits are materialised)"),
    "liger": Candidate(build_liger, "Liger-Kernel `liger_fused_linear_cross_entropy(..., reduction='none')` "
                                    "(Triton kernels: GPUs only)"),
    "liger-tp": Candidate(build_liger_tp, "Liger-Kernel's tensor-parallel `LigerFusedLinearScaledCrossEntropyTP"
                                          "Function` (vocab sharded as ours, entropy and temperature; NCCL, CUDA): "
                                          "both outputs trained, as `fused+entropy`"),
    MATERIALISED_LOSS: Candidate(build_materialised_loss, "the GRPO loss step: `logits = hidden @ weight.T`, then "
                                                          "`ClippedPGLoss` (with entropy, as the train step)",
                                 baseline=MATERIALISED_LOSS_INPLACE),
    MATERIALISED_LOSS_INPLACE: Candidate(build_materialised_loss_inplace,
                                         "the same with `inplace_backward=True`, as the train step runs it: the "
                                         "logits' gradient overwrites the logits (the loss candidates' baseline)",
                                         baseline=MATERIALISED_LOSS_INPLACE),
    "recompute-loss": Candidate(build_recompute_loss, "`vocab_parallel_linear_logprobs(..., with_entropy=True)`, "
                                                      "then `ClippedPGLoss(None, curr_logprobs=...)` (4 GEMMs)",
                                baseline=MATERIALISED_LOSS_INPLACE),
    LOSS_FUSED: Candidate(build_loss_fused, "`ClippedPGLoss.on_hidden_states`: the loss-fused head, its gradient "
                                            "in forward (3 GEMMs)", baseline=MATERIALISED_LOSS_INPLACE),
    LOSS_FUSED_MAIN_GRAD: Candidate(build_loss_fused_main_grad,
                                    "the same under Megatron's DDP (an fp32 `main_grad`, as for `fused-main-grad`), "
                                    "its upstream gradient bound, so dW goes into `main_grad` during forward",
                                    baseline=MATERIALISED_LOSS_INPLACE),
}


# ---- one case on one rank ----

def make_inputs(case: Case, device: torch.device, group) -> CaseInputs:
    """Hidden states replicated over the ranks, a weight shard per rank, logits of std ~3, prompt rows first
    in each sequence."""
    rank = 0 if group is None else dist.get_rank(group)
    dtype = DTYPES[case.dtype]
    hidden = torch.randn(case.tokens, case.hidden, generator=torch.Generator().manual_seed(11))
    weight = torch.randn(case.v_local, case.hidden, generator=torch.Generator().manual_seed(100 + rank))
    weight *= LOGIT_STD / math.sqrt(case.hidden)
    full_vocab = case.v_local * case.tp
    targets = torch.randint(0, full_vocab, (case.tokens,), generator=torch.Generator().manual_seed(7))
    sequence = min(case.tokens, case.sequence)
    response = torch.arange(case.tokens) % sequence >= round((1 - case.response) * sequence)
    targets[~response] = -1
    return CaseInputs(hidden=hidden.to(device, dtype), weight=weight.to(device, dtype), targets=targets.to(device),
                      upstream=response.to(device, torch.float32), group=group, seed=13,
                      distribution=case.distribution)


def _fresh_leaves(inputs: CaseInputs):
    return inputs.hidden.clone().requires_grad_(True), inputs.weight.clone().requires_grad_(True)


def _forward_backward(step: Step, leaves) -> None:
    hidden, weight = leaves
    torch.autograd.grad(step.forward(hidden, weight), (hidden, weight), step.grad_out)


def interleaved_times(steps: dict[str, Step], inputs: CaseInputs, device: torch.device, repeats: int,
                      warmup: int) -> tuple[dict[str, float], dict[str, str]]:
    """The median forward+backward ms of each candidate: in each round every candidate runs once, in turn (after
    `warmup` untimed rounds), so that a shared machine's changing load weighs on all of them alike. A candidate that
    fails is dropped from the rounds, with why. Each step gets fresh leaves, made outside the timed region."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    failed: dict[str, str] = {}
    for round_number in range(warmup + repeats):
        for name, step in steps.items():
            if name in failed:
                continue
            leaves = _fresh_leaves(inputs)
            synchronize(device)
            start = time.perf_counter()
            try:
                _forward_backward(step, leaves)
                synchronize(device)
            except Exception as exc:  # noqa: BLE001 - any failure means "cannot run here", reported, never fatal
                failed[name] = _reason(exc)
                continue
            if round_number >= warmup:
                times[name].append(time.perf_counter() - start)
            del leaves
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items() if name not in failed and ts}, failed


def extra_peaks(step: Step, inputs: CaseInputs, device: torch.device) -> tuple[float, float]:
    """(live tensors' peak MiB, the process's resident or the allocator's peak MiB) of one step beyond what was live
    before it (the inputs), less the hidden and weight gradients the step returns. Untimed runs of their own."""
    gradients = inputs.hidden.nbytes + inputs.weight.nbytes
    leaves = _fresh_leaves(inputs)
    with PeakMemory(device) as peak:
        _forward_backward(step, leaves)
    del leaves
    leaves = _fresh_leaves(inputs)
    with LiveTensorBytes() as live:
        _forward_backward(step, leaves)
    return (live.peak_bytes - gradients) / 2**20, (peak.extra_bytes - gradients) / 2**20


def fused_accuracy(case: Case, inputs: CaseInputs, rows: int) -> dict[str, float]:
    """The fused op against a float64 reference on `rows` evenly spaced rows: max |logprob error| over response
    rows, and max |error| / max |reference| of the TP-summed hidden gradient and of this shard's weight
    gradient (the worst over ranks). The reference is plain float64 torch over the gathered full-vocab logits.
    The subsample is cut into as many chunks as the whole case is by default, so that the chunked weight
    gradient sums as many partial products as it does at full size."""
    group, tp = inputs.group, case.tp
    index = torch.linspace(0, case.tokens - 1, min(rows, case.tokens)).round().long().unique()
    hidden, targets, upstream = inputs.hidden[index], inputs.targets[index], inputs.upstream[index]
    weight = inputs.weight
    full_trained = int((inputs.targets >= 0).sum())
    full_chunk_rows = case.chunk_rows or chunk_rows_for(full_trained, case.v_local, weight.dtype)
    full_chunks = math.ceil(full_trained / full_chunk_rows)
    chunk_rows = max(1, math.ceil(int((targets >= 0).sum()) / max(full_chunks, 1)))
    leaves = (hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True))
    logprob = vocab_parallel_linear_logprobs(*leaves, targets, shard=VocabShard(group=group if tp > 1 else None),
                                             chunk_rows=chunk_rows)
    grad_hidden, grad_weight = torch.autograd.grad(logprob, leaves, upstream)
    if tp > 1:
        dist.all_reduce(grad_hidden, group=group)  # the op's hidden gradient is this rank's partial sum
    # float64 reference: full-vocab logits, log_softmax, and d(sum upstream * logprob)/d(logits) by formula.
    h64, w64 = hidden.double(), weight.double()
    shard = h64 @ w64.t()
    shards = [torch.empty_like(shard) for _ in range(tp)] if tp > 1 else [shard]
    if tp > 1:
        dist.all_gather(shards, shard, group=group)
    logits = torch.cat(shards, dim=1)
    log_softmax = torch.log_softmax(logits, dim=1)
    valid = targets >= 0
    safe = targets.clamp(min=0)
    reference = torch.where(valid, log_softmax.gather(1, safe[:, None]).squeeze(1), 0.0)
    onehot = torch.zeros_like(logits).scatter_(1, safe[:, None], 1.0)
    grad_logits = (upstream.double() * valid)[:, None] * (onehot - log_softmax.exp())
    rank = 0 if tp == 1 else dist.get_rank(group)
    mine = grad_logits[:, rank * case.v_local:(rank + 1) * case.v_local]
    ref_weight = mine.t() @ h64
    ref_hidden = mine @ w64
    if tp > 1:
        dist.all_reduce(ref_hidden, group=group)

    def relative(got, want):
        return ((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-300)).item()

    errors = torch.tensor([
        (logprob.double() - reference)[valid].abs().max().item() if valid.any() else 0.0,
        relative(grad_hidden, ref_hidden), relative(grad_weight, ref_weight)], dtype=torch.float64,
        device=hidden.device)  # the TP group's device (NCCL on GPUs)
    if tp > 1:
        dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=group)
    return {"rows": int(index.numel()), "chunks": max(full_chunks, 1), "logprob_max_abs": errors[0].item(),
            "grad_hidden_max_rel": errors[1].item(), "grad_weight_max_rel": errors[2].item()}


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def benchmark_case(case: Case, device: torch.device, group, names: list[str], repeats: int, warmup: int,
                   accuracy_rows: int) -> dict:
    """Times the selected candidates on one case, interleaved, then measures each one's memory; a candidate that
    cannot build or run is skipped, with why."""
    inputs = make_inputs(case, device, group if case.tp > 1 else None)
    steps, skipped = {}, {}
    for name in names:
        try:
            steps[name] = CANDIDATES[name].build(case, inputs)
        except Exception as exc:  # noqa: BLE001 - any failure means "cannot run here", reported, never fatal
            skipped[name] = _reason(exc)
    times, failed = interleaved_times(steps, inputs, device, repeats, warmup)
    skipped.update(failed)
    rows = []
    for name in steps:
        if name in times:
            live_mib, peak_mib = extra_peaks(steps[name], inputs, device)
            rows.append({"candidate": name, "forward_backward_ms": times[name], "extra_live_mib": live_mib,
                         "extra_peak_mib": peak_mib})
    accuracy = fused_accuracy(case, inputs, accuracy_rows) if accuracy_rows > 0 and not case.distribution.filtered \
        else None
    return {"case": asdict(case), "trained_rows": int((inputs.targets >= 0).sum()), "rows": rows,
            "skipped": {name: skipped[name] for name in names if name in skipped}, "accuracy": accuracy}


def _run_cases(device: torch.device, group, cases: list[Case], names: list[str], repeats: int, warmup: int,
               accuracy_rows: int) -> tuple[list[dict], dict]:
    """The body of one TP rank (see `measure.run_ranks`)."""
    return [benchmark_case(case, device, group, names, repeats, warmup, accuracy_rows) for case in cases], {}


# ---- report ----

def ratio(baseline_ms: float | None, ms: float) -> float | None:
    """How many times faster than the baseline (> 1: faster); None without a baseline."""
    return None if baseline_ms is None else baseline_ms / ms


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def peak_fraction(row: dict | None, baseline: dict | None, key: str = "extra_live_mib") -> float | None:
    """`row`'s extra peak (`key`: live tensors, or the process's / allocator's peak) as a fraction of `baseline`'s;
    None when either is missing or the baseline's is below 1 MiB (too small to compare)."""
    if row is None or baseline is None or baseline.get(key, 0.0) < 1.0:
        return None
    return max(row[key], 0.0) / baseline[key]


def case_summary(result: dict) -> dict:
    """The targets' figures for one case: the fused op's speed and extra peak (live tensors) relative to the
    materialised path, plain and under Megatron's DDP; the loss-fused step's, plain and under DDP, relative to the
    materialised loss step with its in-place backward (the train step's)."""
    by_name = {r["candidate"]: r for r in result["rows"]}
    fused, materialised = by_name.get(FUSED), by_name.get(MATERIALISED)
    loss_baseline = by_name.get(MATERIALISED_LOSS_INPLACE)

    def speed(name: str, baseline: dict | None) -> float | None:
        row = by_name.get(name)
        return None if row is None or baseline is None else baseline["forward_backward_ms"] / row["forward_backward_ms"]

    all_rows = result["case"]["response"] >= 1.0
    return {"speed": speed(FUSED, materialised),
            "speed_target": TARGET_SPEED_ALL_ROWS if all_rows else TARGET_SPEED_QUARTER_ROWS,
            "peak_fraction": peak_fraction(fused, materialised),
            "main_grad_peak_fraction": peak_fraction(by_name.get(FUSED_MAIN_GRAD), materialised),
            "loss_speed": speed(LOSS_FUSED, loss_baseline),
            "loss_peak_fraction": peak_fraction(by_name.get(LOSS_FUSED), loss_baseline),
            "loss_main_grad_speed": speed(LOSS_FUSED_MAIN_GRAD, loss_baseline),
            "loss_main_grad_peak_fraction": peak_fraction(by_name.get(LOSS_FUSED_MAIN_GRAD), loss_baseline),
            "measured": {name for name in by_name}}


def _speed_cell(value: float | None, target: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x" + ("" if target is None else f" (>= {target}x {_verdict(value >= target)})")


def _peak_cell(fraction: float | None, measured: bool) -> str:
    if not measured:
        return "-"
    if fraction is None:
        return "- (below 1 MiB: not measurable)"
    return f"{100 * fraction:.1f}% (<= {100 * TARGET_PEAK_FRACTION:.0f}% {_verdict(fraction <= TARGET_PEAK_FRACTION)})"


def report(results: list[dict], device: torch.device, repeats: int, warmup: int, command: str,
           load: tuple[str, str] | None = None) -> str:
    """The Markdown report: machine and method, the targets per case, then one table per case."""
    resident = "the allocator's peak" if device.type == "cuda" else "the process's resident high-water mark"
    lines = [
        f"# Fused linear + logprob benchmark ({device.type})",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {machine_description(device)}",
        f"- command: `{command}`",
        *([f"- load average at the start: {load[0]}; at the end: {load[1]}"] if load else []),
        f"- median of {repeats} forward+backward steps per candidate after {warmup} warm-up round(s), the candidates "
        "interleaved: each round runs every candidate once, in turn, in one process, so that the machine's load "
        "weighs on all alike. Each step gets fresh leaf copies of the same hidden states and weight shard (made "
        "outside the timed region) and takes both gradients with torch.autograd.grad, the upstream gradient being 1 "
        "on response rows and 0 on prompt rows (target -1), or 1 for a loss step's scalar loss.",
        "- ratios: the baseline's time (the materialised path's; for a loss step, the materialised loss step's with "
        "its in-place backward, the train step's) or Megatron's, divided by the candidate's, both measured in this "
        "run (> 1: the candidate is faster).",
        "- extra peak, live tensors: the largest sum of the bytes of tensor storages alive at once during one step "
        "(rank 0), beyond those alive before it (the inputs), less the hidden and weight gradients the step returns; "
        "counted at the dispatcher, so deterministic (`measure.LiveTensorBytes`). The targets use it. Extra peak, "
        f"{'allocator' if device.type == 'cuda' else 'resident'}: {resident} during another run of the step, less "
        "the same gradients.",
        "- TP > 1: every candidate's hidden gradient is this rank's partial sum over its vocab shard (Megatron's "
        "output layer all-reduces it afterwards, for all of them alike, so no candidate's time includes it).",
        f"- targets: fused extra peak <= {100 * TARGET_PEAK_FRACTION:.0f}% of the materialised path's "
        f"(also under Megatron's DDP: `{FUSED_MAIN_GRAD}`); materialised/fused time >= {TARGET_SPEED_ALL_ROWS}x at "
        f"100% response rows, >= {TARGET_SPEED_QUARTER_ROWS}x at 25%; the loss-fused step (plain and under DDP) at "
        f">= {TARGET_LOSS_FUSED}x the materialised loss step's speed (in-place backward) at 100% response rows, "
        f"with <= {100 * TARGET_PEAK_FRACTION:.0f}% of its extra peak.",
        "",
        "Candidates:",
        "",
    ]
    lines += [f"- `{name}`: {c.description}" for name, c in CANDIDATES.items()]
    lines += ["", "## Targets", "",
              "| case | fused op: materialised/fused | extra peak vs materialised | under DDP (`main_grad`) | "
              "loss-fused: speed vs the materialised loss step (in place) | extra peak vs it | loss-fused under DDP: "
              "speed | extra peak |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for result in results:
        summary = case_summary(result)
        measured = summary["measured"]
        loss_target = TARGET_LOSS_FUSED if result["case"]["response"] >= 1.0 else None
        lines.append(
            f"| {Case(**result['case']).label()} | {_speed_cell(summary['speed'], summary['speed_target'])} | "
            f"{_peak_cell(summary['peak_fraction'], FUSED in measured and MATERIALISED in measured)} | "
            f"{_peak_cell(summary['main_grad_peak_fraction'], FUSED_MAIN_GRAD in measured)} | "
            f"{_speed_cell(summary['loss_speed'], loss_target)} | "
            f"{_peak_cell(summary['loss_peak_fraction'], LOSS_FUSED in measured)} | "
            f"{_speed_cell(summary['loss_main_grad_speed'], loss_target)} | "
            f"{_peak_cell(summary['loss_main_grad_peak_fraction'], LOSS_FUSED_MAIN_GRAD in measured)} |")
    lines.append("")
    for result in results:
        lines += case_section(result, device)
    return "\n".join(lines)


def case_section(result: dict, device: torch.device) -> list[str]:
    case = Case(**result["case"])
    by_name = {r["candidate"]: r for r in result["rows"]}
    megatron = by_name.get(MEGATRON, {}).get("forward_backward_ms")
    logits_mib = case.tokens * case.v_local * (4 if case.dtype == "fp32" else 2) / 2**20
    resident = "allocator" if device.type == "cuda" else "resident"
    lines = [f"## {case.label()}", "",
             f"{result['trained_rows']} of {case.tokens} rows have a target; the logits would take "
             f"{logits_mib:.0f} MiB per rank.", "",
             f"| candidate | fwd+bwd ms | vs baseline | vs megatron | extra peak MiB, live tensors | vs baseline | "
             f"extra peak MiB, {resident} | vs baseline |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        baseline = by_name.get(CANDIDATES[row["candidate"]].baseline)
        base_ms = None if baseline is None else baseline["forward_backward_ms"]

        def peak(key: str) -> str:
            fraction = peak_fraction(row, baseline, key)  # below 1 MiB: too small to compare
            return f"{max(row[key], 0.0):.1f} | {'-' if fraction is None else f'{100 * fraction:.1f}%'}"

        lines.append(
            f"| {row['candidate']} | {row['forward_backward_ms']:.1f} | "
            f"{_x(ratio(base_ms, row['forward_backward_ms']))} | {_x(ratio(megatron, row['forward_backward_ms']))} | "
            f"{peak('extra_live_mib')} | {peak('extra_peak_mib')} |")
    lines += [f"| {name} | skipped: {why} | | | | | | |" for name, why in result["skipped"].items()]
    accuracy = result.get("accuracy")
    if accuracy:
        lines += ["", f"Fused op against float64 on {accuracy['rows']} evenly spaced rows, in "
                      f"{accuracy['chunks']} chunk(s) as the whole case: max |logprob error| "
                      f"{accuracy['logprob_max_abs']:.2e}; max relative error of the hidden gradient "
                      f"{accuracy['grad_hidden_max_rel']:.2e}, of the weight gradient "
                      f"{accuracy['grad_weight_max_rel']:.2e} (max |error| / max |reference|)."]
    lines.append("")
    return lines


def plot(results: list[dict], path: Path) -> None:
    cases = [Case(**r["case"]) for r in results]
    names = list(dict.fromkeys(row["candidate"] for r in results for row in r["rows"]))
    series = {name: [next((row["forward_backward_ms"] for row in r["rows"] if row["candidate"] == name), None)
                     for r in results] for name in names}
    labels = [f"TP={c.tp} {c.dtype}\n{100 * c.response:.0f}% rows" for c in cases]
    grouped_bar_plot(labels, series, "forward+backward, ms (median)", path)


# ---- command line ----

def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-grpo bench linear", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where the ranks run: cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes (T=256, H=64, V_local=1024 unless given), 1 run, 32 accuracy rows; "
                             "writes linear_<device>_quick.*")
    parser.add_argument("--tp", type=int, nargs="+", default=None,
                        help="tensor-parallel sizes (default: 1 and 2; on CUDA, 2 only with two GPUs)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"],
                        help="dtypes of the hidden states and weight")
    parser.add_argument("--response", type=float, nargs="+", default=[1.0, 0.25],
                        help="fractions of rows that are response tokens (the others are prompt rows, not scored)")
    parser.add_argument("--tokens", type=int, default=None, help="rows T per rank (default: 4096; 256 with --quick)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size H (default: 512; 64 with --quick)")
    parser.add_argument("--v-local", type=int, default=None,
                        help="vocab columns per rank (default: 32768; 1024 with --quick)")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="rows per chunk of the fused candidates (default: the op's own choice)")
    parser.add_argument("--sequence-length", type=int, default=SEQUENCE_ROWS,
                        help="rows per sequence (prompt rows first), for the response rows and the loss candidates")
    parser.add_argument("--top-k", type=int, default=None,
                        help="the top-k filter of our candidates' distribution (the peers have none and are skipped; "
                             "default: none)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="likewise, a top-p in (0, 1] (default: none)")
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES),
                        help="the candidates to run")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per candidate (default: 5; 1 with --quick)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per candidate first")
    parser.add_argument("--accuracy-rows", type=int, default=None,
                        help="rows of the float64 accuracy check, 0 to skip it (default: 256; 32 with --quick)")
    parser.add_argument("--peer-path", type=Path, action="append", default=[], metavar="DIR",
                        help="a directory holding optional peers (Cut-Cross-Entropy, Liger-Kernel) installed with "
                             "`pip install --target DIR`; repeatable")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=OUT_HELP)
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds to wait for each TP size's ranks before giving up")
    parser.add_argument("--verbose", action="store_true", help="show Megatron-Core's notices, filtered by default")
    args = parser.parse_args(argv)
    for fraction in args.response:
        if not 0.0 < fraction <= 1.0:
            parser.error(f"--response fractions must be in (0, 1], got {fraction}")
    if args.chunk_rows is not None and args.chunk_rows < 1:
        parser.error(f"--chunk-rows must be >= 1, got {args.chunk_rows}")
    if args.sequence_length < 1:
        parser.error(f"--sequence-length must be >= 1, got {args.sequence_length}")
    problems = SamplingDistribution.problems(top_k=args.top_k, top_p=args.top_p)
    if problems:
        parser.error("; ".join(f"--{name.replace('_', '-')} {problem}" for name, problem in problems.items()))
    shape = (256, 64, 1024) if args.quick else (4096, 512, 32768)
    tokens, hidden, v_local = (given if given is not None else default
                               for given, default in zip((args.tokens, args.hidden, args.v_local), shape))
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 5)
    accuracy_rows = args.accuracy_rows if args.accuracy_rows is not None else (32 if args.quick else 256)
    sys.path.extend(str(path) for path in args.peer_path)  # spawned ranks inherit sys.path
    tp_sizes = args.tp or ([1, 2] if args.device == "cpu" or torch.cuda.device_count() >= 2 else [1])
    results, load_at_start = [], load_average()
    for tp in tp_sizes:
        cases = [Case(tp=tp, dtype=d, tokens=tokens, hidden=hidden, v_local=v_local, response=f,
                      chunk_rows=args.chunk_rows, sequence=args.sequence_length, top_k=args.top_k, top_p=args.top_p)
                 for d in args.dtypes for f in args.response]
        work = functools.partial(_run_cases, cases=cases, names=args.candidates, repeats=repeats,
                                 warmup=args.warmup, accuracy_rows=accuracy_rows)
        tp_results, _ = run_ranks(tp, work, args.device, args.timeout, name="bench linear", verbose=args.verbose)
        results += tp_results
    skipped = {(name, why) for result in results for name, why in result["skipped"].items()}
    for name, why in sorted(skipped):
        print(f"bench linear: {name} skipped in some cases: {why}", file=sys.stderr)
    command = "megatron-grpo bench linear" + ("" if not argv else " " + " ".join(argv))
    text = report(results, torch.device(args.device), repeats, args.warmup, command, (load_at_start, load_average()))
    stem = f"linear_{args.device}{'_quick' if args.quick else ''}"
    path = write_results(args.out, stem, text, {"results": results}, lambda png: plot(results, png),
                         alt="forward+backward time")
    print(text)
    print(f"wrote {path}")
    return 0
