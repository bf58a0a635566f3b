"""inplace_backward="exp": forward leaves exp(z - row max) in the logits buffer and backward turns it into the
gradient without an exponential. Against the float64 anchor (padded vocab, ignored rows, top-k/top-p, logit
scale, fp32/bf16/fp16, both implementations), and its guards: the version counter, the entropy gradient, what
the buffer holds, and the CUDA refusal."""

from __future__ import annotations

import pytest
import torch
from logprob_reference import make_case
from test_logprob_temperature import anchor, check

from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_logprobs
from megatron_grpo.ops.core.backends import FusedKernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_exp_mode(full, targets, true_vocab, *, implementation, scale=1.0, top_k=None, top_p=None, seed=0):
    """Logprob, entropy (returned for logging only) and gradient of sum(g_lp * logprob), with the exp mode."""
    g_lp = torch.randn(targets.shape, generator=torch.Generator().manual_seed(seed))
    x = full.clone().requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(
        x, targets, shard=VocabShard(true_vocab_size=true_vocab), with_entropy=True, implementation=implementation,
        distribution=SamplingDistribution(logit_scale=scale, top_k=top_k, top_p=top_p), inplace_backward="exp",
    )
    (torch.where(torch.isfinite(logprob), logprob, 0.0) * g_lp).sum().backward()
    return logprob.detach(), entropy.detach(), x.grad, g_lp


@pytest.mark.parametrize("implementation", ["fused", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale,top_k,top_p", [(1.0, None, None), (1 / 0.7, None, None), (1.0, 7, None),
                                               (1 / 0.7, 5, 0.6)])
def test_exp_mode_matches_the_float64_anchor(scale, top_k, top_p, dtype, implementation):
    rows, padded, true_vocab = 37, 1031, 1000  # odd widths: vector body and scalar tail
    full, targets = make_case(rows, padded, true_vocab, dtype, seed=17)
    targets[::2] = torch.where(targets[::2] >= 0, full[::2, :true_vocab].float().argmax(-1), targets[::2])
    logprob, entropy, grad, g_lp = run_exp_mode(full, targets, true_vocab, implementation=implementation,
                                                scale=scale, top_k=top_k, top_p=top_p)
    expected = anchor(full, targets, true_vocab, scale, top_k, top_p, g_lp, None)
    check(logprob, entropy, grad, expected, targets, true_vocab, dtype, f"scale={scale} top_k={top_k} top_p={top_p}",
          roundings=1 if dtype == torch.float32 else 2)
    if top_k is not None:
        assert bool((grad[:, :true_vocab][expected.grad[:, :true_vocab] == 0] == 0).all()), "filtered logits get 0"


@pytest.mark.parametrize("implementation", ["fused", "torch"])
def test_forward_leaves_exps_in_the_buffer_and_never_touches_padding_or_ignored_rows(implementation):
    rows, padded, true_vocab, scale = 9, 70, 64, 0.5
    full, targets = make_case(rows, padded, true_vocab, torch.float32, seed=2)
    x = full.clone()
    vocab_parallel_logprobs(x, targets, shard=VocabShard(true_vocab_size=true_vocab), implementation=implementation,
                            distribution=SamplingDistribution(logit_scale=scale), inplace_backward="exp")
    z = full[:, :true_vocab].double() * scale
    expected = torch.exp(z - z.amax(dim=-1, keepdim=True))
    trained = targets >= 0
    # the kernels' exp errs by up to 3 ulps (3.6e-7), after z = scale x and z - m were rounded (u (|z| + |z - m|),
    # 1.1e-6 here, |z| < 6): 2e-6 relative
    torch.testing.assert_close(x[trained, :true_vocab].double(), expected[trained], rtol=2e-6, atol=0)
    assert torch.equal(x[:, true_vocab:], full[:, true_vocab:]), "padding columns must not be written"
    assert torch.equal(x[~trained], full[~trained]), "ignored rows must not be written"


def test_whoever_saved_the_logits_fails_loudly():
    base = torch.randn(5, 40, requires_grad=True)
    logits = torch.tanh(base)  # tanh saves its output: the logits the exp mode overwrites
    logprob = vocab_parallel_logprobs(logits, torch.arange(5), inplace_backward="exp")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        logprob.sum().backward()


def test_entropy_gradient_is_refused_by_name():
    x = torch.randn(4, 30, requires_grad=True)
    logprob, entropy = vocab_parallel_logprobs(x, torch.arange(4), with_entropy=True, inplace_backward="exp")
    with pytest.raises(RuntimeError, match="inplace_backward='exp' cannot differentiate the entropy"):
        (logprob.sum() + entropy.sum()).backward()


@pytest.mark.parametrize("bad", ["grad", 1, None, "EXP"])
def test_unknown_inplace_backward_mode_is_a_named_error(bad):
    with pytest.raises(ValueError, match="inplace_backward must be False, True or 'exp'"):
        vocab_parallel_logprobs(torch.randn(2, 5), torch.arange(2), inplace_backward=bad)


def test_fused_exp_mode_is_cpu_only():
    meta = torch.empty(2, 8, device="meta")
    with pytest.raises(NotImplementedError, match="inplace_backward='exp'"):
        FusedKernels().logprob_partials_writing_exps(meta, torch.zeros(2, dtype=torch.long, device="meta"),
                                                     0, 8, False, None)
