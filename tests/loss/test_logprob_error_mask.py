"""The sequence mask by logprob error in the loss (`seq_logprob_error_threshold`), and deferred normalisation.

The mask is NeMo-RL's `compute_and_apply_seq_logprob_error_masking`, checked on its own unit tests' numbers and
against a float64 loop; in the loss it reads the batch's prev, or curr.detach() without one. Deferred normalisation
(each microbatch's loss a sum, divided once by the counts the microbatches report) equals the loss under global
counts known beforehand, for every aggregation mode, with the mask dropping a whole microbatch's sequences.
"""

from __future__ import annotations

import math

import pytest
import torch
from _loss_inputs import batch_for_logits, loss_config

from megatron_grpo.loss import ClippedPGLoss, aggregate_metrics, count_valid, trained_token_mask
from megatron_grpo.loss.logprob_error_mask import mask_by_logprob_error, sequence_mult_prob_error
from megatron_grpo.loss.packing import SequenceLayout, pack_rows, row_lengths
from megatron_grpo.ops import VocabShard

# fp32 sums of at most 56 terms of magnitude <= 4, in another order: (n - 1) u mean|term| <= 2e-5 (see
# test_loss_invariance); a weight gradient's elements relative to the largest one.
SCALAR_ATOL, SPLIT_RTOL = 2e-5, 1e-5
BATCH, SEQ, HIDDEN, VOCAB = 8, 7, 5, 13
MICROBATCHES = ((0, 3), (3, 6), (6, 8))  # the mask below drops every sequence of the second one
DROPPED = (3, 4, 5, 6)
THRESHOLD = 1.25
SPLITS = [("token-mean", False), ("seq-mean-token-mean", False), ("seq-mean-token-sum", False),
          ("seq-mean-token-sum-norm", False), ("seq-mean-token-mean", True)]


def nemo_rl_batch(generation: torch.Tensor, token_mask: torch.Tensor | None = None,
                  sample_mask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """NeMo-RL's unit-test layout: prev 0, the given generation logprobs, token_mask ones; position 0 is the one
    NeMo-RL slices off (`[:, 1:]`) and this contract's mask leaves out."""
    batch_size, seq_len = generation.shape
    return {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.int64),
            "token_mask": torch.ones(batch_size, seq_len) if token_mask is None else token_mask,
            "sample_mask": torch.ones(batch_size) if sample_mask is None else sample_mask,
            "prev_logprobs": torch.zeros(batch_size, seq_len), "generation_logprobs": generation}


def masked(batch: dict[str, torch.Tensor], threshold: float, rewards: torch.Tensor):
    mask = trained_token_mask(batch)
    layout = SequenceLayout.of_batch(batch)
    result = mask_by_logprob_error(batch["prev_logprobs"], batch["generation_logprobs"], mask, threshold, layout,
                                   rewards=rewards)
    kept = (layout.sum(result.mask) > 0) | (layout.sum(mask) == 0)
    return result, kept


def test_nemo_rl_unit_test_masking_with_threshold():
    generation = torch.zeros(4, 10)
    for row, error in enumerate((0.1, 0.1, 0.5, 1.0)):
        generation[row, 1:5] = error  # 4 of the 9 trained tokens: (4 e^x + 5) / 9
    result, kept = masked(nemo_rl_batch(generation), 1.2, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert result.metrics["num_masked_seqs_by_logprob_error"] == 2
    assert result.metrics["masked_correct_pct"] == 0.5
    assert kept.tolist() == [True, True, False, False]
    assert result.metrics["masked_seqs_by_logprob_error_fraction"] == 0.5  # ours: 2 of the 4 checked
    assert result.metrics["max_seq_mult_prob_error"] == pytest.approx((4 * torch.e + 5) / 9, rel=1e-6)


def test_nemo_rl_unit_test_fully_token_masked_sequences_are_left_out_of_the_metrics():
    generation = torch.zeros(3, 3)
    generation[:, 1] = torch.log(torch.tensor([2.0, 4.0, 16.0]))
    token_mask = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    result, kept = masked(nemo_rl_batch(generation, token_mask), 3.0, torch.tensor([0.0, 1.0, 1.0]))
    expected = {"max_seq_mult_prob_error": 4.0, "mean_seq_mult_prob_error": 3.0, "min_seq_mult_prob_error": 2.0,
                "num_masked_seqs_by_logprob_error": 1, "masked_correct_pct": 1.0,
                "max_seq_mult_prob_error_after_mask": 2.0, "mean_seq_mult_prob_error_after_mask": 2.0,
                "min_seq_mult_prob_error_after_mask": 2.0, "num_valid_samples_before_mask": 2}
    for name, value in expected.items():
        assert result.metrics[name].item() == pytest.approx(value, rel=1e-6), name
    assert kept.tolist() == [True, False, True]


def test_nemo_rl_unit_test_respects_the_existing_sample_mask():
    generation = torch.zeros(4, 8)
    generation[:, 1:4] = 1.0
    batch = nemo_rl_batch(generation, sample_mask=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    result, _ = masked(batch, 1.0, torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert result.metrics["num_masked_seqs_by_logprob_error"] == 3  # the dropped one is not counted again
    assert result.metrics["masked_correct_pct"].item() == pytest.approx(2 / 3)
    assert result.mask.sum() == 0


def test_an_infinite_generation_logprob_masks_its_sequence():
    # Per-sequence mean exp(|gen - prev|): (e^0 + e^1) / 2 = 1.859, e^0.1 = 1.105, +inf (a -inf generation logprob),
    # 1.0. With threshold 1.5, sequences 0 and 2 are masked: 2 of 4.
    prev = torch.tensor([[0, -1.0, -1.0], [0, -1.0, -1.0], [0, -1.0, -1.0], [0, -2.0, -2.0]])
    generation = torch.tensor([[0, -1.0, -2.0], [0, -1.1, -0.9], [0, -torch.inf, -1.0], [0, -2.0, -2.0]])
    batch = dict(nemo_rl_batch(generation), prev_logprobs=prev)
    result, kept = masked(batch, 1.5, torch.ones(4))
    assert kept.tolist() == [False, True, False, True]
    assert result.metrics["num_masked_seqs_by_logprob_error"] == 2
    assert result.metrics["masked_seqs_by_logprob_error_fraction"] == 0.5
    assert result.metrics["max_seq_mult_prob_error"] == torch.inf
    assert result.metrics["max_seq_mult_prob_error_after_mask"].item() == pytest.approx(math.exp(0.1), rel=1e-6)


def test_the_error_is_the_float64_per_sequence_mean_of_exp_abs_difference_padded_and_packed():
    gen = torch.Generator().manual_seed(4)
    batch = batch_for_logits(torch.randn(5, 9, 11, generator=gen), 11, seed=5, spread=0.5)
    mask = trained_token_mask(batch)
    batch["prev_logprobs"][2, int(mask[2].nonzero()[0])] = -torch.inf  # filtered out on a trained token: error inf
    error = sequence_mult_prob_error(batch["prev_logprobs"], batch["generation_logprobs"], mask)
    for row in range(5):
        on = mask[row].bool()
        if not on.any():
            assert error[row] == 0
            continue
        expected = torch.exp((batch["generation_logprobs"][row][on].double()
                              - batch["prev_logprobs"][row][on].double()).abs()).mean()
        assert error[row].double().item() == pytest.approx(expected.item(), rel=1e-6), row
    assert error[2] == torch.inf
    lengths = row_lengths(batch)
    packed = pack_rows(batch, list(range(5)), lengths)
    layout = SequenceLayout.of_batch(packed)
    packed_error = sequence_mult_prob_error(packed["prev_logprobs"], packed["generation_logprobs"],
                                            trained_token_mask(packed), layout)
    torch.testing.assert_close(packed_error, error, rtol=0, atol=0)


# --- In the loss, with deferred normalisation ----------------------------------------------------------------------


def problem(seed: int = 9) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A linear head `features @ weight` and a batch whose generation logprobs put sequences 3-6 over the threshold
    (each trained token 0.5 nats off the current logprob: error e^0.5 = 1.65) and the others under it (0.05); its
    prev (a pass of other weights) is within 0.02 * N(0, 1) nats of the current logprobs, which moves no sequence
    across the threshold."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    weight = torch.randn(HIDDEN, VOCAB, generator=gen)
    batch = batch_for_logits(features @ weight, VOCAB, seed=seed + 1)
    batch["token_mask"][BATCH - 1, 3:] = 1  # every sequence has trained tokens ...
    batch["sample_mask"][:] = 1
    batch["sample_mask"][1] = 0  # ... but one is dropped before the mask
    logits = (features @ weight).double()
    curr = torch.zeros(BATCH, SEQ, dtype=torch.float64)
    curr[:, 1:] = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    offset = torch.full((BATCH, 1), 0.05, dtype=torch.float64)
    offset[list(DROPPED)] = 0.5
    batch["generation_logprobs"] = (curr - offset).float()
    batch["prev_logprobs"] = (curr + 0.02 * torch.randn(curr.shape, generator=gen, dtype=torch.float64)).float()
    return features, weight, batch


def loss_and_gradient(features, weight, batch, cfg, **call):
    weight = weight.clone().requires_grad_()
    loss, metrics = ClippedPGLoss(cfg)(features @ weight, batch, shard=VocabShard(true_vocab_size=VOCAB), **call)
    loss.backward()
    return loss.detach(), metrics, weight.grad


def rows(batch, start, stop):
    return {key: value[start:stop] for key, value in batch.items()}


def split_config(mode: str, gspo: bool):
    return loss_config(loss_agg_mode=mode, max_response_length=9, sequence_level_importance_ratio=gspo,
                       reference_policy_kl_penalty=0.2, kl_output_clamp_value=0.5, entropy_coef=0.03,
                       use_importance_sampling_correction=True,
                       truncated_importance_sampling=dict(type="icepop", ratio_min=0.6, ratio_max=1.6),
                       positive_example_nll_weight=0.5 if mode == "token-mean" else 0.0)


@pytest.mark.parametrize("prev_from_current", [False, True], ids=["prev-pass", "curr-detach"])
@pytest.mark.parametrize("mode, gspo", SPLITS, ids=[f"{m}{'-gspo' if g else ''}" for m, g in SPLITS])
def test_deferred_normalisation_with_the_mask_equals_precomputed_counts_on_the_premasked_batch(
        mode, gspo, prev_from_current):
    features, weight, batch = problem()
    cfg = split_config(mode, gspo)
    if prev_from_current:
        del batch["prev_logprobs"]  # the mask and the ratio read curr.detach()
    premasked = dict(batch, sample_mask=batch["sample_mask"].clone())
    premasked["sample_mask"][list(DROPPED)] = 0
    counts = [count_valid(rows(premasked, a, b)) for a, b in MICROBATCHES]
    tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    expected = [loss_and_gradient(features[a:b], weight, rows(premasked, a, b), cfg, global_valid_tokens=tokens,
                                  global_valid_seqs=seqs, prev_logprobs_from_current=prev_from_current)
                for a, b in MICROBATCHES]
    deferred = [loss_and_gradient(features[a:b], weight, rows(batch, a, b), cfg, defer_normalisation=True,
                                  seq_logprob_error_threshold=THRESHOLD, prev_logprobs_from_current=prev_from_current)
                for a, b in MICROBATCHES]
    assert deferred[1][1]["num_masked_seqs_by_logprob_error"] == 3 and deferred[1][1]["loss_normaliser"] == 0
    assert deferred[1][0] == 0 and deferred[1][2].abs().max() == 0  # the whole microbatch masked: nothing to train
    normaliser = sum(part[1]["loss_normaliser"] for part in deferred)
    assert normaliser == (tokens if mode == "token-mean" else seqs)
    expected_grad = sum(part[2] for part in expected)
    assert expected_grad.abs().max() > 0
    torch.testing.assert_close(sum(part[0] for part in deferred) / normaliser, sum(part[0] for part in expected),
                               rtol=SPLIT_RTOL, atol=SCALAR_ATOL)
    torch.testing.assert_close(sum(part[2] for part in deferred) / normaliser, expected_grad, rtol=SPLIT_RTOL,
                               atol=SPLIT_RTOL * float(expected_grad.abs().max()))
    got = aggregate_metrics([part[1] for part in deferred])
    want = aggregate_metrics([part[1] for part in expected])
    for name in ("loss", "positive_nll_loss"):
        if name in want:
            got[name] /= float(normaliser)
    for name, value in want.items():  # every metric of the kept sequences, as if they had been dropped before
        assert got[name] == pytest.approx(value, rel=SPLIT_RTOL, abs=SCALAR_ATOL), name


def test_the_masks_metrics_aggregate_over_microbatches_to_the_whole_batchs():
    features, weight, batch = problem(seed=13)
    cfg = split_config("token-mean", False)
    call = dict(defer_normalisation=True, seq_logprob_error_threshold=THRESHOLD)
    _, whole, _ = loss_and_gradient(features, weight, batch, cfg, **call)
    parts = [loss_and_gradient(features[a:b], weight, rows(batch, a, b), cfg, **call)[1] for a, b in MICROBATCHES]
    assert whole["num_masked_seqs_by_logprob_error"] == len(DROPPED)
    assert whole["num_valid_samples_before_mask"] == BATCH - 1  # one dropped before the mask
    assert whole["masked_seqs_by_logprob_error_fraction"].item() == pytest.approx(len(DROPPED) / (BATCH - 1))
    assert 1.5 < whole["max_seq_mult_prob_error"] < 1.8  # e^(0.5 +- 0.02 N), a masked one
    assert 1.0 < whole["min_seq_mult_prob_error"] <= whole["max_seq_mult_prob_error_after_mask"] < 1.2  # e^(0.05 ...)
    aggregated, expected = aggregate_metrics(parts), aggregate_metrics([whole])
    for name in ("num_masked_seqs_by_logprob_error", "masked_seqs_by_logprob_error_fraction", "masked_correct_pct",
                 *(f"{s}_seq_mult_prob_error{m}" for s in ("max", "mean", "min") for m in ("", "_after_mask"))):
        assert aggregated[name] == pytest.approx(expected[name], rel=1e-6), name


def test_deferred_normalisation_without_a_mask_reports_the_modes_count():
    features, weight, batch = problem()
    for mode, count in (("token-mean", 0), ("seq-mean-token-sum", 1)):
        _, metrics, _ = loss_and_gradient(features, weight, batch, split_config(mode, False), defer_normalisation=True)
        assert metrics["loss_normaliser"] == count_valid(batch)[count]
        assert "num_masked_seqs_by_logprob_error" not in metrics


@pytest.mark.parametrize("call, config, message", [
    (dict(seq_logprob_error_threshold=1.5, global_valid_tokens=10, global_valid_seqs=2), {},
     "seq_logprob_error_threshold: the mask drops sequences in the forward.*defer_normalisation=True"),
    (dict(defer_normalisation=True, global_valid_tokens=10), {}, "global_valid_tokens: given with defer_normal"),
    (dict(), {}, "global_valid_tokens and global_valid_seqs: required"),
    (dict(defer_normalisation=True, seq_logprob_error_threshold=0.0), {},
     "seq_logprob_error_threshold: must be None or a finite number > 0, got 0.0"),
    (dict(defer_normalisation=True), dict(positive_example_nll_weight=0.5, loss_agg_mode="seq-mean-token-sum"),
     "positive_example_nll_weight > 0 and loss_fn.loss_agg_mode = seq-mean-token-sum"),
], ids=["threshold-without-deferral", "counts-with-deferral", "no-counts", "threshold-zero", "two-divisors"])
def test_what_deferral_and_the_mask_cannot_serve_is_a_named_error(call, config, message):
    features, weight, batch = problem()
    with pytest.raises(ValueError, match=message):
        loss_and_gradient(features, weight, batch, loss_config(**config), **call)


def test_the_mask_needs_generation_logprobs_and_refuses_an_approximated_prev():
    from megatron_grpo.loss import PrevApproximation

    features, weight, batch = problem()
    call = dict(defer_normalisation=True, seq_logprob_error_threshold=1.5)
    with pytest.raises(ValueError, match=r"generation_logprobs'\] is missing: it is required by "
                                         r"seq_logprob_error_threshold"):
        loss_and_gradient(features, weight, {k: v for k, v in batch.items() if k != "generation_logprobs"},
                          loss_config(), **call)
    with pytest.raises(ValueError, match="seq_logprob_error_threshold and prev_approximation='generation'"):
        loss_and_gradient(features, weight, batch, loss_config(), prev_approximation=PrevApproximation("generation"),
                          **call)
