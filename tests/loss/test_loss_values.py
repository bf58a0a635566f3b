"""ClippedPGLoss values, gradients and metrics against a float64 reference written token by token here.

Tolerances: fp32 maths on fp32 logits. The loss and the metrics are means of at most ~70 token terms of magnitude
below ~4: within 1e-5 relative plus 1e-6. A logit's gradient sums the PG, KL and entropy terms of its token, which
may cancel: within 1e-4 of itself plus 1e-6, above the op's fp32 error on p (the exp's 3.6e-7 and lse's rounding
over at most 16 columns, ~4e-6 relative) times terms of |A| ratio / tokens, below ~0.15 here. bf16/fp16 logits add
their own rounding (2^-8, 2^-11 relative) to the logprobs' inputs.
"""

from __future__ import annotations

import math

import pytest
import torch
from _loss_inputs import LossInputs, loss_config, random_inputs

from megatron_grpo.loss import METRIC_AGGREGATION, Aggregation, ClippedPGLoss, ClippedPGLossConfig, count_valid
from megatron_grpo.ops import VocabShard


def reference_loss(
    logits: torch.Tensor,
    batch: dict[str, torch.Tensor],
    cfg: ClippedPGLossConfig,
    *,
    true_vocab_size: int,
    global_valid_tokens: float,
    global_valid_seqs: float,
    prev_from_current: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of float64 `logits` (differentiable) and its metrics, one sequence and one token at a time."""
    logprobs = torch.log_softmax(logits[..., :true_vocab_size], dim=-1)
    ids, adv = batch["input_ids"], batch["advantages"].double()
    gen_in, ref_in = batch["generation_logprobs"].double(), batch["reference_policy_logprobs"].double()
    prev_in = None if prev_from_current or cfg.force_on_policy_ratio else batch["prev_logprobs"].double()
    tis = cfg.truncated_importance_sampling
    total = logits.new_zeros(())
    seen: dict[str, list[float]] = {
        k: [] for k in ("ratio", "clamped", "w", "oob", "oob_seq", "mult", "genkl", "kl", "ent", "approx_ent")
    }
    nll = logits.new_zeros(())
    for b in range(ids.shape[0]):
        tokens = [t for t in range(1, ids.shape[1]) if batch["token_mask"][b, t] != 0 and batch["sample_mask"][b] != 0]
        if not tokens:
            continue
        curr = {t: logprobs[b, t - 1, ids[b, t]] for t in tokens}
        prev = {t: curr[t].detach() if prev_in is None else prev_in[b, t] for t in tokens}
        advantage = {t: adv[b] if adv.dim() == 1 else adv[b, t] for t in tokens}
        log_w = {t: float(prev[t].detach()) - float(gen_in[b, t]) for t in tokens}
        seq_log_w = sum(log_w.values()) / len(tokens)
        if cfg.sequence_level_importance_ratio:
            seq_log_ratio = sum(curr[t] - prev[t] for t in tokens) / len(tokens)
            ratio = {t: torch.exp(seq_log_ratio) for t in tokens}
            product = cfg.sequence_level_importance_weight == "product"
            weight = {t: math.exp(sum(log_w.values()) if product else seq_log_w) for t in tokens}
        else:
            ratio = {t: torch.exp(curr[t] - prev[t]) for t in tokens}
            weight = {t: math.exp(log_w[t]) for t in tokens}
        out_of_bounds = {t: False for t in tokens}
        for t in tokens:
            if tis.type == "tis":
                low = tis.ratio_min or 0.0
                out_of_bounds[t] = not low <= weight[t] <= tis.ratio_max
                weight[t] = min(max(weight[t], low), tis.ratio_max)
            elif tis.type == "icepop":
                out_of_bounds[t] = not tis.ratio_min <= weight[t] <= tis.ratio_max
            elif tis.type == "seq-mask-tis":
                out_of_bounds[t] = not tis.ratio_min <= math.exp(seq_log_w) <= tis.ratio_max
            if out_of_bounds[t] and tis.type in ("icepop", "seq-mask-tis"):
                weight[t] = 0.0
        token_losses = []
        for t in tokens:
            a, r = advantage[t], ratio[t]
            r_clamped = r if cfg.disable_ppo_ratio else r.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
            if cfg.disable_ppo_ratio:
                pg = -a * curr[t]
            elif cfg.use_cispo:
                pg = -a * r_clamped.detach() * curr[t]
            else:
                pg = torch.maximum(-a * r, -a * r_clamped)
                if cfg.ratio_clip_c is not None and a < 0:
                    pg = torch.minimum(pg, -a * cfg.ratio_clip_c)
            if cfg.use_importance_sampling_correction:
                pg = weight[t] * pg
            token_loss = pg
            if cfg.reference_policy_kl_penalty > 0 and not cfg.kl_in_sequence_reward:
                kl_weight = torch.exp(curr[t] - curr[t].detach())
                if cfg.use_on_policy_kl_approximation:
                    kl_weight = kl_weight * math.exp(float(curr[t].detach()) - float(gen_in[b, t]))
                kl = _reference_kl(curr[t], ref_in[b, t], cfg, weight=kl_weight)
                token_loss = token_loss + cfg.reference_policy_kl_penalty * kl
                seen["kl"].append(float(kl.detach()))
            row = logprobs[b, t - 1]
            entropy = -(row.exp() * row).sum()
            token_loss = token_loss - cfg.entropy_coef * entropy
            token_losses.append(token_loss)
            seen["ratio"].append(float(r.detach()))
            seen["clamped"].append(float(r_clamped.detach()))
            seen["w"].append(weight[t])
            seen["oob"].append(float(out_of_bounds[t]))
            seen["mult"].append(math.exp(abs(float(gen_in[b, t]) - float(prev[t].detach()))))
            seen["genkl"].append(float(_reference_kl(gen_in[b, t], prev[t].detach(), cfg, clamp=False)))
            seen["ent"].append(float(entropy.detach()))
            p_ratio = math.exp(float(curr[t].detach()) - float(gen_in[b, t]))
            seen["approx_ent"].append(-p_ratio * float(curr[t].detach()))
            if cfg.positive_example_nll_weight > 0 and batch["rewards"][b] > 0:
                nll = nll - curr[t] / global_valid_tokens
        if tis.type == "seq-mask-tis":
            seen["oob_seq"].append(float(out_of_bounds[tokens[0]]))
        seq_sum = torch.stack(token_losses).sum()
        if cfg.loss_agg_mode == "token-mean":
            total = total + seq_sum / global_valid_tokens
        elif cfg.loss_agg_mode == "seq-mean-token-mean":
            total = total + seq_sum / len(tokens) / global_valid_seqs
        elif cfg.loss_agg_mode == "seq-mean-token-sum":
            total = total + seq_sum / global_valid_seqs
        else:
            total = total + seq_sum / cfg.max_response_length / global_valid_seqs
    total = total + cfg.positive_example_nll_weight * nll
    return total, _reference_metrics(seen, tis.type, float(nll.detach()))


def _reference_kl(logprob, reference, cfg: ClippedPGLossConfig, clamp: bool = True, weight=None):
    """NeMo-RL's calculate_kl: where the input clamp binds, the weight is detached; the output clamp comes last."""
    x = reference - logprob
    if clamp and cfg.kl_input_clamp_value is not None:
        c = cfg.kl_input_clamp_value
        if weight is not None and not -c <= float(x.detach()) <= c:
            weight = weight.detach()
        x = x.clamp(-c, c)
    kl = {"k1": -x, "k2": x * x / 2, "k3": torch.exp(x) - 1 - x}[cfg.reference_policy_kl_type]
    if weight is not None:
        kl = weight * kl
    if clamp and cfg.kl_output_clamp_value is not None:
        kl = kl.clamp(-cfg.kl_output_clamp_value, cfg.kl_output_clamp_value)
    return kl


def _reference_metrics(seen: dict[str, list[float]], truncation: str | None, nll: float) -> dict[str, float]:
    def mean(key: str) -> float:
        return sum(seen[key]) / len(seen[key])

    ratios, clamped = seen["ratio"], seen["clamped"]
    return {
        "num_valid_tokens": len(ratios),
        "probs_ratio": mean("ratio"),
        "probs_ratio_min": min(ratios),
        "probs_ratio_max": max(ratios),
        "probs_ratio_clamped": mean("clamped"),
        "probs_ratio_clamped_min": min(clamped),
        "probs_ratio_clamped_max": max(clamped),
        "clip_fraction_lower": sum(c > r for r, c in zip(ratios, clamped, strict=True)) / len(ratios),
        "clip_fraction_upper": sum(c < r for r, c in zip(ratios, clamped, strict=True)) / len(ratios),
        "token_mult_prob_error": mean("mult"),
        "gen_kl_error": mean("genkl"),
        "sampling_importance_ratio": mean("w"),
        "is_oob_ratio": mean("oob_seq") if truncation == "seq-mask-tis" else mean("oob"),
        "is_oob_token_ratio": mean("oob"),
        "kl_penalty": mean("kl") if seen["kl"] else None,
        "entropy": mean("ent"),
        "approx_entropy": mean("approx_ent"),
        "positive_nll_loss": nll,
    }


def run_both(
    inputs: LossInputs, cfg: ClippedPGLossConfig, *, prev_from_current: bool = False
) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    """(loss, metrics, logits grad) of ClippedPGLoss on float32 logits, then of the float64 reference."""
    tokens, seqs = count_valid(inputs.batch)
    logits = inputs.logits.clone().requires_grad_()
    loss, metrics = ClippedPGLoss(cfg)(
        logits,
        inputs.batch,
        global_valid_tokens=tokens,
        global_valid_seqs=seqs,
        shard=VocabShard(true_vocab_size=inputs.true_vocab_size),
        prev_logprobs_from_current=prev_from_current,
    )
    loss.backward()
    logits64 = inputs.logits.double().requires_grad_()
    ref_loss, ref_metrics = reference_loss(
        logits64,
        inputs.batch,
        cfg,
        true_vocab_size=inputs.true_vocab_size,
        global_valid_tokens=float(tokens),
        global_valid_seqs=float(seqs),
        prev_from_current=prev_from_current,
    )
    ref_loss.backward()
    return loss, metrics, logits.grad, ref_loss, ref_metrics, logits64.grad


CASES = {
    "token_mean_clip_higher": {},
    "dual_clip": dict(ratio_clip_c=1.3),
    "reinforce": dict(disable_ppo_ratio=True),
    "seq_mean_token_mean": dict(loss_agg_mode="seq-mean-token-mean"),
    "seq_mean_token_sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "dr_grpo_token_sum_norm": dict(loss_agg_mode="seq-mean-token-sum-norm", max_response_length=11),
    "gspo": dict(sequence_level_importance_ratio=True, loss_agg_mode="seq-mean-token-mean"),
    "gspo_with_is_token_sum": dict(
        sequence_level_importance_ratio=True,
        loss_agg_mode="seq-mean-token-sum",
        use_importance_sampling_correction=True,
    ),
    "kl_k1": dict(reference_policy_kl_penalty=0.3, reference_policy_kl_type="k1"),
    "kl_k2": dict(reference_policy_kl_penalty=0.3, reference_policy_kl_type="k2"),
    "kl_k3_input_clamp": dict(reference_policy_kl_penalty=0.3, kl_input_clamp_value=0.25),
    "kl_k3_output_clamp": dict(reference_policy_kl_penalty=0.3, kl_output_clamp_value=0.02),
    "kl_on_policy_approximation": dict(reference_policy_kl_penalty=0.3, use_on_policy_kl_approximation=True),
    "kl_in_reward_adds_nothing": dict(reference_policy_kl_penalty=0.3, kl_in_sequence_reward=True),
    "kl_k3_input_clamp_on_policy_weight": dict(
        reference_policy_kl_penalty=0.3, kl_input_clamp_value=0.25, use_on_policy_kl_approximation=True
    ),
    "kl_k1_output_clamp_on_policy_weight": dict(
        reference_policy_kl_penalty=0.3,
        reference_policy_kl_type="k1",
        kl_output_clamp_value=0.2,
        use_on_policy_kl_approximation=True,
    ),
    "is_correction": dict(use_importance_sampling_correction=True),
    "tis": dict(use_importance_sampling_correction=True, truncated_importance_sampling=dict(type="tis", ratio_max=1.2)),
    "tis_with_ratio_min": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling=dict(type="tis", ratio_min=0.9, ratio_max=1.2),
    ),
    "gspo_geometric_mean_weight": dict(
        sequence_level_importance_ratio=True,
        sequence_level_importance_weight="geometric_mean",
        loss_agg_mode="seq-mean-token-mean",
        use_importance_sampling_correction=True,
    ),
    "cispo": dict(use_cispo=True, use_importance_sampling_correction=True),
    "vapo_positive_example_nll": dict(positive_example_nll_weight=0.7),
    "icepop": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling=dict(type="icepop", ratio_min=0.8, ratio_max=1.25),
    ),
    "seq_mask_tis": dict(
        use_importance_sampling_correction=True,
        truncated_importance_sampling=dict(type="seq-mask-tis", ratio_min=0.9, ratio_max=1.1),
    ),
    "entropy_bonus": dict(entropy_coef=0.05),
    "everything": dict(
        ratio_clip_c=1.5,
        loss_agg_mode="seq-mean-token-sum-norm",
        max_response_length=8,
        reference_policy_kl_penalty=0.2,
        reference_policy_kl_type="k2",
        kl_input_clamp_value=0.4,
        use_on_policy_kl_approximation=True,
        use_importance_sampling_correction=True,
        truncated_importance_sampling=dict(type="icepop", ratio_min=0.7, ratio_max=1.4),
        entropy_coef=-0.02,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_loss_gradient_and_metrics_match_the_float64_reference(case):
    cfg = loss_config(**CASES[case])
    inputs = random_inputs(5, 9, 13, seed=len(case), padded_vocab_size=16, per_sequence_advantages=len(case) % 2 == 1)
    loss, metrics, grad, ref_loss, ref_metrics, ref_grad = run_both(inputs, cfg)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert grad[..., inputs.true_vocab_size :].abs().max() == 0, "padding columns must get no gradient"
    assert float(metrics["loss"]) == float(loss.detach())
    _assert_metrics_match(metrics, ref_metrics, cfg)


def _assert_metrics_match(metrics: dict, expected: dict, cfg: ClippedPGLossConfig) -> None:
    always = ["num_valid_tokens", "probs_ratio", "probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped"]
    always += ["clip_fraction_lower", "clip_fraction_upper", "token_mult_prob_error", "gen_kl_error"]
    always += ["sampling_importance_ratio"]
    always += ["probs_ratio_clamped_min", "probs_ratio_clamped_max", "entropy", "approx_entropy"]
    optional = {
        "is_oob_ratio": cfg.truncated_importance_sampling.type is not None,
        "is_oob_token_ratio": cfg.truncated_importance_sampling.type == "seq-mask-tis",
        "kl_penalty": cfg.reference_policy_kl_penalty > 0 and not cfg.kl_in_sequence_reward,
        "positive_nll_loss": cfg.positive_example_nll_weight > 0,
    }
    for name in always + [name for name, present in optional.items() if present]:
        assert float(metrics[name]) == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    for name, present in optional.items():
        assert (name in metrics) == present, name


def test_unpadded_vocab_with_per_token_advantages_matches_the_reference():
    cfg = loss_config(ratio_clip_c=2.0, reference_policy_kl_penalty=0.1, entropy_coef=0.01)
    inputs = random_inputs(4, 7, 11, seed=5)
    loss, _, grad, ref_loss, _, ref_grad = run_both(inputs, cfg)
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)


def test_hand_computed_clipping_on_uniform_logits():
    # Uniform logits over 4 tokens: every curr logprob is log(1/4). prev = curr - log(r) gives ratios r of
    # 0.5, 1 and 2 at positions 1..3, with advantages +1, -1, -1, clip 0.2/0.28 and dual clip c = 1.5:
    #   t1: max(-0.5, -0.8) = -0.5   (the lower clip does not bind for A > 0: gradient -A r = -0.5)
    #   t2: max(1, 1) = 1            (gradient -A r = 1)
    #   t3: min(max(2, 1.28), 1.5) = 1.5   (dual-clipped: constant, gradient 0)
    ratios = torch.tensor([0.5, 1.0, 2.0])
    cfg = loss_config(ratio_clip_c=1.5)
    uniform = math.log(0.25)
    batch = {
        "input_ids": torch.tensor([[0, 1, 2, 3]]),
        "token_mask": torch.tensor([[0, 1, 1, 1]]),
        "sample_mask": torch.tensor([1]),
        "advantages": torch.tensor([[0.0, 1.0, -1.0, -1.0]]),
        "prev_logprobs": torch.cat([torch.zeros(1), uniform - ratios.log()])[None],
    }
    logits = torch.zeros(1, 4, 4, requires_grad=True)
    loss, metrics = ClippedPGLoss(cfg)(logits, batch, global_valid_tokens=3, global_valid_seqs=1)
    loss.backward()
    assert loss.item() == pytest.approx((-0.5 + 1 + 1.5) / 3, rel=1e-6)
    assert float(metrics["probs_ratio_min"]) == pytest.approx(0.5, rel=1e-6)
    assert float(metrics["probs_ratio_max"]) == pytest.approx(2.0, rel=1e-6)
    assert float(metrics["clip_fraction_lower"]) == pytest.approx(1 / 3)
    assert float(metrics["clip_fraction_upper"]) == pytest.approx(1 / 3)
    # d loss / d logits[t - 1] = g_t * (onehot(input_ids[t]) - 1/4), with g_t = d loss / d curr_t.
    g = torch.tensor([-0.5, 1.0, 0.0]) / 3
    expected = torch.zeros(1, 4, 4)
    expected[0, :3] = g[:, None] * (torch.eye(4)[1:4] - 0.25)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-7)


def test_hand_computed_k3_kl_and_reinforce_on_uniform_logits():
    # REINFORCE: loss_t = -A curr_t; k3 with log r = ref - curr = log 2: r - 1 - log r = 1 - log 2.
    cfg = loss_config(disable_ppo_ratio=True, reference_policy_kl_penalty=0.5)
    uniform = math.log(1 / 3)
    batch = {
        "input_ids": torch.tensor([[2, 0, 1]]),
        "token_mask": torch.tensor([[1, 1, 1]]),
        "sample_mask": torch.tensor([1.0]),
        "advantages": torch.tensor([2.0]),
        "prev_logprobs": torch.full((1, 3), uniform),
        "reference_policy_logprobs": torch.full((1, 3), uniform + math.log(2)),
    }
    loss, metrics = ClippedPGLoss(cfg)(torch.zeros(1, 3, 3), batch, global_valid_tokens=2, global_valid_seqs=1)
    assert loss.item() == pytest.approx(-2 * uniform + 0.5 * (1 - math.log(2)), rel=1e-6)
    assert float(metrics["kl_penalty"]) == pytest.approx(1 - math.log(2), rel=1e-6)


@pytest.mark.parametrize("mode", ["force_on_policy_ratio", "prev_logprobs_from_current"])
@pytest.mark.parametrize("gspo", [False, True])
def test_on_policy_ratio_is_exactly_one_with_the_gradient_of_explicit_detached_prev(mode, gspo):
    overrides = dict(
        sequence_level_importance_ratio=gspo, loss_agg_mode="seq-mean-token-mean" if gspo else "token-mean"
    )
    cfg = loss_config(**overrides, force_on_policy_ratio=mode == "force_on_policy_ratio")
    inputs = random_inputs(5, 8, 9, seed=11)
    on_policy = dict(inputs.batch)
    del on_policy["prev_logprobs"]
    on_policy_inputs = LossInputs(inputs.logits, on_policy, inputs.true_vocab_size)
    loss, metrics, grad, ref_loss, ref_metrics, ref_grad = run_both(on_policy_inputs, cfg, prev_from_current=True)
    assert float(metrics["probs_ratio_min"]) == 1.0 and float(metrics["probs_ratio_max"]) == 1.0
    assert ref_metrics["probs_ratio_min"] == ref_metrics["probs_ratio_max"] == 1.0
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)

    explicit = dict(inputs.batch, prev_logprobs=metrics["curr_logprobs"].clone())
    tokens, seqs = count_valid(explicit)
    logits = inputs.logits.clone().requires_grad_()
    explicit_loss, _ = ClippedPGLoss(loss_config(**overrides))(
        logits, explicit, global_valid_tokens=tokens, global_valid_seqs=seqs,
        shard=VocabShard(true_vocab_size=inputs.true_vocab_size),
    )
    explicit_loss.backward()
    torch.testing.assert_close(explicit_loss, loss, rtol=0, atol=0)
    torch.testing.assert_close(logits.grad, grad, rtol=1e-6, atol=1e-8)


def test_mismatch_metrics_use_the_current_logprobs_when_prev_comes_from_current():
    inputs = random_inputs(4, 8, 10, seed=2)
    batch = {k: v for k, v in inputs.batch.items() if k != "prev_logprobs"}
    tokens, seqs = count_valid(batch)
    _, metrics = ClippedPGLoss(loss_config())(
        inputs.logits, batch, global_valid_tokens=tokens, global_valid_seqs=seqs, prev_logprobs_from_current=True
    )
    mask = torch.zeros(4, 8, dtype=torch.bool)
    for b in range(4):
        for t in range(1, 8):
            mask[b, t] = bool(inputs.batch["token_mask"][b, t] != 0 and inputs.batch["sample_mask"][b] != 0)
    curr = torch.log_softmax(inputs.logits.double(), -1)[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    gap = (inputs.batch["generation_logprobs"].double()[:, 1:] - curr)[mask[:, 1:]]
    assert float(metrics["token_mult_prob_error"]) == pytest.approx(float(gap.abs().exp().mean()), rel=1e-5)
    assert float(metrics["sampling_importance_ratio"]) == pytest.approx(float((-gap).exp().mean()), rel=1e-5)
    torch.testing.assert_close(
        metrics["curr_logprobs"][:, 1:][mask[:, 1:]].double(), curr[mask[:, 1:]], rtol=1e-5, atol=1e-6
    )


def test_zero_valid_tokens_give_a_zero_loss_and_zero_gradient():
    inputs = random_inputs(3, 6, 7, seed=4)
    inputs.batch["token_mask"].zero_()
    cfg = loss_config(reference_policy_kl_penalty=0.1, entropy_coef=0.1, loss_agg_mode="seq-mean-token-mean")
    logits = inputs.logits.clone().requires_grad_()
    loss, metrics = ClippedPGLoss(cfg)(logits, inputs.batch, global_valid_tokens=0, global_valid_seqs=0)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0
    scalars = [v for v in metrics.values() if v.dim() == 0]
    assert not any(torch.isnan(v) for v in scalars)
    assert float(metrics["num_valid_tokens"]) == 0 and float(metrics["num_valid_samples"]) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits_follow_the_reference(dtype):
    cfg = loss_config(entropy_coef=0.01)
    inputs = random_inputs(3, 7, 10, seed=8)
    rounded = LossInputs(inputs.logits.to(dtype).float(), inputs.batch, inputs.true_vocab_size)
    _, _, _, ref_loss, _, ref_grad = run_both(rounded, cfg)
    tokens, seqs = count_valid(inputs.batch)
    logits = inputs.logits.to(dtype).requires_grad_()
    loss, _ = ClippedPGLoss(cfg)(logits, inputs.batch, global_valid_tokens=tokens, global_valid_seqs=seqs)
    loss.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=2e-2, atol=1e-4)


def test_every_metric_is_detached_declared_and_survives_in_place_division_of_the_loss():
    cfg = loss_config(**CASES["everything"])
    inputs = random_inputs(4, 6, 9, seed=1)
    tokens, seqs = count_valid(inputs.batch)
    logits = inputs.logits.clone().requires_grad_()
    loss, metrics = ClippedPGLoss(cfg)(logits, inputs.batch, global_valid_tokens=tokens, global_valid_seqs=seqs)
    reported = float(metrics["loss"])
    loss.div_(4)  # what Megatron does with the loss_func's output
    assert float(metrics["loss"]) == reported
    assert set(metrics) <= set(METRIC_AGGREGATION)
    assert all(not value.requires_grad for value in metrics.values())
    assert metrics["curr_logprobs"].shape == (4, 6) and METRIC_AGGREGATION["curr_logprobs"] is Aggregation.PER_TOKEN
    assert all(value.dim() == 0 for name, value in metrics.items() if name != "curr_logprobs")
