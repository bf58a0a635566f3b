"""The runner replaying its sampler's kept sets (`generation.replay_kept_set`) on the stale demo with top-p 0.8:
the prev pass, skipped by the plan or computed, gives the same run (replay changes nothing in which passes run), and
the kept-set metrics are logged. One process (TP=1, gloo) drives `loop.train`."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist import run_on_ranks
from test_grpo_offpolicy import stale_demo_with

from megatron_grpo.runner.plan_inputs import plan_for

STEPS = 6
REPLAY = {"generation.top_p": 0.8, "generation.replay_kept_set": True, "grpo.max_num_steps": STEPS,
          "checkpoint.every_n_steps": 0}


def replayed_auto_and_compute(rank: int, world_size: int, root: str) -> dict:
    from megatron.core import parallel_state

    from megatron_grpo.megatron import init_parallel
    from megatron_grpo.runner import loop
    from megatron_grpo.runner.plugin_params import parallel_params
    from megatron_grpo.runner.reporting import read_metrics

    runs = {}
    for mode in ("auto", "compute"):
        cfg = stale_demo_with({**REPLAY, "logprob_passes.prev": mode, "run_dir": f"{root}/{mode}",
                               "checkpoint.dir": f"{root}/{mode}/checkpoints"})
        plan = plan_for(cfg)
        layout = init_parallel(parallel_params(cfg))
        try:
            loop.train(cfg, plan, layout, resume_from=None)
        finally:
            parallel_state.destroy_model_parallel()
        runs[mode] = {"plan": plan, "records": list(read_metrics(Path(cfg.run_dir)))}
    return runs


@pytest.mark.slow  # two training runs of the stale demo, 12 steps in all
def test_replay_trains_the_same_with_the_prev_pass_skipped_or_computed(tmp_path):
    (runs,) = run_on_ranks(1, replayed_auto_and_compute, str(tmp_path))
    auto, compute = runs["auto"], runs["compute"]
    assert not auto["plan"].compute_prev_logprobs and compute["plan"].compute_prev_logprobs
    recomputing = plan_for(stale_demo_with({**REPLAY, "generation.replay_kept_set": False}))
    assert auto["plan"] == recomputing  # the same passes, for the same reasons, word for word
    assert [r["reward_mean"] for r in auto["records"]] == [r["reward_mean"] for r in compute["records"]]
    for step, (mine, theirs) in enumerate(zip(auto["records"], compute["records"], strict=True)):
        # fp32 rounding between the pass and the training forward (test_grpo_offpolicy.py's reasoning)
        for key in ("loss", "gen_ratio_outside_band", "kept_set_mass", "kept_set_differs",
                    "kept_set_replayed_ratio_outside_band", "kept_set_recomputed_ratio_outside_band"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (key, step)
        assert mine["rollout_kept_set_size"] == theirs["rollout_kept_set_size"] >= 1.0
    assert all(r["filtered_out_tokens"] == 0 for r in auto["records"])  # every token is in its replayed set
    assert any(r["kept_set_differs"] > 0 for r in auto["records"][1:])  # the stale rollouts' sets differ at times
