"""Packing needs no more memory than padding for the same rollout: the live tensors' peak of `train_step`
(`bench.measure.LiveTensorBytes`: deterministic, independent of the allocator) with packed microbatches of at most
the padded microbatch's tokens (micro_batch_size × the rollout's width, `bench step`'s rule), by
`balanced_first_fit_decreasing`, is at most the padded step's, through the tiny GPTModel on the materialised, fused
linear and loss-fused paths. The rollout is `bench packing`'s long setting scaled down: 16 rows of a 3-token prompt
and a response of a quarter to all of the width, microbatches of 8 rows, so that padding fills about a third of each
padded microbatch. First-fit decreasing fills its first microbatch to the budget with trained tokens, more than any
padded microbatch trains, and the fused heads keep buffers per trained token (`loss.packing`).

Each step is counted after one uncounted step, so that the optimizer's state exists already, as in the benchmarks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from test_megatron_hooks import TINY_MODEL, VOCAB

ROWS, WIDTH, PROMPT, MICRO_BATCH = 16, 128, 3, 8
MODES = {"materialised": (False, False), "fused": (True, False), "loss_fused": (True, True)}
VARIANTS = {"padded": None, "packed": "balanced_first_fit_decreasing"}


def long_rollout() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(WIDTH // 4, WIDTH - PROMPT + 1, (ROWS,), generator=gen)
    positions = torch.arange(WIDTH)
    token_mask = ((positions >= PROMPT) & (positions < PROMPT + lengths[:, None])).to(torch.float32)
    return {"input_ids": torch.randint(0, VOCAB, (ROWS, WIDTH), generator=gen), "token_mask": token_mask,
            "sample_mask": torch.ones(ROWS), "advantages": torch.randn(ROWS, generator=gen)}


def live_peaks(rank: int, world_size: int) -> dict:
    from megatron_grpo.bench.measure import LiveTensorBytes
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import (
        build_gpt_model,
        build_optimizer,
        destroy_parallel,
        init_parallel,
        train_step,
        vocab_shard_of,
    )
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, model_params, parallel_params, step_config

    tiny = {**TINY_MODEL, "policy.tensor_model_parallel_size": 1, "policy.model.max_position_embeddings": WIDTH,
            "policy.train_micro_batch_size": MICRO_BATCH, "policy.train_global_batch_size": ROWS,
            "grpo.num_generations_per_prompt": ROWS // 2}
    init_parallel(parallel_params(config_with(tiny)))
    batch = long_rollout()
    peaks = {}
    try:
        for mode, (linear, loss_fused) in MODES.items():
            cfg = config_with({**tiny, "policy.fused_linear_logprobs": linear, "policy.fused_linear_loss": loss_fused})
            for variant, algorithm in VARIANTS.items():
                torch.manual_seed(cfg.seed)
                model = build_gpt_model(model_params(cfg), VOCAB)
                optimizer = build_optimizer(model, adam_params(cfg))
                step = step_config(cfg)
                if algorithm is not None:
                    step = dataclasses.replace(step, max_tokens_per_microbatch=MICRO_BATCH * WIDTH,
                                               packing_algorithm=algorithm)
                loss_fn, plan, vocab = ClippedPGLoss(cfg.loss_fn), plan_for(cfg), vocab_shard_of(model, VOCAB)
                train_step(step, model, optimizer, loss_fn, plan, dict(batch), vocab=vocab)
                with LiveTensorBytes() as live:
                    train_step(step, model, optimizer, loss_fn, plan, dict(batch), vocab=vocab)
                peaks[mode, variant] = live.peak_bytes
    finally:
        destroy_parallel()
    return peaks


@pytest.fixture(scope="module")
def peaks() -> dict:
    return run_on_ranks(1, live_peaks)[0]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_balanced_packing_needs_no_more_live_memory_than_padding(peaks, mode):
    padded, packed = peaks[mode, "padded"], peaks[mode, "packed"]
    assert 0 < packed <= padded, (mode, packed, padded)
