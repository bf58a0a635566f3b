"""Rollout sampling: stop rules, masks, generation logprobs, padding exclusion, determinism, per-group generators
(a prompt's samples do not depend on its neighbours), TP=2 == TP=1, draws shared with ranks without logits."""

from __future__ import annotations

import math

import pytest
import torch
from _dist import run_on_ranks
from logprob_reference import LOGPROB_ATOL_FP32

from megatron_grpo.ops import SamplingDistribution, vocab_parallel_logprobs
from megatron_grpo.runner.rollout import SamplingParams, generate, sampling_log_probs

TRUE_VOCAB = 13
PADDED_VOCAB = 16  # 3 padding columns, split 8 + 8 over two TP ranks
EOS, PAD = 11, 12


def _toy_logits_table(seed: int = 0) -> torch.Tensor:
    """Next-token logits for each previous token, with padding columns that would win if they were sampled."""
    table = torch.randn(PADDED_VOCAB, PADDED_VOCAB, generator=torch.Generator().manual_seed(seed)) * 2
    table[:, TRUE_VOCAB:] = 50.0
    return table


def _toy_logits_fn(table: torch.Tensor, shard: slice = slice(None)):
    """The last position's logits (shard): a table lookup of the last token plus a bias growing with position."""
    def logits_fn(input_ids: torch.Tensor) -> torch.Tensor:
        return (table[input_ids[:, -1]] + 0.3 * (input_ids.shape[1] - 1))[:, shard]

    return logits_fn


def _prompts(rows: int = 9) -> torch.Tensor:
    return torch.randint(0, 10, (rows, 3), generator=torch.Generator().manual_seed(1))


def _generators(seed: int, groups: range = range(3)) -> list[torch.Generator]:
    """One generator per group of 3 rows, keyed by the group's index (as the runner keys them by prompt)."""
    return [torch.Generator().manual_seed(seed * 1000 + group) for group in groups]


def _params(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
            **overrides) -> SamplingParams:
    values = dict(max_new_tokens=6, distribution=SamplingDistribution.of_sampling(temperature, top_k, top_p),
                  eos_id=EOS, pad_id=PAD)
    values.update(overrides)
    return SamplingParams(**values)


def _sample(params: SamplingParams, seed: int = 7):
    return generate(
        _toy_logits_fn(_toy_logits_table()),
        _prompts(),
        params,
        true_vocab_size=TRUE_VOCAB,
        generators=_generators(seed),
    )


def _reference_logprob(table: torch.Tensor, ids: list[int], t: int, temperature: float, top_k) -> float:
    """log p(ids[t]) under softmax(logits[t-1] / T) over the true vocab, restricted to the top k, in float64."""
    logits = (table[ids[t - 1]][:TRUE_VOCAB].double() + 0.3 * (t - 1)) / temperature
    allowed = sorted(range(TRUE_VOCAB), key=lambda v: -logits[v].item())[: top_k or TRUE_VOCAB]
    if ids[t] not in allowed:
        return -math.inf
    norm = math.log(sum(math.exp(logits[v].item()) for v in allowed))
    return logits[ids[t]].item() - norm


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 4), (1.6, 1)])
def test_generation_logprobs_are_those_of_the_sampling_distribution(temperature, top_k):
    rollout = _sample(_params(temperature=temperature, top_k=top_k))
    table = _toy_logits_table()
    prompt_length = rollout.prompt_length
    for row in range(rollout.input_ids.shape[0]):
        ids = rollout.input_ids[row].tolist()
        for t in range(prompt_length, len(ids)):
            if rollout.token_mask[row, t] == 1:
                expected = _reference_logprob(table, ids, t, temperature, top_k)
                assert rollout.generation_logprobs[row, t].item() == pytest.approx(expected, abs=1e-5)
            else:
                assert rollout.generation_logprobs[row, t].item() == 0.0
    if top_k == 1:  # greedy: every sampled token has probability 1
        assert rollout.generation_logprobs.abs().max().item() < 1e-6


def test_padded_vocab_is_never_sampled_and_prompts_are_kept():
    rollout = _sample(_params())
    assert rollout.input_ids.max().item() < TRUE_VOCAB
    assert torch.equal(rollout.input_ids[:, :3], _prompts())
    assert rollout.token_mask[:, :3].abs().max() == 0


def test_responses_stop_at_eos_and_are_padded_after_it():
    rollout = _sample(_params(max_new_tokens=12))
    responses, mask = rollout.responses, rollout.token_mask[:, rollout.prompt_length :]
    saw_early_stop = False
    for row, row_mask in zip(responses.tolist(), mask.tolist()):
        if EOS in row:
            end = row.index(EOS) + 1
            saw_early_stop |= end < 12
            assert row_mask == [1.0] * end + [0.0] * (len(row) - end)
            assert row[end:] == [PAD] * (len(row) - end)
        else:
            assert len(row) == 12 and row_mask == [1.0] * 12
    assert saw_early_stop


def test_responses_stop_at_max_new_tokens():
    rollout = _sample(_params(max_new_tokens=2))
    assert rollout.input_ids.shape == (9, 5)
    assert rollout.token_mask[:, 3:].sum().item() >= 9  # every row has at least its first token


def test_sampling_is_deterministic_per_seed():
    first, again, other = _sample(_params(), 7), _sample(_params(), 7), _sample(_params(), 8)
    assert torch.equal(first.input_ids, again.input_ids)
    assert torch.equal(first.generation_logprobs, again.generation_logprobs)
    assert not torch.equal(first.input_ids, other.input_ids)


@pytest.mark.parametrize("top_k, top_p", [(None, 0.8), (6, 0.5), (3, None), (None, 1.0)])
def test_sampler_and_training_op_share_one_filtered_distribution(top_k, top_p):
    """The rollout's log-probabilities are the op's filtered logprobs, token for token, at every vocab id: one
    distribution object, the same scaled logits and the same filter on both sides."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, TRUE_VOCAB, generator=gen) * 2).round() / 2  # ties included
    distribution = SamplingDistribution.of_sampling(0.8, top_k, top_p)
    sampler = sampling_log_probs(logits, distribution)
    for token in range(TRUE_VOCAB):
        targets = torch.full((6,), token)
        op = vocab_parallel_logprobs(logits, targets, distribution=distribution)
        assert torch.equal(op == float("-inf"), sampler[:, token] == float("-inf")), token
        finite = op > float("-inf")
        # ours carries the kernels' exp (3 ulps: 3.6e-7 of lse) where torch's log_softmax carries one, and each
        # rounds its |logprob| < 20 once (1e-6 each): within LOGPROB_ATOL_FP32
        torch.testing.assert_close(op[finite], sampler[finite, token], rtol=0, atol=LOGPROB_ATOL_FP32)


@pytest.mark.parametrize("top_k, top_p", [(None, 0.7), (4, None)])
def test_each_token_records_the_kept_set_it_was_drawn_from(top_k, top_p):
    """With a filter, every response token's kept set is its sampling distribution's support (the finite
    logprobs), holding the token; prompt, padding and the tokens after <eos> have none. Without one, none is kept."""
    params = _params(0.9, top_k, top_p)
    rollout = _sample(params)
    kept = rollout.kept_set
    assert kept.positions == rollout.input_ids.numel()
    kept.check_values(torch.where(rollout.token_mask.view(-1) != 0, rollout.input_ids.view(-1), -1), TRUE_VOCAB)
    lengths = kept.lengths().view(rollout.input_ids.shape)
    assert torch.equal(lengths > 0, rollout.token_mask != 0)
    table = _toy_logits_table()
    for row, column in (rollout.token_mask != 0).nonzero().tolist():
        logits = table[rollout.input_ids[row, column - 1]][None, :TRUE_VOCAB] + 0.3 * (column - 1)
        support = torch.isfinite(sampling_log_probs(logits, params.distribution)[0]).nonzero().squeeze(1)
        at = row * rollout.input_ids.shape[1] + column
        assert kept.ids[kept.offsets[at]:kept.offsets[at + 1]].tolist() == support.tolist(), (row, column)
    assert _sample(_params(0.9)).kept_set is None


def test_a_groups_samples_do_not_depend_on_the_other_groups():
    """Rows 3-8 sampled without rows 0-2 (as on another data-parallel rank) are the same tokens."""
    full = _sample(_params())
    alone = generate(_toy_logits_fn(_toy_logits_table()), _prompts()[3:], _params(), true_vocab_size=TRUE_VOCAB,
                     generators=_generators(7, range(1, 3)))
    assert full.input_ids.shape[1] >= alone.input_ids.shape[1]  # fewer rows may all stop earlier
    assert torch.equal(full.input_ids[3:, :alone.input_ids.shape[1]], alone.input_ids)
    assert torch.equal(full.generation_logprobs[3:, :alone.input_ids.shape[1]], alone.generation_logprobs)


def _ragged_logits_fn(table: torch.Tensor):
    """`_toy_logits_fn` read at each row's own last position when given (right-padded rows of ragged prompts)."""
    def logits_fn(input_ids: torch.Tensor, last_positions: torch.Tensor | None = None) -> torch.Tensor:
        if last_positions is None:
            last_positions = torch.full((input_ids.shape[0],), input_ids.shape[1] - 1)
        last = input_ids[torch.arange(input_ids.shape[0]), last_positions]
        return table[last] + 0.3 * last_positions[:, None]

    return logits_fn


def test_ragged_prompts_sample_what_each_group_samples_alone():
    """Prompts of 1, 3 and 2 tokens, right-padded to 3: each group's rows are the same tokens and logprobs as the
    group sampled alone with its unpadded prompt; each response starts right after its own prompt."""
    lengths = torch.tensor([1, 1, 1, 3, 3, 3, 2, 2, 2])
    prompts = _prompts().masked_fill(torch.arange(3)[None] >= lengths[:, None], PAD)
    ragged = generate(_ragged_logits_fn(_toy_logits_table()), prompts, _params(max_new_tokens=8),
                      true_vocab_size=TRUE_VOCAB, generators=_generators(7), prompt_lengths=lengths)
    assert torch.equal(ragged.prompt_lengths, lengths) and ragged.prompt_length == 3
    for group in range(3):
        rows = slice(3 * group, 3 * group + 3)
        own = int(lengths[3 * group])
        alone = generate(_ragged_logits_fn(_toy_logits_table()), prompts[rows, :own], _params(max_new_tokens=8),
                         true_vocab_size=TRUE_VOCAB, generators=_generators(7, range(group, group + 1)))
        width = alone.input_ids.shape[1]
        assert torch.equal(ragged.input_ids[rows, :width], alone.input_ids)
        assert torch.equal(ragged.generation_logprobs[rows, :width], alone.generation_logprobs)
        assert torch.equal(ragged.token_mask[rows, :width], alone.token_mask)
        assert ragged.token_mask[rows, width:].abs().max() == 0 if ragged.input_ids.shape[1] > width else True
        width = ragged.responses.shape[1]
        assert torch.equal(ragged.responses[rows], ragged.input_ids[rows, own:own + width])  # from its prompt's end


def test_prompt_lengths_out_of_range_are_rejected_by_name():
    with pytest.raises(ValueError, match="prompt_lengths"):
        generate(_ragged_logits_fn(_toy_logits_table()), _prompts(), _params(), true_vocab_size=TRUE_VOCAB,
                 generators=_generators(7), prompt_lengths=torch.tensor([1, 1, 1, 4, 4, 4, 2, 2, 2]))


def test_rows_that_do_not_split_into_the_generators_groups_are_rejected_by_name():
    with pytest.raises(ValueError, match="generators: 9 prompt rows do not split into 2 equal groups"):
        generate(_toy_logits_fn(_toy_logits_table()), _prompts(), _params(), true_vocab_size=TRUE_VOCAB,
                 generators=_generators(7, range(2)))


def _distributed_rollout(rank: int, world_size: int, split: str) -> dict:
    """Two ranks sampling together: `"tensor"`, each holding half the vocab shard, gathered over TP; or
    `"pipeline"`, only rank 1 holding logits (the last pipeline stage), its draws broadcast to rank 0."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    def share_draws(draws: torch.Tensor) -> torch.Tensor:
        dist.broadcast(draws, src=1)
        return draws

    shard_width = PADDED_VOCAB // world_size
    own_shard = _toy_logits_fn(_toy_logits_table(), slice(rank * shard_width, (rank + 1) * shard_width))
    whole = _toy_logits_fn(_toy_logits_table())
    rollout = generate(
        own_shard if split == "tensor" else whole if rank == 1 else (lambda input_ids: None),
        _prompts(),
        _params(temperature=0.9, top_k=5),
        true_vocab_size=TRUE_VOCAB,
        generators=_generators(7),
        tp_group=dist.group.WORLD if split == "tensor" else None,
        share_draws=share_draws if split == "pipeline" else None,
    )
    return {"ids": rollout.input_ids, "logprobs": rollout.generation_logprobs, "mask": rollout.token_mask,
            "kept": (rollout.kept_set_offsets, rollout.kept_set_ids)}


@pytest.mark.parametrize("split, tolerance", [("tensor", 1e-6), ("pipeline", 0.0)])
def test_two_ranks_sample_what_one_rank_samples(split, tolerance):
    """TP: the same tokens, logprobs to 1e-6 (the gathered shards are summed in another order); PP: the ranks
    without logits receive the sampling rank's draws exactly."""
    single = _sample(_params(temperature=0.9, top_k=5))
    for result in run_on_ranks(2, _distributed_rollout, split):
        assert torch.equal(result["ids"], single.input_ids)
        assert torch.equal(result["mask"], single.token_mask)
        torch.testing.assert_close(result["logprobs"], single.generation_logprobs, rtol=0, atol=tolerance)
        assert all(torch.equal(a, b) for a, b in zip(result["kept"], (single.kept_set_offsets, single.kept_set_ids)))
