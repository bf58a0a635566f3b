"""vocab_parallel_logprobs across 2 and 4 gloo ranks against the float64 anchor on the full, unpadded vocab,
with the collective count, and against Megatron-Core's vocab_parallel_cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import counted_collectives, run_on_ranks
from logprob_reference import (
    LOGPROB_ATOL_FP32,
    LOW_PRECISION_MARGIN,
    assert_grad_close,
    expected_logprobs,
    make_case,
    torch_fp32_logprob_error,
    upstream_grads,
)

from megatron_grpo.ops import VocabShard, vocab_parallel_logprobs

# (rows, v_local, true_vocab as a function of world size); the second case leaves the last rank all padding.
SHAPES = [(257, 500, lambda world: 500 * world), (7, 3, lambda world: 3 * (world - 1) - 1),
          (1, 1000, lambda world: 1000 * world - 37)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def sharded_run(rank, world, rows, v_local, true_vocab, dtype, implementation, seed):
    """This rank's logprob, entropy and gradient shard, and the collectives counted in forward and backward."""
    full, targets = make_case(rows, v_local * world, true_vocab, dtype, seed=seed)
    g_lp, g_h = upstream_grads(rows, seed)
    local = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    with counted_collectives() as calls:
        logprob, entropy = vocab_parallel_logprobs(
            local, targets, shard=VocabShard(true_vocab_size=true_vocab, group=dist.group.WORLD), with_entropy=True,
            implementation=implementation,
        )
        forward_calls = calls["n"]
        ((logprob * g_lp).sum() + (entropy * g_h).sum()).backward()
        backward_calls = calls["n"] - forward_calls
    return logprob.detach(), entropy.detach(), local.grad, forward_calls, backward_calls


def tp_worker(rank, world, cases):
    return [sharded_run(rank, world, *case) for case in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_full_vocab_anchor(world):
    cases = [
        (rows, v_local, true_vocab(world), dtype, implementation, 100 * i + j)
        for i, (rows, v_local, true_vocab) in enumerate(SHAPES)
        for j, dtype in enumerate(DTYPES)
        for implementation in ("fused", "torch")
    ]
    per_rank = run_on_ranks(world, tp_worker, cases)
    for index, (rows, v_local, true_vocab, dtype, implementation, seed) in enumerate(cases):
        label = f"world={world} rows={rows} v_local={v_local} true_vocab={true_vocab} {dtype} {implementation}"
        full, targets = make_case(rows, v_local * world, true_vocab, dtype, seed=seed)
        g_lp, g_h = upstream_grads(rows, seed)
        expected = expected_logprobs(full, targets, true_vocab, g_lp, g_h)
        results = [per_rank[rank][index] for rank in range(world)]
        for rank, (logprob, _entropy, _, forward_calls, backward_calls) in enumerate(results):
            assert (forward_calls, backward_calls) == (1, 0), f"{label}: collectives per pass on rank {rank}"
            torch.testing.assert_close(logprob, results[0][0], atol=0, rtol=0, msg=f"{label}: ranks disagree")
        logprob, entropy = results[0][0].double(), results[0][1].double()
        bound = LOGPROB_ATOL_FP32 if dtype == torch.float32 else \
            torch_fp32_logprob_error(full, targets, true_vocab, expected) + LOW_PRECISION_MARGIN
        assert float((logprob - expected.logprob).abs().max()) <= bound, label
        assert float((entropy - expected.entropy).abs().max()) <= 1e-5 * max(1.0, float(expected.entropy.max())), label
        grad = torch.cat([r[2] for r in results], dim=1)
        assert grad.dtype == dtype
        assert bool((grad[:, true_vocab:] == 0).all()), f"{label}: padding gradient must be exactly 0"
        assert_grad_close(grad, expected.grad, dtype, terms=expected.grad_terms)


def megatron_worker(rank, world, rows, v_local, seed):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        full, targets = make_case(rows, v_local * world, v_local * world, torch.float32, seed=seed, ignore_every=0)
        shard = full[:, rank * v_local:(rank + 1) * v_local]
        ours_in = shard.clone().requires_grad_(True)
        ours = vocab_parallel_logprobs(
            ours_in, targets, shard=VocabShard(group=parallel_state.get_tensor_model_parallel_group()))
        ours.sum().backward()
        theirs_in = shard.clone().requires_grad_(True)
        theirs = -vocab_parallel_cross_entropy(theirs_in * 1, targets)
        theirs.sum().backward()
        return ours.detach(), theirs.detach(), ours_in.grad, theirs_in.grad
    finally:
        parallel_state.destroy_model_parallel()


def test_agrees_with_megatron_vocab_parallel_cross_entropy_on_unpadded_vocab():
    for ours, theirs, our_grad, their_grad in run_on_ranks(2, megatron_worker, 63, 1001, 3):
        # each within LOGPROB_ATOL_FP32 of the float64 value; the gradients, 1[v = y] - p in fp32 from both, within
        # the per-element tolerance of two fp32 computations (ours with the exp's 3 ulps, Megatron's with torch's)
        torch.testing.assert_close(ours, theirs, atol=2 * LOGPROB_ATOL_FP32, rtol=0)
        assert_grad_close(our_grad, their_grad.double(), torch.float32, roundings=2)
