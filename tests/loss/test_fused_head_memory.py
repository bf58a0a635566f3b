"""The loss-fused head's extra memory, counted deterministically (`bench.measure.LiveTensorBytes`), against the
materialised loss step with its in-place backward (the train step's: the logits' gradient overwrites the logits), in
bf16, at the issue's shape scaled down (2 sequences of 512 tokens, H = 16, V = 2048: the same share of the logits per
chunk), unfiltered and with top-k and top-p: at most 10% of its extra peak, both less the gradients returned."""

from __future__ import annotations

import pytest
import torch
from _loss_inputs import loss_config

from megatron_grpo.bench.measure import LiveTensorBytes
from megatron_grpo.loss import ClippedPGLoss, count_valid
from megatron_grpo.ops import SamplingDistribution

B, S, H, V = 2, 512, 16, 2048
LIMIT = 0.10  # of the materialised loss step's extra peak
FILTERS = {"none": SamplingDistribution(), "top-k": SamplingDistribution(top_k=40),
           "top-p": SamplingDistribution(top_p=0.9)}


def problem():
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


@pytest.mark.parametrize("name", FILTERS)
def test_the_loss_fused_head_holds_at_most_a_tenth_of_the_materialised_steps_extra_peak(name):
    hidden, weight, batch = problem()
    loss_fn, distribution = ClippedPGLoss(loss_config(entropy_coef=0.01)), FILTERS[name]
    tokens, seqs = count_valid(batch)
    counts = {"global_valid_tokens": tokens, "global_valid_seqs": seqs, "distribution": distribution,
              "check_inputs": False}
    materialised = extra_peak(lambda h, w: loss_fn(h @ w.t(), batch, inplace_backward=True, **counts)[0],
                              hidden, weight)
    fused = extra_peak(lambda h, w: loss_fn.on_hidden_states(h, w, batch, **counts)[0], hidden, weight)
    assert materialised >= B * S * V * hidden.element_size()  # the logits, their gradient in place
    assert fused <= LIMIT * materialised, f"{fused / materialised:.1%} of the materialised step's extra peak"
