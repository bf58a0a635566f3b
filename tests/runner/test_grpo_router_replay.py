"""Rollout routing replay (R3) in the GRPO loop, on a tiny Mixture-of-Experts policy at TP 2 (sequence parallel)
over gloo: the sampler records every token's routes, the train step replays them, and on-policy the prev pass is
exactly the training forward, so 20 steps with the pass skipped and 20 with it computed are bitwise the same run
(the same operations on the same machine: docs/design.md, "Tolerances"). One job drives the real Trainer.
"""

from __future__ import annotations

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks

STEPS = 20
MOE = {
    "policy.tensor_model_parallel_size": 2,
    "policy.sequence_parallel": True,
    "policy.router_replay.enabled": True,
    "policy.train_global_batch_size": 4,
    "policy.train_micro_batch_size": 2,
    "policy.model.num_layers": 2,
    "policy.model.hidden_size": 24,
    "policy.model.num_attention_heads": 4,
    "policy.model.ffn_hidden_size": 40,
    "policy.model.max_position_embeddings": 8,
    "policy.model.make_vocab_size_divisible_by": 8,
    "policy.model.add_bias_linear": False,
    "policy.model.num_moe_experts": 4,
    "policy.model.moe_ffn_hidden_size": 32,
    "policy.model.moe_aux_loss_coeff": 0.01,
    "policy.model.moe_z_loss_coeff": 0.001,
    "task.num_digits": 2,  # a prompt of 5 tokens and 3 sampled: sequences of odd length, padded for the TP split
    "generation.max_new_tokens": 3,
    "grpo.num_prompts_per_step": 2,
    "grpo.num_generations_per_prompt": 2,
    "logging.tensorboard": False,
    "logging.progress_bar": False,
}
DIFFERS_BY_DESIGN = ("prev_pass_ran", "prev_passes_skipped")  # and every `*_time_s`


def twenty_steps(prev: str) -> dict:
    """The run with `logprob_passes.prev: prev`: its plan, records, recorded routes and final weights."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron import init_parallel
    from megatron_grpo.megatron.routing_replay import RouterReplay
    from megatron_grpo.runner.loop import Trainer
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import parallel_params

    cfg = config_with({**MOE, "logprob_passes.prev": prev})
    plan = plan_for(cfg)
    trainer = Trainer.build(cfg, plan, init_parallel(parallel_params(cfg)))  # seeded: the same initial weights
    try:
        routes = []
        rollout = trainer.rollout

        def recording_rollout(step):
            produced = rollout(step)
            routes.append(produced[0].routed_experts)
            return produced

        trainer.rollout = recording_rollout
        records = [trainer.step(step) for step in range(STEPS)]
        return {"plan": plan, "records": records, "routes": routes,
                "weights": [param.detach().clone() for param in trainer.model.parameters()]}
    finally:
        RouterReplay.clear_global_router_replay_instances()
        parallel_state.destroy_model_parallel()


def both_runs(rank: int, world_size: int) -> dict:
    """The run with the prev pass skipped (`auto`) and the one with it computed, one after the other in one job."""
    from megatron_grpo.megatron import destroy_parallel

    try:
        return {prev: twenty_steps(prev) for prev in ("auto", "compute")}
    finally:
        destroy_parallel()


def comparable(record: dict) -> dict:
    return {key: value for key, value in record.items()
            if key not in DIFFERS_BY_DESIGN and not key.endswith("_time_s")}


@pytest.mark.slow  # two training runs of 20 steps on two ranks
def test_twenty_steps_with_prev_skipped_and_computed_are_bitwise_the_same_run():
    ranks = run_on_ranks(2, both_runs)
    for result in ranks:
        skipped, computed = result["auto"], result["compute"]
        assert (skipped["plan"].compute_prev_logprobs, computed["plan"].compute_prev_logprobs) == (False, True)
        assert "replay the rollout's routes" in skipped["plan"].reasons[1]
        assert [r["prev_pass_ran"] for r in skipped["records"]] == [False] * STEPS
        assert [r["prev_pass_ran"] for r in computed["records"]] == [True] * STEPS
        for step, (a, b) in enumerate(zip(skipped["records"], computed["records"], strict=True)):
            assert comparable(a) == comparable(b), step  # every metric, floats bit for bit
        assert all(torch.equal(a, b) for a, b in zip(skipped["weights"], computed["weights"], strict=True))
        # the sampler recorded every token's routes, [B, S, L, k], and the run learned something
        assert all(torch.equal(a, b) for a, b in zip(skipped["routes"], computed["routes"], strict=True))
        assert skipped["routes"][0].shape[2:] == (2, 2) and skipped["routes"][0].dtype == torch.int64
        assert {"router_replay_changed_fraction", "load_balancing_loss", "z_loss"} <= set(skipped["records"][0])
        assert computed["records"][-1]["probs_ratio"] == 1.0  # prev equals curr bitwise: the ratio is exactly 1
    assert comparable(ranks[0]["auto"]["records"][-1]) == comparable(ranks[1]["auto"]["records"][-1])
