"""Replaying a rollout engine's kept sets (`KeptSet`, `ops.core.replay`): against an independent float64 reference of
the softmax restricted to each set (tests/logprob_reference.py, masked `log_softmax`), bit for bit against the filter
when the set is the filter's own, the three paths (logits, the fused linear op, the loss-fused head) and the packed
layout against each other, on one rank and on 2 and 4 gloo ranks, with padded vocab, a temperature, ignored targets,
singleton sets and sets on one shard only; the kept-set metrics; and every malformed set's named error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_on_ranks
from _loss_inputs import loss_config
from logprob_reference import assert_grad_close, expected_kept_logprobs, make_case, upstream_grads

from megatron_grpo.loss import ClippedPGLoss, check_batch_values, count_valid
from megatron_grpo.loss.packing import pack_rows, row_lengths
from megatron_grpo.ops import SamplingDistribution, VocabShard, vocab_parallel_linear_logprobs, vocab_parallel_logprobs
from megatron_grpo.ops.core.filtering import kept_threshold
from megatron_grpo.ops.core.gemm import chunk_buffer, chunk_logits
from megatron_grpo.ops.kept_set import KeptSet

SCALE = 1 / 0.7  # a sampling temperature of 0.7
REPLAY = SamplingDistribution(logit_scale=SCALE, top_k=6, top_p=0.9, replay_kept_set=True)
# Active filters: one that keeps every token runs the kernels' unfiltered variant, whose gradient may round otherwise
# than the filtered variant the replay runs (docs/ops.md); `test_a_set_of_every_token_is_the_unfiltered_softmax`.
FILTERS = [(1, None), (7, None), (None, 0.8), (5, 0.6), (40, 0.95)]


def kept_case(rows: int, padded: int, true_vocab: int, dtype: torch.dtype, seed: int):
    """Logits (huge padding, every fourth row ignored) and a set per row: the exact top-k set of the row's scaled
    logits on every third row (taken by threshold), a random one elsewhere (gathered), a singleton on row 6 and
    sets with no id on the last shard, each holding its row's target."""
    full, targets = make_case(rows, padded, true_vocab, torch.float64, seed=seed)
    full = full.to(dtype)
    z = full[:, :true_vocab].double() * SCALE
    gen = torch.Generator().manual_seed(seed + 1)
    keep = torch.rand(rows, true_vocab, generator=gen) < 0.3
    for row in range(0, rows, 3):
        keep[row] = z[row] >= z[row].topk(min(1 + row % 7, true_vocab)).values[-1]
        targets[row] = z[row].argmax() if targets[row] >= 0 else -1
    keep[6 % rows] = False
    keep[2 % rows, true_vocab // 2:] = False
    trained = targets >= 0
    keep[trained, targets[trained]] = True
    keep[~trained, 0] = True  # sets on rows that score nothing, which the op ignores
    return full, targets, keep


def replayed(logits, targets, keep, implementation, shard=None, distribution=REPLAY, shift=False):
    """The op's logprob, entropy and gradient (of `g_lp` · logprob + `g_h` · entropy) under the kept sets `keep`."""
    g_lp, g_h = upstream_grads(targets.numel(), 1)
    x = logits.clone().requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(x, targets, shard=shard, distribution=distribution, shift=shift,
                                               with_entropy=True, kept_set=KeptSet.from_mask(keep),
                                               implementation=implementation)
    (logprob * g_lp.view_as(logprob) + entropy * g_h.view_as(entropy)).sum().backward()
    return logprob.detach(), entropy.detach(), x.grad


def check_reference(logprob, entropy, grad, full, targets, true_vocab, keep, dtype, label):
    g_lp, g_h = upstream_grads(targets.numel(), 1)
    expected = expected_kept_logprobs(full, targets, true_vocab, keep, g_lp, g_h, logit_scale=SCALE)
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5  # fp32 maths of exact inputs: as the filter's tests
    assert float((logprob.double().cpu() - expected.logprob).abs().max()) <= tolerance, label
    entropy_error = float((entropy.double().cpu() - expected.entropy).abs().max())
    assert entropy_error <= tolerance * max(1.0, float(expected.entropy.max())), label
    assert bool((grad[:, true_vocab:] == 0).all()), f"{label}: padding gradient must be exactly 0"
    assert bool((grad.cpu()[targets < 0] == 0).all()), f"{label}: ignored rows' gradient must be exactly 0"
    assert bool((grad.cpu()[:, :true_vocab][~keep & (targets >= 0)[:, None]] == 0).all()), \
        f"{label}: logits outside the kept set must get exactly 0"
    assert_grad_close(grad.cpu(), expected.grad, dtype, terms=expected.grad_terms)


@pytest.mark.parametrize("implementation, dtype", [("torch", torch.float64), ("fused", torch.float32),
                                                   ("fused", torch.bfloat16)])
def test_replayed_sets_match_the_float64_reference(device, implementation, dtype):
    rows, padded, true_vocab = 31, 70, 61
    full, targets, keep = kept_case(rows, padded, true_vocab, dtype, seed=3)
    logprob, entropy, grad = replayed(full.to(device), targets.to(device), keep.to(device), implementation,
                                      shard=VocabShard(true_vocab_size=true_vocab))
    check_reference(logprob, entropy, grad, full, targets, true_vocab, keep, dtype, f"{device} {implementation}")


def test_shifted_sets_are_the_tokens_and_ignored_rows_sets_are_ignored():
    """With `shift=True` position t holds the set token t was drawn from (position 0 none); sets on rows whose
    target is ignored take no part."""
    batch, seq, padded, true_vocab = 3, 9, 40, 33
    full, row_targets, keep = kept_case(batch * seq, padded, true_vocab, torch.float64, seed=4)
    tokens = torch.randint(0, true_vocab, (batch, seq), generator=torch.Generator().manual_seed(5))
    tokens.view(-1)[1:] = torch.where(row_targets[:-1] >= 0, row_targets[:-1], tokens.view(-1)[1:])
    tokens[:, 1:][row_targets.view(batch, seq)[:, :-1] < 0] = -1  # these rows score nothing, their sets included
    token_keep = torch.zeros_like(keep)
    token_keep[1:] = keep[:-1]
    token_keep.view(batch, seq, -1)[:, 0] = False
    logprob, entropy, _ = replayed(full.view(batch, seq, -1), tokens, token_keep, "torch",
                                   shard=VocabShard(true_vocab_size=true_vocab), shift=True)
    row_scores = torch.full((batch, seq), -1)
    row_scores[:, :-1] = tokens[:, 1:]
    expected = expected_kept_logprobs(full, row_scores.view(-1), true_vocab, keep, logit_scale=SCALE)
    torch.testing.assert_close(logprob[:, 1:], expected.logprob.view(batch, seq)[:, :-1], atol=1e-12, rtol=0)
    torch.testing.assert_close(entropy[:, 1:], expected.entropy.view(batch, seq)[:, :-1], atol=1e-12, rtol=0)
    assert bool((logprob[:, 0] == 0).all())


def own_filter_set(logits: torch.Tensor, distribution: SamplingDistribution, true_vocab: int, scaled: bool = False,
                   group=None, gather: bool = False) -> torch.Tensor:
    """The filter's kept set of each row, from its own threshold (over TP with `group`; `gather`: all ranks'
    shards' masks side by side)."""
    valid = logits[:, :max(0, min(logits.shape[1], true_vocab - (dist.get_rank(group) * logits.shape[1]
                                                                  if group else 0)))]
    threshold = kept_threshold(valid, distribution, true_vocab_size=true_vocab, group=group, scaled=scaled)
    z = valid.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    z = z if scaled else z * distribution.logit_scale
    local = torch.zeros(logits.shape, dtype=torch.bool)
    local[:, :valid.shape[1]] = True if threshold is None else z >= threshold[:, None]
    if not gather:
        return local[:, :true_vocab]
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local, group=group)
    return torch.cat(shards, dim=1)[:, :true_vocab]


@pytest.mark.parametrize("implementation, dtype", [("torch", torch.float64), ("fused", torch.float32),
                                                   ("fused", torch.bfloat16)])
def test_the_filters_own_set_replays_the_filter_bit_for_bit(implementation, dtype):
    """Logits on a coarse grid (ties at the boundaries); the logits op and the fused linear op."""
    rows, padded, true_vocab = 23, 48, 41
    full, targets, _ = kept_case(rows, padded, true_vocab, torch.float64, seed=6)
    full = ((full * 2).round() / 4).to(dtype)
    shard = VocabShard(true_vocab_size=true_vocab)
    for top_k, top_p in FILTERS:
        distribution = SamplingDistribution(logit_scale=SCALE, top_k=top_k, top_p=top_p)
        keep = own_filter_set(full, distribution, true_vocab)
        best = torch.where(keep, full[:, :true_vocab].double(), -torch.inf).argmax(dim=1)
        row_targets = torch.where(targets >= 0, best, -1)
        filtered = _filtered(full, row_targets, implementation, shard, distribution)
        replay = replayed(full, row_targets, keep, implementation, shard, distribution.replayed())
        for a, b, what in zip(filtered, replay, ("logprob", "entropy", "gradient")):
            assert torch.equal(a, b), f"{implementation} {dtype} top_k={top_k} top_p={top_p}: {what}"
    hidden = torch.randn(rows, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    weight = torch.randn(padded, 8, generator=torch.Generator().manual_seed(8), dtype=torch.float64).to(dtype)
    trained = targets >= 0
    logits = chunk_logits(hidden[trained], weight[:true_vocab], SCALE, chunk_buffer(int(trained.sum()), true_vocab,
                                                                                    hidden))  # the op's one chunk
    row_targets = targets.clone()
    row_targets[trained] = logits.argmax(dim=1)  # kept by every filter
    for top_k, top_p in FILTERS[1:4]:
        distribution = SamplingDistribution(logit_scale=SCALE, top_k=top_k, top_p=top_p)
        keep = torch.zeros(rows, true_vocab, dtype=torch.bool)
        keep[trained] = own_filter_set(logits, distribution, true_vocab, scaled=True)
        outputs = [_linear(hidden, weight, row_targets, keep, implementation, shard, d)
                   for d in (distribution, distribution.replayed())]
        for a, b in zip(*outputs):
            assert torch.equal(a, b), f"linear {implementation} {dtype} top_k={top_k} top_p={top_p}"


def test_a_set_of_every_token_is_the_unfiltered_softmax():
    full, targets, _ = kept_case(17, 40, 33, torch.float32, seed=9)
    every = torch.ones(17, 33, dtype=torch.bool)
    for implementation in ("fused", "torch"):
        plain = _filtered(full, targets, implementation, VocabShard(true_vocab_size=33), REPLAY.unfiltered())
        replay = replayed(full, targets, every, implementation, VocabShard(true_vocab_size=33))
        for a, b in zip(plain, replay):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)  # a few fp32 ulps: the kernels' two variants


def _filtered(logits, targets, implementation, shard, distribution):
    g_lp, g_h = upstream_grads(targets.numel(), 1)
    x = logits.clone().requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(x, targets, shard=shard, distribution=distribution, with_entropy=True,
                                               implementation=implementation)
    (logprob * g_lp + entropy * g_h).sum().backward()
    return logprob.detach(), entropy.detach(), x.grad


def _linear(hidden, weight, targets, keep, implementation, shard, distribution):
    g_lp, g_h = upstream_grads(targets.numel(), 1)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    kept = KeptSet.from_mask(keep) if distribution.replay_kept_set else None
    logprob, entropy = vocab_parallel_linear_logprobs(h, w, targets, shard=shard, distribution=distribution,
                                                      with_entropy=True, implementation=implementation, kept_set=kept)
    (logprob * g_lp + entropy * g_h).sum().backward()
    return logprob.detach(), entropy.detach(), h.grad, w.grad


def test_replay_reads_nothing_back_but_the_chunks_bounds():
    """Without checks the logits op's replay reads nothing back to the host; the linear op reads the chunks' bounds
    in the ids once per call (with its trained-row gather's `nonzero`)."""
    from collections import Counter

    from test_host_syncs import CountSyncs

    full, targets, keep = kept_case(40, 48, 41, torch.float32, seed=13)
    kept = KeptSet.from_mask(keep)
    with CountSyncs() as logits_op:
        vocab_parallel_logprobs(full, targets, shard=VocabShard(true_vocab_size=41), distribution=REPLAY,
                                kept_set=kept, check_inputs=False, with_entropy=True)
    hidden = torch.randn(40, 8, generator=torch.Generator().manual_seed(14))
    with CountSyncs() as linear_op:
        vocab_parallel_linear_logprobs(hidden, torch.randn(48, 8), targets, shard=VocabShard(true_vocab_size=41),
                                       distribution=REPLAY, kept_set=kept, check_inputs=False, chunk_rows=7)
    assert logits_op.counts == Counter()
    assert linear_op.counts == Counter(nonzero=1, tolist=1)


# ---- the loss: three paths, packed, the metrics ----

def loss_case(seed: int, batch: int = 5, seq: int = 9, hidden_size: int = 6, padded: int = 40, true_vocab: int = 33):
    """float64 hidden states, output weight and a batch whose response tokens carry kept sets (random ones, and the
    recomputed filter's own set, top-6 then top-p 0.9, on every other token), each holding its token."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen, dtype=torch.float64)
    weight = torch.randn(padded, hidden_size, generator=gen, dtype=torch.float64)
    input_ids = torch.randint(0, true_vocab, (batch, seq), generator=gen)
    token_mask = (torch.arange(seq) >= 3).float().expand(batch, seq).clone()
    token_mask[1, 7:] = 0  # a shorter response
    logits = hidden @ weight.t()
    keep = torch.rand(batch, seq, true_vocab, generator=gen) < 0.3
    own = own_filter_set(logits[:, :-1].reshape(-1, padded), REPLAY.recomputed(), true_vocab)
    keep[:, 1::2] = own.view(batch, seq - 1, true_vocab)[:, ::2]
    input_ids[:, 1::2] = logits[:, :-1:2, :true_vocab].argmax(dim=-1)
    keep[token_mask == 0] = False
    keep[token_mask != 0, input_ids[token_mask != 0]] = True
    kept = KeptSet.from_mask(keep)
    data = {"input_ids": input_ids, "token_mask": token_mask, "sample_mask": torch.ones(batch),
            "advantages": torch.randn(batch, generator=gen), "generation_logprobs": -torch.rand(batch, seq),
            "kept_set_offsets": kept.offsets, "kept_set_ids": kept.ids}
    data["sample_mask"][3] = 0  # a dropped sequence: its sets are ignored
    return hidden, weight, data, keep


def run_loss(path, hidden, weight, batch, true_vocab, distribution, shard=None, chunk_rows=4, kl=0.0):
    """Loss, metrics and the gradients of hidden states and weight on one path; GSPO-like sequence coupling through
    `seq-mean-token-mean`, truncated IS weights, an entropy bonus, and with `kl` a KL to reference logprobs of -2."""
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    tokens, seqs = count_valid(batch)
    loss_fn = ClippedPGLoss(loss_config(reference_policy_kl_penalty=kl, entropy_coef=0.02,
                                        loss_agg_mode="seq-mean-token-mean", use_importance_sampling_correction=True,
                                        truncated_importance_sampling=dict(type="tis", ratio_max=1.5)))
    keywords = dict(global_valid_tokens=tokens, global_valid_seqs=seqs, distribution=distribution,
                    shard=shard or VocabShard(true_vocab_size=true_vocab), prev_logprobs_from_current=True)
    batch = {**batch, "reference_policy_logprobs": torch.full(batch["input_ids"].shape, -2.0)}
    if path == "logits":
        loss, metrics = loss_fn(h @ w.t(), batch, **keywords)
    else:
        loss, metrics = loss_fn.on_hidden_states(h, w, batch, loss_fused=path == "loss_fused", chunk_rows=chunk_rows,
                                                 **keywords)
    loss.backward()
    return loss.detach(), metrics, h.grad, w.grad


def packed(hidden, batch):
    """The batch (and hidden states) packed, each sequence to its last response token: `pack_rows` moves the kept
    sets with their tokens."""
    rows = list(range(batch["input_ids"].shape[0]))
    out = pack_rows({**batch, "hidden": hidden}, rows, row_lengths(batch))
    return out.pop("hidden"), out


@pytest.mark.parametrize("replay, kl", [(True, 0.0), (True, 0.1), (False, 0.0)])
def test_three_paths_and_the_packed_layout_agree(replay, kl):
    """Replayed (with a KL, which reads unfiltered logprobs, too) or recomputed, every path agrees."""
    true_vocab = 33
    hidden, weight, batch, _ = loss_case(seed=1)
    distribution = REPLAY if replay else REPLAY.recomputed()
    paths = ("logits", "linear", "loss_fused")
    reference = run_loss("logits", hidden, weight, batch, true_vocab, distribution, kl=kl)
    packed_hidden, packed_batch = packed(hidden, batch)
    for path in paths:
        for layout, (h, b) in {"padded": (hidden, batch), "packed": (packed_hidden, packed_batch)}.items():
            label = f"{path} {layout} replay={replay} kl={kl}"
            loss, metrics, grad_h, grad_w = run_loss(path, h, weight, b, true_vocab, distribution, kl=kl)
            torch.testing.assert_close(loss, reference[0], atol=1e-12, rtol=0, msg=label)
            if layout == "padded":
                torch.testing.assert_close(grad_h, reference[2], atol=1e-12, rtol=0, msg=label)
            torch.testing.assert_close(grad_w, reference[3], atol=1e-12, rtol=0, msg=label)
            for name in ("kept_set_mass", "kept_set_differs", "gen_ratio_outside_band", "entropy", "probs_ratio",
                         "kept_set_replayed_ratio_outside_band", "kept_set_recomputed_ratio_outside_band"):
                torch.testing.assert_close(metrics[name].double(), reference[1][name].double(), atol=1e-6, rtol=0,
                                           msg=f"{label}: {name}")  # (float32 metrics of float64 values)


def test_the_kept_set_metrics_say_what_they_name():
    true_vocab = 33
    hidden, weight, batch, keep = loss_case(seed=2)
    _, metrics, _, _ = run_loss("logits", hidden, weight, batch, true_vocab, REPLAY.recomputed())
    logits = (hidden @ weight.t())[:, :-1, :true_vocab] * SCALE
    trained = (batch["token_mask"] != 0) & (batch["sample_mask"] != 0)[:, None]
    trained[:, 0] = False
    keep_rows = keep[:, 1:]
    probs = torch.softmax(logits, dim=-1)
    mass = (probs * keep_rows).sum(-1)
    recomputed = torch.zeros_like(keep_rows)
    for index in trained[:, 1:].nonzero():  # the filter from its definition, top-6 then top-p 0.9, by sorting
        z = logits[index[0], index[1]]
        top = z >= z.topk(6).values[-1]
        p = torch.softmax(z.masked_fill(~top, -torch.inf), -1)
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]
        recomputed[index[0], index[1], order] = top[order] & (before < 0.9)
    differs = (recomputed != keep_rows).any(-1)
    mask = trained[:, 1:]
    # The metrics are float32 means (2^-24 relative per value and per addition of ~20 terms: 1e-6 covers them)
    assert float(metrics["kept_set_mass"]) == pytest.approx(float(mass[mask].mean()), rel=1e-6)
    assert float(metrics["kept_set_differs"]) == pytest.approx(float(differs[mask].double().mean()), rel=1e-6)
    assert 0 < float(metrics["kept_set_differs"]) < 1  # some sets are the recomputed ones, some not
    prev = torch.log_softmax(logits.masked_fill(~recomputed, -torch.inf), -1).gather(
        -1, batch["input_ids"][:, 1:, None]).squeeze(-1)  # prev = curr: the recomputed filter's logprob
    ratio = torch.exp(prev - batch["generation_logprobs"][:, 1:].double())
    scored = mask & torch.isfinite(prev)  # a token outside the recomputed set is dropped from the loss's terms
    outside = ((ratio < 0.9) | (ratio > 1.1))[scored].double().mean()
    assert float(metrics["gen_ratio_outside_band"]) == pytest.approx(float(outside), rel=1e-6)
    # The same band for curr over each set, on every trained token (ratio 0 outside the recomputed set).
    replayed = torch.log_softmax(logits.masked_fill(~keep_rows, -torch.inf), -1).gather(
        -1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    for name, curr in (("replayed", replayed), ("recomputed", prev)):
        ratio = torch.exp(curr - batch["generation_logprobs"][:, 1:].double())
        expected = ((ratio < 0.9) | (ratio > 1.1))[mask].double().mean()
        assert float(metrics[f"kept_set_{name}_ratio_outside_band"]) == pytest.approx(float(expected), rel=1e-6)


# ---- tensor parallelism ----

def tp_cases(world: int) -> list[tuple[int, int, int, int]]:
    """(rows, V_local, true vocab, seed): padding on the last rank, and (second) a last rank of padding only."""
    return [(19, 16, 16 * world - 5, 11), (7, 6, 6 * (world - 1) - 1, 12)]


def tp_worker(rank, world):
    """TP 4 over every rank, and TP 2 over ranks 0-1 and 2-3 (the same computation twice): one launch."""
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    out = {}
    for size, group in ((4, dist.group.WORLD), (2, pairs[rank // 2])):
        out[size] = _tp_cases(dist.get_rank(group), size, group)
    return out


def _tp_cases(rank, world, group):
    out = []
    for index, (rows, v_local, true_vocab, seed) in enumerate(tp_cases(world)):
        shard = VocabShard(true_vocab_size=true_vocab, group=group)
        full, targets, keep = kept_case(rows, v_local * world, true_vocab, torch.float64, seed)
        local = full[:, rank * v_local:(rank + 1) * v_local]
        results = {"torch": replayed(local, targets, keep, "torch", shard),
                   "fused": replayed(local.float(), targets, keep, "fused", shard)}
        bits = []
        for top_k, top_p in FILTERS[1:4]:
            distribution = SamplingDistribution(logit_scale=SCALE, top_k=top_k, top_p=top_p)
            if not distribution.active(true_vocab):  # (see FILTERS)
                continue
            own = own_filter_set(local.float(), distribution, true_vocab, group=group, gather=True)
            best = torch.where(own, full[:, :true_vocab], -torch.inf).argmax(dim=1)
            row_targets = torch.where(targets >= 0, best, -1)
            filtered = _filtered(local.float(), row_targets, "fused", shard, distribution)
            replay = replayed(local.float(), row_targets, own, "fused", shard, distribution.replayed())
            bits.append(all(torch.equal(a, b) for a, b in zip(filtered, replay)))
        paths = {}
        if index == 0:  # the loss's three paths on the first case
            hidden, weight, batch, _ = loss_case(seed, padded=v_local * world, true_vocab=true_vocab)
            weight_local = weight[rank * v_local:(rank + 1) * v_local]
            paths = {path: run_loss(path, hidden, weight_local, batch, true_vocab, REPLAY, shard)
                     for path in ("logits", "linear", "loss_fused")}
        out.append((results, bits, paths))
    return out


@pytest.fixture(scope="module")
def tp_ranks() -> list[dict]:
    return run_on_ranks(4, tp_worker)


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_replay(tp_ranks, world):
    """Each rank replays the sets' ids in its shard: the op (one rank with padding only at the second case) against
    the float64 reference, the filter's own set bit for bit on every rank, and (first case) the three loss paths
    alike."""
    per_rank = [tp_ranks[rank][world] for rank in range(world)]  # TP 2: ranks 0 and 1
    if world == 2:  # ranks 2 and 3 ran the same TP 2 computation
        for rank in range(2):
            assert torch.equal(tp_ranks[2 + rank][2][0][0]["fused"][0], per_rank[rank][0][0]["fused"][0])
    for index, (rows, v_local, true_vocab, seed) in enumerate(tp_cases(world)):
        full, targets, keep = kept_case(rows, v_local * world, true_vocab, torch.float64, seed)
        for implementation, dtype in (("torch", torch.float64), ("fused", torch.float32)):
            outputs = [per_rank[rank][index][0][implementation] for rank in range(world)]
            grad = torch.cat([o[2] for o in outputs], dim=1)
            check_reference(outputs[0][0], outputs[0][1], grad, full.to(dtype), targets, true_vocab, keep, dtype,
                            f"TP {world} case {index} {implementation}")
            for other in outputs[1:]:
                assert torch.equal(other[0], outputs[0][0]), "the ranks' logprobs must agree bit for bit"
        assert all(all(per_rank[rank][index][1]) for rank in range(world)), "the filter's own set, bit for bit"
        paths = [per_rank[rank][index][2] for rank in range(world)]
        for path in ("linear", "loss_fused") if index == 0 else ():
            for rank in range(world):
                loss, metrics, grad_h, grad_w = paths[rank][path]
                reference = paths[rank]["logits"]
                torch.testing.assert_close(loss, reference[0], atol=1e-12, rtol=0)
                torch.testing.assert_close(grad_w, reference[3], atol=1e-12, rtol=0)
                torch.testing.assert_close(metrics["kept_set_mass"], reference[1]["kept_set_mass"], atol=1e-12,
                                           rtol=0)
            partial_sum = sum(paths[rank][path][2] for rank in range(world))  # dH: each rank's share of the vocab
            torch.testing.assert_close(partial_sum, sum(paths[r]["logits"][2] for r in range(world)), atol=1e-12,
                                       rtol=0)


# ---- the form and the errors ----

def test_take_cuts_the_sets_of_any_positions():
    kept = KeptSet.from_lists([[3, 1], [], [7], [2, 5, 9]])
    assert kept.offsets.tolist() == [0, 2, 2, 3, 6] and kept.ids.tolist() == [1, 3, 7, 2, 5, 9]
    taken = kept.take(torch.tensor([3, -1, 0, 3]))
    assert taken.offsets.tolist() == [0, 3, 3, 5, 8] and taken.ids.tolist() == [2, 5, 9, 1, 3, 2, 5, 9]
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0, [1, 3]] = mask[2, 7] = mask[3, [2, 5, 9]] = True
    dense = KeptSet.from_mask(mask)
    assert torch.equal(dense.offsets, kept.offsets) and torch.equal(dense.ids, kept.ids)


def _set(offsets, ids):
    return KeptSet(torch.tensor(offsets, dtype=torch.int64), torch.tensor(ids, dtype=torch.int64))


@pytest.mark.parametrize("kept, targets, message", [
    (_set([1, 2, 3], [4, 5]), [4, 5], r"kept_set.offsets: must start at 0, starts at 1"),
    (_set([0, 2, 1], [4, 5]), [4, 5], r"kept_set.offsets: must not decrease .* offsets\[2\] < offsets\[1\]"),
    (_set([0, 1, 1], [4, 5]), [4, -1], r"kept_set.offsets: must end at the number of ids \(2\), ends at 1"),
    (_set([0, 1, 2], [4, 9]), [4, -1], r"kept_set.ids: contains token id 9, outside the vocab \[0, 9\)"),
    (_set([0, 1, 2], [-2, 5]), [-1, 5], r"kept_set.ids: contains token id -2"),
    (_set([0, 2, 3], [4, 4, 5]), [4, 5], r"kept_set.ids: each set's ids must increase .* position 0's do not"),
    (_set([0, 2, 3], [1, 4, 5]), [3, 5], r"kept_set.ids: the target 3 at position 0 is not in its kept set \[1, 4\]"),
    (_set([0, 2, 2], [1, 4]), [1, 5], r"the target 5 at position 1 is not in its kept set \[\]"),
    (_set([0, 2], [1, 4]), [1, 5], r"kept_set.offsets: expected 3 entries .* got 2"),
    (KeptSet(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1, 4])), [1, 4],
     r"kept_set.offsets: expected a 1-D int64 tensor, got torch.int32"),
])
def test_a_malformed_set_is_a_named_error(kept, targets, message):
    logits = torch.randn(2, 12)
    for implementation in ("torch", "fused"):
        with pytest.raises(ValueError, match=message):
            vocab_parallel_logprobs(logits, torch.tensor(targets), shard=VocabShard(true_vocab_size=9),
                                    distribution=REPLAY, kept_set=kept, implementation=implementation)
    with pytest.raises(ValueError, match=message):
        vocab_parallel_linear_logprobs(torch.randn(2, 3), torch.randn(12, 3), torch.tensor(targets),
                                       shard=VocabShard(true_vocab_size=9), distribution=REPLAY, kept_set=kept)


def test_replay_and_its_set_go_together():
    logits, targets, kept = torch.randn(2, 5), torch.tensor([1, 2]), KeptSet.from_lists([[1], [2]])
    with pytest.raises(ValueError, match="kept_set: required by distribution.replay_kept_set"):
        vocab_parallel_logprobs(logits, targets, distribution=REPLAY)
    with pytest.raises(ValueError, match=r"kept_set: given, but the distribution recomputes its filter"):
        vocab_parallel_logprobs(logits, targets, distribution=REPLAY.recomputed(), kept_set=kept)
    with pytest.raises(ValueError, match="inplace_backward='exp' has no replay"):
        vocab_parallel_logprobs(logits, targets, distribution=REPLAY, kept_set=kept, inplace_backward="exp")


def test_the_batch_contract_names_a_set_on_an_untrained_position():
    _, _, batch, _ = loss_case(seed=3)
    check_batch_values(batch, 33)
    stray = KeptSet(batch["kept_set_offsets"], batch["kept_set_ids"]).take(
        torch.cat([torch.tensor([12]), torch.arange(1, batch["input_ids"].numel())]))  # position 0: a response set
    with pytest.raises(ValueError, match=r"batch\['kept_set_offsets'\]: position 0 \(row 0, column 0\) is not a "
                                         r"response token .* carries a kept set"):
        check_batch_values({**batch, "kept_set_offsets": stray.offsets, "kept_set_ids": stray.ids}, 33)
    missing = batch["input_ids"].clone()
    position = 2 * missing.shape[1] + 5
    kept = KeptSet(batch["kept_set_offsets"], batch["kept_set_ids"])
    outside = sorted(set(range(33)) - set(kept.ids[kept.offsets[position]:kept.offsets[position + 1]].tolist()))
    missing[2, 5] = outside[0]
    with pytest.raises(ValueError, match=rf"batch\['kept_set_ids'\]: the target {outside[0]} at position "
                                         rf"{position} is not in its kept set"):
        check_batch_values({**batch, "input_ids": missing}, 33)
    with pytest.raises(ValueError, match=r"batch\['kept_set_ids'\] is missing"):
        check_batch_values({k: v for k, v in batch.items() if k != "kept_set_ids"}, 33)
    hidden, weight, _, _ = loss_case(seed=3)
    without = {k: v for k, v in batch.items() if not k.startswith("kept_set")}
    with pytest.raises(ValueError, match=r"batch\['kept_set_offsets'\] is missing: required by "
                                         "distribution.replay_kept_set"):
        run_loss("logits", hidden, weight, without, 33, REPLAY)
