"""The loss-fused head (`ClippedPGLoss.on_hidden_states`) against the materialised loss (`logits = scale * hidden @
weight.T`, then `ClippedPGLoss`):

- in float64, every loss setting (the policy term's four forms, dual clipping, GSPO, every aggregation, the KL's
  three estimators with their clamps and the on-policy weight, every importance-sampling truncation, the entropy
  bonus, VAPO, prev from the batch, from curr, from the generation logprobs and interpolated), with padded vocab,
  untrained tokens and several chunk sizes, unfiltered and under top-k / top-p (the KL then reads the unfiltered
  logprobs); the closed-form gradient (`loss.token_gradient`) where it holds, and the same settings with chunks of
  whole sequences and autograd, to 1e-10;
- in bf16, every setting, with top-k and with top-p, at TP 1 and TP 2, to the bound of the two paths' bf16
  roundings (`assert_bf16_close`);
- in float32 at TP 2 against the full vocab, counting the collectives per chunk;
- the upstream gradient bound up front (dW into Megatron DDP's `main_grad` during forward), unbound (1, read back),
  and a backward that brings another gradient than the bound one.
The float32 comparison also runs on CUDA (conftest's `device`, marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import counted_collectives, run_on_ranks
from _loss_inputs import batch_for_logits, loss_config

from megatron_grpo.loss import ClippedPGLoss, count_valid
from megatron_grpo.loss.call import LossCall, PrevSource
from megatron_grpo.loss.prev_approximation import VERSION_KEY, PrevApproximation, StepVersions
from megatron_grpo.loss.token_gradient import obstacle
from megatron_grpo.ops import SamplingDistribution, VocabShard
from megatron_grpo.ops.core.chunking import row_chunks, sequence_chunks

BATCH, SEQ, HIDDEN, VOCAB, PADDED, SCALE = 5, 9, 12, 29, 32, 1.25
VERSIONS = StepVersions(prev=3.0, current=3.5)
# Each setting: the loss config's overrides, and the call's prev (keyword arguments of `on_hidden_states`).
SETTINGS = {
    "PPO, token-mean": ({}, {}),
    "dual clip, k3 KL clamped, entropy, VAPO": (
        {"ratio_clip_c": 3.0, "reference_policy_kl_penalty": 0.1, "kl_input_clamp_value": 0.3,
         "kl_output_clamp_value": 0.02, "entropy_coef": 0.03, "positive_example_nll_weight": 0.2}, {}),
    "k1 on-policy KL, seq-mean-token-mean, TIS": (
        {"loss_agg_mode": "seq-mean-token-mean", "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k1",
         "use_on_policy_kl_approximation": True, "use_importance_sampling_correction": True,
         "truncated_importance_sampling": {"type": "tis", "ratio_max": 1.2}}, {}),
    "k2 KL, icepop, seq-mean-token-sum": (
        {"loss_agg_mode": "seq-mean-token-sum", "reference_policy_kl_penalty": 0.1, "reference_policy_kl_type": "k2",
         "use_importance_sampling_correction": True,
         "truncated_importance_sampling": {"type": "icepop", "ratio_min": 0.8, "ratio_max": 1.2}}, {}),
    "seq-mask-tis, seq-mean-token-sum-norm": (
        {"loss_agg_mode": "seq-mean-token-sum-norm", "max_response_length": 8,
         "use_importance_sampling_correction": True,
         "truncated_importance_sampling": {"type": "seq-mask-tis", "ratio_min": 0.9, "ratio_max": 1.1}}, {}),
    "REINFORCE": ({"disable_ppo_ratio": True, "entropy_coef": 0.01}, {}),
    "CISPO": ({"use_cispo": True}, {}),
    "GSPO, seq-mean-token-mean": ({"sequence_level_importance_ratio": True, "loss_agg_mode": "seq-mean-token-mean",
                                   "use_importance_sampling_correction": True}, {}),
    "prev from curr, TIS": ({"use_importance_sampling_correction": True,
                             "truncated_importance_sampling": {"type": "tis", "ratio_max": 1.1}},
                            {"prev_logprobs_from_current": True}),
    "prev from generation, k3 KL": ({"reference_policy_kl_penalty": 0.1},
                                    {"prev_approximation": PrevApproximation("generation")}),
    "prev loglinear": ({}, {"prev_approximation": PrevApproximation("loglinear", VERSIONS)}),
    "prev linear, KL": ({"reference_policy_kl_penalty": 0.05},
                        {"prev_approximation": PrevApproximation("linear", VERSIONS)}),
    # NeMo-RL's sequence mask by logprob error, with the normalisation deferred (the loss a sum): from the batch's
    # prev (a pass), and from curr (no pass: it reads each sequence's current logprobs)
    "sequence mask from prev, deferred": ({"entropy_coef": 0.01},
                                          {"seq_logprob_error_threshold": 1.3, "defer_normalisation": True}),
    "sequence mask from curr, deferred, seq-mean": ({"loss_agg_mode": "seq-mean-token-mean"},
                                                    {"seq_logprob_error_threshold": 1.3, "defer_normalisation": True,
                                                     "prev_logprobs_from_current": True}),
}
# the settings whose gradient couples a sequence's tokens
COUPLED = {"GSPO, seq-mean-token-mean", "sequence mask from curr, deferred, seq-mean"}
FILTERS = {"top-k": SamplingDistribution(logit_scale=SCALE, top_k=6),
           "top-p": SamplingDistribution(logit_scale=SCALE, top_p=0.7)}
# Under a filter: a KL (the second, unfiltered distribution), the closed form with an entropy bonus, and a kept count
# that couples a sequence's tokens (seq-mean-token-mean).
FILTERED_SETTINGS = ["dual clip, k3 KL clamped, entropy, VAPO", "REINFORCE",
                     "k1 on-policy KL, seq-mean-token-mean, TIS"]
BF16_U = 2.0**-8  # bf16's unit roundoff: 8 significant bits


def make_problem(seed: int, dtype: torch.dtype, grid: bool = False):
    """Hidden states, a weight whose padding rows are huge (a leak into the softmax would show) and a batch. `grid`:
    hidden and weight entries in {-1, -1/2, 0, 1/2, 1}, so that every logit (a sum of 12 multiples of 1/4, times a
    power of 2) is exact in bf16 and fp32 whichever way a GEMM blocks it: both paths then see the same logits."""
    gen = torch.Generator().manual_seed(seed)
    if grid:
        hidden = torch.randint(-2, 3, (BATCH, SEQ, HIDDEN), generator=gen).double() / 2
        weight = torch.randint(-2, 3, (PADDED, HIDDEN), generator=gen).double() / 2
    else:
        hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.float64)
        weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    weight[VOCAB:] = 40.0
    batch = batch_for_logits(SCALE * hidden @ weight.t(), VOCAB, seed=seed + 1)
    batch[VERSION_KEY] = torch.tensor([3.0, 2.0, 2.5, 3.0, 1.0])
    return hidden.to(dtype), weight.to(dtype), batch


def _counts(batch, call=None):
    """The step's global counts, none where the normalisation is deferred."""
    if call and call.get("defer_normalisation"):
        return {}
    tokens, seqs = count_valid(batch)
    return {"global_valid_tokens": tokens, "global_valid_seqs": seqs}


def materialised(cfg, prev, hidden, weight, batch, shard, distribution=None):
    """(loss, metrics, d hidden, d weight) through the logits, in the inputs' dtype."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    unscaled = None if distribution is None else SamplingDistribution(top_k=distribution.top_k,
                                                                      top_p=distribution.top_p)
    logits = (h @ w.t()) * SCALE
    loss, metrics = ClippedPGLoss(cfg)(logits, batch, shard=shard, distribution=unscaled, **_counts(batch, prev),
                                       **prev)
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def fused(cfg, prev, hidden, weight, batch, shard, chunk_rows, distribution=None, upstream=3.0):
    """The same through the loss-fused head; backward brings `upstream` (Megatron's loss scale), unbound."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    distribution = SamplingDistribution(logit_scale=SCALE) if distribution is None else distribution
    loss, metrics = ClippedPGLoss(cfg).on_hidden_states(h, w, batch, shard=shard, distribution=distribution,
                                                        chunk_rows=chunk_rows, **_counts(batch, prev), **prev)
    (loss * upstream).backward()
    return loss.detach(), metrics, h.grad / upstream, w.grad / upstream


def assert_same(got, want, rtol, label):
    loss, metrics, grad_hidden, grad_weight = got
    want_loss, want_metrics, want_hidden, want_weight = want
    assert abs(float(loss) - float(want_loss)) <= rtol * max(1.0, abs(float(want_loss))), f"{label}: loss"
    assert metrics.keys() == want_metrics.keys(), label
    for name, value in want_metrics.items():
        torch.testing.assert_close(metrics[name].double(), value.double(), rtol=rtol, atol=rtol,
                                   msg=f"{label}: metric {name}")
    for name, a, b in (("hidden", grad_hidden, want_hidden), ("weight", grad_weight, want_weight)):
        error = float((a.double() - b.double()).abs().max())
        assert error <= rtol * float(b.abs().max()), f"{label}: grad {name} off by {error}"
    assert bool((grad_weight[VOCAB:] == 0).all()), f"{label}: padding rows of the weight must get exactly 0"


def _obstacle_of(setting: str, distribution: SamplingDistribution | None = None) -> str | None:
    overrides, prev = SETTINGS[setting]
    source = PrevSource(prev.get("prev_logprobs_from_current"), prev.get("prev_approximation"))
    call = LossCall.of(None, None, distribution=distribution, prev=source, defer_normalisation=True,
                       seq_logprob_error_threshold=prev.get("seq_logprob_error_threshold"))
    return obstacle(loss_config(**overrides), call, prev_from_current=bool(source.from_current),
                    filter_active=distribution is not None and distribution.active(VOCAB),
                    prev_in_batch=not source.from_current and source.approximation is None)


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("chunk_rows", [None, 7, 1])
def test_loss_fused_equals_the_materialised_loss_in_float64(setting, chunk_rows):
    overrides, prev = SETTINGS[setting]
    cfg = loss_config(**overrides)
    hidden, weight, batch = make_problem(seed=3, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, prev, hidden, weight, batch, shard)
    assert_same(fused(cfg, prev, hidden, weight, batch, shard, chunk_rows), want, 1e-10,
                f"{setting} chunk={chunk_rows}")
    assert (_obstacle_of(setting) is not None) == (setting in COUPLED)  # the closed form everywhere else


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s not in COUPLED])
def test_whole_sequence_chunks_with_autograd_agree_with_the_closed_form(setting, monkeypatch):
    """The head's other way to a chunk's gradient (autograd over whole sequences), forced for settings that have the
    closed form: both equal the materialised loss in float64."""
    overrides, prev = SETTINGS[setting]
    cfg = loss_config(**overrides)
    hidden, weight, batch = make_problem(seed=4, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, prev, hidden, weight, batch, shard)
    monkeypatch.setattr("megatron_grpo.loss.clipped_pg.obstacle", lambda *args, **kwargs: "forced by the test")
    assert_same(fused(cfg, prev, hidden, weight, batch, shard, chunk_rows=10), want, 1e-10, setting)


@pytest.mark.parametrize("name", FILTERS)
@pytest.mark.parametrize("setting", FILTERED_SETTINGS)
def test_loss_fused_under_a_filter_equals_the_materialised_loss_in_float64(name, setting):
    overrides, prev = SETTINGS[setting]
    cfg, distribution = loss_config(**overrides), FILTERS[name]
    hidden, weight, batch = make_problem(seed=6, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, prev, hidden, weight, batch, shard, distribution)
    assert 0 < float(want[1]["filtered_out_tokens"]) < float(want[1]["num_valid_tokens"])  # the filter drops some
    assert_same(fused(cfg, prev, hidden, weight, batch, shard, 7, distribution), want, 1e-10, f"{setting}, {name}")
    # a filter's kept counts couple a sequence's tokens in seq-mean-token-mean only
    assert (_obstacle_of(setting, distribution) is not None) == ("seq-mean-token-mean" in setting)


def fused_on(device, cfg, hidden, weight, batch, shard, chunk_rows):
    """`fused` on `device` from CPU inputs; its results on the CPU."""
    on_device = {key: value.to(device) for key, value in batch.items()}
    loss, metrics, grad_hidden, grad_weight = fused(cfg, {}, hidden.to(device), weight.to(device), on_device, shard,
                                                    chunk_rows)
    return loss.cpu(), {name: value.cpu() for name, value in metrics.items()}, grad_hidden.cpu(), grad_weight.cpu()


@pytest.mark.parametrize("setting", ["dual clip, k3 KL clamped, entropy, VAPO", "GSPO, seq-mean-token-mean"])
def test_loss_fused_in_float32_matches_float64(setting, device):
    cfg = loss_config(**SETTINGS[setting][0])
    hidden, weight, batch = make_problem(seed=5, dtype=torch.float32)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, {}, hidden.double(), weight.double(), batch, shard)
    assert_same(fused_on(device, cfg, hidden, weight, batch, shard, chunk_rows=8), want, 1e-4, f"{setting} {device}")


# ---- bf16 ----

def bf16_bound(cfg, prev, hidden, weight, batch, shard, distribution, chunks: int):
    """Elementwise bounds on |fused - materialised| in bf16 for the grid problem, whose logits both paths compute
    exactly (so their logprobs, entropies, kept sets and loss are the same numbers, up to the fp32 order of the
    rows' gradients): each path rounds d(loss)/d(logits) once into bf16 (u = 2^-8 of its magnitude), its `dH` GEMM
    once (u), and its `dW` once (the materialised GEMM) or once per chunk (the fused head adds each chunk's product
    into the bf16 gradient, beta=1): with `dx` the float64 gradient of the logits and S the sums of magnitudes,
    |d dH| <= 4u (|dx| @ |W|) and |d dW| <= (chunks + 3)u (|dx|^T @ |h|), plus a floor of 1e-6 of the largest
    element for the fp32 per-row gradients' last bits."""
    h64, w64 = hidden.double(), weight.double()
    logits = ((h64 @ w64.t()) * SCALE).requires_grad_(True)
    unscaled = None if distribution is None else SamplingDistribution(top_k=distribution.top_k,
                                                                      top_p=distribution.top_p)
    loss, _ = ClippedPGLoss(cfg)(logits, batch, shard=shard, distribution=unscaled, **_counts(batch, prev), **prev)
    (dx,) = torch.autograd.grad(loss, logits)
    dx = dx.abs().reshape(-1, PADDED)
    hidden_sum = (dx @ w64.abs()).reshape(hidden.shape) * SCALE
    weight_sum = dx.t() @ h64.abs().reshape(-1, HIDDEN) * SCALE
    return 4 * BF16_U * hidden_sum, (chunks + 3) * BF16_U * weight_sum


def assert_bf16_close(cfg, prev, hidden, weight, batch, shard, distribution, chunk_rows, label):
    want = materialised(cfg, prev, hidden, weight, batch, shard, distribution)
    got = fused(cfg, prev, hidden, weight, batch, shard, chunk_rows, distribution, upstream=1.0)
    # The same logits: the same logprobs, and the loss and metrics from the same code on them.
    assert abs(float(got[0]) - float(want[0])) <= 1e-6 * max(1.0, abs(float(want[0]))), f"{label}: loss"
    torch.testing.assert_close(got[1]["curr_logprobs"], want[1]["curr_logprobs"], rtol=0, atol=0, msg=label)
    trained = int(count_valid(batch)[0])
    chunks = trained if chunk_rows == 1 else -(-trained // chunk_rows) + BATCH  # rows, or at most that many runs
    hidden_bound, weight_bound = bf16_bound(cfg, prev, hidden, weight, batch, shard, distribution, chunks)
    for name, a, b, bound in (("hidden", got[2], want[2], hidden_bound), ("weight", got[3], want[3], weight_bound)):
        assert a.dtype == b.dtype == torch.bfloat16, label
        error = (a.double() - b.double()).abs()
        floor = 1e-6 * float(b.double().abs().max())
        worst = float((error - bound).max())
        assert worst <= floor, f"{label}: grad {name} beyond the bf16 bound by {worst:.3g}"
    assert bool((got[3][VOCAB:] == 0).all()), label


BF16_CASES = [(s, None) for s in SETTINGS] + [(s, f) for f in FILTERS for s in FILTERED_SETTINGS]


@pytest.mark.parametrize("setting, filter_name", BF16_CASES, ids=[f"{s}-{f}" for s, f in BF16_CASES])
def test_bf16_loss_fused_equals_the_materialised_loss_step_to_bf16_rounding(setting, filter_name):
    overrides, prev = SETTINGS[setting]
    hidden, weight, batch = make_problem(seed=8, dtype=torch.bfloat16, grid=True)
    distribution = None if filter_name is None else FILTERS[filter_name]
    assert_bf16_close(loss_config(**overrides), prev, hidden, weight, batch, VocabShard(true_vocab_size=VOCAB),
                      distribution, 5, f"{setting}, {filter_name}")


# ---- TP 2 ----

# The closed form, whole sequences (GSPO), a KL under top-k (the second distribution's partials), top-p.
TP_CASES = [("dual clip, k3 KL clamped, entropy, VAPO", None), ("GSPO, seq-mean-token-mean", None),
            ("dual clip, k3 KL clamped, entropy, VAPO", "top-k"), ("REINFORCE", "top-p")]


def tp_worker(rank, world):
    """Every TP case on this rank, in float32 (with the collectives counted) and in bf16 on the grid problem."""
    v_local = PADDED // world
    shard = VocabShard(true_vocab_size=VOCAB, group=dist.group.WORLD)
    mine = slice(rank * v_local, (rank + 1) * v_local)
    out = {}
    for setting, filter_name in TP_CASES:
        overrides, prev = SETTINGS[setting]
        cfg, distribution = loss_config(**overrides), FILTERS.get(filter_name)
        hidden, weight, batch = make_problem(seed=7, dtype=torch.float32)
        with counted_collectives() as calls:
            loss, metrics, grad_hidden, grad_weight = fused(cfg, prev, hidden, weight[mine], batch, shard, 10,
                                                            distribution)
        dist.all_reduce(grad_hidden)  # the caller's TP reduction
        hidden, weight, batch = make_problem(seed=8, dtype=torch.bfloat16, grid=True)
        bf16 = [fused(cfg, prev, hidden, weight[mine], batch, shard, 5, distribution, upstream=1.0),
                materialised(cfg, prev, hidden, weight[mine], batch, shard, distribution)]
        for result in bf16:
            dist.all_reduce(result[2])
        out[(setting, filter_name)] = ((loss, metrics, grad_hidden, grad_weight), calls["n"], bf16)
    return out


@pytest.fixture(scope="module")
def tp_ranks():
    return run_on_ranks(2, tp_worker)


def _trained_rows(batch) -> list[int]:
    """Trained rows (next-token targets) per sequence: the trained tokens after position 0."""
    mask = batch["token_mask"].bool() & batch["sample_mask"].bool()[:, None]
    return mask[:, 1:].sum(dim=1).tolist()


@pytest.mark.parametrize("setting, filter_name", TP_CASES, ids=[f"{s}-{f}" for s, f in TP_CASES])
def test_tensor_parallel_matches_the_full_vocab(tp_ranks, setting, filter_name):
    overrides, prev = SETTINGS[setting]
    cfg, distribution = loss_config(**overrides), FILTERS.get(filter_name)
    hidden, weight, batch = make_problem(seed=7, dtype=torch.float32)
    want = materialised(cfg, prev, hidden.double(), weight.double(), batch, VocabShard(true_vocab_size=VOCAB),
                        distribution)
    rows = _trained_rows(batch)
    coupled = _obstacle_of(setting, distribution) is not None
    chunks = len(sequence_chunks(rows, 10)) if coupled else len(row_chunks(sum(rows), 10))
    per_chunk = {None: 1, "top-k": 2}.get(filter_name)  # the partials' all-gather (+ top-k's); top-p runs more
    if per_chunk is not None and distribution is not None and cfg.kl_in_loss:
        per_chunk += 1  # the unfiltered distribution's partials
    grad_weight = torch.cat([rank[(setting, filter_name)][0][3] for rank in tp_ranks])
    for number, rank in enumerate(tp_ranks):
        (loss, metrics, grad_hidden, _), collectives, _ = rank[(setting, filter_name)]
        if per_chunk is not None:
            assert collectives == per_chunk * chunks, f"rank {number}: {collectives} collectives for {chunks} chunks"
        assert_same((loss, metrics, grad_hidden, grad_weight), want, 1e-4, f"TP=2 rank {number}")


@pytest.mark.parametrize("setting, filter_name", TP_CASES, ids=[f"{s}-{f}" for s, f in TP_CASES])
def test_tensor_parallel_bf16_equals_the_materialised_loss_step_to_bf16_rounding(tp_ranks, setting, filter_name):
    """At TP 2 both paths reduce the same per-rank partials of the same exact logits: the same bound as at TP 1 for
    each rank's weight shard and for the TP-summed hidden gradient (its two partial sums add one more rounding, in
    both paths alike, inside the 4u)."""
    overrides, prev = SETTINGS[setting]
    cfg, distribution = loss_config(**overrides), FILTERS.get(filter_name)
    hidden, weight, batch = make_problem(seed=8, dtype=torch.bfloat16, grid=True)
    trained = int(count_valid(batch)[0])
    hidden_bound, weight_bound = bf16_bound(cfg, prev, hidden, weight, batch, VocabShard(true_vocab_size=VOCAB),
                                            distribution, -(-trained // 5) + BATCH)
    v_local = PADDED // 2
    for number, rank in enumerate(tp_ranks):
        got, want = rank[(setting, filter_name)][2]
        assert abs(float(got[0]) - float(want[0])) <= 1e-6 * max(1.0, abs(float(want[0])))
        torch.testing.assert_close(got[1]["curr_logprobs"], want[1]["curr_logprobs"], rtol=0, atol=0)
        error = (got[2].double() - want[2].double()).abs() - 2 * hidden_bound
        assert float(error.max()) <= 1e-6 * float(want[2].double().abs().max()), f"rank {number}: grad hidden"
        error = (got[3].double() - want[3].double()).abs() - weight_bound[number * v_local:(number + 1) * v_local]
        assert float(error.max()) <= 1e-6 * float(want[3].double().abs().max()), f"rank {number}: grad weight"


# ---- chunks, the upstream gradient, main_grad ----

def test_sequence_chunks_keep_sequences_whole():
    assert sequence_chunks([3, 3, 3], 6) == [slice(0, 2), slice(2, 3)]
    assert sequence_chunks([10, 1, 1], 4) == [slice(0, 1), slice(1, 3)]  # a long sequence is a chunk of its own
    assert sequence_chunks([0, 0, 2, 0], 1) == [slice(0, 3), slice(3, 4)]
    assert sequence_chunks([], 4) == []
    assert row_chunks(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)] and row_chunks(0, 3) == []


def test_bad_hidden_shape_is_named():
    hidden, weight, batch = make_problem(seed=1, dtype=torch.float32)
    for loss_fused in (True, False):
        with pytest.raises(ValueError,
                           match=r"hidden: expected shape \[5, 9, H\] to match input_ids, got \[5, 8, 12\]"):
            ClippedPGLoss(loss_config()).on_hidden_states(hidden[:, :-1], weight, batch, loss_fused=loss_fused,
                                                          **_counts(batch))


def _ddp_weight(weight: torch.Tensor, tied: bool) -> torch.Tensor:
    """A weight leaf with Megatron DDP's fp32 `main_grad` protocol."""
    w = weight.clone().requires_grad_(True)
    w.main_grad = torch.full(weight.shape, 0.5, dtype=torch.float64)  # what earlier microbatches left there
    w.grad_added_to_main_grad = False
    if tied:
        w.zero_out_wgrad = True
    return w


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_bound_upstream_gradient_puts_dw_into_main_grad_during_forward(tied):
    """Bound up front (as the Megatron step binds it), dW is added into the weight's `main_grad` before backward runs,
    and backward hands autograd Megatron's dummy (zeros for a tied weight) and only checks the gradient it brings."""
    cfg = loss_config(**SETTINGS["dual clip, k3 KL clamped, entropy, VAPO"][0])
    hidden, weight, batch = make_problem(seed=3, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, {}, hidden, weight, batch, shard)
    h, w = hidden.clone().requires_grad_(True), _ddp_weight(weight, tied)
    loss, _ = ClippedPGLoss(cfg).on_hidden_states(h, w, batch, shard=shard, upstream_gradient=3.0,
                                                  distribution=SamplingDistribution(logit_scale=SCALE), chunk_rows=7,
                                                  **_counts(batch))
    torch.testing.assert_close((w.main_grad - 0.5) / 3.0, want[3], rtol=1e-10, atol=1e-10)  # before backward
    (loss * 3.0).backward()
    assert w.grad_added_to_main_grad is True and (not tied or bool((w.grad == 0).all()))
    torch.testing.assert_close(h.grad / 3.0, want[2], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close((w.main_grad - 0.5) / 3.0, want[3], rtol=1e-10, atol=1e-10)  # nothing added twice


def test_unbound_the_head_returns_dw_and_leaves_main_grad_to_ddp():
    """Without a bound upstream gradient the head assumes 1, as Liger's fused linear cross entropy does, and returns
    dW (scaled in backward when the gradient is not 1); `main_grad` is DDP's hook's to fill."""
    cfg = loss_config()
    hidden, weight, batch = make_problem(seed=3, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, {}, hidden, weight, batch, shard)
    w = _ddp_weight(weight, tied=False)
    loss, _ = ClippedPGLoss(cfg).on_hidden_states(hidden, w, batch, shard=shard, chunk_rows=7,
                                                  distribution=SamplingDistribution(logit_scale=SCALE),
                                                  **_counts(batch))
    (loss * 2.0).backward()
    assert w.grad_added_to_main_grad is False and bool((w.main_grad == 0.5).all())
    torch.testing.assert_close(w.grad / 2.0, want[3], rtol=1e-10, atol=1e-10)


def test_a_backward_that_brings_another_gradient_than_the_bound_one_is_an_error():
    hidden, weight, batch = make_problem(seed=3, dtype=torch.float32)
    w = weight.clone().requires_grad_(True)
    loss, _ = ClippedPGLoss(loss_config()).on_hidden_states(hidden, w, batch, upstream_gradient=2.0,
                                                            shard=VocabShard(true_vocab_size=VOCAB), **_counts(batch))
    with pytest.raises(RuntimeError, match=r"upstream gradient other than the one bound in forward .* bound 2, got 3"):
        (loss * 3.0).backward()


def test_overlapped_chunks_two_buffers_and_the_deferred_gemms_give_the_same_result(monkeypatch):
    """The CUDA schedule (two chunk buffers, each chunk's dH / dW GEMMs queued after the next chunk's logits GEMM),
    run in that order on the CPU, where no stream exists: the same gradients as the one-buffer order, bit for bit."""
    cfg = loss_config(**SETTINGS["dual clip, k3 KL clamped, entropy, VAPO"][0])
    hidden, weight, batch = make_problem(seed=3, dtype=torch.float32)
    shard = VocabShard(true_vocab_size=VOCAB)
    in_order = fused(cfg, {}, hidden, weight, batch, shard, chunk_rows=4, distribution=FILTERS["top-k"])
    monkeypatch.setattr("megatron_grpo.loss.fused_head.overlaps_chunks", lambda device: True)
    overlapped = fused(cfg, {}, hidden, weight, batch, shard, chunk_rows=4, distribution=FILTERS["top-k"])
    for a, b in zip(in_order[2:], overlapped[2:]):
        assert torch.equal(a, b)
    assert float(in_order[0]) == float(overlapped[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fused search", "plain-torch search"])
def test_top_p_searches_a_chunk_a_piece_of_rows_at_a_time(monkeypatch, dtype):
    """Top-p's threshold search over a chunk keeps its temporaries a fraction of the chunk buffer: the plain-torch
    twin (float64 logits; 20-32 bytes per logit) on 1/16 of the chunk's rows at a time, the fused kernels' staged
    search (as over TP ranks; per row two histograms and at most 1024 candidates' keys) on as many rows as keep them
    within a third of the chunk's bf16 buffer. (On one CPU rank the fused search runs whole in one call, with
    per-thread temporaries.)"""
    from megatron_grpo.ops.core import filtering

    monkeypatch.setattr(filtering, "searches_in_one_call", lambda *args: False)
    name = "_select_top_p" if dtype == torch.float64 else "_select_top_p_fused"
    seen = []
    select = getattr(filtering, name)
    monkeypatch.setattr(filtering, name, lambda x, *args: seen.append(x.shape[0]) or select(x, *args))
    hidden, weight, batch = make_problem(seed=6, dtype=dtype)
    ClippedPGLoss(loss_config()).on_hidden_states(hidden, weight, batch, distribution=FILTERS["top-p"], chunk_rows=32,
                                                  shard=VocabShard(true_vocab_size=VOCAB), **_counts(batch))
    trained = int(count_valid(batch)[0])  # one chunk of them all
    assert seen and sum(seen) == trained
    if dtype == torch.float64:
        assert max(seen) == -(-trained // 16) < trained
    else:  # a tiny vocab: the rows' fixed temporaries fill the budget quickly
        assert max(seen) * filtering._fused_search_row_bytes(VOCAB) <= max(trained * VOCAB * 2 // 3,
                                                                           filtering._fused_search_row_bytes(VOCAB))


def test_the_fused_top_p_search_takes_a_whole_chunk_of_a_wide_vocab():
    """From 12.3K columns per rank, the fused search's per-row temporaries (8 KiB at most: the histograms and the
    candidates' keys) fit in a third of the bf16 row they search: one search per chunk; at 8K, two of even size."""
    from megatron_grpo.ops.core.chunking import threshold_piece_rows
    from megatron_grpo.ops.core.filtering import _fused_search_row_bytes

    assert _fused_search_row_bytes(16384) == (256 + 256 + 2) * 8 + 4 * 1024
    for cols in (12312, 16384, 32800, 65536, 152064):
        assert threshold_piece_rows(256, cols, _fused_search_row_bytes(cols)) == 256
    assert threshold_piece_rows(256, 12311, _fused_search_row_bytes(12311)) == 128  # 255 fit: two pieces of 128
    assert threshold_piece_rows(256, 8192, _fused_search_row_bytes(8192)) == 128  # 170 fit: two pieces of 128
    assert threshold_piece_rows(64, 8192, _fused_search_row_bytes(8192)) == 32  # 42 fit: two pieces of 32
    assert threshold_piece_rows(256, 16384) == 16  # the plain-torch search
