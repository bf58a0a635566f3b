"""prev without a pass (`loss.prev_approximation`): verl's bypass (prev := generation) and AReaL's interpolation,
against float64 formulas; AReaL's own unit-test numbers; and the comparison with a computed pass (AReaL's
`metrics`)."""

from __future__ import annotations

import math

import pytest
import torch
from _loss_inputs import loss_config, random_inputs

from megatron_grpo.loss import ClippedPGLoss, count_valid, trained_token_mask
from megatron_grpo.loss.prev_approximation import (
    PrevApproximation,
    StepVersions,
    approximate_prev,
    interpolation_weights,
)
from megatron_grpo.ops import VocabShard

B, S, V = 5, 9, 11
VERSIONS = torch.tensor([3, 2, 0, 3, 1])  # mixed: on-policy (3), one, two and three rollouts old
ONE_ULP = 2.0**-23  # a float64 value rounded once to float32 is within half an ulp: relative 2^-24 < 2^-23


def inputs(seed: int = 3):
    data = random_inputs(B, S, V, seed=seed)
    data.batch["rollout_weight_version"] = VERSIONS.clone()
    return data


def call(data, *, cfg=None, logits=None, **kwargs):
    logits = (data.logits if logits is None else logits).clone().requires_grad_()
    tokens, seqs = count_valid(data.batch)
    loss, metrics = ClippedPGLoss(cfg or loss_config())(
        logits, data.batch, global_valid_tokens=tokens, global_valid_seqs=seqs,
        shard=VocabShard(true_vocab_size=data.true_vocab_size), **kwargs)
    loss.backward()
    return loss, metrics, logits.grad


def alpha_float64(versions: torch.Tensor, prev: float, current: float) -> torch.Tensor:
    behave = versions.double()
    return torch.tensor([1.0 if current == v else (prev - v) / (current - v) for v in behave.tolist()],
                        dtype=torch.float64)


# --- AReaL's numbers (its tests/test_prox_approx.py), as (v_behave, v_prox, v_theta) ------------------------------


@pytest.mark.parametrize("method, old, new, behave, prev, current, expected", [
    ("loglinear", [-1.0, -2.0, -3.0], [-1.5, -2.5, -3.5], [0], 1, 2, [-1.25, -2.25, -3.25]),  # alpha 0.5
    ("loglinear", [-1.0], [-2.0], [4], 4, 5, [-1.0]),  # alpha 0: the behaviour policy
    ("linear", [math.log(0.5)], [math.log(0.25)], [0], 1, 2, [math.log(0.375)]),  # p = 0.5 * 0.5 + 0.5 * 0.25
    ("generation", [-1.0, -2.0], [-5.0, -6.0], [0], 1, 5, [-1.0, -2.0]),  # AReaL's "rollout": old_logp as is
])
def test_areal_single_sample_cases(method, old, new, behave, prev, current, expected):
    versions = StepVersions(prev=prev, current=current)
    alpha = interpolation_weights(torch.tensor(behave), versions)
    prev = approximate_prev(method, torch.tensor([new]), torch.tensor([old]), torch.ones(1, len(old)), alpha)
    torch.testing.assert_close(prev, torch.tensor([expected]), rtol=ONE_ULP, atol=0)


def test_areal_mixed_versions_case():
    # v_prox 3, v_theta 4; samples from versions 0 and 2: alpha 0.75 and 0.5 -> -1.375 and -2.1.
    alpha = interpolation_weights(torch.tensor([0, 2]), StepVersions(prev=3, current=4))
    prev = approximate_prev("loglinear", torch.tensor([[-1.5], [-2.2]]), torch.tensor([[-1.0], [-2.0]]),
                            torch.ones(2, 1), alpha)
    torch.testing.assert_close(prev, torch.tensor([[-1.375], [-2.1]]), rtol=ONE_ULP, atol=0)


# --- the loss with prev approximated --------------------------------------------------------------------------


def test_bypass_ratio_is_exactly_exp_of_curr_minus_generation():
    data = inputs()
    cfg = loss_config(use_importance_sampling_correction=False)
    loss, metrics, grad = call(data, cfg=cfg, prev_approximation=PrevApproximation("generation"))
    mask = trained_token_mask(data.batch).bool()
    assert torch.equal(metrics["prev_logprobs"][mask], data.batch["generation_logprobs"][mask])
    # the same loss and gradient, bit for bit, as a prev pass that returned the generation logprobs
    explicit = dict(data.batch, prev_logprobs=data.batch["generation_logprobs"])
    loss_explicit, metrics_explicit, grad_explicit = call(type(data)(data.logits, explicit, data.true_vocab_size),
                                                          cfg=cfg)
    assert torch.equal(loss, loss_explicit) and torch.equal(grad, grad_explicit)
    # the ratio is exp(curr - generation) per token: its extremes and mean against float64 from the loss's curr
    ratio = torch.exp(metrics["curr_logprobs"].double() - data.batch["generation_logprobs"].double())[mask]
    assert float(metrics["probs_ratio_min"]) == pytest.approx(float(ratio.min()), rel=4 * ONE_ULP)
    assert float(metrics["probs_ratio_max"]) == pytest.approx(float(ratio.max()), rel=4 * ONE_ULP)
    assert float(metrics["probs_ratio"]) == pytest.approx(float(ratio.mean()), rel=1e-6)  # fp32 token mean
    # prev vs generation is prev vs itself: absent, not a fake exact 1 or 0
    assert not {"token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio", "is_oob_ratio",
                "nonfinite_generation_logprobs"} & set(metrics)
    assert "token_mult_prob_error" in metrics_explicit  # the same call with a pass reports them


@pytest.mark.parametrize("method", ["loglinear", "linear"])
@pytest.mark.parametrize("prev, current", [(3.0, 3.5), (3.0, 4.0), (3.0, 3.0)])
def test_interpolation_equals_the_float64_formula_per_token_with_mixed_versions(method, prev, current):
    data = inputs()
    versions = StepVersions(prev=prev, current=current)
    loss, metrics, grad = call(data, prev_approximation=PrevApproximation(method, versions))
    mask = trained_token_mask(data.batch).bool()
    curr = metrics["curr_logprobs"].double()  # the loss's own current logprobs, so only the formula is tested
    gen = data.batch["generation_logprobs"].double()
    alpha = alpha_float64(VERSIONS, prev, current)[:, None]
    if method == "loglinear":
        expected = gen + alpha * (curr - gen)
    else:
        expected = torch.log((1 - alpha) * torch.exp(gen) + alpha * torch.exp(curr))
    expected = torch.where(alpha == 1, curr, expected)
    # evaluated in float64 and rounded once to float32
    torch.testing.assert_close(metrics["prev_logprobs"].double()[mask], expected[mask], rtol=ONE_ULP, atol=1e-12)
    # prev is detached: the loss and its gradient are those of the same prev given as a pass's
    explicit = dict(data.batch, prev_logprobs=metrics["prev_logprobs"])
    loss_explicit, _, grad_explicit = call(type(data)(data.logits, explicit, data.true_vocab_size))
    assert torch.equal(loss, loss_explicit) and torch.equal(grad, grad_explicit)


@pytest.mark.parametrize("method", ["loglinear", "linear"])
def test_interpolation_is_curr_detached_when_the_prev_policy_is_the_current_one(method):
    # The first optimizer step of a rollout (v_theta = v_prox): alpha = 1 for every sample, prev = curr bit for bit.
    data = inputs()
    approximation = PrevApproximation(method, StepVersions(prev=3, current=3))
    loss, metrics, grad = call(data, prev_approximation=approximation)
    mask = trained_token_mask(data.batch).bool()
    assert torch.equal(metrics["prev_logprobs"][mask], metrics["curr_logprobs"][mask])
    assert float(metrics["probs_ratio_min"]) == float(metrics["probs_ratio_max"]) == 1.0
    loss_current, _, grad_current = call(data, prev_logprobs_from_current=True)
    assert torch.equal(loss, loss_current) and torch.equal(grad, grad_current)


# --- AReaL's metrics mode: each approximation against a computed prev ------------------------------------------


def test_compare_approximations_logs_each_methods_errors_against_the_pass():
    data = inputs()
    versions = StepVersions(prev=3, current=3.5)
    _, metrics, _ = call(data, compare_approximations=versions)
    mask = trained_token_mask(data.batch).bool()
    prev, gen = data.batch["prev_logprobs"].double(), data.batch["generation_logprobs"].double()
    curr = metrics["curr_logprobs"].double()
    alpha = alpha_float64(VERSIONS, 3, 3.5)[:, None]
    approximations = {"generation": gen, "loglinear": torch.where(alpha == 1, curr, gen + alpha * (curr - gen)),
                      "linear": torch.where(alpha == 1, curr,
                                            torch.log((1 - alpha) * gen.exp() + alpha * curr.exp()))}
    for method, approx in approximations.items():
        expected = {
            "abs_error": (prev - approx).abs(),
            "rel_error": (prev - approx).abs() / (prev.abs() + 1e-8),
            "is_weight_abs_error": (torch.exp(prev - gen) - torch.exp(approx - gen)).abs(),
            "ratio_abs_error": (torch.exp(curr - prev) - torch.exp(curr - approx)).abs(),
        }
        for kind, values in expected.items():
            # token means in float32 of float64 per-token values; the interpolation is rounded to float32 first
            assert float(metrics[f"prox_{method}_{kind}"]) == pytest.approx(float(values[mask].mean()), rel=1e-5), \
                (method, kind)
    assert float(metrics["prox_generation_abs_error"]) > 0


def test_compare_approximations_are_zero_where_the_pass_is_the_current_policy():
    data = inputs()
    _, first, _ = call(data, prev_logprobs_from_current=True)
    exact = dict(data.batch, prev_logprobs=first["curr_logprobs"])  # a pass that returned curr exactly
    _, metrics, _ = call(type(data)(data.logits, exact, data.true_vocab_size),
                         compare_approximations=StepVersions(prev=3, current=3))
    for method in ("loglinear", "linear"):
        for kind in ("abs_error", "rel_error", "is_weight_abs_error", "ratio_abs_error"):
            assert float(metrics[f"prox_{method}_{kind}"]) == 0.0, (method, kind)


# --- named errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("versions, message", [
    (None, r"batch\['rollout_weight_version'\] is missing"),
    (torch.tensor([3.0, float("nan"), 0.0, 3.0, 1.0]), r"batch\['rollout_weight_version'\]: contains NaN"),
    (torch.tensor([4, 2, 0, 3, 1]), r"version 4 is newer than the step's prev version 3"),
    (torch.tensor([3, 2, 0]), r"batch\['rollout_weight_version'\]: expected shape \[5\] \(one value per sequence"),
], ids=["missing", "nan", "newer-than-prev", "wrong-shape"])
def test_a_bad_version_is_a_named_error(versions, message):
    data = inputs()
    if versions is None:
        del data.batch["rollout_weight_version"]
    else:
        data.batch["rollout_weight_version"] = versions
    with pytest.raises(ValueError, match=message):
        call(data, prev_approximation=PrevApproximation("loglinear", StepVersions(3, 3.5)))


@pytest.mark.parametrize("method", ["generation", "loglinear", "linear"])
def test_a_non_finite_generation_logprob_on_a_trained_token_is_a_named_error(method):
    data = inputs()
    mask = trained_token_mask(data.batch).bool()
    b, t = mask.nonzero()[0].tolist()
    data.batch["generation_logprobs"][b, t] = float("-inf")
    cfg = loss_config(use_importance_sampling_correction=False)
    with pytest.raises(ValueError, match=rf"generation_logprobs'\]: 1 trained token\(s\) have a non-finite.*"
                                         rf"prev_approximation='{method}'"):
        call(data, cfg=cfg, prev_approximation=PrevApproximation(method, StepVersions(3, 3.5)))
    del data.batch["generation_logprobs"]
    with pytest.raises(ValueError, match=r"batch\['generation_logprobs'\] is missing"):
        call(data, cfg=cfg, prev_approximation=PrevApproximation(method, StepVersions(3, 3.5)))


def test_an_interpolation_that_gives_nan_is_a_named_error():
    with pytest.raises(ValueError, match="the interpolation gave NaN or infinite logprobs at 1 trained token"):
        approximate_prev("loglinear", torch.tensor([[float("nan"), -1.0]]), torch.tensor([[-1.0, -1.0]]),
                         torch.ones(1, 2), torch.tensor([0.5], dtype=torch.float64))


@pytest.mark.parametrize("kwargs, cfg, message", [
    (dict(prev_approximation=PrevApproximation("generation")), dict(use_importance_sampling_correction=True),
     "prev_approximation='generation' and loss_fn.use_importance_sampling_correction"),
    (dict(prev_approximation=PrevApproximation("generation")), dict(force_on_policy_ratio=True),
     "prev_approximation='generation' and loss_fn.force_on_policy_ratio"),
    (dict(prev_approximation=PrevApproximation("loglinear", StepVersions(3, 3)), prev_logprobs_from_current=True),
     {}, "prev_approximation='loglinear' and prev_logprobs_from_current=True"),
    (dict(compare_approximations=StepVersions(3, 3), prev_logprobs_from_current=True), {},
     "compare_approximations: compares the approximations with a computed prev pass"),
], ids=["bypass-with-is-correction", "bypass-with-forced-ratio", "approximation-and-from-current",
        "compare-without-a-pass"])
def test_contradictory_prev_sources_are_named(kwargs, cfg, message):
    with pytest.raises(ValueError, match=message):
        call(inputs(), cfg=loss_config(**cfg), **kwargs)


def test_approximation_settings_are_checked_when_built():
    with pytest.raises(ValueError, match="'loglinear' needs the step's versions"):
        PrevApproximation("loglinear")
    with pytest.raises(ValueError, match="method must be one of generation, loglinear, linear"):
        PrevApproximation("rollout")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="older than the prev one"):
        StepVersions(prev=3, current=2)
    assert StepVersions.of_optimizer_step(3, 1, 4) == StepVersions(3.0, 3.25)
