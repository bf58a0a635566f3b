"""The standard scalars (rewards, advantages, response lengths, lr, grad norm after clipping) and the step timer."""

from __future__ import annotations

import pytest
import torch
from _dist import run_on_ranks

from megatron_grpo.megatron.optimizer import grad_norm_after_clipping, learning_rate
from megatron_grpo.runner.statistics import rollout_statistics
from megatron_grpo.timing import PHASES, StepTimer, format_time_breakdown, time_breakdown_rows

EOS, PAD = 2, 0


def _rollout(lengths: list[int], width: int, eos_at_end: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """responses `[B, width]` and token_mask `[B, width]`: `length` tokens, the last one <eos> where asked."""
    responses = torch.full((len(lengths), width), PAD)
    mask = torch.zeros(len(lengths), width)
    for row, (length, eos) in enumerate(zip(lengths, eos_at_end)):
        responses[row, :length] = 5
        if eos:
            responses[row, length - 1] = EOS
        mask[row, :length] = 1
    return responses, mask


def _expected(rewards, advantages, lengths, eos_at_end):
    """In float64 from the float32 values the step holds."""
    adv32 = torch.tensor(advantages).double()
    token_adv = torch.cat([torch.full((n,), a.item(), dtype=torch.float64) for a, n in zip(adv32, lengths)])
    r = torch.tensor(rewards).double()
    n = torch.tensor(lengths, dtype=torch.float64)
    return {
        "reward_mean": r.mean().item(), "reward_std": r.std(unbiased=False).item(),
        "reward_min": r.min().item(), "reward_max": r.max().item(),
        "advantages_mean": token_adv.mean().item(), "advantages_std": token_adv.std(unbiased=False).item(),
        "advantages_min": token_adv.min().item(), "advantages_max": token_adv.max().item(),
        "response_length_mean": n.mean().item(), "response_length_min": n.min().item(),
        "response_length_max": n.max().item(),
        "response_truncated_fraction": sum(not e for e in eos_at_end) / len(eos_at_end),
    }


REWARDS = [0.0, 0.2, 1.0, 0.6, 0.4, 0.8]
ADVANTAGES = [-1.5, -0.5, 1.5, 0.5, -1.0, 1.0]
LENGTHS = [5, 3, 5, 1, 2, 5]
EOS_AT_END = [False, True, True, True, True, False]  # rows 0 and 5 hit max_new_tokens = 5 without <eos>


def test_rollout_statistics_single_rank() -> None:
    responses, mask = _rollout(LENGTHS, 5, EOS_AT_END)
    stats = rollout_statistics(torch.tensor(REWARDS), torch.tensor(ADVANTAGES), mask, responses, EOS)
    expected = _expected(REWARDS, ADVANTAGES, LENGTHS, EOS_AT_END)
    assert stats.keys() == expected.keys()
    for name, value in expected.items():
        assert stats[name] == pytest.approx(value, abs=1e-12), name
    # row 2 has length 5 and ends in <eos>: verl's clip_ratio would count it, "truncated" does not
    assert stats["response_truncated_fraction"] == pytest.approx(2 / 6)


def test_rollout_statistics_per_token_advantages_match_per_sample() -> None:
    responses, mask = _rollout(LENGTHS, 5, EOS_AT_END)
    per_token = torch.tensor(ADVANTAGES)[:, None] * mask
    a = rollout_statistics(torch.tensor(REWARDS), torch.tensor(ADVANTAGES), mask, responses, EOS)
    b = rollout_statistics(torch.tensor(REWARDS), per_token, mask, responses, EOS)
    assert a == pytest.approx(b)


def test_rollout_statistics_one_sample_has_zero_std() -> None:
    responses, mask = _rollout([3], 5, [True])
    stats = rollout_statistics(torch.tensor([0.5]), torch.tensor([0.0]), mask, responses, EOS)
    assert stats["reward_std"] == 0.0 and stats["advantages_std"] == 0.0
    assert stats["response_truncated_fraction"] == 0.0


def _dp_worker(rank: int, world_size: int, rows: list[int]) -> dict:
    """Each DP rank holds its share of the rows; also checks grad_norm_after_clipping against the real clip."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron.optimizer import clip_grad_norm

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        responses, mask = _rollout(LENGTHS, 5, EOS_AT_END)
        mine = torch.tensor(rows[rank])
        stats = rollout_statistics(torch.tensor(REWARDS)[mine], torch.tensor(ADVANTAGES)[mine], mask[mine],
                                   responses[mine], EOS, group=parallel_state.get_data_parallel_group())
        model = torch.nn.Linear(4, 3)
        clip_checks = []
        for scale, max_norm in ((10.0, 1.0), (0.01, 1.0), (10.0, 0.0)):
            for p in model.parameters():
                p.grad = torch.full_like(p, scale * (rank + 1))  # same on both ranks after no DP sum: fine here
            before = clip_grad_norm(model, max_norm)
            after = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm().item()
            clip_checks.append((before, max_norm, after))
        return {"stats": stats, "clip": clip_checks}
    finally:
        parallel_state.destroy_model_parallel()


def test_rollout_statistics_over_data_parallel_ranks_and_clip_norm() -> None:
    rows = [[0, 1, 2, 3], [4, 5]]  # uneven shares: counts, not per-rank means, must be combined
    results = run_on_ranks(2, _dp_worker, rows)
    expected = _expected(REWARDS, ADVANTAGES, LENGTHS, EOS_AT_END)
    for result in results:
        for name, value in expected.items():
            assert result["stats"][name] == pytest.approx(value, abs=1e-12), name
        for before, max_norm, after in result["clip"]:
            assert grad_norm_after_clipping(before, max_norm) == pytest.approx(after, rel=1e-5)


def test_grad_norm_after_clipping() -> None:
    assert grad_norm_after_clipping(0.5, 1.0) == 0.5
    assert grad_norm_after_clipping(5.0, 0.0) == 5.0  # clip_grad 0: no clipping
    assert grad_norm_after_clipping(5.0, 1.0) == pytest.approx(1.0, abs=1e-6)
    assert grad_norm_after_clipping(5.0, 1.0) < 1.0


def test_learning_rate() -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    assert learning_rate(optimizer) == 3e-4
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    optimizer.step()
    scheduler.step()
    assert learning_rate(optimizer) == pytest.approx(1.5e-4)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_step_timer_accumulates_and_reports_every_phase() -> None:
    clock, synced = FakeClock(), []
    timer = StepTimer(clock=clock, sync=lambda: synced.append(clock.now))
    with timer.section("rollout"):
        clock.now += 0.5
    for _ in range(2):  # two optimizer steps of one rollout
        with timer.section("forward_backward"):
            clock.now += 0.25
        with timer.section("optimizer"):
            clock.now += 0.125
    times = timer.times()
    assert list(times) == [f"{phase}_time_s" for phase in PHASES]
    assert times["rollout_time_s"] == 0.5 and times["forward_backward_time_s"] == 0.5
    assert times["optimizer_time_s"] == 0.25 and times["prev_pass_time_s"] == 0.0
    assert len(synced) == 2 * 5
    timer.add("custom", 1.0)
    assert timer.times()["custom_time_s"] == 1.0
    timer.reset()
    assert set(timer.times().values()) == {0.0}


def test_step_timer_counts_a_failing_section_and_refuses_nesting() -> None:
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    with pytest.raises(ValueError):
        with timer.section("rollout"):
            clock.now += 1.0
            raise ValueError("boom")
    assert timer.times()["rollout_time_s"] == 1.0
    with pytest.raises(RuntimeError, match="do not nest"):
        with timer.section("forward_backward"):
            with timer.section("optimizer"):
                pass
    with timer.section("optimizer"):  # usable again afterwards
        clock.now += 2.0
    assert timer.times()["optimizer_time_s"] == 2.0


def _record(step: int, **times: float) -> dict:
    return {"step": step, "reference_pass_ran": False, "prev_pass_ran": True, **times}


def test_time_breakdown_shares_and_skipped_passes() -> None:
    phases = dict(rollout_time_s=0.1, reference_pass_time_s=0.0, prev_pass_time_s=0.02, forward_backward_time_s=0.05,
                  optimizer_time_s=0.01, checkpoint_time_s=0.0, step_time_s=0.2)
    no_checkpoint = {key: value for key, value in phases.items() if key != "checkpoint_time_s"}
    records = [_record(0, **no_checkpoint), _record(1, **{**phases, "checkpoint_time_s": 0.2, "step_time_s": 0.4})]
    rows = dict(time_breakdown_rows(records))
    assert rows["time per step, by phase"] == "0.300 s"
    assert rows["  rollout"] == "0.100 s   33.3%"
    assert rows["  reference pass"] == "skipped by the plan"
    assert rows["  prev pass"] == "0.020 s    6.7%"
    assert rows["  checkpoint"] == "0.100 s   33.3%"  # a step without the key counts 0
    assert rows["  training forward/backward"] == "0.050 s   16.7%"
    assert rows["  other"] == "0.020 s    6.7%"  # 0.3 - (0.1 + 0.02 + 0.05 + 0.01 + 0.1)
    text = format_time_breakdown(records)
    assert text.splitlines()[0].startswith("time per step, by phase")


def test_time_breakdown_of_records_without_phases_is_empty() -> None:
    assert time_breakdown_rows([]) == []
    assert format_time_breakdown([{"step": 0, "step_time_s": 0.2}]) == ""
    rows = time_breakdown_rows([{"step": 0, "rollout_time_s": 0.1, "step_time_s": 0.2}])
    assert [label for label, _ in rows] == ["time per step, by phase", "  rollout", "  other"]
