"""The digit task, its exact reward, and GRPO group-relative advantages against float64 references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megatron_grpo.runner.advantages import group_relative_advantages
from megatron_grpo.runner.tasks import DigitTask, DigitTokenizer, answer_reward


@pytest.fixture
def tokenizer() -> DigitTokenizer:
    return DigitTokenizer()


def test_tokenizer_has_sixteen_distinct_tokens_with_digits_as_their_own_ids(tokenizer):
    assert tokenizer.vocab_size == 16
    assert len(set(tokenizer.tokens)) == 16
    assert [tokenizer.token_id(str(d)) for d in range(10)] == list(range(10))
    assert len({tokenizer.bos_id, tokenizer.sep_id, tokenizer.eos_id, tokenizer.pad_id}) == 4


@pytest.mark.parametrize("name", ["copy", "reverse"])
def test_task_prompts_and_answers_follow_the_format(tokenizer, name):
    task = DigitTask(name, num_digits=5, tokenizer=tokenizer)
    batch = task.sample(7, torch.Generator().manual_seed(3))
    assert batch.prompts.shape == (7, task.prompt_length) == (7, 8)
    assert batch.answers.shape == (7, task.answer_length) == (7, 6)
    for prompt, answer in zip(batch.prompts.tolist(), batch.answers.tolist()):
        text = tokenizer.decode(prompt).split()
        assert text[0] == "<bos>" and text[1] == {"copy": "C", "reverse": "R"}[name] and text[-1] == "="
        digits = text[2:-1]
        expected = digits if name == "copy" else digits[::-1]
        assert tokenizer.decode(answer).split() == expected + ["<eos>"]


def test_task_sampling_is_deterministic_per_generator_seed(tokenizer):
    task = DigitTask("reverse", num_digits=4, tokenizer=tokenizer)
    first = task.sample(9, torch.Generator().manual_seed(11)).prompts
    again = task.sample(9, torch.Generator().manual_seed(11)).prompts
    other = task.sample(9, torch.Generator().manual_seed(12)).prompts
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_unknown_task_name_is_rejected_by_name(tokenizer):
    with pytest.raises(ValueError, match="task.name"):
        DigitTask("sort", num_digits=4, tokenizer=tokenizer)


@pytest.mark.parametrize("name", ["copy", "reverse"])
def test_a_ragged_task_draws_each_prompts_length_and_pads_after_it(tokenizer, name):
    task = DigitTask(name, num_digits=6, tokenizer=tokenizer, min_digits=1)
    batch = task.sample(200, torch.Generator().manual_seed(4))
    pad = tokenizer.pad_id
    assert task.ragged and batch.prompts.shape == (200, 9) and batch.answers.shape == (200, 7)
    assert set((batch.prompt_lengths - 3).tolist()) == set(range(1, 7))  # every count in 1..6 drawn
    assert torch.equal(batch.answer_lengths, batch.prompt_lengths - 2)
    for prompt, answer, p_len, a_len in zip(batch.prompts.tolist(), batch.answers.tolist(),
                                            batch.prompt_lengths.tolist(), batch.answer_lengths.tolist()):
        assert prompt[p_len:] == [pad] * (9 - p_len) and answer[a_len:] == [pad] * (7 - a_len)
        text = tokenizer.decode(prompt[:p_len]).split()
        assert text[0] == "<bos>" and text[1] == {"copy": "C", "reverse": "R"}[name] and text[-1] == "="
        digits = text[2:-1]
        assert tokenizer.decode(answer[:a_len]).split() == (digits if name == "copy" else digits[::-1]) + ["<eos>"]


def test_min_digits_equal_to_num_digits_is_the_fixed_length_task(tokenizer):
    fixed = DigitTask("reverse", num_digits=4, tokenizer=tokenizer)
    same = DigitTask("reverse", num_digits=4, tokenizer=tokenizer, min_digits=4)
    first, second = (task.sample(9, torch.Generator().manual_seed(2)) for task in (fixed, same))
    assert not same.ragged and torch.equal(first.prompts, second.prompts) and torch.equal(first.answers,
                                                                                          second.answers)
    assert first.prompt_lengths.tolist() == [7] * 9 and first.answer_lengths.tolist() == [5] * 9


@pytest.mark.parametrize("min_digits", [0, 5])
def test_min_digits_out_of_range_is_rejected_by_name(tokenizer, min_digits):
    with pytest.raises(ValueError, match="task.min_digits"):
        DigitTask("reverse", num_digits=4, tokenizer=tokenizer, min_digits=min_digits)


def test_a_ragged_reward_counts_each_rows_own_answer_positions(tokenizer):
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    answers = torch.tensor([[3, eos, pad, pad], [3, 1, 4, eos], [5, 2, eos, pad], [7, eos, pad, pad]])
    lengths = torch.tensor([2, 4, 3, 2])
    responses = torch.tensor([
        [3, eos, pad, pad, pad],  # perfect
        [3, 1, eos, pad, pad],  # 2 of 4
        [5, 2, eos, 9, 9],  # perfect: tokens past its answer's length are ignored
        [7, 7, 7, 7, 7],  # never stops: 1 of 2
    ])
    rewards = answer_reward(responses, answers, lengths)
    expected = [_reference_reward(r, a[:n]) for r, a, n in zip(responses.tolist(), answers.tolist(),
                                                                lengths.tolist())]
    assert rewards.tolist() == pytest.approx(expected, abs=0) == [1.0, 0.5, 1.0, 0.5]
    with pytest.raises(ValueError, match="answer_lengths"):
        answer_reward(responses, answers, lengths[:3])


def _reference_reward(response: list[int], answer: list[int]) -> float:
    return sum(1 for i, a in enumerate(answer) if i < len(response) and response[i] == a) / len(answer)


def test_reward_is_the_fraction_of_answer_positions_matched(tokenizer):
    eos, pad = tokenizer.eos_id, tokenizer.pad_id
    answers = torch.tensor([[3, 1, 4, eos]] * 5)
    responses = torch.tensor(
        [
            [3, 1, 4, eos, pad],  # perfect
            [3, 1, eos, pad, pad],  # stopped early: 2 of 4
            [eos, pad, pad, pad, pad],  # only <eos>: 0 of 4 (position 0 is wrong)
            [3, 1, 4, 1, 5],  # never stops: 3 of 4
            [9, 1, 9, eos, pad],  # 2 of 4
        ]
    )
    rewards = answer_reward(responses, answers)
    expected = [_reference_reward(r, a) for r, a in zip(responses.tolist(), answers.tolist())]
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == pytest.approx(expected, abs=0)
    assert rewards.tolist() == [1.0, 0.5, 0.0, 0.75, 0.5]


def test_reward_of_a_response_shorter_than_the_answer_counts_missing_positions_wrong():
    rewards = answer_reward(torch.tensor([[7, 2]]), torch.tensor([[7, 2, 2]]))
    assert rewards.tolist() == pytest.approx([2 / 3])


def test_reward_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="same N"):
        answer_reward(torch.zeros(3, 5, dtype=torch.long), torch.zeros(2, 5, dtype=torch.long))


def _reference_advantages(rewards: list[float], group: int, normalize: bool, loo: bool) -> list[float]:
    """Python-float reference: baseline = mean of the group (or of the other samples with `loo`), spread =
    unbiased std of the whole group in either case."""
    out = []
    for start in range(0, len(rewards), group):
        g = rewards[start : start + group]
        for i, r in enumerate(g):
            pool = g[:i] + g[i + 1 :] if loo else g
            adv = r - statistics.fmean(pool)
            if normalize:
                adv /= statistics.stdev(g) + 1e-6
            out.append(adv)
    return out


BOTH_BASELINES = pytest.mark.parametrize("loo", [True, False])
BOTH_SCALINGS = pytest.mark.parametrize("normalize", [True, False])


@BOTH_SCALINGS
@BOTH_BASELINES
def test_advantages_match_a_float64_reference(normalize, loo):
    rewards = torch.rand(5 * 7, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    result = group_relative_advantages(rewards, 7, normalize_by_std=normalize, leave_one_out=loo)
    expected = _reference_advantages(rewards.tolist(), 7, normalize, loo)
    assert result.advantages.dtype == torch.float32 and result.advantages.shape == (35,)
    assert result.advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert result.groups_without_variance == 0


@BOTH_SCALINGS
@BOTH_BASELINES
@pytest.mark.parametrize("group, rewards", [
    (4, [1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0]),  # a lone winner, a lone loser, a lone winner again
    (2, [1, 0, 0, 1, 1, 1, 0.5, 0]),  # the smallest group: the std of "the others" would be undefined
    (5, [0, 0, 0, 0, 1, 1, 0, 1, 0, 0]),
])
def test_discrete_rewards_give_finite_bounded_advantages(normalize, loo, group, rewards):
    result = group_relative_advantages(torch.tensor(rewards, dtype=torch.float32), group,
                                       normalize_by_std=normalize, leave_one_out=loo)
    expected = _reference_advantages([float(r) for r in rewards], group, normalize, loo)
    assert torch.isfinite(result.advantages).all()
    assert result.advantages.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # |r - mean| <= (n-1)/sqrt(n) * std, and the leave-one-out baseline scales it by n/(n-1): sqrt(n) at most
    assert result.advantages.abs().max() <= (group**0.5 if normalize else 1.0) + 1e-5


def test_a_lone_winner_among_four_gets_a_moderate_advantage():
    """[1, 0, 0, 0]: whole-group std 0.5; leave-one-out baselines 0 and 1/3."""
    result = group_relative_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, normalize_by_std=True,
                                       leave_one_out=True)
    spread = 0.5 + 1e-6
    assert result.advantages.tolist() == pytest.approx([1 / spread] + [-(1 / 3) / spread] * 3, rel=1e-6)


@BOTH_SCALINGS
@BOTH_BASELINES
def test_groups_without_reward_variance_get_zero_advantage_and_are_counted(normalize, loo):
    rewards = torch.tensor([0.2, 0.2, 0.2, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.7, 0.7, 0.7])
    result = group_relative_advantages(rewards, 3, normalize_by_std=normalize, leave_one_out=loo)
    assert result.groups_without_variance == 3
    assert result.advantages[:3].abs().max() == 0 and result.advantages[6:].abs().max() == 0
    assert result.advantages[3:6].abs().min() > 0.1


def test_a_group_of_one_is_rejected_by_name():
    with pytest.raises(ValueError, match="group_size"):
        group_relative_advantages(torch.zeros(3), 1, normalize_by_std=True, leave_one_out=True)


def test_advantages_reject_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match="rewards"):
        group_relative_advantages(torch.zeros(10), 3, normalize_by_std=True, leave_one_out=False)


# --- What the step does with prev logprobs before the loss (runner/shaping.py) --------------------------------------


def _shaping_config(**overrides):
    from _configs import set_key, tiny

    from megatron_grpo.runner.config import load_config

    data = tiny()
    for dotted, value in overrides.items():
        data = set_key(data, dotted, value)
    return load_config(data)


def _shaping_batch(prev, generation, reference=None, token_mask=None):
    """Sequences of one prompt token then len(prev[b]) trained tokens; per-token inputs padded at position 0."""
    pad = lambda rows: torch.nn.functional.pad(torch.tensor(rows, dtype=torch.float32), (1, 0))  # noqa: E731
    batch = {
        "input_ids": torch.zeros(len(prev), len(prev[0]) + 1, dtype=torch.int64),
        "token_mask": pad(token_mask) if token_mask is not None else pad([[1.0] * len(prev[0])] * len(prev)),
        "sample_mask": torch.ones(len(prev)),
        "advantages": torch.zeros(len(prev)),
        "prev_logprobs": pad(prev),
        "generation_logprobs": pad(generation),
    }
    if reference is not None:
        batch["reference_policy_logprobs"] = pad(reference)
    return batch


def test_the_kl_in_the_reward_moves_into_the_group_advantages():
    from megatron_grpo.runner.shaping import PrevLogprobShaping

    # k1 KL(prev || ref) summed over each sequence: 0.5 + 0 and 0 + 0; penalty 0.2. Equal rewards [1, 1] become
    # [0.9, 1.0]; Dr. GRPO (no std division) gives advantages [-0.05, +0.05]: the KL alone makes the signal.
    prev = [[-1.0, -2.0], [-1.0, -2.0]]
    reference = [[-1.5, -2.0], [-1.0, -2.0]]
    cfg = _shaping_config(**{
        "loss_fn.kl_in_sequence_reward": True, "loss_fn.reference_policy_kl_penalty": 0.2,
        "loss_fn.reference_policy_kl_type": "k1", "grpo.num_generations_per_prompt": 2,
        "grpo.normalize_rewards_by_std": False,
    })
    shaping = PrevLogprobShaping(cfg, torch.tensor([1.0, 1.0]), dp_group=None)
    shaped = shaping(_shaping_batch(prev, prev, reference))
    torch.testing.assert_close(shaped["advantages"], torch.tensor([-0.05, 0.05]), rtol=1e-6, atol=1e-7)
    assert shaping.metrics["reward_kl_penalty"] == pytest.approx((0.5 / 2 + 0.0) / 2)  # verl's mean token-mean KL
    assert torch.equal(shaped["sample_mask"], torch.ones(2))  # the mask by logprob error is the loss's


def test_the_kl_in_the_reward_uses_the_configured_estimator_clamps_and_only_trained_tokens():
    from megatron_grpo.runner.shaping import PrevLogprobShaping

    # k3 with log r = ref - prev = 3 clamped to 1 at the first token (e - 2), an untrained token with a huge gap,
    # and a -inf prev (outside a filtered distribution: no defined KL). Rewards 1 and 0, std division on.
    prev = [[-4.0, -1.0, -torch.inf], [-1.0, -1.0, -1.0]]
    reference = [[-1.0, 50.0, -1.0], [-1.0, -1.0, -1.0]]
    cfg = _shaping_config(**{
        "loss_fn.kl_in_sequence_reward": True, "loss_fn.reference_policy_kl_penalty": 0.5,
        "loss_fn.kl_input_clamp_value": 1.0, "grpo.num_generations_per_prompt": 2,
    })
    shaping = PrevLogprobShaping(cfg, torch.tensor([1.0, 0.0]), dp_group=None)
    batch = _shaping_batch(prev, prev, reference, token_mask=[[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    shaped = shaping(batch)
    shaped_rewards = torch.tensor([1.0 - 0.5 * (math.e - 2), 0.0], dtype=torch.float64)
    expected = group_relative_advantages(shaped_rewards, 2, normalize_by_std=True, leave_one_out=False).advantages
    torch.testing.assert_close(shaped["advantages"], expected)
    assert torch.isfinite(shaped["advantages"]).all()
