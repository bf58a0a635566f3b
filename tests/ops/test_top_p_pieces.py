"""Top-p's selection works on pieces of rows (`chunking.PIECE_LOGITS` logits per rank, rows per piece the same on
every rank): cutting a call into many pieces changes nothing, bit for bit, on one rank and over TP = 2 with a last
shard narrower than the first, where the fused search and its plain-torch twin agree too; the kept sets match the
sorting reference of tests/logprob_reference.py. Each radix pass keeps the highest bucket that reaches the target,
and the prefix's lowest logit where rounding left the target above the prefix's mass; the passes over bits that are
0 in every key (bf16 and fp16 logits, unscaled) are left out, with the same threshold."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import counted_collectives, run_on_ranks
from logprob_reference import filtered_keep_mask

from megatron_grpo.ops.core import chunking, filtering
from megatron_grpo.ops.core.backends import FusedKernels, TorchKernels, fused_supports
from megatron_grpo.ops.core.filtering import (
    BUCKET_BITS,
    BUCKETS,
    _radix_select,
    _value_of_unsigned_key,
    kept_threshold,
    zero_key_bits,
)
from megatron_grpo.ops.distribution import SamplingDistribution

ROWS, TRUE_VOCAB, V_LOCAL = 13, 95, 50  # at TP 2 the second shard holds 45 real columns and 5 of padding


def logits_with_ties(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, TRUE_VOCAB, generator=gen) * 2
    logits[:, ::7] = (logits[:, ::7] * 2).round() / 2  # exact ties, some at the boundary
    logits[3] = 0.5  # a flat row: every logit is a candidate of the boundary bin
    return logits


@pytest.mark.parametrize("top_k, top_p", [(None, 0.9), (None, 0.3), (20, 0.7)])
def test_pieces_change_nothing_on_one_rank(monkeypatch, top_k, top_p):
    logits = logits_with_ties(seed=1)
    sampling = SamplingDistribution(top_k=top_k, top_p=top_p)
    whole = kept_threshold(logits, sampling, true_vocab_size=TRUE_VOCAB)
    monkeypatch.setattr(chunking, "PIECE_LOGITS", 3 * TRUE_VOCAB)  # pieces of 3 rows, the last of 1
    assert chunking.piece_rows(TRUE_VOCAB) == 3
    pieces = kept_threshold(logits, sampling, true_vocab_size=TRUE_VOCAB)
    assert torch.equal(whole, pieces)
    assert torch.equal(logits >= pieces[:, None], filtered_keep_mask(logits, top_k, top_p))


def sharded_worker(rank: int, world: int, top_p: float) -> tuple[torch.Tensor, int, torch.Tensor]:
    default = chunking.PIECE_LOGITS
    chunking.PIECE_LOGITS = 4 * V_LOCAL  # pieces of 4 rows on both ranks, for this task only: the rank processes
    try:  # are the session's pool, and the next task must find the default
        return _sharded(rank, top_p)
    finally:
        chunking.PIECE_LOGITS = default


def _sharded(rank: int, top_p: float) -> tuple[torch.Tensor, int, torch.Tensor]:
    logits = logits_with_ties(seed=2)
    padded = torch.cat([logits, torch.full((ROWS, 2 * V_LOCAL - TRUE_VOCAB), 1e4)], dim=1)
    local = padded[:, rank * V_LOCAL:(rank + 1) * V_LOCAL]
    valid = min(TRUE_VOCAB - rank * V_LOCAL, V_LOCAL)
    with counted_collectives() as calls:
        threshold = kept_threshold(local[:, :valid], SamplingDistribution(top_p=top_p), true_vocab_size=TRUE_VOCAB,
                                   group=dist.group.WORLD)
    twin = kept_threshold(local[:, :valid], SamplingDistribution(top_p=top_p), true_vocab_size=TRUE_VOCAB,
                          group=dist.group.WORLD, kernels=TorchKernels())
    return threshold, calls["n"], twin


def test_pieces_agree_over_tensor_parallel_ranks():
    """Also the fused search (where the extension is built) against its plain-torch twin, on each rank."""
    top_p = 0.8
    per_rank = run_on_ranks(2, sharded_worker, top_p)
    pieces = -(-ROWS // 4)
    for threshold, collectives, twin in per_rank:
        assert torch.equal(threshold, per_rank[0][0]) and torch.equal(twin, threshold)
        assert collectives == 1 + pieces * (1 + 4)  # the row max; per piece the value bins and 4 radix passes (fp32)
    logits = logits_with_ties(seed=2)
    assert torch.equal(logits >= per_rank[0][0][:, None], filtered_keep_mask(logits, None, top_p))
    assert torch.equal(per_rank[0][0], kept_threshold(logits, SamplingDistribution(top_p=top_p),
                                                     true_vocab_size=TRUE_VOCAB))


def radix_masses(low_bit: int, prefix: torch.Tensor) -> torch.Tensor:
    """One row of two candidates of mass 1, keys 0x03000000 and 0x05000000: the first pass finds them in buckets 3
    and 5; each later pass finds the chosen one alone in bucket 0 and the other off the prefix (slot 256)."""
    masses = torch.zeros(1, BUCKETS + 1, dtype=torch.float64)
    if low_bit == 32 - BUCKET_BITS:
        masses[0, 3] = masses[0, 5] = 1.0
    else:
        masses[0, 0] = masses[0, BUCKETS] = 1.0
    return masses


@pytest.mark.parametrize("target, first", [
    (1.5, 3),  # 2 >= 1.5 from bucket 3 up
    (0.5, 5),  # bucket 5 holds 0.5 alone
    (2.0 + 1e-12, 3),  # rounding left the target above the prefix's mass: its lowest logit
    (float("nan"), 3),
])
def test_each_radix_pass_keeps_the_highest_bucket_that_reaches_the_target(target, first):
    threshold = _radix_select(radix_masses, torch.tensor([target], dtype=torch.float64), 1, 32, torch.device("cpu"))
    assert torch.equal(threshold, _value_of_unsigned_key(torch.tensor([first << 24]), 32))


@pytest.mark.parametrize("kernels", ["fused", "torch"])
@pytest.mark.parametrize("dtype, passes", [(torch.bfloat16, 2), (torch.float16, 3), (torch.float32, 4)])
def test_radix_passes_over_bits_zero_in_every_key_are_left_out(monkeypatch, kernels, dtype, passes):
    """bf16 / fp16 logits converted to float32 have 16 / 13 low mantissa bits of 0: the passes reading only those
    would choose bucket 0; without them the threshold is the same, bit for bit, ties and top-k floor included. The
    fused kernels' staged search (as over TP ranks) counts its passes here; their one-rank search takes the same
    number of bits and gives the same threshold."""
    if kernels == "fused" and not fused_supports(torch.device("cpu")):
        pytest.skip("the extension is not built")
    chosen = FusedKernels() if kernels == "fused" else TorchKernels()
    logits = logits_with_ties(seed=4).to(dtype)
    radix = filtering._radix_select
    seen = []

    def counting(bucket_masses, *args):
        return radix(lambda low_bit, prefix: seen.append(low_bit) or bucket_masses(low_bit, prefix), *args)

    monkeypatch.setattr(filtering, "_radix_select", counting)
    for sampling in (SamplingDistribution(top_p=0.8), SamplingDistribution(top_k=20, top_p=0.6)):
        one_call = kept_threshold(logits, sampling, true_vocab_size=TRUE_VOCAB, kernels=chosen)
        seen.clear()
        with monkeypatch.context() as staged:
            staged.setattr(filtering, "searches_in_one_call", lambda *args: False)
            skipped = kept_threshold(logits, sampling, true_vocab_size=TRUE_VOCAB, kernels=chosen)
            assert seen == [24, 16, 8, 0][:passes]
            seen.clear()
            staged.setattr(filtering, "zero_key_bits", lambda *args: 0)
            full = kept_threshold(logits, sampling, true_vocab_size=TRUE_VOCAB, kernels=chosen)
            assert len(seen) == 4
            seen.clear()
        assert torch.equal(skipped, full) and torch.equal(one_call, skipped)
        reference = filtered_keep_mask(logits.double(), sampling.top_k, sampling.top_p)
        assert torch.equal(logits.double() >= skipped[:, None].double(), reference)


def test_a_scale_still_to_apply_keeps_every_pass():
    """z = fl32(scale * x) has no zero bits to rely on: all 4 passes, whatever the logits' dtype."""
    assert [zero_key_bits(dtype, 1.0) for dtype in (torch.bfloat16, torch.float16, torch.float32)] == [16, 13, 0]
    assert zero_key_bits(torch.bfloat16, 1 / 0.7) == zero_key_bits(torch.float64, 1.0) == 0
