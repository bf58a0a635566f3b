"""ClippedPGLoss against NeMo-RL's and verl's semantics, on hand-checked float64 numbers.

Each test builds logits whose current logprobs are chosen exactly (two columns, the target in column 0), so every
expected value below is written out by hand, or taken from NeMo-RL's own unit tests where one exists.
"""

from __future__ import annotations

import math

import pytest
import torch
from _loss_inputs import loss_config, random_inputs

from megatron_grpo.loss import ClippedPGLoss, aggregate_metrics, count_valid
from megatron_grpo.ops import SamplingDistribution, VocabShard
from megatron_grpo.runner.config import ConfigError

IS_ON = dict(use_importance_sampling_correction=True)


def logits_for(curr: list[list[float]]) -> torch.Tensor:
    """`[B, S, 2]` logits whose logprob of token 0 at position t (from row t - 1) is `curr[b][t - 1]`."""
    p = torch.tensor(curr, dtype=torch.float64).exp()
    logits = torch.zeros(p.shape[0], p.shape[1] + 1, 2, dtype=torch.float64)
    logits[:, :-1, 0] = torch.log(p / (1 - p))
    return logits.float()


def batch_for(curr: list[list[float]], **per_token: list[list[float]]) -> dict[str, torch.Tensor]:
    """A batch whose positions 1..S-1 are all trained, with the given per-token inputs (position 0 padded)."""
    batch_size, length = len(curr), len(curr[0]) + 1
    batch = {
        "input_ids": torch.zeros(batch_size, length, dtype=torch.int64),
        "token_mask": torch.ones(batch_size, length),
        "sample_mask": torch.ones(batch_size),
    }
    for key, values in per_token.items():
        batch[key] = torch.nn.functional.pad(torch.tensor(values, dtype=torch.float32), (1, 0))
    return batch


def run(cfg, curr, batch, **kwargs):
    """(loss, metrics, d loss / d curr) of one call on `logits_for(curr)`, over all of the batch's tokens."""
    logits = logits_for(curr).requires_grad_()
    tokens, seqs = count_valid(batch)
    loss, metrics = ClippedPGLoss(cfg)(logits, batch, global_valid_tokens=tokens, global_valid_seqs=seqs, **kwargs)
    loss.backward()
    # d loss / d logits[t - 1, 0] = g_t (1 - p_t): divide the target column's gradient by 1 - p
    p = torch.tensor(curr, dtype=torch.float64).exp()
    return float(loss.detach()), metrics, logits.grad[:, :-1, 0].double() / (1 - p)


# --- Bug 1: the KL clamps bound the weighted term, as NeMo-RL's calculate_kl does ---------------------------------


def test_kl_input_clamp_stops_the_score_function_gradient_where_it_binds():
    # k3, penalty 0.5, input clamp 2, advantage 0. Token 1: log r = ref - curr = 3 binds (k3(2) = e^2 - 3);
    # token 2: log r = 1 is free (k3(1) = e - 2, d/dcurr [exp(curr - sg(curr)) k3] = k3 - (e^1 - 1) = -1).
    curr = [[-1.5, -1.2]]
    batch = batch_for(curr, advantages=[[0.0, 0.0]], prev_logprobs=curr, reference_policy_logprobs=[[1.5, -0.2]])
    cfg = loss_config(reference_policy_kl_penalty=0.5, kl_input_clamp_value=2.0)
    loss, metrics, grad = run(cfg, curr, batch)
    assert loss == pytest.approx(0.5 * ((math.e**2 - 3) + (math.e - 2)) / 2, rel=1e-5)
    assert float(grad[0, 0]) == pytest.approx(0.0, abs=1e-7)  # was 0.5 (e^2 - 3) / 2: the clamp let 2.19 through
    assert float(grad[0, 1]) == pytest.approx(0.5 * -1 / 2, rel=1e-5)
    assert float(metrics["kl_penalty"]) == pytest.approx(((math.e**2 - 3) + (math.e - 2)) / 2, rel=1e-5)


def test_kl_output_clamp_bounds_the_kl_after_the_on_policy_weight():
    # On-policy weight exp(curr - generation) = 100, k3(log r = 1) = e - 2: the weighted KL 71.8 clamps to 1.
    curr = [[-1.0]]
    batch = batch_for(
        curr,
        advantages=[[0.0]],
        prev_logprobs=curr,
        reference_policy_logprobs=[[0.0]],
        generation_logprobs=[[-1.0 - math.log(100.0)]],
    )
    cfg = loss_config(reference_policy_kl_penalty=1.0, kl_output_clamp_value=1.0, use_on_policy_kl_approximation=True)
    loss, metrics, grad = run(cfg, curr, batch)
    assert loss == pytest.approx(1.0, rel=1e-6)  # was 100 (e - 2) = 71.8
    assert float(grad[0, 0]) == pytest.approx(0.0, abs=1e-6)  # was 100 ((e - 2) - (e - 1)) = -100
    assert float(metrics["kl_penalty"]) == pytest.approx(1.0, rel=1e-6)


# --- Bug 2: tis clamps to [ratio_min, ratio_max] -----------------------------------------------------------------


def test_tis_clamps_the_weights_to_ratio_min_and_counts_both_bounds():
    # On-policy ratio 1, advantage 1: loss = -mean(w). Weights 0.5, 2, 1 clamp to 0.8, 1.5, 1.
    curr = [[-1.0, -1.0, -1.0]]
    generation = [[-1.0 - math.log(0.5), -1.0 - math.log(2.0), -1.0]]
    batch = batch_for(curr, advantages=[[1.0, 1.0, 1.0]], prev_logprobs=curr, generation_logprobs=generation)
    cfg = loss_config(**IS_ON, truncated_importance_sampling=dict(type="tis", ratio_min=0.8, ratio_max=1.5))
    loss, metrics, _ = run(cfg, curr, batch)
    assert loss == pytest.approx(-(0.8 + 1.5 + 1.0) / 3, rel=1e-6)  # was -(0.5 + 1.5 + 1) / 3
    assert float(metrics["is_oob_ratio"]) == pytest.approx(2 / 3)  # was 1/3: only the upper bound counted
    assert float(metrics["sampling_importance_ratio"]) == pytest.approx(3.3 / 3, rel=1e-6)


def test_tis_without_ratio_min_clamps_at_zero_as_nemo_does():
    curr = [[-1.0, -1.0]]
    generation = [[-1.0 - math.log(0.01), -1.0 - math.log(3.0)]]
    batch = batch_for(curr, advantages=[[1.0, 1.0]], prev_logprobs=curr, generation_logprobs=generation)
    cfg = loss_config(**IS_ON, truncated_importance_sampling=dict(type="tis", ratio_min=None, ratio_max=2.0))
    loss, metrics, _ = run(cfg, curr, batch)
    assert loss == pytest.approx(-(0.01 + 2.0) / 2, rel=1e-5)
    assert float(metrics["is_oob_ratio"]) == pytest.approx(0.5)


# --- Bug 3: GSPO's importance weight is the sequence's probability ratio, the product ----------------------------

NEMO_GSPO_CURR = [[-1.69315, -1.0, -0.59453]]  # NeMo-RL's test_clipped_pg_loss_gspo_importance_sampling_correction


def _nemo_gspo_case(**overrides):
    batch = batch_for(
        NEMO_GSPO_CURR,
        advantages=[[1.0, -1.0, 2.0]],
        prev_logprobs=[[-1.0, -1.0, -1.0]],
        generation_logprobs=[[-0.5, -1.5, -0.8]],
    )
    cfg = loss_config(
        **IS_ON,
        ratio_clip_min=0.2,
        ratio_clip_max=0.2,
        sequence_level_importance_ratio=True,
        loss_agg_mode="seq-mean-token-mean",
        **overrides,
    )
    return run(cfg, NEMO_GSPO_CURR, batch)


def test_gspo_importance_weight_is_the_product_matching_nemo_rl():
    # weight exp(sum(prev - gen)) = exp(-0.2); ratio exp(mean(curr - prev)) = 0.9086 (unclipped).
    loss, metrics, grad = _nemo_gspo_case()
    weight, ratio = math.exp(-0.2), math.exp((-0.69315 + 0.0 + 0.40547) / 3)
    assert loss == pytest.approx(weight * ratio * (-1 + 1 - 2) / 3, rel=1e-5)
    assert loss == pytest.approx(-0.4959, abs=1e-4)  # NeMo-RL's expected value; the geometric mean gave -0.5666
    assert float(metrics["sampling_importance_ratio"]) == pytest.approx(weight, rel=1e-5)
    # loss = (1/3) sum_t w (-A_t) r with dr/dcurr_j = r / 3: every token's gradient is w r (-sum A) / 9
    torch.testing.assert_close(grad, torch.full_like(grad, weight * ratio * -2 / 9), rtol=1e-4, atol=1e-7)


def test_gspo_geometric_mean_weight_is_its_own_option():
    loss, metrics, _ = _nemo_gspo_case(sequence_level_importance_weight="geometric_mean")
    weight = math.exp(-0.2 / 3)
    assert loss == pytest.approx(-0.5666, abs=1e-4)
    assert float(metrics["sampling_importance_ratio"]) == pytest.approx(weight, rel=1e-5)


# --- Bug 4: a -inf generation logprob never poisons the batch -----------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(IS_ON),
        dict(IS_ON, sequence_level_importance_ratio=True, loss_agg_mode="seq-mean-token-mean"),
        dict(IS_ON, truncated_importance_sampling=dict(type="seq-mask-tis", ratio_min=0.5, ratio_max=2.0)),
        dict(IS_ON, truncated_importance_sampling=dict(type="icepop", ratio_min=0.5, ratio_max=2.0)),
        dict(reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True),
    ],
    ids=["is", "gspo", "seq_mask_tis", "icepop", "on_policy_kl"],
)
def test_a_minus_inf_generation_logprob_gives_a_finite_loss_gradient_and_metrics(overrides):
    curr = [[-1.0, -1.2, -0.7], [-0.9, -1.1, -2.0]]
    generation = [[-1.1, -torch.inf, -0.6], [-0.9, -1.0, -2.1]]
    batch = batch_for(
        curr,
        advantages=[[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
        prev_logprobs=curr,
        generation_logprobs=generation,
        reference_policy_logprobs=curr,
    )
    loss, metrics, grad = run(loss_config(**overrides), curr, batch)
    assert math.isfinite(loss)
    assert torch.isfinite(grad).all()
    scalars = {name: float(value) for name, value in metrics.items() if value.dim() == 0}
    assert all(math.isfinite(value) for value in scalars.values()), scalars
    assert scalars["nonfinite_generation_logprobs"] == 1
    # the mismatch metrics are over the 5 tokens with a finite generation logprob
    gaps = [0.1, 0.1, 0.0, 0.1, 0.1]
    assert scalars["token_mult_prob_error"] == pytest.approx(sum(math.exp(g) for g in gaps) / 5, rel=1e-5)


def test_a_minus_inf_generation_logprob_zeroes_its_token_weight():
    # Per-token IS, no truncation: the bad token's weight is 0 (NeMo's nan_to_num); the others keep theirs.
    curr = [[-1.0, -1.0]]
    batch = batch_for(
        curr, advantages=[[1.0, 1.0]], prev_logprobs=curr, generation_logprobs=[[-1.0 - math.log(2.0), -torch.inf]]
    )
    loss, metrics, _ = run(loss_config(**IS_ON), curr, batch)
    assert loss == pytest.approx(-(2.0 + 0.0) / 2, rel=1e-6)
    assert float(metrics["sampling_importance_ratio"]) == pytest.approx(1.0, rel=1e-6)


def test_seq_mask_tis_is_oob_ratio_is_the_fraction_of_sequences():
    # Geometric-mean weights: sequence 0 (1 token) e^1 out, sequence 1 (3 tokens) 1 in, sequence 2 (2 tokens) e^-1
    # out. NeMo: 2 of 3 sequences; the token fraction is 3 of 6.
    curr = [[-1.0, -1.0, -1.0]] * 3
    token_mask = torch.tensor([[0, 1, 0, 0], [0, 1, 1, 1], [0, 1, 1, 0]])
    generation = [[-2.0, 0.0, 0.0], [-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]]
    batch = dict(batch_for(curr, advantages=[[1.0] * 3] * 3, prev_logprobs=curr, generation_logprobs=generation))
    batch["token_mask"] = token_mask
    cfg = loss_config(**IS_ON, truncated_importance_sampling=dict(type="seq-mask-tis", ratio_min=0.5, ratio_max=2.0))
    loss, metrics, _ = run(cfg, curr, batch)
    assert float(metrics["is_oob_ratio"]) == pytest.approx(2 / 3)  # was 0.5, the token fraction
    assert float(metrics["is_oob_token_ratio"]) == pytest.approx(3 / 6)
    assert loss == pytest.approx(-3 / 6, rel=1e-6)  # only sequence 1's three tokens, weight 1 each

    # Split into microbatches, the loss's own aggregation gives the fraction of sequences of the whole batch.
    loss_fn = ClippedPGLoss(cfg)
    tokens, seqs = count_valid(batch)
    parts = []
    for rows in (slice(0, 1), slice(1, 3)):
        part = {key: value[rows] for key, value in batch.items()}
        parts.append(loss_fn(logits_for(curr)[rows], part, global_valid_tokens=tokens, global_valid_seqs=seqs)[1])
    combined = aggregate_metrics(parts, aggregation=loss_fn.metric_aggregation)
    assert combined["is_oob_ratio"] == pytest.approx(2 / 3)
    assert combined["is_oob_token_ratio"] == pytest.approx(3 / 6)


# --- The options NeMo-RL has: CISPO, VAPO's positive-example NLL, clamped-ratio extremes, approximate entropy ------


def test_cispo_is_the_detached_clipped_ratio_times_the_logprob():
    # ratio 2 clips to 1.28, advantage 1: loss = -1.28 curr, d loss / d curr = -1.28 (PPO's clipped term: 0).
    curr = [[-1.0, -0.5]]
    prev = [[-1.0 - math.log(2.0), -0.5 - math.log(0.5)]]
    batch = batch_for(curr, advantages=[[1.0, -1.0]], prev_logprobs=prev)
    loss, metrics, grad = run(loss_config(use_cispo=True), curr, batch)
    assert loss == pytest.approx((-1.28 * -1.0 + 1.0 * 0.8 * -0.5) / 2, rel=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[-1.28 / 2, 0.8 / 2]], dtype=torch.float64), rtol=1e-5, atol=1e-7)
    assert float(metrics["probs_ratio_clamped_min"]) == pytest.approx(0.8, rel=1e-5)
    assert float(metrics["probs_ratio_clamped_max"]) == pytest.approx(1.28, rel=1e-5)
    assert float(metrics["probs_ratio_min"]) == pytest.approx(0.5, rel=1e-5)


def test_positive_example_nll_adds_the_nll_of_rewarded_samples_per_trained_token():
    curr = [[-1.0, -2.0], [-0.5, -0.25]]
    batch = batch_for(curr, advantages=[[0.0, 0.0], [0.0, 0.0]], prev_logprobs=curr)
    batch["rewards"] = torch.tensor([1.0, 0.0])
    loss, metrics, grad = run(loss_config(positive_example_nll_weight=0.5), curr, batch)
    assert loss == pytest.approx(0.5 * (1.0 + 2.0) / 4, rel=1e-6)
    assert float(metrics["positive_nll_loss"]) == pytest.approx(3.0 / 4, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[-0.125, -0.125], [0.0, 0.0]], dtype=torch.float64))

    del batch["rewards"]
    with pytest.raises(ValueError, match=r"batch\['rewards'\] is missing.*positive_example_nll_weight"):
        run(loss_config(positive_example_nll_weight=0.5), curr, batch)


def test_the_exact_entropy_is_always_logged_and_the_approximate_one_beside_it():
    # Two-token rows with p(target) = exp(curr): H = -(p log p + (1 - p) log(1 - p)).
    # NeMo-RL's approximation: mean(-exp(curr - generation) * curr).
    curr = [[-1.0, -0.5]]
    generation = [[-1.0, -0.5 - math.log(2.0)]]
    batch = batch_for(curr, advantages=[[0.0, 0.0]], prev_logprobs=curr, generation_logprobs=generation)
    exact = [-(math.exp(c) * c + (1 - math.exp(c)) * math.log(1 - math.exp(c))) for c in curr[0]]
    for entropy_coef in (0.0, 0.01):  # logged whether or not it is trained
        loss, metrics, _ = run(loss_config(entropy_coef=entropy_coef), curr, batch)
        assert float(metrics["entropy"]) == pytest.approx(sum(exact) / 2, rel=1e-5)
        assert float(metrics["approx_entropy"]) == pytest.approx((1.0 + 2 * 0.5) / 2, rel=1e-5)
        assert loss == pytest.approx(-entropy_coef * sum(exact) / 2, rel=1e-5, abs=1e-9)
    del batch["generation_logprobs"]
    _, metrics, _ = run(loss_config(), curr, batch)
    assert "entropy" in metrics and "approx_entropy" not in metrics


def test_cispo_conflicts_name_their_keys():
    with pytest.raises(ConfigError) as err:
        loss_config(use_cispo=True, disable_ppo_ratio=True, ratio_clip_c=3.0)
    assert any("loss_fn.use_cispo and loss_fn.disable_ppo_ratio" in p for p in err.value.problems)
    assert any("loss_fn.use_cispo and loss_fn.ratio_clip_c" in p for p in err.value.problems)


# --- Filtered distributions: a -inf current logprob is masked out of the loss and counted ------------------------


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_minus_inf_current_logprob_is_dropped_from_the_loss_and_counted(agg):
    inputs = random_inputs(4, 7, 11, seed=3)
    batch = inputs.batch
    b, t = 1, 4
    batch["token_mask"][b, t] = 1
    cfg = loss_config(
        **IS_ON, loss_agg_mode=agg, reference_policy_kl_penalty=0.1, entropy_coef=0.01,
        truncated_importance_sampling=dict(type="icepop", ratio_min=0.5, ratio_max=2.0),
    )
    tokens, seqs = count_valid(batch)
    filtered = inputs.logits.clone()
    filtered[b, t - 1, batch["input_ids"][b, t]] = -torch.inf  # the target is outside the kept set
    filtered.requires_grad_()
    loss, metrics = ClippedPGLoss(cfg)(
        filtered, batch, global_valid_tokens=tokens, global_valid_seqs=seqs, shard=VocabShard(true_vocab_size=11)
    )
    loss.backward()
    assert float(metrics["filtered_out_tokens"]) == 1
    assert torch.isfinite(filtered.grad).all() and math.isfinite(float(loss.detach()))

    # the same as leaving the token untrained, with the same global counts (they still include it)
    untrained = dict(batch, token_mask=batch["token_mask"].clone())
    untrained["token_mask"][b, t] = 0
    logits = inputs.logits.clone().requires_grad_()
    expected, _ = ClippedPGLoss(cfg)(
        logits, untrained, global_valid_tokens=tokens, global_valid_seqs=seqs, shard=VocabShard(true_vocab_size=11)
    )
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    keep = torch.ones_like(logits.grad, dtype=torch.bool)
    keep[b, t - 1] = False
    torch.testing.assert_close(filtered.grad[keep], logits.grad[keep], rtol=1e-5, atol=1e-7)
    assert filtered.grad[b, t - 1].abs().max() == 0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_the_kl_keeps_filtered_out_tokens_through_the_unfiltered_logprobs(agg):
    # With zero advantages only the KL term remains; it reads unfiltered current logprobs over every trained token
    # (NeMo-RL), so top_k = 1 leaves loss and gradient unchanged although it filters tokens out of the policy term.
    inputs = random_inputs(3, 6, 9, seed=7)
    batch = dict(inputs.batch, advantages=torch.zeros_like(inputs.batch["advantages"]))
    cfg = loss_config(loss_agg_mode=agg, reference_policy_kl_penalty=0.2)
    tokens, seqs = count_valid(batch)
    results = []
    for top_k in (None, 1):
        logits = inputs.logits.clone().requires_grad_()
        loss, metrics = ClippedPGLoss(cfg)(
            logits, batch, global_valid_tokens=tokens, global_valid_seqs=seqs, shard=VocabShard(true_vocab_size=9),
            distribution=SamplingDistribution(top_k=top_k),
        )
        loss.backward()
        results.append((loss.detach(), logits.grad, metrics))
    (plain, plain_grad, plain_metrics), (filtered, filtered_grad, filtered_metrics) = results
    assert float(filtered_metrics["filtered_out_tokens"]) > 0 == float(plain_metrics["filtered_out_tokens"])
    torch.testing.assert_close(filtered, plain, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(filtered_grad, plain_grad, rtol=1e-5, atol=1e-7)
    assert float(filtered_metrics["kl_penalty"]) == pytest.approx(float(plain_metrics["kl_penalty"]), rel=1e-6)


# --- force_on_policy_ratio with NeMo-RL's meaning: the key alone takes prev = curr.detach() ------------------------
# NeMo-RL's tests/unit/algorithms/test_loss_functions.py calls its loss with the key set, prev logprobs in the batch
# and no other argument; the same calls here (no prev_logprobs_from_current), with its numbers.

NEMO_CURR = [[-1.69315, -1.0, -0.59453]]  # log(0.5) - 1, log(1) - 1, log(1.5) - 1: ratios 0.5, 1, 1.5 against prev -1
FORCED = dict(force_on_policy_ratio=True, ratio_clip_min=0.2, ratio_clip_max=0.2)


def test_nemo_rl_force_on_policy_ratio_forces_every_ratio_to_one():
    # NeMo-RL's test_clipped_pg_loss_force_on_policy_ratio: loss = mean(-A * 1) = (-1 + 1 - 2) / 3.
    batch = batch_for(NEMO_CURR, advantages=[[1.0, -1.0, 2.0]], prev_logprobs=[[-1.0, -1.0, -1.0]])
    loss, metrics, grad = run(loss_config(**FORCED), NEMO_CURR, batch)
    assert loss == pytest.approx(-2.0 / 3.0, rel=1e-6)
    for name in ("probs_ratio", "probs_ratio_clamped", "probs_ratio_min", "probs_ratio_max",
                 "probs_ratio_clamped_min", "probs_ratio_clamped_max"):
        assert float(metrics[name]) == 1.0, name
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 1.0, -2.0]], dtype=torch.float64) / 3, rtol=1e-5, atol=0)


def test_nemo_rl_force_on_policy_ratio_ignores_prev_logprobs():
    # NeMo-RL's test_clipped_pg_loss_force_on_policy_ratio_ignores_prev_logprobs: prev = curr or prev = -10.
    curr = [[-1.0, -1.0, -1.0]]
    results = [run(loss_config(**FORCED), curr, batch_for(curr, advantages=[[1.0, -1.0, 2.0]], prev_logprobs=prev))
               for prev in (curr, [[-10.0, -10.0, -10.0]])]
    (loss_1, metrics_1, _), (loss_2, metrics_2, _) = results
    assert loss_1 == loss_2
    assert float(metrics_1["probs_ratio"]) == float(metrics_2["probs_ratio"]) == 1.0


@pytest.mark.parametrize("ratio_min, weights, oob_ratio",
                         [(None, [0.1, 1.0, 2.0], 1 / 3), (0.5, [0.5, 1.0, 2.0], 2 / 3)])
def test_nemo_rl_tis_min_bound_defaults_to_zero_under_forced_ratio(ratio_min, weights, oob_ratio):
    # NeMo-RL's test_clipped_pg_loss_tis_min_bound_defaults_to_zero: curr logprobs log(0.1, 1, 3) given directly,
    # generation 0, advantage 1, the forced ratio: IS weights exp(curr - 0) truncated to [ratio_min or 0, 2].
    curr = torch.nn.functional.pad(torch.log(torch.tensor([[0.1, 1.0, 3.0]])), (1, 0))
    batch = batch_for([[0.0, 0.0, 0.0]], advantages=[[1.0, 1.0, 1.0]], generation_logprobs=[[0.0, 0.0, 0.0]])
    cfg = loss_config(**IS_ON, force_on_policy_ratio=True,
                      truncated_importance_sampling=dict(type="tis", ratio_min=ratio_min, ratio_max=2.0))
    tokens, seqs = count_valid(batch)
    loss, metrics = ClippedPGLoss(cfg)(None, batch, global_valid_tokens=tokens, global_valid_seqs=seqs,
                                       curr_logprobs=curr, curr_entropy=torch.zeros_like(curr))
    torch.testing.assert_close(loss, -torch.tensor(weights).mean())
    assert float(metrics["is_oob_ratio"]) == pytest.approx(oob_ratio)


def test_force_on_policy_ratio_contradicted_by_an_explicit_false_is_named():
    batch = batch_for(NEMO_CURR, advantages=[[1.0, -1.0, 2.0]], prev_logprobs=[[-1.0, -1.0, -1.0]])
    with pytest.raises(ValueError, match="force_on_policy_ratio is true but prev_logprobs_from_current=False"):
        run(loss_config(**FORCED), NEMO_CURR, batch, prev_logprobs_from_current=False)
    loss, metrics, _ = run(loss_config(**FORCED), NEMO_CURR, batch, prev_logprobs_from_current=True)
    assert loss == pytest.approx(-2.0 / 3.0, rel=1e-6) and float(metrics["probs_ratio"]) == 1.0
