"""vocab_parallel_logprobs with top_k / top_p against an independent float64 reference of the filtered
distribution (tests/logprob_reference.py sorts; the op uses thresholds), on one rank and on 2 and 4 gloo ranks,
with padding, ties, ignored targets, k = 1, k >= V, p = 1 and odd shapes; plus the gradient buffer's
alignment and the op's argument errors (the distribution's own are in test_sampling_distribution.py). The one-rank
cases that hold on any device run on every device (conftest's `device`: the cpu case, and the cuda case marked
`gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import counted_collectives, run_on_ranks
from logprob_reference import (
    assert_grad_close,
    expected_filtered_logprobs,
    expected_logprobs,
    make_case,
    upstream_grads,
)

from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_logprobs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (top_k, top_p): k = 1 (greedy), k in the middle, k >= V, p = 1 (no filter), p alone, both.
FILTERS = [(1, None), (7, None), (10_000, None), (None, 1.0), (None, 0.9), (None, 0.3), (5, 0.6), (10_000, 0.95)]


def tied_case(rows: int, padded_vocab: int, true_vocab: int, dtype: torch.dtype, seed: int):
    """Logits on a coarse grid (many exact ties, also at the top-k and top-p boundaries), huge padding values,
    every fourth row ignored, and half the targets on the row's largest logit so that kept targets occur."""
    logits, targets = make_case(rows, padded_vocab, true_vocab, torch.float64, seed=seed)
    logits[:, :true_vocab] = (logits[:, :true_vocab] * 2).round() / 4  # multiples of 0.25: exact in every dtype
    best = logits[:, :true_vocab].argmax(dim=-1)
    targets[::2] = torch.where(targets[::2] >= 0, best[::2], targets[::2])
    return logits.to(dtype), targets


def check_against_reference(logprob, entropy, grad, full, targets, true_vocab, top_k, top_p, dtype, label):
    g_lp, g_h = upstream_grads(full.shape[0], 1)
    expected = expected_filtered_logprobs(full, targets, true_vocab, top_k, top_p, g_lp, g_h)
    logprob, entropy = logprob.double().cpu(), entropy.double().cpu()
    filtered = expected.logprob == float("-inf")
    assert torch.equal(logprob == float("-inf"), filtered), f"{label}: filtered targets differ"
    finite = ~filtered
    error = (logprob[finite] - expected.logprob[finite]).abs()
    assert (float(error.max()) if error.numel() else 0.0) <= 2e-5, label
    assert float((entropy - expected.entropy).abs().max()) <= 1e-5 * max(1.0, float(expected.entropy.max())), label
    assert bool((grad[:, true_vocab:] == 0).all()), f"{label}: padding gradient must be exactly 0"
    assert_grad_close(grad.cpu(), expected.grad, dtype, terms=expected.grad_terms)
    return expected


@pytest.mark.parametrize("implementation", ["fused", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_filtered_logprobs_match_the_float64_reference(device, implementation, dtype):
    rows, padded, true_vocab = 37, 131, 120
    full, targets = tied_case(rows, padded, true_vocab, dtype, seed=5)
    g_lp, g_h = upstream_grads(rows, 1)
    for top_k, top_p in FILTERS:
        label = f"{device} {implementation} {dtype} top_k={top_k} top_p={top_p}"
        x = full.clone().to(device).requires_grad_(True)
        logprob, entropy = vocab_parallel_logprobs(
            x, targets.to(device), shard=VocabShard(true_vocab_size=true_vocab), with_entropy=True,
            distribution=SamplingDistribution(top_k=top_k, top_p=top_p),
            implementation=implementation,
        )
        objective = torch.where(torch.isfinite(logprob), logprob, 0.0) * g_lp.to(device) + entropy * g_h.to(device)
        objective.sum().backward()
        expected = check_against_reference(logprob.detach(), entropy.detach(), x.grad, full, targets, true_vocab,
                                           top_k, top_p, dtype, label)
        if top_k == 1:  # greedy: every kept target has probability 1, and the entropy is that of the tie
            assert bool((expected.logprob[expected.logprob > float("-inf")] <= 0).all())
        if (top_k is None or top_k >= true_vocab) and (top_p is None or top_p == 1.0):
            unfiltered = expected_logprobs(full, targets, true_vocab)
            torch.testing.assert_close(expected.logprob, unfiltered.logprob)


def test_float64_logits_on_the_reference_path(device):
    """float64 logits select their top-p threshold over 64-bit patterns (8 radix passes)."""
    full, targets = tied_case(29, 70, 64, torch.float64, seed=9)
    full[:, :64] += torch.randn(29, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 1e-9
    g_lp, g_h = upstream_grads(29, 1)
    for top_k, top_p in [(None, 0.7), (9, 0.5), (1, None)]:
        x = full.to(device, copy=True).requires_grad_(True)
        logprob, entropy = vocab_parallel_logprobs(x, targets.to(device), shard=VocabShard(true_vocab_size=64),
                                                   with_entropy=True,
                                                   distribution=SamplingDistribution(top_k=top_k, top_p=top_p),
                                                   implementation="torch")
        objective = torch.where(torch.isfinite(logprob), logprob, 0.0) * g_lp.to(device) + entropy * g_h.to(device)
        objective.sum().backward()
        check_against_reference(logprob.detach(), entropy.detach(), x.grad.cpu(), full, targets, 64, top_k, top_p,
                                torch.float64, f"{device} float64 top_k={top_k} top_p={top_p}")


@pytest.mark.parametrize("implementation", ["fused", "torch"])
def test_a_nan_logit_poisons_its_own_row_only_under_a_filter(implementation, device):
    full, targets = make_case(6, 20, 20, torch.float32, seed=3, ignore_every=0)
    full[2, 5] = float("nan")
    for top_k, top_p in [(4, None), (None, 0.8), (3, 0.9)]:
        logprob = vocab_parallel_logprobs(full.to(device), targets.to(device),
                                          distribution=SamplingDistribution(top_k=top_k, top_p=top_p),
                                          implementation=implementation).cpu()
        assert bool(torch.isnan(logprob[2])), (top_k, top_p)
        expected = expected_filtered_logprobs(full[[0, 1, 3, 4, 5]], targets[[0, 1, 3, 4, 5]], 20, top_k, top_p)
        torch.testing.assert_close(logprob[[0, 1, 3, 4, 5]].double(), expected.logprob, atol=2e-5, rtol=0)


def test_filters_that_keep_everything_take_the_unfiltered_path_bit_for_bit(device):
    full, targets = make_case(9, 40, 33, torch.float32, seed=2)
    full, targets = full.to(device), targets.to(device)
    plain = vocab_parallel_logprobs(full, targets, shard=VocabShard(true_vocab_size=33), with_entropy=True)
    for top_k, top_p in [(33, None), (None, 1.0), (10**6, 1.0)]:
        same = vocab_parallel_logprobs(full, targets, shard=VocabShard(true_vocab_size=33), with_entropy=True,
                                       distribution=SamplingDistribution(top_k=top_k, top_p=top_p))
        assert all(torch.equal(a, b) for a, b in zip(plain, same))


def test_filtered_targets_are_counted_per_rule():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])

    def kept(distribution: SamplingDistribution) -> list[bool]:
        return [bool(vocab_parallel_logprobs(logits, torch.tensor([t]), distribution=distribution) > float("-inf"))
                for t in range(5)]

    # top-k = 2: the tie with the 2nd largest stays, so 3 tokens are kept.
    assert kept(SamplingDistribution(top_k=2)) == [True, True, True, False, False]
    # top-p: p(3.0) = 0.53 < 0.6, so the tied 2.0s join (the mass strictly above each is 0.53 < 0.6), whole.
    assert kept(SamplingDistribution(top_p=0.6)) == [True, True, True, False, False]
    assert kept(SamplingDistribution(top_p=0.5)) == [True, False, False, False, False]


def sharded_filtered_run(rank, world, rows, v_local, true_vocab, dtype, top_k, top_p, implementation, seed):
    full, targets = tied_case(rows, v_local * world, true_vocab, dtype, seed)
    g_lp, g_h = upstream_grads(rows, 1)
    local = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
    with counted_collectives() as calls:
        logprob, entropy = vocab_parallel_logprobs(
            local, targets, shard=VocabShard(true_vocab_size=true_vocab, group=dist.group.WORLD), with_entropy=True,
            distribution=SamplingDistribution(top_k=top_k, top_p=top_p), implementation=implementation,
        )
        forward_calls = calls["n"]
        (torch.where(torch.isfinite(logprob), logprob, 0.0) * g_lp + entropy * g_h).sum().backward()
        backward_calls = calls["n"] - forward_calls
    return logprob.detach(), entropy.detach(), local.grad, forward_calls, backward_calls


def filtered_tp_worker(rank, world, cases):
    return [sharded_filtered_run(rank, world, *case) for case in cases]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_filtered_logprobs_match_the_float64_reference(world):
    # (rows, v_local, true_vocab); the second shape leaves the last rank with padding only.
    shapes = [(23, 40, 40 * world - 9), (5, 6, 6 * (world - 1) - 1)]
    cases = [
        (rows, v_local, true_vocab, dtype, top_k, top_p, implementation, 10 * i + j)
        for i, (rows, v_local, true_vocab) in enumerate(shapes)
        for j, (dtype, implementation) in enumerate([(torch.float32, "fused"), (torch.bfloat16, "fused"),
                                                     (torch.float32, "torch")])
        for top_k, top_p in [(1, None), (7, None), (10_000, None), (None, 1.0), (None, 0.8), (4, 0.7)]
    ]
    per_rank = run_on_ranks(world, filtered_tp_worker, cases)
    for index, (rows, v_local, true_vocab, dtype, top_k, top_p, implementation, seed) in enumerate(cases):
        label = f"world={world} rows={rows} v_local={v_local} {dtype} {implementation} top_k={top_k} top_p={top_p}"
        results = [per_rank[rank][index] for rank in range(world)]
        for logprob, _entropy, _, forward_calls, backward_calls in results:
            torch.testing.assert_close(logprob, results[0][0], atol=0, rtol=0, msg=f"{label}: ranks disagree")
            assert backward_calls == 0, label
            uses_k = top_k is not None and top_k < true_vocab
            uses_p = top_p is not None and top_p < 1.0
            # The partials' all-gather; one all-gather of [rows, k] for top-k; for top-p, one all-reduce of the
            # row max, then (one piece of rows here) one of the masses by distance below the max and one per radix
            # pass (4 passes for fp32 logits, 2 for bf16 ones, whose keys' low 16 bits are 0).
            passes = 2 if dtype == torch.bfloat16 else 4
            expected_calls = 1 + uses_k + (1 + 1 + passes) * uses_p
            assert forward_calls == expected_calls, f"{label}: {forward_calls} collectives"
        full, targets = tied_case(rows, v_local * world, true_vocab, dtype, seed)
        grad = torch.cat([r[2] for r in results], dim=1)
        check_against_reference(results[0][0], results[0][1], grad, full, targets, true_vocab, top_k, top_p, dtype,
                                label)


def test_gradient_of_sliced_logits_has_the_logits_alignment():
    """A view at an odd offset with a padded row stride gets a gradient aligned like it, row by row (so the
    kernels' vector path is taken), not a fresh 64-byte-aligned buffer."""
    base = torch.randn(12, 70)
    for dtype in DTYPES:
        source = base.detach().to(dtype).requires_grad_(True)
        sliced = source[:, 3:68]  # offset 3 elements, row stride 70 > 65 columns
        captured = []
        sliced.register_hook(captured.append)
        targets = torch.randint(0, 65, (12,))
        vocab_parallel_logprobs(sliced, targets).sum().backward()
        (grad,) = captured
        assert grad.shape == sliced.shape
        for row in range(12):
            assert grad[row].data_ptr() % 16 == sliced[row].data_ptr() % 16, (dtype, row)
        expected = expected_logprobs(sliced.detach(), targets, 65, torch.ones(12))
        assert_grad_close(grad, expected.grad, dtype, terms=expected.grad_terms)


def test_unknown_implementation_is_a_named_error():
    logits, targets = torch.randn(3, 5), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"implementation must be one of 'auto', 'fused', 'torch', got 'bogus'"):
        vocab_parallel_logprobs(logits, targets, implementation="bogus")


def test_clipped_pg_loss_trains_the_filtered_policy_and_takes_the_kl_unfiltered():
    """With a sampling filter, the ratio uses filtered current logprobs, and the KL to the (unfiltered)
    reference uses unfiltered ones, as NeMo-RL's loss does."""
    from _loss_inputs import batch_for_logits, loss_config

    from megatron_grpo.loss import ClippedPGLoss

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 6, 9, generator=gen) * 2
    batch = batch_for_logits(logits, 9, seed=5)
    batch["input_ids"][:, 1:] = logits[:, :-1].argmax(dim=-1)  # every trained token survives top-k = 3
    loss_fn = ClippedPGLoss(loss_config(reference_policy_kl_penalty=0.1))
    counts = {"global_valid_tokens": 10.0, "global_valid_seqs": 3.0}
    _, plain = loss_fn(logits, batch, **counts)
    _, filtered = loss_fn(logits, batch, **counts, distribution=SamplingDistribution(top_k=3))
    assert float(filtered["kl_penalty"]) == pytest.approx(float(plain["kl_penalty"]), rel=1e-6)
    assert float(filtered["probs_ratio"]) > float(plain["probs_ratio"])  # filtered logprobs are larger


def chunk_threshold_worker(rank, world, rows, true_vocab, v_local, chunk_rows):
    """Top-p's threshold over a fused path's chunk (`chunk_rows` given: the search cut into pieces) on this rank's
    valid columns; the last rank holds padding only."""
    from megatron_grpo.ops.core.filtering import kept_threshold

    full = torch.randn(rows, true_vocab, generator=torch.Generator().manual_seed(3))
    valid = full[:, rank * v_local:min((rank + 1) * v_local, true_vocab)]
    return kept_threshold(valid, SamplingDistribution(top_k=5, top_p=0.8), true_vocab_size=true_vocab,
                          group=dist.group.WORLD, chunk_rows=chunk_rows)


def test_a_rank_holding_only_padding_searches_top_p_in_the_others_pieces():
    """The fused kernels search no empty shard: that rank runs the plain-torch search, cut into the same pieces as
    the others' (different pieces would mean different collectives: gloo aborts, NCCL hangs). The threshold is the
    one-rank threshold, exactly (a logit of the row)."""
    from megatron_grpo.ops.core.filtering import kept_threshold

    rows, true_vocab, v_local, chunk_rows = 64, 6, 6, 64
    per_rank = run_on_ranks(2, chunk_threshold_worker, rows, true_vocab, v_local, chunk_rows)
    full = torch.randn(rows, true_vocab, generator=torch.Generator().manual_seed(3))
    one_rank = kept_threshold(full, SamplingDistribution(top_k=5, top_p=0.8), true_vocab_size=true_vocab,
                              chunk_rows=chunk_rows)
    for threshold in per_rank:
        assert torch.equal(threshold, one_rank)
