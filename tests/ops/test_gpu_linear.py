"""GPU-specific cases of the fused linear logprob op (`vocab_parallel_linear_logprobs`) and the loss-fused path
(on a GPU machine: `pytest -m gpu`).

The op's general cases run on every device in test_linear_logprobs.py (its one-rank anchor comparisons; TP over
gloo, bad inputs and collective counts on the CPU). Here: the CUDA kernels inside the op's chunked GEMM loop, at
shapes whose rows split across blocks, against a float64 anchor computed on the GPU, a production-like shape with
its gradients, the memory the op exists to save, and the loss-fused head in bf16 (its CUDA streams) and its memory at
the issue's H200 shape. Every test name starts with `test_fused_linear_`: benchmarks/gpu_check.sh runs them as their
own step.
"""

from __future__ import annotations

import pytest
import torch
from test_linear_logprobs import Anchor, assert_matches  # its fp32 / bf16 tolerance model

from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_linear_logprobs, vocab_parallel_logprobs

pytestmark = pytest.mark.gpu  # conftest skips it, with the reason, where there is no CUDA device

DEVICE = "cuda"  # every case runs here (a module constant, so that the helpers can be checked on the CPU too)


def linear_case_on(device, rows: int, hidden_size: int, local_vocab: int, vocab_start: int, true_vocab: int,
                   dtype: torch.dtype, seed: int, ignore_every: int = 4):
    """Hidden states `[rows, H]` and a `[V_local, H]` weight shard holding ids vocab_start.. (logits of scale ~3;
    padding rows x100, so that a leak into the softmax shows), targets inside the shard's real ids with every
    `ignore_every`-th row ignored (row 0 trained), and the upstream gradients; generated on `device`."""
    gen = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=gen, device=device)
    weight = torch.randn(local_vocab, hidden_size, generator=gen, device=device) * (3 / hidden_size**0.5)
    valid = min(true_vocab - vocab_start, local_vocab)
    weight[valid:] *= 100
    targets = torch.randint(vocab_start, vocab_start + valid, (rows,), generator=gen, device=device)
    if ignore_every:
        targets[1::ignore_every] = -1
    g_lp, g_h = torch.randn(rows, generator=gen, device=device), torch.randn(rows, generator=gen, device=device)
    return hidden.to(dtype), weight.to(dtype), targets, g_lp, g_h


def linear_anchor64(hidden, weight, targets, vocab_start: int, true_vocab: int, scale: float, g_lp,
                    g_h) -> Anchor:
    """float64 on the inputs' device, from the definition and independent of `megatron_grpo.ops`: logits =
    scale * h @ W.T over the shard's real rows (its targets all lie in it, so it is the whole softmax), the
    target's log_softmax, the entropy, and autograd for the gradients of h and W (W's padding rows get 0)."""
    valid = min(true_vocab - vocab_start, weight.shape[0])
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    logits = (h @ w[:valid].t()) * scale
    log_p = torch.log_softmax(logits, dim=-1)
    trained = targets >= 0
    zero = torch.zeros((), dtype=torch.float64, device=h.device)
    logprob = torch.where(trained, log_p.gather(1, (targets - vocab_start).clamp(min=0)[:, None]).squeeze(1), zero)
    entropy = torch.where(trained, -(log_p.exp() * log_p).sum(-1), zero)
    objective = (logprob * g_lp.double()).sum()
    if g_h is not None:
        objective = objective + (entropy * g_h.double()).sum()
    objective.backward()
    with torch.no_grad():
        real = logits.detach()[trained]
        p = log_p.detach()[trained].exp()
        std = (p * (real - (p * real).sum(-1, keepdim=True)) ** 2).sum(-1).sqrt()
        max_logit = float(real.abs().max()) if real.numel() else 0.0
        max_std = float(std.max()) if std.numel() else 0.0
    return Anchor(logprob=logprob.detach(), entropy=entropy.detach(), grad_hidden=h.grad, grad_weight=w.grad,
                  max_logit=max_logit, max_std=max_std)


def run_linear(hidden, weight, targets, g_lp, g_h, **kwargs):
    """Forward and backward of the op (CUDA kernels only) on fresh leaves: (logprob, entropy or None, dH, dW)."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with_entropy = g_h is not None
    out = vocab_parallel_linear_logprobs(h, w, targets, with_entropy=with_entropy, implementation="fused", **kwargs)
    logprob, entropy = out if with_entropy else (out, None)
    ((logprob * g_lp).sum() + ((entropy * g_h).sum() if with_entropy else 0)).backward()
    return logprob.detach(), None if entropy is None else entropy.detach(), h.grad, w.grad


def materialised_fp32(hidden, weight, targets, vocab_start: int, true_vocab: int, scale: float, g_lp, g_h):
    """The same objective in plain torch fp32 with materialised logits: the accuracy an fp32 run gets without
    the op, to bound the op's fp32 error at shapes where a fixed tolerance would not fit."""
    valid = min(true_vocab - vocab_start, weight.shape[0])
    h, w = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)
    log_p = torch.log_softmax((h @ w[:valid].t()) * scale, dim=-1)
    trained = targets >= 0
    logprob = torch.where(trained, log_p.gather(1, (targets - vocab_start).clamp(min=0)[:, None]).squeeze(1), 0.0)
    entropy = torch.where(trained, -(log_p.exp() * log_p).sum(-1), 0.0)
    objective = (logprob * g_lp).sum() + ((entropy * g_h).sum() if g_h is not None else 0)
    objective.backward()
    return logprob.detach(), entropy.detach(), h.grad, w.grad


def assert_linear_matches(result, expected: Anchor, baseline, targets, valid: int, dtype: torch.dtype, label: str):
    """bf16: `assert_matches`'s bound from the rounding of the logits to bf16. fp32: exact zeros for ignored rows
    and padding weight rows, and each of logprob, entropy, dH, dW within twice the error of `materialised_fp32`
    (`baseline`) on the same inputs, plus 1e-6 of the largest entry."""
    if dtype != torch.float32:
        assert_matches(*result, targets, valid, dtype, expected, label=label)
        return
    logprob, entropy, grad_hidden, grad_weight = result
    ignored = targets < 0
    assert logprob.dtype == torch.float32 and grad_hidden.dtype == grad_weight.dtype == dtype, label
    assert bool((logprob[ignored] == 0).all()) and bool((grad_hidden[ignored] == 0).all()), label
    assert bool((grad_weight[valid:] == 0).all()), f"{label}: padding weight rows must get exactly zero gradient"
    wanted = (expected.logprob, expected.entropy, expected.grad_hidden, expected.grad_weight)
    for name, actual, ours_baseline, anchor64 in zip(("logprob", "entropy", "grad hidden", "grad weight"), result,
                                                     baseline, wanted):
        if actual is None:
            continue
        err = float((actual.double() - anchor64).abs().max())
        bound = 2 * float((ours_baseline.double() - anchor64).abs().max()) + 1e-6 * float(anchor64.abs().max())
        assert err <= bound, f"{label}: {name} off by {err:.3g}, more than {bound:.3g} (twice torch fp32's error)"


def check_linear_case(rows, hidden_size, local_vocab, vocab_start, true_vocab, scale, chunk_rows, with_entropy,
                      dtype, seed, device=None):
    """The op (CUDA kernels) against the float64 anchor on one case; returns the largest logprob error."""
    device = DEVICE if device is None else device
    hidden, weight, targets, g_lp, g_h = linear_case_on(device, rows, hidden_size, local_vocab, vocab_start,
                                                        true_vocab, dtype, seed)
    g_h = g_h if with_entropy else None
    result = run_linear(hidden, weight, targets, g_lp, g_h,
                        shard=VocabShard(start_index=vocab_start, true_vocab_size=true_vocab),
                        distribution=SamplingDistribution(logit_scale=scale), chunk_rows=chunk_rows)
    expected = linear_anchor64(hidden, weight, targets, vocab_start, true_vocab, scale, g_lp, g_h)
    baseline = materialised_fp32(hidden, weight, targets, vocab_start, true_vocab, scale, g_lp, g_h) \
        if dtype == torch.float32 else None
    del hidden, weight
    valid = min(true_vocab - vocab_start, local_vocab)
    label = f"T={rows} H={hidden_size} V_local={local_vocab} valid={valid} scale={scale} chunk={chunk_rows} {dtype}"
    assert_linear_matches(result, expected, baseline, targets, valid, dtype, label)
    return float((result[0].double() - expected.logprob).abs().max())


# (T, H, V_local, vocab_start, true vocab, logit_scale, chunk_rows, entropy), each with rows split across blocks
# inside the chunk loop: chunk sizes that do not divide the trained rows (750 trained rows in chunks of 333; 193
# in chunks of 100), the default chunk, a shard with a padded tail at a vocab offset (TP rank 1 of 2), no
# padding, no entropy, logit_scale != 1. Small shapes (one-row chunks, ...) run as test_linear_logprobs's cuda
# cases.
FUSED_LINEAR_CASES = [
    (1000, 256, 5003, 0, 4990, 1 / 0.7, 333, True),
    (515, 128, 32771, 32771, 2 * 32771 - 71, 1.0, None, True),
    (257, 64, 50257, 0, 50257, 2.0, 100, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", FUSED_LINEAR_CASES, ids=lambda c: f"T{c[0]}-H{c[1]}-V{c[2]}-chunk{c[6]}")
def test_fused_linear_matches_float64_on_cuda(case, dtype):
    check_linear_case(*case, dtype=dtype, seed=FUSED_LINEAR_CASES.index(case))


def test_fused_linear_production_shape_gradients():
    """T = 8192, H = 4096, V_local = 32768 in bf16 (TP rank 1 of 2, a padded tail): the default chunk (4105 rows)
    leaves 6144 trained rows in two unequal chunks, and dW is summed in fp32 across them."""
    check_linear_case(8192, 4096, 32768, 32768, 2 * 32768 - 77, 1.0, None, True, torch.bfloat16, seed=8192)


def extra_peak_bytes(step) -> int:
    """Peak CUDA memory allocated while `step()` runs beyond what is allocated after it (what was there before,
    plus the gradients and outputs it leaves behind, which any method must produce): its working memory."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    kept = step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    del kept
    return extra


@pytest.mark.parametrize("ignore_every", [0, 4], ids=["all-trained", "every-4th-ignored"])
def test_fused_linear_peak_memory_stays_far_below_the_logits(ignore_every):
    """T = 32768, H = 4096, V_local = 32768 (padded tail), bf16, forward + backward with entropy: the materialised
    path's working memory holds at least the [T, V_local] logits (2 GiB); the fused op's holds one chunk of
    logits, an fp32 dW sum only where it is small next to the logits (`fp32_sum_is_small`: not here, 2H/T = 1/4)
    and, with ignored rows, the trained rows of hidden and of dH: at most a tenth of the materialised path's."""
    from megatron_grpo.ops.core.chunking import chunk_rows_for
    from megatron_grpo.ops.core.gemm import fp32_sum_is_small

    rows, hidden_size, local_vocab, true_vocab, dtype = 32768, 4096, 32768, 32768 - 77, torch.bfloat16
    hidden, weight, targets, g_lp, g_h = linear_case_on(DEVICE, rows, hidden_size, local_vocab, 0, true_vocab,
                                                        dtype, seed=5, ignore_every=ignore_every)
    size = hidden.element_size()
    logits_bytes = rows * local_vocab * size
    trained = int((targets >= 0).sum())
    chunk_rows = chunk_rows_for(trained, true_vocab, dtype)
    chunk_bytes = min(chunk_rows, trained) * true_vocab * size
    accumulator_bytes = true_vocab * hidden_size * 4 if trained > chunk_rows and fp32_sum_is_small(
        trained, hidden_size, dtype) else 0
    trained_row_copies = 2 * trained * hidden_size * size if ignore_every else 0  # hidden rows and their dH
    slack = 64 * 2**20  # partials and row statistics ([T, 4] fp32), the trained rows' index, cuBLAS workspace
    bound = chunk_bytes + accumulator_bytes + trained_row_copies + slack
    h, w = hidden.requires_grad_(True), weight.requires_grad_(True)  # leaves made outside the measured steps

    def fused():
        h.grad = w.grad = None
        logprob, entropy = vocab_parallel_linear_logprobs(h, w, targets, shard=VocabShard(true_vocab_size=true_vocab),
                                                          with_entropy=True, implementation="fused")
        ((logprob * g_lp).sum() + (entropy * g_h).sum()).backward()
        return logprob.detach(), entropy.detach()

    def materialised():
        h.grad = w.grad = None
        logprob, entropy = vocab_parallel_logprobs(h @ w.t(), targets, shard=VocabShard(true_vocab_size=true_vocab),
                                                   with_entropy=True, implementation="fused")
        ((logprob * g_lp).sum() + (entropy * g_h).sum()).backward()
        return logprob.detach(), entropy.detach()

    fused()  # warm-up: kernels loaded and cuBLAS workspaces allocated before anything is measured
    fused_extra, materialised_extra = extra_peak_bytes(fused), extra_peak_bytes(materialised)
    mib = {name: f"{value / 2**20:.0f} MiB" for name, value in
           (("fused", fused_extra), ("materialised", materialised_extra), ("bound", bound),
            ("logits", logits_bytes))}
    print(f"extra peak memory, T={rows} H={hidden_size} V_local={local_vocab} bf16 ignore_every={ignore_every}: {mib}")
    assert materialised_extra >= logits_bytes, mib  # the measurement sees the logits where they exist
    assert bound < logits_bytes, mib  # the bound leaves no room for a [T, V_local] tensor
    assert fused_extra <= bound, mib
    assert fused_extra <= 0.10 * materialised_extra, mib


@pytest.mark.parametrize("setting, filter_name", [("dual clip, k3 KL clamped, entropy, VAPO", None),
                                                  ("dual clip, k3 KL clamped, entropy, VAPO", "top-k"),
                                                  ("REINFORCE", "top-p"), ("GSPO, seq-mean-token-mean", None)])
def test_fused_linear_loss_fused_head_in_bf16_matches_the_materialised_step(setting, filter_name):
    """The loss-fused head with the CUDA kernels and its two streams, in bf16, against the materialised loss step on
    CUDA, to the bound of test_linear_loss's bf16 comparison (the grid problem: the same logits in both paths)."""
    from _loss_inputs import loss_config
    from test_linear_loss import BATCH, FILTERS, SETTINGS, VOCAB, bf16_bound, fused, make_problem, materialised

    overrides, prev = SETTINGS[setting]
    cfg, distribution = loss_config(**overrides), FILTERS.get(filter_name)
    hidden, weight, batch = make_problem(seed=8, dtype=torch.bfloat16, grid=True)
    shard = VocabShard(true_vocab_size=VOCAB)
    on_device = {key: value.to(DEVICE) for key, value in batch.items()}
    want = materialised(cfg, prev, hidden.to(DEVICE), weight.to(DEVICE), on_device, shard, distribution)
    got = fused(cfg, prev, hidden.to(DEVICE), weight.to(DEVICE), on_device, shard, 5, distribution, upstream=1.0)
    torch.testing.assert_close(got[1]["curr_logprobs"].cpu(), want[1]["curr_logprobs"].cpu(), rtol=0, atol=0)
    trained = int(on_device["token_mask"].sum())
    bounds = bf16_bound(cfg, prev, hidden, weight, batch, shard, distribution, -(-trained // 5) + BATCH)
    for a, b, bound in zip(got[2:], want[2:], bounds):
        error = (a.double().cpu() - b.double().cpu()).abs() - bound
        assert float(error.max()) <= 1e-6 * float(b.double().abs().max())


@pytest.mark.parametrize("filter_name", [None, "top-p"])
def test_fused_linear_loss_fused_head_memory_at_the_h200_shape(filter_name):
    """T = 8192 (8 sequences of 1024), H = 4096, V_local = 65536, bf16, the GRPO loss with an entropy bonus: the
    loss-fused head's working memory against the materialised loss step's with its in-place backward (the train
    step's), at most a tenth of it, and its dW under Megatron's DDP (a bound upstream gradient) in main_grad with
    no dW of its own. Measured with torch's allocator peak beyond what the step leaves behind."""
    from _loss_inputs import loss_config

    from megatron_grpo.loss import ClippedPGLoss, count_valid

    sequences, length, hidden_size, local_vocab = 8, 1024, 4096, 65536
    gen = torch.Generator(DEVICE).manual_seed(3)
    hidden = torch.randn(sequences, length, hidden_size, generator=gen, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(local_vocab, hidden_size, generator=gen, device=DEVICE) * (3 / hidden_size**0.5)).to(
        torch.bfloat16)
    batch = {"input_ids": torch.randint(0, local_vocab, (sequences, length), generator=gen, device=DEVICE),
             "token_mask": torch.ones(sequences, length, device=DEVICE),
             "sample_mask": torch.ones(sequences, device=DEVICE),
             "advantages": torch.randn(sequences, length, generator=gen, device=DEVICE)}
    tokens, seqs = count_valid(batch)
    loss_fn = ClippedPGLoss(loss_config(entropy_coef=0.01))
    call = {"global_valid_tokens": tokens, "global_valid_seqs": seqs, "prev_logprobs_from_current": True,
            "distribution": SamplingDistribution(top_p=0.9) if filter_name else None, "check_inputs": False}
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

    def materialised():
        h.grad = w.grad = None
        loss_fn(h @ w.t(), batch, inplace_backward=True, **call)[0].backward()
        return h.grad, w.grad

    def fused():
        h.grad = w.grad = None
        loss_fn.on_hidden_states(h, w, batch, **call)[0].backward()
        return h.grad, w.grad

    fused()  # warm-up: cuBLAS workspaces and the side stream exist before anything is measured
    fused_extra, materialised_extra = extra_peak_bytes(fused), extra_peak_bytes(materialised)
    mib = {"fused": fused_extra / 2**20, "materialised": materialised_extra / 2**20}
    print(f"loss-fused head, extra peak memory at T=8192 H=4096 V_local=65536 bf16 filter={filter_name}: {mib}")
    assert materialised_extra >= sequences * length * local_vocab * 2, mib  # the logits
    assert fused_extra <= 0.10 * materialised_extra, mib
    w.main_grad, w.grad_added_to_main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEVICE), False
    h.grad = w.grad = None
    loss_fn.on_hidden_states(h, w, batch, upstream_gradient=1.0, **call)[0].backward()
    assert w.grad_added_to_main_grad and float(w.main_grad.abs().max()) > 0


def test_fused_linear_loss_fused_path_in_bf16_matches_the_materialised_loss():
    """`ClippedPGLoss.on_hidden_states` with the CUDA kernels in bf16 against the materialised loss in float64
    (float32 runs as test_linear_loss's cuda cases)."""
    from _loss_inputs import loss_config
    from test_linear_loss import SETTINGS, VOCAB, assert_same, fused_on, make_problem, materialised

    cfg = loss_config(**SETTINGS["dual clip, k3 KL clamped, entropy, VAPO"][0])
    hidden, weight, batch = make_problem(seed=9, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, {}, hidden, weight, batch, shard)
    got = fused_on(DEVICE, cfg, hidden.to(torch.bfloat16), weight.to(torch.bfloat16), batch, shard, chunk_rows=7)
    assert_same(got, want, 3e-2, "loss-fused on CUDA bf16")
