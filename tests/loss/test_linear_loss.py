"""The loss-fused linear path (`ClippedPGLoss.on_hidden_states`) against the materialised loss (`logits = scale *
hidden @ weight.T`, then `ClippedPGLoss`) in float64, across loss settings that couple a sequence's tokens (GSPO,
sequence-mean aggregation) or add per-token terms (KL, entropy bonus, VAPO), with padded vocab, untrained tokens,
several chunk sizes, and at TP = 2 against the full vocab. The float32 comparison runs on every device (conftest's
`device`: the cpu case, and the cuda case marked `gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import counted_collectives, run_on_ranks
from _loss_inputs import batch_for_logits, loss_config

from megatron_grpo.loss import ClippedPGLoss, count_valid
from megatron_grpo.ops import SamplingDistribution, VocabShard
from megatron_grpo.ops.core.chunking import sequence_chunks

BATCH, SEQ, HIDDEN, VOCAB, PADDED, SCALE = 5, 9, 12, 29, 32, 1.25
SETTINGS = {
    "token-mean": {},
    "entropy, KL, VAPO": {"entropy_coef": 0.03, "reference_policy_kl_penalty": 0.1,
                          "positive_example_nll_weight": 0.2},
    "GSPO, seq-mean": {"sequence_level_importance_ratio": True, "loss_agg_mode": "seq-mean-token-mean"},
    "seq-mean-token-sum-norm, TIS": {"loss_agg_mode": "seq-mean-token-sum-norm", "max_response_length": 8,
                                     "use_importance_sampling_correction": True,
                                     "truncated_importance_sampling": {"type": "tis", "ratio_max": 2.0}},
}


def make_problem(seed: int, dtype: torch.dtype):
    """Hidden states, a weight whose padding rows are huge (a leak into the softmax would show) and a batch."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, SEQ, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    weight[VOCAB:] = 40.0
    batch = batch_for_logits(SCALE * hidden @ weight.t(), VOCAB, seed=seed + 1)
    return hidden.to(dtype), weight.to(dtype), batch


def materialised(cfg, hidden, weight, batch, shard):
    """(loss, metrics, d hidden, d weight) through the logits."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    tokens, seqs = count_valid(batch)
    loss, metrics = ClippedPGLoss(cfg)(SCALE * h @ w.t(), batch, global_valid_tokens=tokens, global_valid_seqs=seqs,
                                       shard=shard)
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def fused(cfg, hidden, weight, batch, shard, chunk_rows):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    tokens, seqs = count_valid(batch)
    loss, metrics = ClippedPGLoss(cfg).on_hidden_states(h, w, batch, global_valid_tokens=tokens,
                                                        global_valid_seqs=seqs, shard=shard,
                                                        distribution=SamplingDistribution(logit_scale=SCALE),
                                                        chunk_rows=chunk_rows)
    (loss * 3.0).backward()  # the upstream gradient scales dH and dW (Megatron's loss scale)
    return loss.detach(), metrics, h.grad / 3.0, w.grad / 3.0


def assert_same(got, want, rtol, label):
    loss, metrics, grad_hidden, grad_weight = got
    want_loss, want_metrics, want_hidden, want_weight = want
    assert abs(float(loss) - float(want_loss)) <= rtol * max(1.0, abs(float(want_loss))), f"{label}: loss"
    assert metrics.keys() == want_metrics.keys(), label
    for name, value in want_metrics.items():
        torch.testing.assert_close(metrics[name].double(), value.double(), rtol=rtol, atol=rtol,
                                   msg=f"{label}: metric {name}")
    for name, a, b in (("hidden", grad_hidden, want_hidden), ("weight", grad_weight, want_weight)):
        error = float((a.double() - b.double()).abs().max())
        assert error <= rtol * float(b.abs().max()), f"{label}: grad {name} off by {error}"
    assert bool((grad_weight[VOCAB:] == 0).all()), f"{label}: padding rows of the weight must get exactly 0"


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("chunk_rows", [None, 7, 1])
def test_loss_fused_equals_the_materialised_loss_in_float64(setting, chunk_rows):
    cfg = loss_config(**SETTINGS[setting])
    hidden, weight, batch = make_problem(seed=3, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, hidden, weight, batch, shard)
    assert_same(fused(cfg, hidden, weight, batch, shard, chunk_rows), want, 1e-10, f"{setting} chunk={chunk_rows}")


def fused_on(device, cfg, hidden, weight, batch, shard, chunk_rows):
    """`fused` on `device` from CPU inputs; its results on the CPU."""
    on_device = {key: value.to(device) for key, value in batch.items()}
    loss, metrics, grad_hidden, grad_weight = fused(cfg, hidden.to(device), weight.to(device), on_device, shard,
                                                    chunk_rows)
    return loss.cpu(), {name: value.cpu() for name, value in metrics.items()}, grad_hidden.cpu(), grad_weight.cpu()


@pytest.mark.parametrize("setting", SETTINGS)
def test_loss_fused_in_float32_matches_float64(setting, device):
    cfg = loss_config(**SETTINGS[setting])
    hidden, weight, batch = make_problem(seed=5, dtype=torch.float32)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, hidden.double(), weight.double(), batch, shard)
    assert_same(fused_on(device, cfg, hidden, weight, batch, shard, chunk_rows=8), want, 1e-4, f"{setting} {device}")


def tp_worker(rank, world, setting):
    cfg = loss_config(**SETTINGS[setting])
    hidden, weight, batch = make_problem(seed=7, dtype=torch.float32)
    v_local = PADDED // world
    shard = VocabShard(true_vocab_size=VOCAB, group=dist.group.WORLD)
    with counted_collectives() as calls:
        loss, metrics, grad_hidden, grad_weight = fused(cfg, hidden, weight[rank * v_local:(rank + 1) * v_local],
                                                        batch, shard, chunk_rows=10)
    dist.all_reduce(grad_hidden)  # the caller's TP reduction
    return loss, metrics, grad_hidden, grad_weight, calls["n"]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_the_full_vocab(world):
    setting = "entropy, KL, VAPO"
    per_rank = run_on_ranks(world, tp_worker, setting)
    hidden, weight, batch = make_problem(seed=7, dtype=torch.float32)
    want = materialised(loss_config(**SETTINGS[setting]), hidden.double(), weight.double(), batch,
                        VocabShard(true_vocab_size=VOCAB))
    chunks = len(sequence_chunks(_trained_rows(batch), 10))
    for rank, (loss, metrics, grad_hidden, _, collectives) in enumerate(per_rank):
        assert collectives == chunks, f"rank {rank}: {collectives} collectives for {chunks} chunks"
        grad_weight = torch.cat([r[3] for r in per_rank])
        assert_same((loss, metrics, grad_hidden, grad_weight), want, 1e-4, f"TP={world} rank {rank}")


def _trained_rows(batch) -> list[int]:
    """Trained rows (next-token targets) per sequence: the trained tokens after position 0."""
    mask = batch["token_mask"].bool() & batch["sample_mask"].bool()[:, None]
    return mask[:, 1:].sum(dim=1).tolist()


def test_sequence_chunks_keep_sequences_whole():
    assert sequence_chunks([3, 3, 3], 6) == [slice(0, 2), slice(2, 3)]
    assert sequence_chunks([10, 1, 1], 4) == [slice(0, 1), slice(1, 3)]  # a long sequence is a chunk of its own
    assert sequence_chunks([0, 0, 2, 0], 1) == [slice(0, 3), slice(3, 4)]
    assert sequence_chunks([], 4) == []


def test_bad_hidden_shape_is_named():
    hidden, weight, batch = make_problem(seed=1, dtype=torch.float32)
    tokens, seqs = count_valid(batch)
    for loss_fused in (True, False):
        with pytest.raises(ValueError,
                           match=r"hidden: expected shape \[5, 9, H\] to match input_ids, got \[5, 8, 12\]"):
            ClippedPGLoss(loss_config()).on_hidden_states(hidden[:, :-1], weight, batch, global_valid_tokens=tokens,
                                                          global_valid_seqs=seqs, loss_fused=loss_fused)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_under_megatron_ddp_the_loss_fused_weight_gradient_goes_into_main_grad(tied):
    """The loss-fused path keeps dW until backward (the upstream gradient scales it), then adds it into the weight's
    `main_grad` (Megatron DDP's) and hands autograd Megatron's dummy (zeros for a tied weight)."""
    cfg = loss_config(**SETTINGS["entropy, KL, VAPO"])
    hidden, weight, batch = make_problem(seed=3, dtype=torch.float64)
    shard = VocabShard(true_vocab_size=VOCAB)
    want = materialised(cfg, hidden, weight, batch, shard)
    w = weight.clone().requires_grad_(True)
    w.main_grad = torch.zeros_like(weight)
    w.grad_added_to_main_grad = False
    if tied:
        w.zero_out_wgrad = True
    tokens, seqs = count_valid(batch)
    loss, _ = ClippedPGLoss(cfg).on_hidden_states(hidden, w, batch, global_valid_tokens=tokens, global_valid_seqs=seqs,
                                                  shard=shard, distribution=SamplingDistribution(logit_scale=SCALE),
                                                  chunk_rows=7)
    (loss * 3.0).backward()
    assert w.grad_added_to_main_grad is True and (not tied or bool((w.grad == 0).all()))
    torch.testing.assert_close(w.main_grad / 3.0, want[3], rtol=1e-10, atol=1e-10)  # float64 throughout
