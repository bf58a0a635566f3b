"""Every seed in [0, 2**63 - 1] drives a run: the per-step generators accept it and stay distinct per draw."""

from __future__ import annotations

import pytest
import torch

from megatron_grpo.runner.config import MAX_SEED
from megatron_grpo.runner.loop import PROMPT_STREAM, SAMPLING_STREAM, step_generator


def draw(generator: torch.Generator) -> list[int]:
    return torch.randint(0, 2**31 - 1, (4,), generator=generator).tolist()


@pytest.mark.parametrize("seed", [0, 1234, 123456789, 2**31 - 1, 2**46, MAX_SEED])
def test_large_seeds_make_generators_and_every_stream_differs(seed):
    draws = {
        (step, stream, dp_rank): tuple(draw(step_generator(seed, step, stream, dp_rank)))
        for step in (0, 1, 299)
        for stream in (PROMPT_STREAM, SAMPLING_STREAM)
        for dp_rank in (0, 1)
    }
    assert len(set(draws.values())) == len(draws)
    assert draw(step_generator(seed, 7, SAMPLING_STREAM, 1)) == draw(step_generator(seed, 7, SAMPLING_STREAM, 1))


def test_small_seeds_keep_the_unreduced_key_so_existing_runs_are_unchanged():
    seed, step, stream, dp_rank = 1234, 17, SAMPLING_STREAM, 1
    unreduced = ((seed * 1_000_003 + step) * 4 + stream) * 65_537 + dp_rank
    assert unreduced < 2**64
    assert draw(step_generator(seed, step, stream, dp_rank)) == draw(torch.Generator().manual_seed(unreduced))
