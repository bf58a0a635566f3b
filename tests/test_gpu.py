"""The CUDA kernels of `vocab_parallel_logprobs` against the float64 anchor (on a GPU machine: `pytest -m gpu`).

Every call asks for `implementation="fused"`, which raises instead of falling back to the reference, so these
tests run `csrc/logprob_cuda.cu`. Cases are built on the CPU (`make_case`), run on CUDA, and compared on the CPU
with the anchor of `logprob_reference`. TP shards are emulated on one GPU with `vocab_start_index` and
`true_vocab_size` and no group. The shapes aim at the kernels' paths: tiny rows (V_local = 1, 3), rows split
across blocks (few rows of 50257 or 131072 columns), rows off a 16-byte boundary, and vector tails.
"""

from __future__ import annotations

import pytest
import torch

from logprob_reference import assert_grad_close, expected_logprobs, make_case, torch_fp32_logprob_error
from megatron_grpo.ops import fused_supports, vocab_parallel_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rows T, V_local): one and odd row counts; widths below, near and far above one block's share of a row. The
# last three have so few rows that forward splits each row across several blocks and merges them.
SHAPES = [(1, 1), (7, 3), (257, 1000), (257, 50257), (7, 50257), (1, 50257), (3, 131072)]
LOGPROB_ATOL_FP32 = 1e-5
ENTROPY_ATOL = 1e-5
LOW_PRECISION_MARGIN = 2e-6  # bf16/fp16 logprob: at most torch's fp32-upcast error on the same input, plus this


def cuda_ops():
    """torch.ops.megatron_grpo after checking that its CUDA kernels are built (checking also loads _C)."""
    assert fused_supports(torch.device("cuda")), "megatron_grpo._C was built without its CUDA kernels"
    return torch.ops.megatron_grpo


def gpu_case(rows: int, vocab: int, true_vocab: int, dtype: torch.dtype, seed: int):
    """make_case's logits (padding columns huge) with rows 1, 5, 9, ... ignored, so that T = 1 has a live row."""
    logits, targets = make_case(rows, vocab, true_vocab, dtype, seed=seed, ignore_every=0)
    targets[1::4] = -1
    return logits, targets


def upstream_grads(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)


def run_fused(logits, targets, g_lp, g_h, *, with_entropy=True, inplace_backward=False, **layout):
    """Forward and backward on CUDA; returns (logprob, entropy or None, grad) on the CPU.

    `logits` is a CUDA tensor used as laid out (strides, alignment); with inplace_backward it is overwritten.
    """
    leaf = logits.detach().requires_grad_(True)
    out = vocab_parallel_logprobs(leaf, targets.cuda(), with_entropy=with_entropy,
                                  inplace_backward=inplace_backward, implementation="fused", **layout)
    logprob, entropy = out if with_entropy else (out, None)
    objective = (logprob * g_lp.cuda()).sum() + ((entropy * g_h.cuda()).sum() if with_entropy else 0)
    objective.backward()
    return logprob.detach().cpu(), None if entropy is None else entropy.detach().cpu(), leaf.grad.cpu()


def assert_matches_anchor(logits, targets, true_vocab, g_lp, g_h, logprob, entropy, grad):
    """Values and gradient against the float64 anchor (all on the CPU; g_h None without entropy)."""
    expected = expected_logprobs(logits, targets, true_vocab, g_lp, g_h)
    assert logprob.dtype == torch.float32
    logprob_err = float((logprob.double() - expected.logprob).abs().max())
    if logits.dtype == torch.float32:
        assert logprob_err <= LOGPROB_ATOL_FP32
    else:
        assert logprob_err <= torch_fp32_logprob_error(logits, targets, true_vocab, expected) + LOW_PRECISION_MARGIN
    if entropy is not None:
        entropy_err = float((entropy.double() - expected.entropy).abs().max())
        assert entropy_err <= ENTROPY_ATOL * max(1.0, float(expected.entropy.abs().max()))
    assert grad.dtype == logits.dtype
    assert bool((grad[:, true_vocab:] == 0).all()), "padding columns must get exactly zero gradient"
    assert bool((grad[targets < 0] == 0).all()), "ignored rows must get exactly zero gradient"
    assert_grad_close(grad, expected.grad, logits.dtype)


def test_cuda_kernels_are_built():
    assert cuda_ops().compiled_with_cuda()


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("rows,vocab", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_anchor(dtype, rows, vocab, with_entropy):
    true_vocab = max(1, vocab - vocab // 7)  # a padded tail whenever vocab > 1
    logits, targets = gpu_case(rows, vocab, true_vocab, dtype, seed=rows * 1000 + vocab)
    g_lp, g_h = upstream_grads(rows, seed=rows)
    logprob, entropy, grad = run_fused(logits.cuda(), targets, g_lp, g_h, with_entropy=with_entropy,
                                       true_vocab_size=true_vocab)
    assert_matches_anchor(logits, targets, true_vocab, g_lp, g_h if with_entropy else None, logprob, entropy, grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shard_at_an_offset(dtype):
    """A shard at vocab_start_index with a padded tail: owned targets match the anchor over the shard's own
    real columns; a target on another shard has logprob -inf and local gradient -g_lp * p."""
    rows, v_local, vocab_start, true_vocab = 9, 1000, 3000, 3937
    valid = true_vocab - vocab_start
    logits, local_targets = make_case(rows, v_local, valid, dtype, seed=21, ignore_every=0)
    foreign = torch.arange(rows) % 3 == 0
    targets = torch.where(foreign, torch.arange(rows) * 100, local_targets + vocab_start)
    targets[4] = -1
    g_lp, _ = upstream_grads(rows, seed=22)
    logprob, _, grad = run_fused(logits.cuda(), targets, g_lp, None, with_entropy=False,
                                 vocab_start_index=vocab_start, true_vocab_size=true_vocab)
    assert bool((logprob[foreign] == float("-inf")).all())
    owned = ~foreign
    anchor_targets = torch.where(targets >= 0, targets - vocab_start, -1)
    assert_matches_anchor(logits[owned], anchor_targets[owned], valid, g_lp[owned], None, logprob[owned], None,
                          grad[owned])
    p = torch.softmax(logits[foreign, :valid].double(), dim=-1)
    assert_grad_close(grad[foreign, :valid], -g_lp[foreign, None].double() * p, dtype)
    assert bool((grad[:, valid:] == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", [(7, 1000), (2, 131072)])
def test_padding_only_shard_partials(dtype, rows, cols):
    """valid_cols == 0: partials {-inf, 0, -inf, 0}, ignored rows {0, 1, -inf, 0}; the gradient is all 0."""
    ops = cuda_ops()
    logits, targets = make_case(rows, cols, cols, dtype, seed=31, ignore_every=0)
    logits, targets = logits.cuda(), targets.cuda()
    targets[0] = -1
    partials = ops.logprob_partials(logits, targets, 50000, 0, True).cpu()
    inf = float("inf")
    expected = torch.tensor([[0.0, 1.0, -inf, 0.0]] + [[-inf, 0.0, -inf, 0.0]] * (rows - 1))
    assert torch.equal(partials, expected)
    grad = torch.full_like(logits, 7.0)
    zeros, ones = torch.zeros(rows, device="cuda"), torch.ones(rows, device="cuda")
    ops.logprob_backward(logits, targets, 50000, 0, zeros, zeros, ones, ones, grad)
    assert bool((grad == 0).all())


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("rows,cols", [(257, 1000), (3, 131072), (1, 50257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partials_match_float64(dtype, rows, cols, with_entropy):
    """The raw partials, also of rows split across blocks and merged: m and x_y exact, d and s to fp32 accuracy
    (s = sum exp(x - m) (x - m), see PartialsColumn)."""
    valid = cols - 5
    logits, targets = gpu_case(rows, cols, valid, dtype, seed=41)
    partials = cuda_ops().logprob_partials(logits.cuda(), targets.cuda(), 0, valid, with_entropy).cpu().double()
    x = logits[:, :valid].double()
    m = x.max(dim=-1).values
    e = torch.exp(x - m[:, None])
    live = targets >= 0
    assert torch.equal(partials[live, 0], m[live])
    torch.testing.assert_close(partials[live, 1], e.sum(-1)[live], rtol=1e-5, atol=0)
    assert torch.equal(partials[live, 2], x.gather(1, targets.clamp(min=0)[:, None])[live, 0])
    if with_entropy:
        torch.testing.assert_close(partials[live, 3], (e * (x - m[:, None])).sum(-1)[live], rtol=1e-5, atol=1e-4)
    ignored_row = torch.tensor([0.0, 1.0, float("-inf"), 0.0], dtype=torch.float64)[: partials.shape[1]]
    assert torch.equal(partials[~live], ignored_row.expand(int((~live).sum()), -1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minus_inf_logits_are_masked_tokens(dtype):
    """-inf (top-k/top-p masking) is legal and contributes nothing; no NaN anywhere."""
    rows, cols = 257, 1001  # an odd width puts most rows off a 16-byte boundary: column 0 is in a scalar head
    logits, targets = gpu_case(rows, cols, cols, dtype, seed=51)
    mask = torch.rand(rows, cols, generator=torch.Generator().manual_seed(52)) < 0.3
    mask[:, 0] = True
    live = torch.nonzero(targets >= 0).squeeze(1)
    mask[live, targets[live]] = False  # targets stay unmasked
    logits = logits.masked_fill(mask, float("-inf"))
    g_lp, g_h = upstream_grads(rows, seed=53)
    logprob, entropy, grad = run_fused(logits.cuda(), targets, g_lp, g_h)
    assert bool(torch.isfinite(logprob).all() and torch.isfinite(entropy).all() and torch.isfinite(grad).all())
    assert_matches_anchor(logits, targets, cols, g_lp, g_h, logprob, entropy, grad)
    assert bool((grad[mask] == 0).all())


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("rows,cols", [(7, 1000), (3, 131072)])
def test_nan_or_inf_poisons_only_its_own_row(poison, rows, cols):
    logits, targets = make_case(rows, cols, cols, torch.float32, seed=61, ignore_every=0)
    bad = logits.clone()
    bad[1, cols // 2] = poison
    g_lp, g_h = upstream_grads(rows, seed=62)
    logprob, entropy, grad = run_fused(bad.cuda(), targets, g_lp, g_h)
    clean, clean_entropy, clean_grad = run_fused(logits.cuda(), targets, g_lp, g_h)
    assert bool(torch.isnan(logprob[1])) and bool(torch.isnan(entropy[1]))
    others = torch.arange(rows) != 1
    assert torch.equal(logprob[others], clean[others])
    assert torch.equal(entropy[others], clean_entropy[others])
    assert torch.equal(grad[others], clean_grad[others])


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("rows,cols", [(7, 1000), (257, 3), (3, 50257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_not_16_byte_aligned(dtype, rows, cols, inplace_backward):
    """A slice from column 1 of a wider tensor: rows start off a 16-byte boundary, each differently.

    The default backward writes a fresh gradient whose alignment differs from the logits' (the scalar
    fallback); the in-place one writes back through the same rows (scalar head, vector body, scalar tail).
    """
    logits, targets = gpu_case(rows, cols, cols, dtype, seed=71)
    wide = torch.zeros(rows, cols + 9, dtype=dtype, device="cuda")
    wide[:, 1 : cols + 1] = logits.cuda()
    sliced = wide[:, 1 : cols + 1]
    assert sliced.data_ptr() % 16 != 0 and sliced.stride(0) == cols + 9
    g_lp, g_h = upstream_grads(rows, seed=72)
    logprob, entropy, grad = run_fused(sliced, targets, g_lp, g_h, inplace_backward=inplace_backward)
    assert_matches_anchor(logits, targets, cols, g_lp, g_h, logprob, entropy, grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_batched_input(dtype):
    """[B, S, V] logits whose vocab dim is strided (a permuted [V, S, B] buffer)."""
    batch, seq, cols = 3, 5, 1000
    logits, targets = gpu_case(batch * seq, cols, cols, dtype, seed=81)
    strided = logits.cuda().reshape(batch, seq, cols).permute(2, 1, 0).contiguous().permute(2, 1, 0)
    assert not strided.is_contiguous() and strided.stride(-1) != 1
    g_lp, g_h = upstream_grads(batch * seq, seed=82)
    leaf = strided.detach().requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(leaf, targets.reshape(batch, seq).cuda(), with_entropy=True,
                                               implementation="fused")
    ((logprob.reshape(-1) * g_lp.cuda()).sum() + (entropy.reshape(-1) * g_h.cuda()).sum()).backward()
    assert_matches_anchor(logits, targets, cols, g_lp, g_h, logprob.detach().reshape(-1).cpu(),
                          entropy.detach().reshape(-1).cpu(), leaf.grad.reshape(-1, cols).cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", [(257, 1000), (3, 131072)])
def test_inplace_backward_gives_the_same_gradient(dtype, rows, cols):
    logits, targets = gpu_case(rows, cols, cols - 3, dtype, seed=91)
    g_lp, g_h = upstream_grads(rows, seed=92)
    layout = {"true_vocab_size": cols - 3}
    _, _, default_grad = run_fused(logits.cuda(), targets, g_lp, g_h, **layout)
    _, _, inplace_grad = run_fused(logits.cuda(), targets, g_lp, g_h, inplace_backward=True, **layout)
    assert torch.equal(inplace_grad, default_grad)


def test_input_logits_are_never_written():
    logits, targets = gpu_case(7, 50257, 50257, torch.bfloat16, seed=101)
    on_gpu = logits.cuda()
    g_lp, g_h = upstream_grads(7, seed=102)
    run_fused(on_gpu, targets, g_lp, g_h)
    assert torch.equal(on_gpu.cpu(), logits)
