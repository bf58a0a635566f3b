"""The fused paths at a real vocabulary over TP = 2 (gloo): Qwen2.5's 151,936 tokens, which Megatron pads to 152,064,
so rank 1's shard holds 128 fewer valid columns than rank 0's.

16 sequences of 442 trained tokens (7,072 rows) at a chunk budget of 128 MiB (`BUDGET`, set in the ranks): the budget
decides the chunk size, and sizing it from each rank's valid columns would cut the ranks' calls differently (441 rows
on rank 0, 442 on rank 1: 17 chunks on one rank, 16 on the other), so that their per-chunk collectives mismatch. The
test asserts these conditions before it runs, then runs all four fused paths on both ranks:

1. the fused op with its gradient (`vocab_parallel_linear_logprobs`, then `ClippedPGLoss` on its logprobs);
2. the same with a top-k filter (a collective per chunk);
3. the loss-fused step (`ClippedPGLoss.on_hidden_states`, an all-gather per chunk of trained rows);
4. a logprob pass (no gradient, top-p: a radix select with collectives per chunk).

The ranks must agree bit for bit on every loss and logprob; the logprobs of rows at the chunk boundaries match a
float64 reference. H = 16 keeps the GEMMs cheap: the kernels' passes over 7,072 x 76,032 logits per rank dominate.
"""

from __future__ import annotations

import _dist
import pytest
import torch
import torch.distributed as dist
from _dist import counted_collectives, run_on_ranks
from _loss_inputs import loss_config
from logprob_reference import filtered_keep_mask

from megatron_grpo.loss import ClippedPGLoss, count_valid
from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_linear_logprobs
from megatron_grpo.ops.core import chunking
from megatron_grpo.ops.core.chunking import chunk_rows_for

TRUE_VOCAB, PADDED, TP = 151_936, 152_064, 2
SEQUENCES, TRAINED, HIDDEN = 16, 442, 16
SEQ = TRAINED + 1  # position 0 has no logprob: every later token is trained
ROWS = SEQUENCES * TRAINED
V_LOCAL = PADDED // TP
VALID = [min(max(TRUE_VOCAB - rank * V_LOCAL, 0), V_LOCAL) for rank in range(TP)]
TOP_K, TOP_P = 40, 0.9
BUDGET = 128 * 2**20  # bytes of logits per chunk: below the default, so that it decides at this test's row count
PATHS = ("fused op", "fused op, top-k", "loss-fused", "logprob pass, top-p")

pytestmark = pytest.mark.slow


def problem():
    """Hidden states, the full padded weight (padding rows huge: a leak into the softmax would show) and a batch whose
    targets include ids on both shards and the last real id."""
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(SEQUENCES, SEQ, HIDDEN, generator=gen)
    weight = torch.randn(PADDED, HIDDEN, generator=gen) * (3.0 / HIDDEN**0.5)  # logits of std ~3: a peaked softmax
    weight[TRUE_VOCAB:] = 30.0
    input_ids = torch.randint(0, TRUE_VOCAB, (SEQUENCES, SEQ), generator=gen)
    input_ids[:, 1] = TRUE_VOCAB - 1
    input_ids[:, 2] = V_LOCAL  # rank 1's first column
    batch = {
        "input_ids": input_ids,
        "token_mask": torch.ones(SEQUENCES, SEQ),
        "sample_mask": torch.ones(SEQUENCES),
        "advantages": torch.randn(SEQUENCES, generator=gen),
    }
    return hidden, weight, batch


def _loss_on(cfg, batch, logprobs, entropy):
    tokens, seqs = count_valid(batch)
    return ClippedPGLoss(cfg)(None, batch, global_valid_tokens=tokens, global_valid_seqs=seqs,
                              prev_logprobs_from_current=True, curr_logprobs=logprobs, curr_entropy=entropy)[0]


def worker(rank: int, world: int) -> dict:
    default_budget, chunking.CHUNK_BYTES = chunking.CHUNK_BYTES, BUDGET
    try:
        return _run_paths(rank)
    finally:
        chunking.CHUNK_BYTES = default_budget


def _run_paths(rank: int) -> dict:
    hidden, weight, batch = problem()
    shard_weight = weight[rank * V_LOCAL:(rank + 1) * V_LOCAL].contiguous()
    shard = VocabShard(true_vocab_size=TRUE_VOCAB, group=dist.group.WORLD)
    cfg = loss_config(entropy_coef=0.01)
    targets = batch["input_ids"]
    out = {"losses": {}, "logprobs": {}, "collectives": {}}

    def op_path(name, distribution=None):
        h, w = hidden.clone().requires_grad_(True), shard_weight.clone().requires_grad_(True)
        with counted_collectives() as calls:
            logprobs, entropy = vocab_parallel_linear_logprobs(h, w, targets, shard=shard, shift=True,
                                                               with_entropy=True, distribution=distribution)
            loss = _loss_on(cfg, batch, logprobs, entropy)
            loss.backward()
        out["losses"][name], out["logprobs"][name] = loss.detach(), logprobs.detach()
        out["collectives"][name] = calls["n"]
        assert h.grad is not None and bool(torch.isfinite(h.grad).all()), name
        assert bool((w.grad[VALID[rank]:] == 0).all()), f"{name}: padding rows of dW must be exactly 0"

    op_path(PATHS[0])
    op_path(PATHS[1], SamplingDistribution(top_k=TOP_K))

    h, w = hidden.clone().requires_grad_(True), shard_weight.clone().requires_grad_(True)
    tokens, seqs = count_valid(batch)
    with counted_collectives() as calls:
        loss, metrics = ClippedPGLoss(cfg).on_hidden_states(h, w, batch, global_valid_tokens=tokens,
                                                            global_valid_seqs=seqs, shard=shard,
                                                            prev_logprobs_from_current=True)
        loss.backward()
    out["losses"][PATHS[2]], out["logprobs"][PATHS[2]] = loss.detach(), metrics["curr_logprobs"].detach()
    out["collectives"][PATHS[2]] = calls["n"]

    with torch.no_grad(), counted_collectives() as calls:
        logprobs = vocab_parallel_linear_logprobs(hidden, shard_weight, targets, shard=shard, shift=True,
                                                  distribution=SamplingDistribution(top_p=TOP_P))
    out["losses"][PATHS[3]], out["logprobs"][PATHS[3]] = logprobs.double().sum(), logprobs
    out["collectives"][PATHS[3]] = calls["n"]
    return out


def test_the_conditions_of_the_mismatch_hold():
    """The budget decides the chunk, and rank-local sizing would cut the ranks' calls differently."""
    by_valid = [chunk_rows_for(ROWS, valid, torch.float32, BUDGET) for valid in VALID]
    assert VALID == [V_LOCAL, V_LOCAL - (PADDED - TRUE_VOCAB)]
    assert by_valid == [441, 442] and max(by_valid) < ROWS  # the budget, not the row share, decides
    assert -(-ROWS // by_valid[0]) != -(-ROWS // by_valid[1])  # and row chunks differ in number
    assert chunk_rows_for(ROWS, V_LOCAL, torch.float32, BUDGET) == by_valid[0]  # what every rank uses: the shard width


def test_all_four_fused_paths_agree_across_ranks_at_a_real_vocab(monkeypatch):
    monkeypatch.setattr(_dist, "TIMEOUT_S", 900)  # each rank streams 4 x 7,072 x 76,032 logits, several times
    per_rank = run_on_ranks(TP, worker)
    for path in PATHS:
        assert per_rank[0]["collectives"][path] == per_rank[1]["collectives"][path], path
        assert torch.equal(per_rank[0]["losses"][path], per_rank[1]["losses"][path]), path
        assert torch.equal(per_rank[0]["logprobs"][path], per_rank[1]["logprobs"][path]), path
    assert per_rank[0]["collectives"][PATHS[2]] == -(-ROWS // 441)  # one all-gather per chunk of trained rows

    hidden, weight, batch = problem()
    # Rows at the chunk boundaries (441 rows per chunk: the second chunk starts at row 441), the first and the last.
    positions = [(0, 1), (1, 441), (1, 442), (2, 1), (15, 442)]
    filters = {PATHS[0]: (None, None), PATHS[1]: (TOP_K, None), PATHS[2]: (None, None), PATHS[3]: (None, TOP_P)}
    for b, t in positions:
        logits = (hidden[b, t - 1].double() @ weight[:TRUE_VOCAB].double().t())[None]
        target = int(batch["input_ids"][b, t])
        for path, (top_k, top_p) in filters.items():
            keep = filtered_keep_mask(logits, top_k, top_p)[0]
            want = float(torch.log_softmax(logits[0].masked_fill(~keep, float("-inf")), dim=-1)[target])
            got = float(per_rank[0]["logprobs"][path][b, t])
            # fp32 logits of |z| <~ 20 (H = 16 products): ~1e-5 absolute each, and lse carries one such error.
            assert (got == want == float("-inf")) or abs(got - want) < 1e-4, (path, b, t, got, want)
    # The fused op's loss and the loss-fused step's agree (the same logprobs, combined per call or per chunk).
    assert abs(float(per_rank[0]["losses"][PATHS[0]]) - float(per_rank[0]["losses"][PATHS[2]])) < 1e-5
    for path in PATHS[1], PATHS[3]:  # the filters drop some targets, and keep others
        filtered = per_rank[0]["logprobs"][path][:, 1:]
        assert bool(torch.isneginf(filtered).any()) and bool(torch.isfinite(filtered).any()), path
