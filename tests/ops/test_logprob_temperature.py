"""vocab_parallel_logprobs with a `SamplingDistribution`'s `logit_scale` (1 / temperature) against the float64 anchor
of softmax(scale * x), on one rank and on 2 gloo ranks: padded vocab, ignored rows, entropy, top-k/top-p on the
tempered distribution, both implementations, fp32 and bf16. The anchor's gradient is d/dx = scale * d/dz (chain rule,
by autograd). The one-rank cases run on every device (conftest's `device`: the cpu case, and the cuda case marked
`gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_on_ranks
from logprob_reference import assert_grad_close, expected_filtered_logprobs, filtered_keep_mask, make_case

from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_logprobs

SCALES = [1 / 0.7, 0.4]  # temperature 0.7 (sharper) and 2.5 (flatter)
DTYPES = [torch.float32, torch.bfloat16]
LOGPROB_ATOL = 2e-5  # inputs are exact in their dtype, so only the fp32 maths differs from the anchor
ENTROPY_ATOL = 1e-5


def anchor(full: torch.Tensor, targets: torch.Tensor, true_vocab: int, scale: float, top_k, top_p, g_lp, g_h):
    """Float64 logprob, entropy and d/dx of softmax(scale * x), written with torch's own autograd."""
    x = full.double().requires_grad_(True)
    z = x * scale
    expected = expected_filtered_logprobs(z.detach(), targets, true_vocab, top_k, top_p, g_lp, g_h)
    (grad,) = torch.autograd.grad(z, x, expected.grad)  # = scale * dL/dz
    expected.grad, expected.grad_terms = grad, expected.grad_terms * scale
    return expected


def check(logprob, entropy, grad, expected, targets, true_vocab, dtype, label="", roundings=1):
    """Against the anchor; `roundings` = 2 for inplace_backward="exp", whose e = exp(z - m) is stored (and so
    rounded) in the logits' dtype before the gradient is rounded again."""
    filtered = expected.logprob == float("-inf")
    assert torch.equal(logprob.double() == float("-inf"), filtered), f"{label}: filtered targets differ"
    error = (logprob.double()[~filtered] - expected.logprob[~filtered]).abs()
    assert (float(error.max()) if error.numel() else 0.0) <= LOGPROB_ATOL, f"{label}: logprob off by {error.max()}"
    if entropy is not None:
        entropy_error = float((entropy.double() - expected.entropy).abs().max())
        assert entropy_error <= ENTROPY_ATOL * max(1.0, float(expected.entropy.abs().max())), label
    assert grad.dtype == dtype
    assert bool((grad[:, true_vocab:] == 0).all()), f"{label}: padding must get exactly zero gradient"
    assert bool((grad[targets < 0] == 0).all()), f"{label}: ignored rows must get exactly zero gradient"
    assert_grad_close(grad, expected.grad, dtype, roundings, terms=expected.grad_terms)


def run(full, targets, true_vocab, scale, *, implementation, device, top_k=None, top_p=None,
        inplace_backward=False, seed=0):
    """Forward and backward on `device` of CPU-built inputs; (logprob, entropy, grad) on the CPU, and the
    upstream gradients."""
    gen = torch.Generator().manual_seed(seed)
    g_lp, g_h = torch.randn(targets.shape, generator=gen), torch.randn(targets.shape, generator=gen)
    x = full.to(device, copy=True).requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(
        x, targets.to(device), shard=VocabShard(true_vocab_size=true_vocab), with_entropy=True,
        implementation=implementation, distribution=SamplingDistribution(logit_scale=scale, top_k=top_k, top_p=top_p),
        inplace_backward=inplace_backward,
    )
    finite = torch.isfinite(logprob)
    ((torch.where(finite, logprob, 0.0) * g_lp.to(device)).sum() + (entropy * g_h.to(device)).sum()).backward()
    return logprob.detach().cpu(), entropy.detach().cpu(), x.grad.cpu(), g_lp, g_h


@pytest.mark.parametrize("implementation", ["fused", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("rows,padded,true_vocab", [(7, 1000, 990), (33, 4099, 4000)])
def test_scaled_logits_match_the_float64_anchor(rows, padded, true_vocab, scale, dtype, implementation, device):
    full, targets = make_case(rows, padded, true_vocab, dtype, seed=rows + padded)
    logprob, entropy, grad, g_lp, g_h = run(full, targets, true_vocab, scale, implementation=implementation,
                                            device=device)
    check(logprob, entropy, grad, anchor(full, targets, true_vocab, scale, None, None, g_lp, g_h), targets,
          true_vocab, dtype)


@pytest.mark.parametrize("inplace_backward", [False, True])
def test_scale_one_is_the_unscaled_op_bit_for_bit(inplace_backward, device):
    full, targets = make_case(9, 515, 500, torch.float32, seed=3)
    plain = run(full, targets, 500, 1.0, implementation="fused", device=device, inplace_backward=inplace_backward)
    unscaled = vocab_parallel_logprobs(full.to(device), targets.to(device), shard=VocabShard(true_vocab_size=500),
                                       implementation="fused")
    assert torch.equal(plain[0], unscaled.cpu())


@pytest.mark.parametrize("implementation", ["fused", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("top_k,top_p", [(7, None), (None, 0.9), (5, 0.6)])
def test_top_k_top_p_select_on_the_tempered_distribution(top_k, top_p, dtype, implementation, device):
    rows, padded, true_vocab, scale = 37, 131, 120, 1 / 0.7
    full, targets = make_case(rows, padded, true_vocab, dtype, seed=11)
    targets[::2] = torch.where(targets[::2] >= 0, full[::2, :true_vocab].float().argmax(-1), targets[::2])
    logprob, entropy, grad, g_lp, g_h = run(full, targets, true_vocab, scale, implementation=implementation,
                                            device=device, top_k=top_k, top_p=top_p)
    expected = anchor(full, targets, true_vocab, scale, top_k, top_p, g_lp, g_h)
    check(logprob, entropy, grad, expected, targets, true_vocab, dtype, f"top_k={top_k} top_p={top_p}")
    if top_p is not None:  # the temperature changes which tokens top-p keeps
        z = full[:, :true_vocab].double()
        assert not torch.equal(filtered_keep_mask(z, top_k, top_p), filtered_keep_mask(z * scale, top_k, top_p))


def tp_worker(rank, world, cases):
    out = []
    for rows, v_local, true_vocab, dtype, implementation, scale, top_k, top_p, inplace, seed in cases:
        full, targets = make_case(rows, v_local * world, true_vocab, dtype, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        g_lp, g_h = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
        local = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
        with_entropy = inplace != "exp"
        out_ = vocab_parallel_logprobs(local, targets,
                                       shard=VocabShard(true_vocab_size=true_vocab, group=dist.group.WORLD),
                                       with_entropy=with_entropy, implementation=implementation,
                                       distribution=SamplingDistribution(logit_scale=scale, top_k=top_k, top_p=top_p),
                                       inplace_backward=inplace)
        logprob, entropy = out_ if with_entropy else (out_, None)
        objective = (torch.where(torch.isfinite(logprob), logprob, 0.0) * g_lp).sum()
        if entropy is not None:
            objective = objective + (entropy * g_h).sum()
        objective.backward()
        out.append((logprob.detach(), None if entropy is None else entropy.detach(), local.grad))
    return out


def test_tensor_parallel_two_ranks_with_temperature():
    world, v_local = 2, 300
    cases = [
        (65, v_local, 2 * v_local - 37, dtype, implementation, 1 / 0.7, top_k, top_p, inplace, seed)
        for seed, (dtype, implementation, top_k, top_p, inplace) in enumerate([
            (torch.float32, "fused", None, None, False), (torch.bfloat16, "fused", 9, None, False),
            (torch.float32, "fused", None, 0.8, False), (torch.float32, "torch", 9, 0.8, False),
            (torch.float32, "fused", None, 0.8, "exp"), (torch.bfloat16, "fused", None, None, "exp"),
        ])
    ]
    per_rank = run_on_ranks(world, tp_worker, cases)
    for index, (rows, v_local, true_vocab, dtype, implementation, scale, top_k, top_p, inplace,
                seed) in enumerate(cases):
        label = f"{dtype} {implementation} top_k={top_k} top_p={top_p} inplace={inplace}"
        full, targets = make_case(rows, v_local * world, true_vocab, dtype, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        g_lp, g_h = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
        with_entropy = inplace != "exp"
        expected = anchor(full, targets, true_vocab, scale, top_k, top_p, g_lp, g_h if with_entropy else None)
        grad = torch.cat([per_rank[rank][index][2] for rank in range(world)], dim=1)
        for rank in range(world):
            logprob, entropy, _ = per_rank[rank][index]
            check(logprob, entropy, grad, expected, targets, true_vocab, dtype, f"rank {rank} {label}",
                  roundings=2 if inplace == "exp" else 1)
