"""RolloutQueue: each step's rollout comes from the weights of step - N (or step 0), and the queue round-trips."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.runner.rollout import Rollout
from megatron_grpo.runner.rollout_queue import RolloutQueue


class FakeProducer:
    """Records which step each call made, and with which "weights" (the trainer's step counter at the time)."""

    def __init__(self):
        self.weights_version = 0
        self.calls: list[tuple[int, int]] = []

    def __call__(self, step: int):
        self.calls.append((step, self.weights_version))
        ids = torch.full((2, 3), step, dtype=torch.int64)
        rollout = Rollout(input_ids=ids, token_mask=torch.ones(2, 3), generation_logprobs=torch.zeros(2, 3),
                          prompt_length=1)
        return rollout, torch.tensor([float(step), float(self.weights_version)]), 0.01


def run_steps(queue: RolloutQueue, producer: FakeProducer, steps: range) -> list[tuple[int, int, int]]:
    taken = []
    for step in steps:
        producer.weights_version = step  # the trainer has done `step` steps when it asks for this rollout
        entry = queue.take(step)
        assert entry.rollout.input_ids[0, 0].item() == step
        assert len(queue.pending) <= queue.max_staleness  # the taken one plus these: at most N + 1 in flight
        taken.append((entry.step, entry.weight_version, entry.age))
    return taken


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_rollout_of_step_s_comes_from_the_weights_of_step_s_minus_n(staleness):
    producer = FakeProducer()
    taken = run_steps(RolloutQueue(producer, staleness), producer, range(8))
    assert taken == [(s, max(0, s - staleness), s - max(0, s - staleness)) for s in range(8)]
    assert [step for step, _version in producer.calls] == list(range(8 + staleness))  # each step made once


def test_saved_queue_resumes_exactly():
    producer = FakeProducer()
    queue = RolloutQueue(producer, 2)
    first = run_steps(queue, producer, range(4))
    state = queue.state_dict()
    assert [entry["step"] for entry in state["pending"]] == [4, 5]

    resumed_producer = FakeProducer()
    resumed = RolloutQueue(resumed_producer, 2)
    resumed.load_state_dict(state)
    rest = run_steps(resumed, resumed_producer, range(4, 8))

    straight_producer = FakeProducer()
    straight = run_steps(RolloutQueue(straight_producer, 2), straight_producer, range(8))
    assert first + rest == straight
    assert [call for call in resumed_producer.calls] == [call for call in straight_producer.calls if call[0] >= 6]


def test_queue_refuses_a_different_staleness_or_a_skipped_step():
    producer = FakeProducer()
    queue = RolloutQueue(producer, 1)
    run_steps(queue, producer, range(2))
    with pytest.raises(ValueError, match="grpo.max_rollout_staleness = 1, this run uses 2"):
        RolloutQueue(producer, 2).load_state_dict(queue.state_dict())
    with pytest.raises(RuntimeError, match="holds steps 2..2, but step 5 asked"):
        queue.take(5)
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        RolloutQueue(producer, -1)
