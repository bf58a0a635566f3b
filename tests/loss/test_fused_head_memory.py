"""The loss-fused head's extra memory, counted deterministically (`bench.measure.LiveTensorBytes`), against the
materialised loss step with its in-place backward (the train step's: the logits' gradient overwrites the logits), in
bf16, at the issue's shape with a small hidden size (2 sequences of 512 tokens, H = 16, V = 16384: 12 chunks; 15
where top-p's search runs in stages, as over TP ranks) and at V = 2048 (16 chunks, where the per-row
vectors weigh most), unfiltered and with top-k and top-p: at most 10% of its extra peak, both less the gradients
returned. The per-row vectors the chunk count reserves room for (`chunking.HEAD_ROW_BYTES`) are a bound in every loss
setting."""

from __future__ import annotations

import pytest
import torch
from _loss_inputs import loss_config

from megatron_grpo.bench.measure import LiveTensorBytes
from megatron_grpo.loss import ClippedPGLoss, count_valid, fused_head
from megatron_grpo.ops import SamplingDistribution
from megatron_grpo.ops.core import filtering
from megatron_grpo.ops.core.chunking import HEAD_ROW_BYTES, MIN_CHUNKS, head_min_chunks

B, S, H, V = 2, 512, 16, 2048
LIMIT = 0.10  # of the materialised loss step's extra peak
FILTERS = {"none": SamplingDistribution(), "top-k": SamplingDistribution(top_k=40),
           "top-p": SamplingDistribution(top_p=0.9)}
VOCABS = [2048, 16384]


def problem(V: int = V):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, H, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(V, H, generator=gen) * 3 / H**0.5).to(torch.bfloat16)
    batch = {"input_ids": torch.randint(0, V, (B, S), generator=gen), "token_mask": torch.ones(B, S),
             "sample_mask": torch.ones(B), "advantages": torch.randn(B, S, generator=gen),
             "prev_logprobs": -7.6 + 0.3 * torch.randn(B, S, generator=gen)}
    return hidden, weight, batch


def extra_peak(loss_of, hidden, weight) -> int:
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with LiveTensorBytes() as live:
        torch.autograd.grad(loss_of(h, w), (h, w))
    return live.peak_bytes - hidden.nbytes - weight.nbytes


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("name", [*FILTERS, "top-p, staged"])
def test_the_loss_fused_head_holds_at_most_a_tenth_of_the_materialised_steps_extra_peak(monkeypatch, name, vocab):
    if name == "top-p, staged":  # the search in stages, its temporaries per chunk row, as over TP ranks
        for module in (filtering, fused_head):
            monkeypatch.setattr(module, "searches_in_one_call", lambda *args: False)
        name = "top-p"
    hidden, weight, batch = problem(vocab)
    loss_fn, distribution = ClippedPGLoss(loss_config(entropy_coef=0.01)), FILTERS[name]
    tokens, seqs = count_valid(batch)
    counts = {"global_valid_tokens": tokens, "global_valid_seqs": seqs, "distribution": distribution,
              "check_inputs": False}
    materialised = extra_peak(lambda h, w: loss_fn(h @ w.t(), batch, inplace_backward=True, **counts)[0],
                              hidden, weight)
    fused = extra_peak(lambda h, w: loss_fn.on_hidden_states(h, w, batch, **counts)[0], hidden, weight)
    assert materialised >= B * S * vocab * hidden.element_size()  # the logits, their gradient in place
    assert fused <= LIMIT * materialised, f"{fused / materialised:.1%} of the materialised step's extra peak"


def test_the_chunk_count_takes_what_the_budget_leaves():
    assert head_min_chunks(16384, torch.bfloat16, search_temporaries=False) == 12  # 86 of 1022 rows: 8.4% of the logits
    assert head_min_chunks(16384, torch.bfloat16, search_temporaries=True) == 15  # and a third of it for top-p
    assert head_min_chunks(152064, torch.float32, search_temporaries=False) == 11
    assert head_min_chunks(2048, torch.bfloat16, search_temporaries=False) == MIN_CHUNKS  # the per-row vectors weigh
    assert head_min_chunks(1, torch.bfloat16, search_temporaries=False) == MIN_CHUNKS


SETTINGS = {"default": {}, "kl": {"reference_policy_kl_penalty": 0.1},
            "importance sampling, kl, entropy": {"use_importance_sampling_correction": True,
                                                 "reference_policy_kl_penalty": 0.1, "entropy_coef": 0.01},
            "seq-mean-token-mean": {"loss_agg_mode": "seq-mean-token-mean"}}


# Under a filter, seq-mean-token-mean couples a sequence's tokens (its kept count): chunks of whole sequences.
ROW_CASES = [(setting, name) for setting in SETTINGS for name in ("none", "top-k")
             if (setting, name) != ("seq-mean-token-mean", "top-k")]


@pytest.mark.parametrize(("setting", "name"), ROW_CASES)
def test_the_per_row_vectors_stay_within_the_bytes_the_chunk_count_reserves(setting, name):
    hidden, weight, batch = problem()
    batch = dict(batch, reference_policy_logprobs=batch["prev_logprobs"] - 0.1,
                 generation_logprobs=batch["prev_logprobs"] + 0.05)
    loss_fn, distribution = ClippedPGLoss(loss_config(**SETTINGS[setting])), FILTERS[name]
    tokens, seqs = count_valid(batch)
    rows = 64  # chunks of 64 rows: the per-chunk temporaries (top-k's, 40 values a row) count per trained row too
    fused = extra_peak(lambda h, w: loss_fn.on_hidden_states(
        h, w, batch, global_valid_tokens=tokens, global_valid_seqs=seqs, distribution=distribution,
        check_inputs=False, chunk_rows=rows)[0], hidden, weight)
    buffers = 2 if loss_fn.config.reference_policy_kl_penalty and name != "none" else 1  # a KL under a filter
    per_row = (fused - buffers * rows * V * hidden.element_size()) / (B * S)
    assert 0 < per_row <= HEAD_ROW_BYTES, f"{per_row:.0f} bytes per row"
