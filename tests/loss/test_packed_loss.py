"""ClippedPGLoss on packed (THD) batches equals the same sequences padded, for every loss mode and metric.

Both runs take float64 logits and do the same arithmetic up to the order of the per-sequence and global sums, so
they agree to float64 rounding: ~1e-16 per operation times sequences of tens of tokens, far below the 1e-12 asked.
"""

from __future__ import annotations

import pytest
import torch
from _loss_inputs import loss_config, random_inputs

from megatron_grpo.loss import ClippedPGLoss, count_valid
from megatron_grpo.loss.packing import PackedMicrobatches
from megatron_grpo.loss.prev_approximation import PrevApproximation, StepVersions
from megatron_grpo.ops import VocabShard

TOL = dict(rtol=1e-12, atol=1e-12)  # same sums in another order: float64 ulps × a few tens of terms
# Metrics of the batch's own float32 inputs alone (prev against generation): the loss keeps those inputs float32
# (its batch contract), so these sums round in float32 in another order: float32 ulps (6e-8) × tens of terms.
FLOAT32_METRICS = {"token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio"}
FLOAT32_TOL = dict(rtol=2e-6, atol=1e-7)
LENGTHS = [7, 3, 9, 5, 1, 8]  # ragged rows of a padded S = 9 batch; row 4 is a lone token (no logprob)

IS = dict(use_importance_sampling_correction=True)
CASES = {
    "token-mean": {},
    "seq-mean-token-mean": dict(loss_agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm", max_response_length=9),
    "gspo-product": dict(sequence_level_importance_ratio=True, loss_agg_mode="seq-mean-token-mean", **IS,
                         sequence_level_importance_weight="product"),
    "gspo-geometric-mean": dict(sequence_level_importance_ratio=True, loss_agg_mode="seq-mean-token-mean", **IS,
                                sequence_level_importance_weight="geometric_mean"),
    "seq-mask-tis": dict(**IS, truncated_importance_sampling=dict(type="seq-mask-tis", ratio_min=0.9,
                                                                  ratio_max=1.1)),
    "tis": dict(**IS, truncated_importance_sampling=dict(type="tis", ratio_max=1.2)),
    "icepop": dict(**IS, truncated_importance_sampling=dict(type="icepop", ratio_min=0.8, ratio_max=1.2)),
    "vapo-entropy-dual-clip": dict(positive_example_nll_weight=0.3, entropy_coef=0.01, ratio_clip_c=3.0),
    "kl-k1-on-policy-approx": dict(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k1",
                                   use_on_policy_kl_approximation=True),
    "kl-k3": dict(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k3"),
}


def _problem(seed: int, per_sequence_advantages: bool = False):
    inputs = random_inputs(len(LENGTHS), max(LENGTHS), 11, seed=seed, per_sequence_advantages=per_sequence_advantages)
    batch = inputs.batch
    for row, length in enumerate(LENGTHS):
        batch["token_mask"][row, length:] = 0  # the padding of a ragged row
    batch["token_mask"][0, 2:] = 1  # the dropped row (sample_mask 0) has tokens that must not count
    batch["logits"] = inputs.logits.double()
    batch["rollout_weight_version"] = torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 2.0])
    return batch


def _run(cfg, batch, **kwargs):
    batch = dict(batch)
    logits = batch.pop("logits").clone().requires_grad_()
    tokens, seqs = count_valid(batch)
    loss, metrics = ClippedPGLoss(cfg)(logits, batch, global_valid_tokens=tokens, global_valid_seqs=seqs, **kwargs)
    loss.backward()
    return loss, metrics, logits.grad, (tokens, seqs)


def _packed(batch, pad_multiple=1):
    """One packed microbatch of every row (first-fit decreasing into a budget that holds them all)."""
    packing = PackedMicrobatches(batch, max_tokens=10_000, pad_multiple=pad_multiple)
    assert len(packing.microbatches) == 1
    return packing, packing.microbatches[0]


@pytest.mark.parametrize("pad_multiple", [1, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_equals_padded(case, pad_multiple):
    batch = _problem(seed=3, per_sequence_advantages=case.startswith("gspo"))
    cfg = loss_config(**CASES[case])
    loss, metrics, grad, counts = _run(cfg, batch)
    packing, packed = _packed(batch, pad_multiple)
    # The rows went in in another order (longest first is only the bin order; within a bin, row order is kept).
    assert packing.rows == [list(range(len(LENGTHS)))]
    p_loss, p_metrics, p_grad, p_counts = _run(cfg, packed)
    torch.testing.assert_close(p_counts, counts, rtol=0, atol=0)
    torch.testing.assert_close(p_loss, loss, **TOL)
    assert set(p_metrics) == set(metrics)
    for name, value in metrics.items():
        unpacked = packing.unpack([p_metrics[name]]) if value.dim() == 2 else p_metrics[name]
        tolerance = FLOAT32_TOL if name in FLOAT32_METRICS else TOL
        torch.testing.assert_close(unpacked.double(), value.double(), **tolerance, msg=name)
    # The logits' gradient, row by row: zero on the packed padding, equal where the rows' tokens are.
    torch.testing.assert_close(packing.unpack([p_grad]), _cut(grad), **TOL)
    assert float(p_grad.abs().sum()) == pytest.approx(float(_cut(grad).abs().sum()), rel=1e-12)


def _cut(per_token):
    out = torch.zeros_like(per_token)
    for row, length in enumerate(LENGTHS):
        out[row, :length] = per_token[row, :length]
    return out


def test_packed_counts_sequences_not_rows():
    batch = _problem(seed=5)
    _, packed = _packed(batch)
    tokens, seqs = count_valid(packed)
    # Rows 0 (dropped), 1 (3 tokens, all prompt), 4 (one token, no logprob) and 5 (random_inputs trains none of its
    # tokens) have no trained token: 2 sequences of the 6 count, although the packed batch is one row.
    assert float(seqs) == 2.0 == float(count_valid(batch)[1])
    assert float(tokens) == float(count_valid(batch)[0])


@pytest.mark.parametrize("method", ["generation", "loglinear", "linear"])
def test_packed_prev_approximations_equal_padded(method):
    batch = _problem(seed=7)
    for key in ("generation_logprobs",):  # the approximations need finite generation logprobs on trained tokens
        batch[key] = torch.where(batch["token_mask"] != 0, batch[key], torch.zeros(()))
    cfg = loss_config()
    versions = StepVersions(prev=2.0, current=2.5)
    approx = PrevApproximation(method, None if method == "generation" else versions)
    loss, metrics, grad, _ = _run(cfg, batch, prev_approximation=approx)
    packing, packed = _packed(batch)
    p_loss, p_metrics, p_grad, _ = _run(cfg, packed, prev_approximation=approx)
    torch.testing.assert_close(p_loss, loss, **TOL)
    torch.testing.assert_close(packing.unpack([p_metrics["prev_logprobs"]]), _cut(metrics["prev_logprobs"]), **TOL)
    torch.testing.assert_close(packing.unpack([p_grad]), _cut(grad), **TOL)
    compared_padded = _run(cfg, batch, compare_approximations=versions)[1]
    compared_packed = _run(cfg, packed, compare_approximations=versions)[1]
    for name, value in compared_padded.items():
        if value.dim() == 0:
            torch.testing.assert_close(compared_packed[name], value, **TOL, msg=name)


FUSED_CASES = ["token-mean", "seq-mean-token-sum-norm", "gspo-geometric-mean", "vapo-entropy-dual-clip",
               "kl-k3", "seq-mask-tis"]


@pytest.mark.parametrize("chunk_rows", [4, None])  # chunks of a few sequences each, and one chunk
@pytest.mark.parametrize("case", FUSED_CASES)
def test_packed_loss_fused_path_equals_padded(case, chunk_rows):
    """The loss-fused path (`on_hidden_states`) on the packed batch, its chunks runs of whole packed sequences,
    equals it on the padded batch: loss, metrics and the gradients of the hidden states and the weight."""
    gen = torch.Generator().manual_seed(11)
    batch = _problem(seed=11, per_sequence_advantages=case.startswith("gspo"))
    batch.pop("logits")
    hidden = torch.randn(len(LENGTHS), max(LENGTHS), 6, generator=gen, dtype=torch.float64)
    weight = torch.randn(13, 6, generator=gen, dtype=torch.float64)
    weight[11:] = 40.0  # padded vocab rows must take no part
    batch["hidden"] = hidden
    packing, packed = _packed(batch, pad_multiple=2)
    cfg = loss_config(**CASES[case])

    def run(b):
        b = dict(b)
        h, w = b.pop("hidden").clone().requires_grad_(), weight.clone().requires_grad_()
        tokens, seqs = count_valid(b)
        loss, metrics = ClippedPGLoss(cfg).on_hidden_states(h, w, b, global_valid_tokens=tokens,
                                                            global_valid_seqs=seqs, chunk_rows=chunk_rows,
                                                            shard=VocabShard(true_vocab_size=11))
        (2.0 * loss).backward()
        return loss, metrics, h.grad, w.grad

    loss, metrics, grad_h, grad_w = run(batch)
    p_loss, p_metrics, p_grad_h, p_grad_w = run(packed)
    torch.testing.assert_close(p_loss, loss, **TOL)
    for name, value in metrics.items():
        unpacked = packing.unpack([p_metrics[name]]) if value.dim() == 2 else p_metrics[name]
        tolerance = FLOAT32_TOL if name in FLOAT32_METRICS else TOL
        torch.testing.assert_close(unpacked.double(), value.double(), **tolerance, msg=name)
    torch.testing.assert_close(packing.unpack([p_grad_h]), _cut(grad_h), **TOL)
    torch.testing.assert_close(p_grad_w, grad_w, **TOL)
