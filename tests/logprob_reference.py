"""Float64 anchor for the logprob op tests: log_softmax over the full, unpadded vocab, written independently
of `megatron_grpo.ops` (no partials, no combine, no kernels), with autograd for the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Gradient tolerance. A gradient element d = g_lp (1[v = y] - p) + g_H p (E[x] - x) is computed in fp32 and rounded
# once into the logits' dtype (UNIT_ROUNDOFF of the element itself). The fp32 maths before that errs relative to the
# terms summed into it, not to their sum, which may cancel to about 0: p = exp(x - lse) carries the kernels' exp
# (3 ulps, 3.6e-7) and lse's rounding, E[x] errs like the entropy; MATH_RTOL = 2e-5 bounds both, relative to
# `Expected.grad_terms` (float64 maths: 1e-12). Below UNDERFLOW nothing is relative: far below fp32's and bf16's
# normal range; for fp16, values under 6.1e-5 are spaced 2^-24, so a rounding errs by 2^-25 absolute, and the exp
# mode's stored e by that times |g_lp| scale (< 8) in the gradient: 2^-21 covers both.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float64: 2.0**-53}
MATH_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5, torch.float64: 1e-12}
UNDERFLOW = {torch.float32: 1e-30, torch.bfloat16: 1e-30, torch.float16: 2.0**-21, torch.float64: 1e-300}
NO_TERMS_ATOL = 1e-6


@dataclass
class Expected:
    logprob: torch.Tensor   # float64 [T]
    entropy: torch.Tensor   # float64 [T]
    grad: torch.Tensor      # float64 [T, V_padded]; padding columns 0
    # float64 [T, V_padded]: the magnitude of the terms summed into each gradient element, |g_lp| (1[v = y] + p) +
    # |g_H| p (|x - E[x]| + max(1, H)) (E[x]'s error is like the entropy's, relative to max(1, H)); 0 where the
    # gradient is exactly 0 (padding, ignored rows, filtered logits)
    grad_terms: torch.Tensor | None = None


def expected_logprobs(
    full_logits: torch.Tensor,
    targets: torch.Tensor,
    true_vocab_size: int,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> Expected:
    """Logprob, entropy and d(sum g_lp * logprob + g_H * entropy)/d(logits), ignoring rows with target < 0."""
    return expected_filtered_logprobs(full_logits, targets, true_vocab_size, None, None, grad_logprob, grad_entropy)


def torch_fp32_logprob_error(full_logits: torch.Tensor, targets: torch.Tensor, true_vocab_size: int,
                             expected: Expected) -> float:
    """How far torch's own fp32-upcast log_softmax lands from the float64 anchor on the same input."""
    log_p = torch.log_softmax(full_logits[:, :true_vocab_size].float(), dim=-1)
    lp = log_p.gather(1, targets.clamp(min=0)[:, None]).squeeze(1).double()
    lp = torch.where(targets >= 0, lp, torch.zeros(()))
    return float((lp - expected.logprob).abs().max()) if lp.numel() else 0.0


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, roundings: int = 1,
                      terms: torch.Tensor | None = None) -> None:
    """Elementwise |actual - expected| <= roundings * (UNIT_ROUNDOFF |expected| + MATH_RTOL terms) + a floor.

    `terms`: `Expected.grad_terms`, the magnitude of what each element sums; the floor is then UNDERFLOW. Without
    them (a caller comparing two results, or elements of one term each) terms = |expected| and the floor is
    NO_TERMS_ATOL, which covers cancelling elements only up to terms of about 0.05. `roundings` = 2 where the result
    went through its dtype twice, or where two computed results are compared."""
    err = (actual.double() - expected).abs()
    floor = NO_TERMS_ATOL if terms is None else UNDERFLOW[dtype]
    terms = expected.abs() if terms is None else terms
    bound = roundings * (UNIT_ROUNDOFF[dtype] * expected.abs() + MATH_RTOL[dtype] * terms) + floor
    worst = int(torch.argmax(err - bound)) if err.numel() else 0
    assert bool((err <= bound).all()), (
        f"gradient off by {err.flatten()[worst]:.3g} at flat index {worst} (expected "
        f"{expected.flatten()[worst]:.6g} from terms of {terms.flatten()[worst]:.3g}, got "
        f"{actual.double().flatten()[worst]:.6g}, dtype {dtype})"
    )


def upstream_grads(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The upstream gradients of the logprobs and of the entropies, `[rows]` each, from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)


def make_case(rows: int, padded_vocab: int, true_vocab_size: int, dtype: torch.dtype, seed: int,
              ignore_every: int = 4, padding_value: float = 1e4) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits (scale 3) whose padding columns hold a huge value, so any leak shows; rows 1, 1+k, ... ignored."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, padded_vocab, generator=gen, dtype=torch.float64) * 3
    logits[:, true_vocab_size:] = padding_value
    targets = torch.randint(0, true_vocab_size, (rows,), generator=gen)
    if ignore_every:
        targets[1::ignore_every] = -1  # row 0 stays trained, so single-row cases test a real row
    return logits.to(dtype), targets


def filtered_keep_mask(x: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """float64 keep-mask `[T, V]` of the top-k/top-p filtered distribution, written from its definition by
    sorting (not by the op's thresholds): top-k keeps the logits >= the k-th largest; top-p then keeps a token
    iff the top-k-renormalised mass of the strictly more probable kept tokens is < p."""
    x = x.to(torch.float64)
    keep = torch.ones_like(x, dtype=torch.bool)
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
        keep &= x >= kth
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)
        ascending, order = x.sort(dim=-1)
        p_sorted = probs.gather(1, order)
        above = p_sorted.flip(-1).cumsum(-1).flip(-1) - p_sorted  # mass of the later (larger or tied) entries
        # Strictly larger only: every member of a tie group sees the mass above the group's last member.
        last_of_tie = torch.searchsorted(ascending.contiguous(), ascending.contiguous(), right=True) - 1
        strictly_above = above.gather(1, last_of_tie)
        keep_sorted = strictly_above < top_p
        keep &= torch.zeros_like(keep).scatter(1, order, keep_sorted)
    return keep


def expected_filtered_logprobs(
    full_logits: torch.Tensor,
    targets: torch.Tensor,
    true_vocab_size: int,
    top_k: int | None,
    top_p: float | None,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
) -> Expected:
    """`expected_logprobs` under the filtered distribution: logprob -inf (and no gradient) for a filtered
    target, the entropy of the filtered distribution, and gradient 0 on filtered logits."""
    keep = filtered_keep_mask(full_logits.detach().to(torch.float64)[:, :true_vocab_size], top_k, top_p)
    return expected_kept_logprobs(full_logits, targets, true_vocab_size, keep, grad_logprob, grad_entropy)


def expected_kept_logprobs(
    full_logits: torch.Tensor,
    targets: torch.Tensor,
    true_vocab_size: int,
    keep: torch.Tensor,
    grad_logprob: torch.Tensor | None = None,
    grad_entropy: torch.Tensor | None = None,
    logit_scale: float = 1.0,
) -> Expected:
    """`expected_logprobs` of `softmax(logit_scale * x)` over the tokens `keep` (bool `[T, true_vocab_size]`) marks
    in each row: a replayed kept set, or a filter's; logprob -inf (no gradient) for a target outside it."""
    x = full_logits.detach().to(torch.float64)[:, :true_vocab_size].clone().requires_grad_(True)
    log_p = torch.log_softmax((x * logit_scale).masked_fill(~keep, float("-inf")), dim=-1)
    trained = targets >= 0
    target_lp = log_p.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    logprob = torch.where(trained, target_lp, torch.zeros(()))
    p = log_p.exp()
    # p * where(...) rather than where(p > 0, p * log_p, 0): the latter's backward is 0 * log_p = NaN at -inf logits.
    finite_terms = keep & (p > 0)
    entropy = torch.where(trained, -(p * torch.where(finite_terms, log_p, torch.zeros(()))).sum(-1), torch.zeros(()))
    objective = torch.zeros((), dtype=torch.float64)
    if grad_logprob is not None:
        finite = torch.isfinite(logprob)
        objective = objective + torch.where(finite, logprob, torch.zeros(())).mul(grad_logprob.double()).sum()
    if grad_entropy is not None:
        objective = objective + (entropy * grad_entropy.to(torch.float64)).sum()
    grad = torch.zeros(full_logits.shape, dtype=torch.float64)
    terms = torch.zeros(full_logits.shape, dtype=torch.float64)
    if objective.requires_grad:
        (g,) = torch.autograd.grad(objective, x)
        grad[:, :true_vocab_size] = g
        terms[:, :true_vocab_size] = logit_scale * _gradient_terms(
            x.detach() * logit_scale, keep, targets, p.detach(), entropy.detach(), torch.isfinite(logprob.detach()),
            grad_logprob, grad_entropy)
    return Expected(logprob=logprob.detach(), entropy=entropy.detach(), grad=grad, grad_terms=terms)


def _gradient_terms(x, keep, targets, p, entropy, finite, grad_logprob, grad_entropy) -> torch.Tensor:
    """|g_lp| (1[v = y] + p) + |g_H| p (|x - E[x]| + max(1, H)) on trained rows (and the logprob part only where the
    target's logprob is finite), 0 elsewhere and on filtered logits (p = 0)."""
    trained = (targets >= 0).to(torch.float64)
    terms = torch.zeros_like(x)
    if grad_logprob is not None:
        one_hot = torch.zeros_like(x).scatter_(1, targets.clamp(min=0)[:, None], 1.0) * keep
        weight = trained * finite.to(torch.float64) * grad_logprob.double().abs()
        terms += weight[:, None] * (one_hot + p)
    if grad_entropy is not None:
        live = p > 0  # not filtered, not -inf
        live_x = x.masked_fill(~live, 0.0)
        mean_x = (p * live_x).sum(-1, keepdim=True)
        spread = (live_x - mean_x).abs() + entropy.abs().clamp(min=1.0)[:, None]
        terms += (trained * grad_entropy.double().abs())[:, None] * torch.where(live, p * spread, 0.0)
    return terms


# fp32 logprob: lse carries the exp's 3 ulps (3.6e-7) and the sums' rounding (chains of up to ~100 additions in
# the kernels' lanes and tiles, 6e-6 at worst), then one rounding of |logprob| < 16 (1e-6).
LOGPROB_ATOL_FP32 = 1e-5
ENTROPY_ATOL = 1e-5  # relative to max(1, the largest entropy): the same sums, relative to log D and S / D
# bf16/fp16 logprob: the inputs are exact in fp32, so only the fp32 maths errs, ours with the exp's 3 ulps where
# torch's upcast errs by one: at most torch's fp32-upcast error on the same input plus the fp32 tolerance.
LOW_PRECISION_MARGIN = LOGPROB_ATOL_FP32


def assert_matches_anchor(logits, targets, true_vocab, g_lp, g_h, logprob, entropy, grad, expected=None):
    """Values and gradient against the float64 anchor (all on the CPU; g_h None without entropy): fp32 logprobs to
    1e-5, bf16/fp16 ones within that of torch's fp32 upcast, entropy to 1e-5 relative, padding and ignored rows
    with exactly zero gradient, and the gradient within `assert_grad_close`'s per-dtype tolerance of its terms."""
    if expected is None:
        expected = expected_logprobs(logits, targets, true_vocab, g_lp, g_h)
    assert logprob.dtype == torch.float32
    logprob_err = float((logprob.double() - expected.logprob).abs().max())
    if logits.dtype == torch.float32:
        assert logprob_err <= LOGPROB_ATOL_FP32
    else:
        assert logprob_err <= torch_fp32_logprob_error(logits, targets, true_vocab, expected) + LOW_PRECISION_MARGIN
    if entropy is not None:
        assert entropy.dtype == torch.float32
        entropy_err = float((entropy.double() - expected.entropy).abs().max())
        assert entropy_err <= ENTROPY_ATOL * max(1.0, float(expected.entropy.abs().max()))
    assert grad.dtype == logits.dtype
    assert bool((grad[:, true_vocab:] == 0).all()), "padding columns must get exactly zero gradient"
    assert bool((grad[targets < 0] == 0).all()), "ignored rows must get exactly zero gradient"
    assert_grad_close(grad, expected.grad, logits.dtype, terms=expected.grad_terms)

