"""vocab_parallel_linear_logprobs against an independent float64 anchor: logits = scale * hidden @ weight.T in
float64, then `expected_logprobs` on the full, unpadded vocab, and float64 autograd for the gradients of hidden
and weight. On 1, 2 and 4 gloo ranks, with padding, a rank that is all padding, ignored rows, entropy,
logit_scale != 1, odd chunk sizes, fp32 and bf16, the collective count, and every bad input's message.
The one-rank comparisons with the anchor run on every device (conftest's `device`: the cpu case, and the cuda case
marked `gpu`); the CUDA kernels at larger shapes, with rows split across blocks, are in test_gpu_linear.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from _dist import counted_collectives, run_on_ranks
from logprob_reference import expected_filtered_logprobs, expected_logprobs

from megatron_grpo.ops import SamplingDistribution, VocabShard, linear_logprobs, vocab_parallel_linear_logprobs
from megatron_grpo.ops.core.chunking import chunk_rows_for
from megatron_grpo.ops.core.gemm import fp32_sum_is_small

IMPLEMENTATIONS = ("fused", "torch")
LOGPROB_ATOL_FP32 = 2e-5
GRAD_RTOL_FP32 = 1e-4
BF16_UNIT_ROUNDOFF = 2.0**-8  # relative rounding of one bf16 value: 8 significant bits
# fp32, elementwise: an element of dH or dW sums up to 257 columns' or 64 rows' terms that may cancel, so its rounding
# is relative to those terms: a floor of 1e-5 of the largest element (~170 u)
GRAD_FLOOR_FP32 = 1e-5


@dataclass
class Anchor:
    logprob: torch.Tensor       # float64, [...]
    entropy: torch.Tensor
    grad_hidden: torch.Tensor   # float64, [..., H]
    grad_weight: torch.Tensor   # float64, [V_padded, H]
    max_logit: float            # largest |logit| over the real vocab: scales the bf16 rounding bounds
    max_std: float              # largest per-row std of the logits under p: scales the entropy's


def make_linear_case(shape, hidden_size, padded_vocab, true_vocab, dtype, seed, ignore_every=4):
    """Hidden states, a weight whose padding rows are huge (a leak into the softmax would show), targets with
    every `ignore_every`-th row ignored (row 0 always trained), and the upstream gradients."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(padded_vocab, hidden_size, generator=gen, dtype=torch.float64) * (3 / hidden_size**0.5)
    weight[true_vocab:] *= 100
    rows = int(torch.Size(shape).numel())
    targets = torch.randint(0, true_vocab, (rows,), generator=gen)
    if ignore_every:
        targets[1::ignore_every] = -1
    g_lp, g_h = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    return (hidden.to(dtype), weight.to(dtype), targets.reshape(shape), g_lp.reshape(shape), g_h.reshape(shape))


def anchor(hidden, weight, targets, true_vocab, scale, g_lp, g_h) -> Anchor:
    """The float64 anchor, on the inputs as rounded to their dtype."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1]).requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    logits = (h @ w.t()) * scale
    flat_targets = targets.reshape(-1)
    expected = expected_logprobs(logits.detach(), flat_targets, true_vocab, g_lp.reshape(-1),
                                 None if g_h is None else g_h.reshape(-1))
    logits.backward(expected.grad)
    real = logits.detach()[:, :true_vocab]
    p = torch.softmax(real, dim=-1)
    std = ((p * (real - (p * real).sum(-1, keepdim=True)) ** 2).sum(-1)).sqrt()
    trained = flat_targets >= 0
    return Anchor(
        logprob=expected.logprob.reshape(targets.shape), entropy=expected.entropy.reshape(targets.shape),
        grad_hidden=h.grad.reshape(hidden.shape), grad_weight=w.grad,
        max_logit=float(real[trained].abs().max()) if trained.any() else 0.0,
        max_std=float(std[trained].max()) if trained.any() else 0.0,
    )


def run_op(hidden, weight, targets, g_lp, g_h, device="cpu", **kwargs):
    """Forward and backward of the op on fresh leaves on `device`, from CPU inputs: (logprob, entropy or None,
    grad hidden, grad weight), on the CPU."""
    hidden = hidden.to(device, copy=True).requires_grad_(True)
    weight = weight.to(device, copy=True).requires_grad_(True)
    with_entropy = g_h is not None
    out = vocab_parallel_linear_logprobs(hidden, weight, targets.to(device), with_entropy=with_entropy, **kwargs)
    logprob, entropy = out if with_entropy else (out, None)
    objective = (logprob * g_lp.to(device)).sum() + ((entropy * g_h.to(device)).sum() if with_entropy else 0)
    objective.backward()
    return (logprob.detach().cpu(), None if entropy is None else entropy.detach().cpu(), hidden.grad.cpu(),
            weight.grad.cpu())


def assert_matches(logprob, entropy, grad_hidden, grad_weight, targets, true_vocab, dtype, expected: Anchor,
                   label=""):
    """fp32: logprobs within 2e-5 (entropy relative to max(1, entropy)), gradients within 1e-4 relative (of the
    largest entry, and elementwise with a floor of GRAD_FLOOR_FP32 of it). bf16: the logits are
    rounded to bf16 (|dx| <= 2^-8 |x|), which moves the target logit and the lse by at most that each, the
    entropy by at most std_p(x) * max|dx| (first order), and p (so the gradient) by about 2 max|dx| relative;
    the gradient is then rounded twice more (into the chunk buffer, and the GEMM's output)."""
    assert logprob.dtype == torch.float32, label
    ignored = targets < 0
    assert bool((logprob[ignored] == 0).all()), f"{label}: ignored rows must have logprob exactly 0"
    assert bool((grad_hidden[ignored] == 0).all()), f"{label}: ignored rows must get exactly zero gradient"
    assert bool((grad_weight[true_vocab:] == 0).all()), f"{label}: padding weight rows must get exactly zero gradient"
    assert grad_hidden.dtype == dtype and grad_weight.dtype == dtype, label
    if dtype == torch.float32:
        lp_bound, grad_rel = LOGPROB_ATOL_FP32, GRAD_RTOL_FP32
        ent_bound = LOGPROB_ATOL_FP32 * max(1.0, float(expected.entropy.abs().max()))
    else:
        max_dx = BF16_UNIT_ROUNDOFF * expected.max_logit
        lp_bound = 2 * max_dx + 1e-5
        ent_bound = 2 * expected.max_std * max_dx + 1e-5
        grad_rel = 2 * max_dx + 4 * BF16_UNIT_ROUNDOFF
    lp_err = float((logprob.double() - expected.logprob).abs().max())
    assert lp_err <= lp_bound, f"{label}: logprob off by {lp_err:.3g} > {lp_bound:.3g}"
    if entropy is not None:
        assert bool((entropy[ignored] == 0).all()), f"{label}: ignored rows must have entropy exactly 0"
        ent_err = float((entropy.double() - expected.entropy).abs().max())
        assert ent_err <= ent_bound, f"{label}: entropy off by {ent_err:.3g} > {ent_bound:.3g}"
    for name, actual, wanted in (("hidden", grad_hidden, expected.grad_hidden),
                                 ("weight", grad_weight, expected.grad_weight)):
        err = (actual.double() - wanted).abs()
        scale = float(wanted.abs().max())
        assert float(err.max()) <= grad_rel * scale + 1e-12, \
            f"{label}: grad of {name} off by {float(err.max()):.3g} (relative {grad_rel:.3g} of {scale:.3g})"
        if dtype == torch.float32:  # and elementwise: 1e-4 relative, with a floor far below the largest entry
            worst = float((err - GRAD_RTOL_FP32 * wanted.abs()).max())
            assert worst <= GRAD_FLOOR_FP32 * scale, f"{label}: grad of {name} off by {worst:.3g} beyond 1e-4 relative"


# (batch shape, H, V, true vocab, logit_scale, chunk_rows, with entropy): odd shapes, chunk sizes that do not
# divide the rows (1, 5, larger than T, the default), a 3-D batch, padding, scale != 1, no entropy.
SINGLE_RANK_CASES = [
    ((37,), 16, 50, 45, 0.7, 5, True),
    ((1,), 8, 11, 11, 1.0, 1, True),
    ((13,), 12, 40, 33, 2.5, 100, True),
    ((29,), 16, 31, 30, 1.0, 1, False),
    ((2, 7), 24, 64, 61, 1 / 0.6, 3, True),
    ((64,), 32, 257, 250, 1.0, None, True),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", SINGLE_RANK_CASES, ids=lambda c: f"T{c[0]}-V{c[2]}-chunk{c[5]}")
def test_single_rank_matches_float64_anchor(case, dtype, implementation, device):
    shape, hidden_size, vocab, true_vocab, scale, chunk_rows, entropy = case
    hidden, weight, targets, g_lp, g_h = make_linear_case(shape, hidden_size, vocab, true_vocab, dtype,
                                                           seed=SINGLE_RANK_CASES.index(case))
    g_h = g_h if entropy else None
    expected = anchor(hidden, weight, targets, true_vocab, scale, g_lp, g_h)
    result = run_op(hidden, weight, targets, g_lp, g_h, device, shard=VocabShard(true_vocab_size=true_vocab),
                    distribution=SamplingDistribution(logit_scale=scale), chunk_rows=chunk_rows,
                    implementation=implementation)
    assert result[0].shape == targets.shape and result[2].shape == hidden.shape
    assert_matches(*result, targets, true_vocab, dtype, expected, label=f"{case} {dtype} {implementation} {device}")


def test_float64_takes_the_reference_kernels_and_matches_tightly():
    hidden, weight, targets, g_lp, g_h = make_linear_case((21,), 8, 17, 15, torch.float64, seed=11)
    logprob, entropy, grad_hidden, grad_weight = run_op(hidden, weight, targets, g_lp, g_h,
                                                        shard=VocabShard(true_vocab_size=15),
                                                        distribution=SamplingDistribution(logit_scale=1.5),
                                                        chunk_rows=4)
    expected = anchor(hidden, weight, targets, 15, 1.5, g_lp, g_h)
    assert logprob.dtype == torch.float64 and grad_weight.dtype == torch.float64
    for actual, wanted in ((logprob, expected.logprob), (entropy, expected.entropy),
                           (grad_hidden, expected.grad_hidden), (grad_weight, expected.grad_weight)):
        torch.testing.assert_close(actual, wanted, atol=1e-10, rtol=1e-10)
    assert bool((grad_weight[15:] == 0).all())


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_entropy_that_is_only_logged_passes_no_gradient(implementation):
    hidden, weight, targets, g_lp, _ = make_linear_case((19,), 8, 23, 20, torch.float32, seed=5)
    h = hidden.clone().requires_grad_(True)
    logprob, entropy = vocab_parallel_linear_logprobs(h, weight, targets, shard=VocabShard(true_vocab_size=20),
                                                      with_entropy=True,
                                                      chunk_rows=4, implementation=implementation)
    (logprob * g_lp).sum().backward()
    expected = anchor(hidden, weight, targets, 20, 1.0, g_lp, None)
    torch.testing.assert_close(h.grad.double(), expected.grad_hidden, atol=1e-5, rtol=1e-4)
    assert float((entropy.detach().double() - expected.entropy).abs().max()) <= 2e-5


class CountingKernels:
    """Records the rows and chunks each kernel is given, around the real kernels."""

    def __init__(self, inner):
        self.inner = inner
        self.partial_rows, self.backward_rows = [], []

    def logprob_partials(self, logits, targets, *args):
        self.partial_rows.append(logits.shape[0])
        assert bool((targets >= 0).all()), "an ignored row reached the partials kernel"
        return self.inner.logprob_partials(logits, targets, *args)

    def logprob_backward(self, logits, targets, *args):
        self.backward_rows.append(logits.shape[0])
        assert bool((targets >= 0).all()), "an ignored row reached the backward kernel"
        return self.inner.logprob_backward(logits, targets, *args)

    def combine(self, gathered, targets, with_entropy):
        return self.inner.combine(gathered, targets, with_entropy)


@pytest.fixture
def counting(monkeypatch):
    made = []
    original = linear_logprobs.select_kernels

    def select(logits, implementation):
        made.append(CountingKernels(original(logits, implementation)))
        return made[-1]

    monkeypatch.setattr(linear_logprobs, "select_kernels", select)
    return made


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_ignored_rows_cost_nothing_and_chunks_bound_the_logits(counting, implementation):
    hidden, weight, targets, g_lp, g_h = make_linear_case((50,), 8, 30, 30, torch.float32, seed=7, ignore_every=0)
    targets[::2] = -1
    targets[7] = -100  # 24 trained rows
    trained = int((targets >= 0).sum())
    logprob, entropy, grad_hidden, grad_weight = run_op(hidden, weight, targets, g_lp, g_h, chunk_rows=7,
                                                        implementation=implementation)
    partial_rows = [rows for kernels in counting for rows in kernels.partial_rows]  # forward's and backward's calls
    backward_rows = [rows for kernels in counting for rows in kernels.backward_rows]
    assert sum(partial_rows) == trained and sum(backward_rows) == trained
    assert partial_rows == [7, 7, 7, 3] == backward_rows  # ceil(24 / 7) chunks, none over 7 rows
    assert bool((grad_hidden[targets < 0] == 0).all()) and bool((logprob[targets < 0] == 0).all())
    assert bool((entropy[targets < 0] == 0).all())
    assert_matches(logprob, entropy, grad_hidden, grad_weight, targets, 30, torch.float32,
                   anchor(hidden, weight, targets, 30, 1.0, g_lp, g_h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_inputs_that_require_grad_get_one(dtype):
    hidden, weight, targets, g_lp, _ = make_linear_case((11,), 8, 13, 12, dtype, seed=12)
    expected = anchor(hidden, weight, targets, 12, 1.0, g_lp, None)
    h, w = hidden.clone(), weight.clone().requires_grad_(True)
    twelve = VocabShard(true_vocab_size=12)
    (vocab_parallel_linear_logprobs(h, w, targets, shard=twelve, chunk_rows=3) * g_lp).sum().backward()
    assert h.grad is None
    bound = GRAD_RTOL_FP32 if dtype == torch.float32 else 2 * BF16_UNIT_ROUNDOFF * (expected.max_logit + 2)  # as above
    assert (float((w.grad.double() - expected.grad_weight).abs().max())
            <= bound * float(expected.grad_weight.abs().max()))
    h, w = hidden.clone().requires_grad_(True), weight.clone()
    (vocab_parallel_linear_logprobs(h, w, targets, shard=twelve, chunk_rows=3) * g_lp).sum().backward()
    assert w.grad is None
    assert (float((h.grad.double() - expected.grad_hidden).abs().max())
            <= bound * float(expected.grad_hidden.abs().max()))


def test_bf16_weight_gradient_does_not_degrade_with_the_chunk_count_where_an_fp32_sum_is_small():
    """Where the fp32 `[V, H]` sum is small next to the logits (2H/T <= 1/32: H = 8, T = 600), dW sums over chunks in
    fp32: 600 one-row chunks land as close to the anchor as one chunk of 600 rows."""
    hidden, weight, targets, g_lp, _ = make_linear_case((600,), 8, 16, 16, torch.bfloat16, seed=13, ignore_every=0)
    assert fp32_sum_is_small(600, 8, torch.bfloat16)
    expected = anchor(hidden, weight, targets, 16, 1.0, g_lp, None).grad_weight
    errors = {}
    for chunk_rows in (1, 600):
        w = weight.clone().requires_grad_(True)
        (vocab_parallel_linear_logprobs(hidden, w, targets, chunk_rows=chunk_rows) * g_lp).sum().backward()
        errors[chunk_rows] = float((w.grad.double() - expected).abs().max())
    assert errors[1] <= 1.5 * errors[600] + 1e-6, errors


def test_elsewhere_bf16_weight_gradient_is_summed_in_bf16_within_a_rounding_per_chunk():
    """Where an fp32 sum would not be small (2H/T = 1/4: H = 16, T = 128), each chunk's product is added straight into
    the bf16 gradient (the GEMM accumulates in fp32 and rounds the running sum once per chunk), with no fp32 buffer.
    The rows' d(logits) are the same however the rows are chunked, so against one chunk of 128 rows, 16 chunks of 8
    differ by at most one bf16 rounding (u = 2^-8) per chunk, and the one chunk's own, of the running sum, which is
    at most the sum over rows of |dx| |h| (|dx| <= |g| (p + onehot)). Measured: up to a fifth of that."""
    rows, chunks = 128, 16
    hidden, weight, targets, g_lp, _ = make_linear_case((rows,), 16, 24, 24, torch.bfloat16, seed=14, ignore_every=0)
    assert not fp32_sum_is_small(rows, 16, torch.bfloat16)
    grads = {}
    for chunk_rows in (rows // chunks, rows):
        w = weight.clone().requires_grad_(True)
        (vocab_parallel_linear_logprobs(hidden, w, targets, chunk_rows=chunk_rows) * g_lp).sum().backward()
        assert w.grad.dtype == torch.bfloat16
        grads[chunk_rows] = w.grad.double()
    p = torch.softmax(hidden.double() @ weight.double().t(), dim=-1)
    onehot = torch.nn.functional.one_hot(targets, 24).double()
    terms = (g_lp.double().abs()[:, None] * (p + onehot)).t() @ hidden.double().abs()
    assert bool(((grads[rows // chunks] - grads[rows]).abs() <= (chunks + 1) * BF16_UNIT_ROUNDOFF * terms).all())
    assert not torch.equal(grads[rows // chunks], grads[rows])  # the per-chunk roundings are there


def test_nothing_of_the_size_of_the_logits_is_saved_for_backward():
    rows, vocab, hidden_size = 64, 200, 8
    hidden, weight, targets, g_lp, _ = make_linear_case((rows,), hidden_size, vocab, vocab, torch.float32, seed=9)
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    h = hidden.clone().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprob = vocab_parallel_linear_logprobs(h, weight.requires_grad_(True), targets, chunk_rows=8)
    trained = int((targets >= 0).sum())
    assert (vocab, hidden_size) in saved and (trained, hidden_size) in saved, saved  # the trained rows only
    assert not any(shape[-1:] == (vocab,) for shape in saved), f"logits (or a chunk of them) saved: {saved}"
    assert max(torch.Size(shape).numel() for shape in saved) < rows * vocab, saved
    (logprob * g_lp).sum().backward()
    assert h.grad is not None


def test_all_rows_ignored_runs_no_kernel_and_gives_zeros(counting):
    hidden, weight, targets, g_lp, g_h = make_linear_case((6,), 8, 10, 10, torch.float32, seed=8, ignore_every=0)
    targets[:] = -1
    logprob, entropy, grad_hidden, grad_weight = run_op(hidden, weight, targets, g_lp, g_h, chunk_rows=2)
    assert all(kernels.partial_rows == [] and kernels.backward_rows == [] for kernels in counting)
    assert bool((logprob == 0).all()) and bool((entropy == 0).all())
    assert bool((grad_hidden == 0).all()) and bool((grad_weight == 0).all())


def test_default_chunk_rows_fit_the_memory_budget():
    many = 10**6  # rows enough that only the 256 MiB budget binds
    assert chunk_rows_for(many, 65536, torch.bfloat16) == 2048
    assert chunk_rows_for(many, 152064, torch.float32) == 441
    assert chunk_rows_for(many, 10**12, torch.float32) == 1 and chunk_rows_for(many, 0, torch.float32) >= 1
    assert chunk_rows_for(4096, 32768, torch.float32) == 256  # 16 chunks: one chunk's logits are 1/16 of the call's
    assert chunk_rows_for(8192, 65536, torch.bfloat16, buffers=2) == 256  # two buffers share the 1/16
    assert chunk_rows_for(1000, 32768, torch.float32) == 64  # but at least 64 rows per GEMM
    assert chunk_rows_for(10, 32768, torch.float32) == 64


def test_top_level_export():
    import megatron_grpo

    assert megatron_grpo.vocab_parallel_linear_logprobs is vocab_parallel_linear_logprobs
    assert megatron_grpo.VocabShard is VocabShard


# ---- top-k / top-p, and the next-token shift ----

FILTERS = [(1, None), (6, None), (None, 0.7), (4, 0.8)]


def filtered_run(hidden, weight, targets, g_lp, g_h, shard, top_k, top_p, chunk_rows, device="cpu"):
    """The op with a sampling filter, forward and backward on `device` (a filtered target's -inf logprob passes
    no gradient); results on the CPU."""
    h, w = hidden.to(device, copy=True).requires_grad_(True), weight.to(device, copy=True).requires_grad_(True)
    logprob, entropy = vocab_parallel_linear_logprobs(h, w, targets.to(device), shard=shard, with_entropy=True,
                                                      distribution=SamplingDistribution(logit_scale=1.3, top_k=top_k,
                                                                                        top_p=top_p),
                                                      chunk_rows=chunk_rows)
    g_lp, g_h = g_lp.to(device), g_h.to(device)
    (torch.where(torch.isfinite(logprob), logprob, 0.0) * g_lp + entropy * g_h).sum().backward()
    return logprob.detach().cpu(), entropy.detach().cpu(), h.grad.cpu(), w.grad.cpu()


def check_filtered(result, hidden, weight, targets, g_lp, g_h, true_vocab, top_k, top_p, label):
    """Against the float64 filtered distribution of the float64 logits (`expected_filtered_logprobs` sorts)."""
    logprob, entropy, grad_hidden, grad_weight = result
    h, w = hidden.double().reshape(-1, hidden.shape[-1]), weight.double()
    flat = targets.reshape(-1)
    trained = flat >= 0
    expected = expected_filtered_logprobs(1.3 * h[trained] @ w.t(), flat[trained], true_vocab, top_k, top_p,
                                          g_lp.reshape(-1)[trained], g_h.reshape(-1)[trained])
    got = logprob.reshape(-1)[trained].double()
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected.logprob)), f"{label}: filtered targets differ"
    finite = torch.isfinite(expected.logprob)
    assert float((got[finite] - expected.logprob[finite]).abs().max() if finite.any() else 0.0) \
        <= LOGPROB_ATOL_FP32, label
    assert float((entropy.reshape(-1)[trained].double() - expected.entropy).abs().max()) <= 1e-5, label
    assert bool((logprob.reshape(-1)[~trained] == 0).all()), f"{label}: ignored rows must be 0"
    dlogits = expected.grad  # [trained rows, padded vocab], 0 on the padding
    want_hidden = torch.zeros_like(h)
    want_hidden[trained] = 1.3 * dlogits @ w
    want_weight = 1.3 * dlogits.t() @ h[trained]
    for name, got_grad, want in (("hidden", grad_hidden.reshape(want_hidden.shape), want_hidden),
                                 ("weight", grad_weight, want_weight)):
        error = float((got_grad.double() - want).abs().max())
        assert error <= GRAD_RTOL_FP32 * float(want.abs().max()), f"{label}: grad {name} off by {error}"


@pytest.mark.parametrize("top_k, top_p", FILTERS)
def test_filtered_logprobs_match_the_float64_reference(top_k, top_p, device):
    hidden, weight, targets, g_lp, g_h = make_linear_case((29,), 12, 40, 37, torch.float32, seed=31)
    result = filtered_run(hidden, weight, targets, g_lp, g_h, VocabShard(true_vocab_size=37), top_k, top_p,
                          chunk_rows=6, device=device)
    check_filtered(result, hidden, weight, targets, g_lp, g_h, 37, top_k, top_p,
                   f"{device} top_k={top_k} top_p={top_p}")


def filtered_tp_worker(rank, world, v_local, true_vocab):
    hidden, weight, targets, g_lp, g_h = make_linear_case((21,), 12, v_local * world, true_vocab, torch.float32, 7)
    shard = VocabShard(true_vocab_size=true_vocab, group=dist.group.WORLD)
    out = []
    for top_k, top_p in FILTERS:
        logprob, entropy, grad_hidden, grad_weight = filtered_run(
            hidden, weight[rank * v_local:(rank + 1) * v_local], targets, g_lp, g_h, shard, top_k, top_p,
            chunk_rows=5)
        dist.all_reduce(grad_hidden)  # the caller's TP reduction
        out.append((logprob, entropy, grad_hidden, grad_weight))
    return out


def test_filtered_tensor_parallel_matches_the_full_vocab():
    world, v_local, true_vocab = 2, 20, 37  # the last rank's shard is partly padding
    per_rank = run_on_ranks(world, filtered_tp_worker, v_local, true_vocab)
    hidden, weight, targets, g_lp, g_h = make_linear_case((21,), 12, v_local * world, true_vocab, torch.float32, 7)
    for index, (top_k, top_p) in enumerate(FILTERS):
        results = [per_rank[rank][index] for rank in range(world)]
        logprob, entropy, grad_hidden, _ = results[0]
        grad_weight = torch.cat([r[3] for r in results])
        check_filtered((logprob, entropy, grad_hidden, grad_weight), hidden, weight, targets, g_lp, g_h, true_vocab,
                       top_k, top_p, f"TP=2 top_k={top_k} top_p={top_p}")


def test_shift_scores_the_next_token_and_aligns_with_the_tokens():
    hidden, weight, _, _, _ = make_linear_case((3, 7), 8, 16, 16, torch.float32, seed=4)
    tokens = torch.randint(0, 16, (3, 7), generator=torch.Generator().manual_seed(4))
    tokens[1, 3] = -1  # a token that is not trained
    shifted = vocab_parallel_linear_logprobs(hidden, weight, tokens, shift=True)
    logits = hidden.double() @ weight.double().t()
    expected = torch.zeros(3, 7, dtype=torch.float64)
    expected[:, 1:] = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:].clamp(min=0)[..., None])[..., 0]
    expected[1, 3] = 0
    torch.testing.assert_close(shifted.double(), expected, atol=LOGPROB_ATOL_FP32, rtol=0)
    with pytest.raises(ValueError, match="shift=True needs targets with a sequence dim"):
        vocab_parallel_linear_logprobs(hidden[0, 0], weight, tokens[0, 0], shift=True)


# ---- tensor parallel ----

def tp_worker(rank, world, cases):
    out = []
    for shape, hidden_size, v_local, true_vocab, dtype, implementation, scale, chunk_rows, seed in cases:
        hidden, weight, targets, g_lp, g_h = make_linear_case(shape, hidden_size, v_local * world, true_vocab,
                                                              dtype, seed)
        h = hidden.clone().requires_grad_(True)
        w = weight[rank * v_local:(rank + 1) * v_local].clone().requires_grad_(True)
        with counted_collectives() as calls:
            logprob, entropy = vocab_parallel_linear_logprobs(
                h, w, targets, shard=VocabShard(true_vocab_size=true_vocab, group=dist.group.WORLD),
                with_entropy=True, distribution=SamplingDistribution(logit_scale=scale), chunk_rows=chunk_rows,
                implementation=implementation,
            )
            forward_calls = calls["n"]
            ((logprob * g_lp).sum() + (entropy * g_h).sum()).backward()
            backward_calls = calls["n"] - forward_calls
        grad_hidden = h.grad.clone()
        dist.all_reduce(grad_hidden)  # the caller's TP reduction (Megatron's copy_to_tensor_model_parallel_region)
        out.append((logprob.detach(), entropy.detach(), grad_hidden, w.grad, forward_calls, backward_calls))
    wrong_start = VocabShard(start_index=(rank + 1) % world * 5, group=dist.group.WORLD)
    try:  # a weight shard that is not where the shard says: the rank's real shard starts elsewhere
        vocab_parallel_linear_logprobs(torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2]), shard=wrong_start)
    except ValueError as err:
        out.append(str(err))
    return out


def tp_cases(world):
    """(shape, H, V_local, true vocab, dtype, implementation, scale, chunk_rows, seed): the first shape pads the
    last rank's shard; the second and third leave the last rank all padding (the second also pads the rank
    before it)."""
    shapes = [((23,), 16, 12, 12 * world - 5, 0.8, 4),
              ((3, 5), 8, 7, 7 * (world - 1) - 2, 1.0, 1),
              ((17,), 8, 5, 5 * (world - 1), 1.3, 40)]
    return [(shape, h, v, tv, dtype, impl, scale, chunk, 10 * i + j)
            for i, (shape, h, v, tv, scale, chunk) in enumerate(shapes)
            for j, dtype in enumerate((torch.float32, torch.bfloat16))
            for impl in IMPLEMENTATIONS]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_the_full_vocab(world):
    cases = tp_cases(world)
    per_rank = run_on_ranks(world, tp_worker, cases)
    for rank in range(world):
        assert "disagrees with the local vocab" in per_rank[rank].pop(), f"rank {rank}: a misplaced shard passed"
    for index, (shape, hidden_size, v_local, true_vocab, dtype, impl, scale, chunk_rows, seed) in enumerate(cases):
        label = f"world={world} shape={shape} v_local={v_local} true_vocab={true_vocab} {dtype} {impl}"
        hidden, weight, targets, g_lp, g_h = make_linear_case(shape, hidden_size, v_local * world, true_vocab,
                                                              dtype, seed)
        results = [per_rank[rank][index] for rank in range(world)]
        for rank, result in enumerate(results):
            assert result[4:] == (1, 0), f"{label}: rank {rank} ran {result[4:]} collectives in (forward, backward)"
            for a, b in zip(result[:3], results[0][:3]):
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"{label}: ranks disagree")
        logprob, entropy, grad_hidden = results[0][:3]
        grad_weight = torch.cat([r[3] for r in results])
        expected = anchor(hidden, weight, targets, true_vocab, scale, g_lp, g_h)
        assert_matches(logprob, entropy, grad_hidden, grad_weight, targets, true_vocab, dtype, expected, label)
        # The same computation on one rank over the full, unsharded vocab.
        single = run_op(hidden, weight, targets, g_lp, g_h, shard=VocabShard(true_vocab_size=true_vocab),
                        distribution=SamplingDistribution(logit_scale=scale), chunk_rows=chunk_rows,
                        implementation=impl)
        if dtype == torch.float32:
            for name, a, b in zip(("logprob", "entropy", "grad hidden", "grad weight"),
                                  (logprob, entropy, grad_hidden, grad_weight), single):
                torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=f"{label}: {name} differs from TP=1")


# ---- bad input ----

def _ok():
    return torch.randn(4, 8), torch.randn(10, 8), torch.tensor([0, 3, -1, 9])


BAD_INPUTS = [
    ("hidden size", lambda h, w, t: (torch.randn(4, 7), w, t, {})),
    ("2-D", lambda h, w, t: (h, w.reshape(10, 2, 4), t, {})),
    ("same dtype", lambda h, w, t: (h, w.to(torch.bfloat16), t, {})),
    ("one device", lambda h, w, t: (h, w.to("meta"), t, {})),
    ("hidden.shape[:-1]", lambda h, w, t: (h, w, t[:3], {})),
    ("integer token ids", lambda h, w, t: (h, w, t.float(), {})),
    ("token id 10", lambda h, w, t: (h, w, torch.tensor([0, 10, -1, 2]), {})),
    ("token id 9", lambda h, w, t: (h, w, t, {"shard": VocabShard(true_vocab_size=9)})),
    ("true_vocab_size=11 exceeds the sharded vocab of 1 rank",
     lambda h, w, t: (h, w, t, {"shard": VocabShard(true_vocab_size=11)})),
    ("start_index must be >= 0", lambda h, w, t: (h, w, t, {"shard": VocabShard(start_index=-3, true_vocab_size=9)})),
    ("chunk_rows", lambda h, w, t: (h, w, t, {"chunk_rows": 0})),
    ("chunk_rows", lambda h, w, t: (h, w, t, {"chunk_rows": -3})),
    ("implementation", lambda h, w, t: (h, w, t, {"implementation": "cuda"})),
]


@pytest.mark.parametrize("message,make", BAD_INPUTS, ids=[f"{i}-{m}" for i, (m, _) in enumerate(BAD_INPUTS)])
def test_bad_input_names_the_problem(message, make):
    hidden, weight, targets, kwargs = make(*_ok())
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        vocab_parallel_linear_logprobs(hidden, weight, targets, **kwargs)



# ---- under Megatron's DDP: dW into the weight's main_grad ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_under_megatron_ddp_the_weight_gradient_goes_into_main_grad(dtype, tied):
    """A weight with Megatron DDP's `main_grad` and `grad_added_to_main_grad` gets dW added into `main_grad` (fp32,
    accumulating over microbatches: two calls here), the flag set, and Megatron's dummy as its autograd gradient
    (zeros where `zero_out_wgrad` says the weight is also the embedding)."""
    hidden, weight, targets, g_lp, _ = make_linear_case((40,), 8, 16, 14, dtype, seed=14)
    expected = anchor(hidden, weight, targets, 14, 1.0, g_lp, None)
    w = weight.clone().requires_grad_(True)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    if tied:
        w.zero_out_wgrad = True
    for _ in range(2):  # two microbatches
        (vocab_parallel_linear_logprobs(hidden, w, targets, shard=VocabShard(true_vocab_size=14), chunk_rows=7)
         * g_lp).sum().backward()
    assert w.grad_added_to_main_grad is True
    assert w.grad.shape == w.shape and w.grad.dtype == dtype
    if tied:
        assert bool((w.grad == 0).all()), "a tied weight's dummy gradient must be zeros (the hook adds it)"
    assert bool((w.main_grad[14:] == 0).all()), "padding rows of main_grad must stay exactly 0"
    # fp32: as the op's own dW (twice, in fp32); bf16: the chunks' products are rounded to bf16 on the CPU before
    # the fp32 sum, as in test_only_the_inputs_that_require_grad_get_one
    bound = GRAD_RTOL_FP32 if dtype == torch.float32 else 2 * BF16_UNIT_ROUNDOFF * (expected.max_logit + 2)
    error = float((w.main_grad.double() / 2 - expected.grad_weight).abs().max())
    assert error <= bound * float(expected.grad_weight.abs().max()), error


def test_a_cast_of_the_parameter_takes_the_plain_path():
    """Only the parameter itself carries `main_grad`: a weight cast to the compute dtype returns its gradient (which
    autograd carries back to the parameter, whose DDP hook adds it)."""
    hidden, weight, targets, g_lp, _ = make_linear_case((20,), 8, 16, 16, torch.float32, seed=15)
    w = weight.clone().requires_grad_(True)
    w.main_grad = torch.zeros(w.shape)
    w.grad_added_to_main_grad = False
    (vocab_parallel_linear_logprobs(hidden.double(), w.double(), targets) * g_lp).sum().backward()
    assert w.grad_added_to_main_grad is False and bool((w.main_grad == 0).all())
    expected = anchor(hidden, weight, targets, 16, 1.0, g_lp, None)
    torch.testing.assert_close(w.grad.double(), expected.grad_weight, atol=1e-6, rtol=1e-6)
