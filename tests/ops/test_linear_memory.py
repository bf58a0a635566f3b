"""The fused op's extra memory, counted deterministically (`bench.measure.LiveTensorBytes`: the bytes of tensor
storages alive at once, at the dispatcher, beyond the inputs), against the materialised path (`hidden @ weight.T`,
then `vocab_parallel_logprobs`), both less the hidden and weight gradients they return: at most 10% of it, in fp32
and in bf16, every row trained and (fp32) a quarter of them, at the issue's fp32 shape scaled down (T = 1024, H = 32,
V = 2048: the same H / V, and T / 16 rows per chunk, the default's 1/16 of the call)."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.bench.measure import LiveTensorBytes
from megatron_grpo.ops import vocab_parallel_linear_logprobs, vocab_parallel_logprobs

T, H, V = 1024, 32, 2048
LIMIT = 0.10  # of the materialised path's extra peak


def inputs(dtype: torch.dtype, trained: float):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 3 / H**0.5).to(dtype)
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[: round((1 - trained) * T)] = -1  # the prompt rows
    upstream = (targets >= 0).float()
    return hidden, weight, targets, upstream


def extra_peak(logprobs_of, hidden, weight, upstream) -> int:
    """Live bytes at the peak of one forward + backward beyond the inputs, less the two gradients returned."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with LiveTensorBytes() as live:
        torch.autograd.grad(logprobs_of(h, w), (h, w), upstream)
    return live.peak_bytes - hidden.nbytes - weight.nbytes


@pytest.mark.parametrize("dtype, trained", [(torch.float32, 1.0), (torch.float32, 0.25), (torch.bfloat16, 1.0)],
                         ids=["fp32-all-rows", "fp32-quarter", "bf16-all-rows"])
def test_the_fused_op_holds_at_most_a_tenth_of_the_materialised_paths_extra_peak(dtype, trained):
    hidden, weight, targets, upstream = inputs(dtype, trained)
    materialised = extra_peak(lambda h, w: vocab_parallel_logprobs(h @ w.t(), targets, check_inputs=False),
                              hidden, weight, upstream)
    fused = extra_peak(lambda h, w: vocab_parallel_linear_logprobs(h, w, targets, check_inputs=False),
                       hidden, weight, upstream)
    logits = T * V * hidden.element_size()
    assert materialised >= 1.9 * logits  # the logits and their gradient
    assert fused <= LIMIT * materialised, f"{fused / materialised:.1%} of the materialised path's extra peak"
