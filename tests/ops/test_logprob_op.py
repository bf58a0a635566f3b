"""vocab_parallel_logprobs on one rank (TP shards emulated with vocab_start_index) against the float64 anchor.

Every case that holds on any device runs on the CPU and, where CUDA is present, on the GPU (conftest's `device`;
the cuda cases are marked `gpu`). Inputs are built on the CPU, run on the device, and compared on the CPU.
GPU-only cases (split rows, launch boundaries, streams, production shapes) are in test_gpu_kernels.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from logprob_reference import (
    ENTROPY_ATOL,
    LOGPROB_ATOL_FP32,
    assert_grad_close,
    assert_matches_anchor,
    expected_logprobs,
    make_case,
)

from megatron_grpo.ops import VocabShard, extension_status, vocab_parallel_logprobs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IMPLEMENTATIONS = ["fused", "torch"]
# Odd shapes; the 50257-wide vocab runs with fewer rows to keep the float64 anchor cheap.
SHAPES = [(t, v) for t, v in itertools.product([1, 7, 257], [1, 3, 1000])] + [(1, 50257), (7, 50257), (65, 50257)]


def test_fused_kernels_are_built():
    loaded, reason = extension_status()
    assert loaded, reason


def run_op(logits, targets, implementation, device="cpu", *, with_entropy=True, seed=0, **kwargs):
    """Op output and gradient on `device` for random upstream gradients on both outputs; results on the CPU.

    `logits` is used as laid out when already on `device` (strides, offsets), else copied there."""
    gen = torch.Generator().manual_seed(seed)
    g_lp = torch.randn(targets.shape, generator=gen)
    g_h = torch.randn(targets.shape, generator=gen)
    x = (logits.clone() if logits.device.type == device else logits.to(device)).requires_grad_(True)
    out = vocab_parallel_logprobs(x, targets.to(device), with_entropy=with_entropy, implementation=implementation,
                                  **kwargs)
    logprob, entropy = out if with_entropy else (out, None)
    objective = (logprob * g_lp.to(device)).sum() + ((entropy * g_h.to(device)).sum() if with_entropy else 0)
    objective.backward()
    entropy = None if entropy is None else entropy.detach().cpu()
    return logprob.detach().cpu(), entropy, x.grad.cpu(), g_lp, (g_h if with_entropy else None)



@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_matches_float64_anchor(rows, vocab, dtype, implementation, device):
    true_vocab = max(1, vocab - vocab // 7)  # a padded tail whenever vocab > 1
    logits, targets = make_case(rows, vocab, true_vocab, dtype, seed=rows * 1000 + vocab)
    logprob, entropy, grad, g_lp, g_h = run_op(
        logits, targets, implementation, device, shard=VocabShard(true_vocab_size=true_vocab), seed=rows
    )
    assert_matches_anchor(logits, targets, true_vocab, g_lp, g_h, logprob, entropy, grad)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_shard_at_an_offset_normalises_over_its_own_real_columns(implementation, device):
    """Without a group, a shard at vocab_start_index is its own softmax: owned targets finite, others -inf."""
    rows, v_local, start, true_vocab = 33, 7, 14, 19  # global ids 14..20, of which 19 and 20 are padding
    logits, targets = make_case(rows, v_local, v_local, torch.float32, seed=5, ignore_every=0)
    targets = torch.randint(0, true_vocab, (rows,), generator=torch.Generator().manual_seed(1))
    logprob = vocab_parallel_logprobs(
        logits.to(device), targets.to(device), shard=VocabShard(start_index=start, true_vocab_size=true_vocab),
        implementation=implementation,
    ).cpu()
    owned = (targets >= start) & (targets < true_vocab)
    assert bool(owned.any()) and bool((~owned).any())
    local = torch.log_softmax(logits[:, : true_vocab - start].double(), dim=-1)
    expected = local.gather(1, (targets - start).clamp(0, true_vocab - start - 1)[:, None]).squeeze(1)
    torch.testing.assert_close(logprob[owned].double(), expected[owned], atol=LOGPROB_ATOL_FP32, rtol=0)
    assert bool((logprob[~owned] == float("-inf")).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shard_at_an_offset_gradient(dtype, device):
    """A shard at vocab_start_index with a padded tail: owned targets match the anchor over the shard's own
    real columns; a target on another shard has logprob -inf and local gradient -g_lp * p."""
    rows, v_local, vocab_start, true_vocab = 9, 1000, 3000, 3937
    valid = true_vocab - vocab_start
    logits, local_targets = make_case(rows, v_local, valid, dtype, seed=21, ignore_every=0)
    foreign = torch.arange(rows) % 3 == 0
    targets = torch.where(foreign, torch.arange(rows) * 100, local_targets + vocab_start)
    targets[4] = -1
    logprob, _, grad, g_lp, _ = run_op(logits, targets, "fused", device, with_entropy=False, seed=22,
                                       shard=VocabShard(start_index=vocab_start, true_vocab_size=true_vocab))
    assert bool((logprob[foreign] == float("-inf")).all())
    owned = ~foreign
    anchor_targets = torch.where(targets >= 0, targets - vocab_start, -1)
    assert_matches_anchor(logits[owned], anchor_targets[owned], valid, g_lp[owned], None, logprob[owned], None,
                          grad[owned])
    p = torch.softmax(logits[foreign, :valid].double(), dim=-1)
    assert_grad_close(grad[foreign, :valid], -g_lp[foreign, None].double() * p, dtype,
                      terms=(g_lp[foreign, None].double() * p).abs())  # one term per element
    assert bool((grad[:, valid:] == 0).all())


def test_float64_gradcheck_with_padding_ignored_rows_and_entropy(device):
    logits, targets = make_case(5, 6, 4, torch.float64, seed=3, ignore_every=3, padding_value=0.5)
    x = logits.to(device).requires_grad_(True)
    targets = targets.to(device)

    def both(x):
        logprob, entropy = vocab_parallel_logprobs(x, targets, shard=VocabShard(true_vocab_size=4), with_entropy=True)
        return logprob, entropy

    assert torch.autograd.gradcheck(both, (x,), eps=1e-6, atol=1e-8)
    owned_targets = torch.where(targets >= 0, targets + 2, targets)  # ids 2..5: all in the shard at offset 2
    assert torch.autograd.gradcheck(
        lambda x: vocab_parallel_logprobs(x, owned_targets, shard=VocabShard(start_index=2, true_vocab_size=6)), (x,)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_and_reference_agree(dtype, device):
    logits, targets = make_case(129, 2053, 2000, dtype, seed=11)
    fused = run_op(logits, targets, "fused", device, shard=VocabShard(true_vocab_size=2000))
    ref = run_op(logits, targets, "torch", device, shard=VocabShard(true_vocab_size=2000))
    # each within the anchor's tolerances (logprob_reference), so within twice them of each other
    torch.testing.assert_close(fused[0], ref[0], atol=2 * LOGPROB_ATOL_FP32, rtol=0)
    terms = expected_logprobs(logits, targets, 2000, fused[3], fused[4]).grad_terms
    torch.testing.assert_close(fused[1], ref[1], atol=2 * ENTROPY_ATOL * max(1.0, float(ref[1].abs().max())), rtol=0)
    assert_grad_close(fused[2], ref[2].double(), dtype, roundings=2, terms=terms)  # both sides rounded into dtype


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_inplace_backward_gives_the_same_gradient(implementation, device):
    logits, targets = make_case(65, 1000, 990, torch.bfloat16, seed=2)
    targets = targets.to(device)
    grads = []
    for inplace in (False, True):
        base = logits.to(device).requires_grad_(True)
        x = base * 1  # a non-leaf buffer the op may overwrite
        logprob, entropy = vocab_parallel_logprobs(
            x, targets, shard=VocabShard(true_vocab_size=990), with_entropy=True, inplace_backward=inplace,
            implementation=implementation,
        )
        (logprob.sum() - 0.3 * entropy.sum()).backward()
        grads.append(base.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)


def test_inplace_backward_fails_loudly_when_logits_are_still_needed(device):
    """x * x saves x for its own backward; if the op overwrites x first, autograd must refuse, not corrupt."""
    logits, targets = make_case(9, 31, 31, torch.float32, seed=4)
    base = logits.to(device).requires_grad_(True)
    x = base * 1
    squares = (x * x).sum()  # recorded before the op, so its backward runs after the op's
    logprob = vocab_parallel_logprobs(x, targets.to(device), inplace_backward=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (squares + logprob.sum()).backward()


def test_inplace_backward_is_exact_when_other_users_of_the_logits_ran_first(device):
    logits, targets = make_case(9, 31, 31, torch.float32, seed=4)
    grads = []
    for inplace in (False, True):
        base = logits.to(device).requires_grad_(True)
        x = base * 1
        logprob = vocab_parallel_logprobs(x, targets.to(device), inplace_backward=inplace)
        ((x * x).sum() + logprob.sum()).backward()  # x * x is recorded later, so its backward runs first
        grads.append(base.grad.cpu())
    torch.testing.assert_close(grads[0], grads[1], atol=0, rtol=0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_input_logits_are_never_written(implementation, device):
    logits, targets = make_case(17, 300, 280, torch.float32, seed=6)
    x = logits.to(device).requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(
        x, targets.to(device), shard=VocabShard(true_vocab_size=280), with_entropy=True, implementation=implementation
    )
    (logprob.sum() + entropy.sum()).backward()
    assert torch.equal(x.detach().cpu(), logits)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_padding_only_shard_is_legal_and_finite(implementation, device):
    logits, targets = make_case(8, 5, 5, torch.float32, seed=7, ignore_every=0)
    x = logits.to(device).requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(
        x, (targets + 100).to(device), shard=VocabShard(start_index=200, true_vocab_size=150), with_entropy=True,
        implementation=implementation,
    )
    # Alone, a shard without real vocab has an empty softmax; what matters is that it adds nothing and no NaN.
    (torch.nan_to_num(logprob, neginf=0.0).sum() + torch.nan_to_num(entropy, neginf=0.0).sum()).backward()
    assert not bool(torch.isnan(x.grad).any())
    assert bool((x.grad == 0).all())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_logits_are_masked_tokens(dtype, implementation, device):
    """-inf (top-k/top-p masking) is legal and contributes nothing; no NaN anywhere."""
    rows, cols = 257, 1001  # an odd width puts most rows off a 16-byte boundary: column 0 is in a scalar head
    logits, targets = make_case(rows, cols, cols, dtype, seed=51)
    mask = torch.rand(rows, cols, generator=torch.Generator().manual_seed(52)) < 0.3
    mask[:, 0] = True
    live = torch.nonzero(targets >= 0).squeeze(1)
    mask[live, targets[live]] = False  # targets stay unmasked
    logits = logits.masked_fill(mask, float("-inf"))
    logprob, entropy, grad, g_lp, g_h = run_op(logits, targets, implementation, device, seed=53)
    assert bool(torch.isfinite(logprob).all() and torch.isfinite(entropy).all() and torch.isfinite(grad).all())
    assert_matches_anchor(logits, targets, cols, g_lp, g_h, logprob, entropy, grad)
    assert bool((grad[mask] == 0).all())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_or_inf_poisons_only_its_own_row(implementation, poison, device):
    logits, targets = make_case(40, 700, 700, torch.float32, seed=9, ignore_every=0)
    bad = logits.clone()
    bad[3, 517] = poison
    logprob, entropy, grad, *_ = run_op(bad, targets, implementation, device)
    clean, clean_entropy, clean_grad, *_ = run_op(logits, targets, implementation, device)
    assert bool(torch.isnan(logprob[3])) and bool(torch.isnan(entropy[3]))
    others = torch.arange(40) != 3
    torch.testing.assert_close(logprob[others], clean[others], atol=0, rtol=0)
    torch.testing.assert_close(entropy[others], clean_entropy[others], atol=0, rtol=0)
    torch.testing.assert_close(grad[others], clean_grad[others], atol=0, rtol=0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_non_contiguous_and_batched_inputs(implementation, device):
    logits, targets = make_case(2 * 9, 401, 401, torch.float32, seed=10)
    wide = torch.cat([torch.zeros(18, 3), logits, torch.zeros(18, 2)], dim=1).to(device)
    strided = wide[:, 3:404]  # rows start mid-buffer: unaligned, stride 406
    assert not strided.is_contiguous()
    batched = strided.reshape(2, 9, 401)
    out = vocab_parallel_logprobs(batched, targets.reshape(2, 9).to(device), implementation=implementation)
    transposed = logits.to(device).reshape(9, 2, 401).transpose(0, 1)  # non-contiguous in the batch dims
    out_t = vocab_parallel_logprobs(transposed, targets.reshape(9, 2).t().to(device), implementation=implementation)
    expected = expected_logprobs(logits, targets, 401).logprob
    torch.testing.assert_close(out.cpu().reshape(-1).double(), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(out_t.cpu().t().reshape(-1).double(), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_vocab_dim_with_gradient(dtype, device):
    """[B, S, V] logits whose vocab dim is strided (a permuted [V, S, B] buffer): values and gradient."""
    batch, seq, cols = 3, 5, 1000
    logits, targets = make_case(batch * seq, cols, cols, dtype, seed=81)
    strided = logits.to(device).reshape(batch, seq, cols).permute(2, 1, 0).contiguous().permute(2, 1, 0)
    assert not strided.is_contiguous() and strided.stride(-1) != 1
    logprob, entropy, grad, g_lp, g_h = run_op(strided, targets.reshape(batch, seq), "fused", device, seed=82)
    assert_matches_anchor(logits, targets, cols, g_lp.reshape(-1), g_h.reshape(-1), logprob.reshape(-1),
                          entropy.reshape(-1), grad.reshape(-1, cols))


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("rows,cols", [(7, 1000), (257, 3), (3, 50257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_not_16_byte_aligned(dtype, rows, cols, inplace_backward, device):
    """A slice from column 1 of a wider tensor: rows start off a 16-byte boundary, each differently (the
    vector loads' scalar head, vector body and scalar tail); in place, the gradient goes back through them."""
    logits, targets = make_case(rows, cols, cols, dtype, seed=71)
    wide = torch.zeros(rows, cols + 9, dtype=dtype, device=device)
    wide[:, 1 : cols + 1] = logits.to(device)
    sliced = wide[:, 1 : cols + 1]
    assert sliced.data_ptr() % 16 != 0 and sliced.stride(0) == cols + 9
    leaf = sliced.detach().requires_grad_(True)  # used as laid out, not copied
    logprob, entropy = vocab_parallel_logprobs(leaf, targets.to(device), with_entropy=True,
                                               inplace_backward=inplace_backward, implementation="fused")
    gen = torch.Generator().manual_seed(72)
    g_lp, g_h = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    ((logprob * g_lp.to(device)).sum() + (entropy * g_h.to(device)).sum()).backward()
    assert_matches_anchor(logits, targets, cols, g_lp, g_h, logprob.detach().cpu(), entropy.detach().cpu(),
                          leaf.grad.cpu())


def test_only_logprob_gradient_when_entropy_is_not_requested(device):
    logits, targets = make_case(31, 257, 250, torch.float16, seed=12)
    logprob, _, grad, g_lp, _ = run_op(logits, targets, "fused", device, with_entropy=False,
                                       shard=VocabShard(true_vocab_size=250))
    expected = expected_logprobs(logits, targets, 250, g_lp, None)
    assert_grad_close(grad, expected.grad, torch.float16, terms=expected.grad_terms)
