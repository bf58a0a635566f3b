"""Kept sets under context parallelism: the CP split shifts and splits them with the other per-token tensors (padded
and packed), and at CP 2 the loss on the three paths and the replayed prev pass (`compute_logprobs`) equal CP 1.

One launch of 2 gloo ranks (CP 2, DP 1). The loss runs on each rank's share with the share's rows of the full batch's
hidden states (found through a probe tensor the split moves like the others); the shares' losses and gradients
add up to the whole batch's. The prev pass runs test_context_parallel.py's position-wise model through Megatron's
schedule, so its logprobs at CP 2 are those of its whole logits, which the test replays at CP 1.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_on_ranks
from _loss_inputs import loss_config
from test_context_parallel import PADDED, SEQ, VOCAB, _build_model, _global_batch, _master_weights, _reference_logits

from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_logprobs
from megatron_grpo.ops.kept_set import KeptSet

REPLAY = SamplingDistribution(logit_scale=1 / 0.8, top_k=5, replay_kept_set=True)
HIDDEN = 6
PATHS = ("logits", "linear", "loss_fused")
PACKED_ROWS, PACKED_LENGTHS = [0, 1, 2], [8, 12, 16]  # rows cut to multiples of 2·CP = 4


def _batch_with_kept_sets() -> dict[str, torch.Tensor]:
    """test_context_parallel's batch (ragged spans, chunk boundaries trained), a kept set on every response token:
    the top-5 of the model's own scaled logits on even positions (taken by threshold), random ones on odd ones."""
    batch = {key: value for key, value in _global_batch().items() if key != "prev_logprobs"}
    logits = _reference_logits(_master_weights(), batch["input_ids"])[:, :-1, :VOCAB]
    gen = torch.Generator().manual_seed(8)
    keep = torch.rand(*batch["input_ids"].shape, VOCAB, generator=gen) < 0.3
    top = logits >= logits.topk(5, dim=-1).values[..., -1:]
    keep[:, 2::2] = top[:, 1::2]
    response = batch["token_mask"] != 0
    response[:, 0] = False
    keep[~response] = False
    keep[response, batch["input_ids"][response]] = True
    kept = KeptSet.from_mask(keep)
    return {**batch, "token_mask": response.float(), "kept_set_offsets": kept.offsets, "kept_set_ids": kept.ids}


def _loss(path, hidden, weight, batch, tokens, seqs, context=None):
    from megatron_grpo.loss import ClippedPGLoss

    loss_fn = ClippedPGLoss(loss_config(loss_agg_mode="seq-mean-token-mean", sequence_level_importance_ratio=True,
                                        use_importance_sampling_correction=True, entropy_coef=0.03,
                                        truncated_importance_sampling=dict(type="tis", ratio_max=1.5)))
    keywords = dict(global_valid_tokens=tokens, global_valid_seqs=seqs, shard=VocabShard(true_vocab_size=VOCAB),
                    distribution=REPLAY, prev_logprobs_from_current=True, context=context)
    if path == "logits":
        return loss_fn(hidden @ weight.t(), batch, **keywords)
    return loss_fn.on_hidden_states(hidden, weight, batch, loss_fused=path == "loss_fused", chunk_rows=3,
                                    **keywords)


def _shares(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_grpo.loss import count_valid
    from megatron_grpo.loss.packing import pack_rows
    from megatron_grpo.megatron import (
        ParallelParams,
        compute_logprobs,
        init_parallel,
        split_for_context_parallel,
    )
    from megatron_grpo.megatron.context_parallel import context_shard

    init_parallel(ParallelParams(context_parallel_size=2))
    padded = _batch_with_kept_sets()
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(*padded["input_ids"].shape, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED, HIDDEN, generator=gen, dtype=torch.float64)
    layouts = {"padded": padded, "packed": pack_rows({**padded, "hidden": hidden}, PACKED_ROWS, PACKED_LENGTHS)}
    packed_hidden = layouts["packed"].pop("hidden")
    out = {}
    for name, batch in layouts.items():
        full_hidden = hidden if name == "padded" else packed_hidden
        tokens, seqs = count_valid(batch)
        # The split hands row t position t + 1's tensors (0 where a sequence ends): position q's flat index q is row
        # q - 1's 1-based index, which finds each row of the share its hidden state.
        probe = torch.arange(batch["input_ids"].numel()).view(batch["input_ids"].shape)
        share = split_for_context_parallel({**batch, "probe": probe})
        rows = share.pop("probe") - 1  # -1: a sequence's last row, which scores nothing
        for path in PATHS:
            whole_h, whole_w = full_hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            whole, _ = _loss(path, whole_h, whole_w, batch, tokens, seqs)
            whole.backward()
            h, w = full_hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            local_h = h.reshape(-1, HIDDEN)[rows.clamp(min=0).reshape(-1)].view(*rows.shape, HIDDEN)
            loss, metrics = _loss(path, local_h, w, share, tokens, seqs, context=context_shard())
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = torch.cat([h.grad.reshape(-1), w.grad.reshape(-1)])
            dist.all_reduce(grads)
            out[name, path] = {"loss": (total, whole.detach()),
                               "grads": (grads, torch.cat([whole_h.grad.reshape(-1), whole_w.grad.reshape(-1)])),
                               "kept_set_mass": metrics["kept_set_mass"]}
    model = _build_model(1, 2)
    passes = {}
    for name, max_tokens in (("padded", None), ("packed", 2 * SEQ)):
        passes[name] = compute_logprobs(model, padded, micro_batch_size=2, vocab=VocabShard(true_vocab_size=VOCAB),
                                        distribution=REPLAY, max_tokens_per_microbatch=max_tokens)
    parallel_state.destroy_model_parallel()
    return {"shares": out, "passes": passes}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(2, _shares)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("path", PATHS)
def test_context_parallel_shares_of_the_replayed_loss_add_up_to_the_whole(ranks, layout, path):
    """float64: the shares' sums differ from the whole's by rounding (1e-12 of values of order 1)."""
    result = ranks[0]["shares"][layout, path]
    torch.testing.assert_close(*result["loss"], atol=1e-12, rtol=0)
    torch.testing.assert_close(*result["grads"], atol=1e-12, rtol=0)
    assert 0 < float(result["kept_set_mass"]) < 1


def test_the_replayed_prev_pass_at_context_parallel_2_is_the_whole_logits_replay(ranks):
    batch = _batch_with_kept_sets()
    logits = _reference_logits(_master_weights(), batch["input_ids"])
    kept = KeptSet(batch["kept_set_offsets"], batch["kept_set_ids"])
    targets = batch["input_ids"].masked_fill(kept.lengths().view(batch["input_ids"].shape) == 0, -1)
    expected = vocab_parallel_logprobs(logits, targets, shard=VocabShard(true_vocab_size=VOCAB), distribution=REPLAY,
                                       shift=True, kept_set=kept)
    for rank in ranks:
        for name, logprobs in rank["passes"].items():
            # fp32 logits of one model, computed by the CP split and whole: the model's logprob tolerance
            torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=0, msg=name)
