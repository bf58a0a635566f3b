"""Off-policy GRPO in the loop: stale rollouts really come from older weights, and several optimizer steps per
rollout move the ratio away from 1, and a resume with rollouts in flight repeats the uninterrupted run. One
process (TP=1, gloo) drives the real Trainer for a few steps."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from _configs import CONFIGS, config_with, set_key
from _dist import run_on_ranks
from _tolerances import MODEL_LOGPROB_ATOL

from megatron_grpo.runner.checkpoint_dir import step_dir_name
from megatron_grpo.runner.config import load_config
from megatron_grpo.runner.config_files import read_yaml_with_defaults

STEPS = 4
OFF_POLICY = {
    "policy.tensor_model_parallel_size": 1,
    "grpo.max_rollout_staleness": 1,
    "policy.train_global_batch_size": 64,  # half of the 16 x 8 rollout: two optimizer steps per rollout
    "policy.train_micro_batch_size": 32,
    "grpo.max_num_steps": STEPS,
    "loss_fn.use_importance_sampling_correction": True,
    "loss_fn.truncated_importance_sampling.type": "tis",
    "loss_fn.truncated_importance_sampling.ratio_min": 0.0,
    "loss_fn.truncated_importance_sampling.ratio_max": 2.0,
}


def sampling_logprobs(model, rollout, temperature: float, vocab_size: int) -> torch.Tensor:
    """[B, S] log-probabilities of the rollout's tokens under `model`'s sampling distribution (TP=1)."""
    from megatron_grpo.megatron import model_forward

    with torch.no_grad():
        logits = model_forward(model, rollout.input_ids)[..., :vocab_size].double() / temperature
    picked = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, rollout.input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0)) * rollout.token_mask


def drive_trainer(rank: int, world_size: int, overrides: dict) -> dict:
    from megatron_grpo.megatron import build_gpt_model, destroy_parallel, init_parallel
    from megatron_grpo.runner.loop import Trainer
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import model_params, parallel_params

    cfg = config_with(overrides)
    plan = plan_for(cfg)
    trainer = Trainer.build(cfg, plan, init_parallel(parallel_params(cfg)))
    snapshots, taken, records = {}, [], []
    take = trainer.rollouts.take

    def recording_take(step):
        entry = take(step)
        taken.append(entry)
        return entry

    trainer.rollouts.take = recording_take
    for step in range(STEPS):
        snapshots[step] = copy.deepcopy(trainer.model.state_dict())  # the weights that have done `step` steps
        records.append(trainer.step(step))
        # prev comes from the weights at the start of the step: PPO's old policy, recomputed by the plan's pass
    checks = []
    vocab_size = trainer.task.tokenizer.vocab_size
    probe = build_gpt_model(model_params(cfg), vocab_size)
    temperature = cfg.generation.temperature
    for entry in taken:
        probe.load_state_dict(snapshots[entry.weight_version])
        under_generating = sampling_logprobs(probe, entry.rollout, temperature, vocab_size)
        probe.load_state_dict(snapshots[entry.step])
        under_current = sampling_logprobs(probe, entry.rollout, temperature, vocab_size)
        generation = entry.rollout.generation_logprobs.double()
        checks.append({
            "step": entry.step,
            "weight_version": entry.weight_version,
            "gen_vs_generating_weights": (generation - under_generating).abs().max().item(),
            "gen_vs_current_weights": (generation - under_current).abs().max().item(),
        })
    destroy_parallel()
    return {"plan": (plan.compute_reference_logprobs, plan.compute_prev_logprobs), "checks": checks,
            "records": records}


def test_stale_rollouts_come_from_older_weights_and_the_ratio_moves():
    (result,) = run_on_ranks(1, drive_trainer, OFF_POLICY)
    assert result["plan"] == (False, True)  # staleness and two steps per rollout: prev is computed
    checks, records = result["checks"], result["records"]
    assert [c["weight_version"] for c in checks] == [0, 0, 1, 2]  # step s trains on weights of step max(0, s-1)
    for check in checks:
        # generation logprobs: the generating weights' (one fp32 forward per decoding step against a float64 head on
        # one full-sequence forward: rounding only)
        assert check["gen_vs_generating_weights"] <= MODEL_LOGPROB_ATOL, check
    for check in checks[1:]:
        assert check["gen_vs_current_weights"] > 1e-4, check  # ... not the current ones once the weights moved
    assert [r["rollout_age"] for r in records] == [0, 1, 1, 1]
    for record in records:
        assert record["prev_pass_ran"]
        assert record["probs_ratio"] != 1.0  # the second optimizer step of each rollout trains on moved weights
        assert torch.isfinite(torch.tensor(record["loss"]))
    for record in records[1:]:
        assert record["token_mult_prob_error"] > 1.0 + 1e-6  # prev (current weights) vs generation (older ones)
        assert record["gen_kl_error"] != 0.0


BYPASS = {"loss_fn.use_importance_sampling_correction": False,  # IS against generation is a no-op with prev = it
          "loss_fn.truncated_importance_sampling.type": None}
MODE_OVERRIDES = {"generation": BYPASS}


def train_and_resume(rank: int, world_size: int, overrides: dict, root: str, modes: list[str]) -> dict:
    """Per `logprob_passes.prev` mode: an uninterrupted run that checkpoints after 2 of 4 steps, then a resume of
    that checkpoint in another run directory; then a resume of the first mode's with another staleness (an
    error)."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron import init_parallel
    from megatron_grpo.runner.checkpoint_dir import CheckpointError, step_dir_name
    from megatron_grpo.runner.loop import train
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import parallel_params
    from megatron_grpo.runner.reporting import read_metrics, without_timings

    def run(run_dir: str, resume_from, **more) -> list[dict]:
        cfg = config_with({**overrides, "checkpoint.every_n_steps": 2, "run_dir": f"{root}/{run_dir}",
                           "checkpoint.dir": f"{root}/{run_dir}/checkpoints", **more})
        layout = init_parallel(parallel_params(cfg))
        try:
            train(cfg, plan_for(cfg), layout, resume_from=resume_from)
        finally:
            parallel_state.destroy_model_parallel()  # the default group stays for the next run
        return [without_timings(record) for record in read_metrics(Path(cfg.run_dir))]

    runs = {}
    for mode in modes:
        more = {"logprob_passes.prev": mode, **MODE_OVERRIDES.get(mode, {})}
        uninterrupted = run(f"{mode}/uninterrupted", None, **more)
        resumed = run(f"{mode}/resumed", Path(root) / mode / "uninterrupted" / "checkpoints" / step_dir_name(2), **more)
        runs[mode] = {"uninterrupted": uninterrupted, "resumed": resumed}
    first = {"logprob_passes.prev": modes[0], **MODE_OVERRIDES.get(modes[0], {})}
    try:
        run("other_staleness", Path(root) / modes[0] / "uninterrupted" / "checkpoints" / step_dir_name(2),
            **{**first, "grpo.max_rollout_staleness": overrides["grpo.max_rollout_staleness"] + 1})
        staleness_error = ""
    except CheckpointError as err:
        staleness_error = str(err)
    return {"runs": runs, "staleness_error": staleness_error}


@pytest.mark.slow  # two training runs per mode, and a failing resume
@pytest.mark.parametrize("staleness, modes", [(1, ["compute"]),
                                              (2, ["compute_and_compare", "generation", "loglinear", "linear"])])
def test_a_resume_with_rollouts_in_flight_repeats_the_uninterrupted_run(tmp_path, staleness, modes):
    (result,) = run_on_ranks(1, train_and_resume, {**OFF_POLICY, "grpo.max_rollout_staleness": staleness},
                             str(tmp_path), modes)
    for mode, runs in result["runs"].items():
        uninterrupted, resumed = runs["uninterrupted"], runs["resumed"]
        assert [r["step"] for r in resumed] == [2, 3], mode
        assert [r["rollout_weight_version"] for r in resumed] == [2 - staleness, 3 - staleness]  # from the queue
        assert resumed == uninterrupted[2:], mode  # every metric, bit for bit (fp32 on the CPU)
        assert all(r["prev_pass_ran"] == mode.startswith("compute") for r in uninterrupted), mode
    expected = f"saved with grpo.max_rollout_staleness = {staleness}, this run has {staleness + 1}"
    assert expected in result["staleness_error"]
    if staleness == 1:
        return
    runs = {mode: result["runs"][mode]["uninterrupted"] for mode in modes}
    # Two optimizer steps per rollout two rollouts old: the second step's alpha is 2 / 2.5, so the interpolations
    # are approximations there, and the comparison with the pass says by how much.
    compared = runs["compute_and_compare"]
    assert all(r["prox_loglinear_abs_error"] > 0 and r["prox_generation_abs_error"] > 0 for r in compared[2:])
    assert all(r["prox_loglinear_abs_error"] < r["prox_generation_abs_error"] for r in compared[2:])
    assert len({tuple(r["loss"] for r in records) for records in runs.values()}) == len(modes)  # four trainings
    assert not {"token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio"} & set(runs["generation"][0])
    assert all("token_mult_prob_error" in r for mode in ("loglinear", "linear") for r in runs[mode])


# --- Stale rollouts with one update per rollout: the prev pass is the training forward ----------------------------

EXACT_STEPS, RESUME_AT = 20, 16
STALE_DEMO = CONFIGS / "grpo_tiny_cpu_stale.yaml"


def stale_demo_with(overrides: dict):
    data, _files = read_yaml_with_defaults(STALE_DEMO)  # the demo's keys, the stale config's changes on top
    for key, value in {"policy.tensor_model_parallel_size": 1, "grpo.max_num_steps": EXACT_STEPS,
                       "logging.progress_bar": False, "logging.tensorboard": False, **overrides}.items():
        data = set_key(data, key, value)
    return load_config(data)


def skipped_computed_and_resumed(rank: int, world_size: int, root: str) -> dict:
    """The stale demo (TP=1) for 20 steps with the prev pass skipped (auto) and computed, and the skipped run
    resumed from its checkpoint of step 16; each train step's per-token prev, generation and mask are kept."""
    from megatron.core import parallel_state

    from megatron_grpo.loss import trained_token_mask
    from megatron_grpo.megatron import init_parallel
    from megatron_grpo.runner import loop
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import parallel_params
    from megatron_grpo.runner.reporting import read_metrics, without_timings

    per_token: list[dict] = []
    original = loop.train_step

    def keeping_per_token(step_cfg, model, optimizer, loss_fn, plan, batch, **kwargs):
        result = original(step_cfg, model, optimizer, loss_fn, plan, batch, **kwargs)
        per_token.append({"prev": result.prev_logprobs.clone(), "generation": batch["generation_logprobs"].clone(),
                          "mask": trained_token_mask(batch)})
        return result

    loop.train_step = keeping_per_token

    def run(name: str, prev_mode: str, resume_from=None) -> dict:
        per_token.clear()
        cfg = stale_demo_with({"logprob_passes.prev": prev_mode, "run_dir": f"{root}/{name}",
                               "checkpoint.dir": f"{root}/{name}/checkpoints", "checkpoint.every_n_steps": RESUME_AT})
        plan = plan_for(cfg)
        layout = init_parallel(parallel_params(cfg))
        try:
            loop.train(cfg, plan, layout, resume_from=resume_from)
        finally:
            parallel_state.destroy_model_parallel()
        return {"plan": plan, "records": [without_timings(r) for r in read_metrics(Path(cfg.run_dir))],
                "per_token": list(per_token)}

    skipped = run("skipped", "auto")
    computed = run("computed", "compute")
    resumed = run("resumed", "auto", Path(root) / "skipped" / "checkpoints" / step_dir_name(RESUME_AT))
    return {"skipped": skipped, "computed": computed, "resumed": resumed}


def _is_weights(per_token: dict) -> torch.Tensor:
    """The stale demo's truncated IS weights, clamp(exp(prev - generation), 0, 2), on the trained tokens."""
    mask = per_token["mask"].bool()
    return torch.exp(per_token["prev"][mask].double() - per_token["generation"][mask].double()).clamp(0.0, 2.0)


@pytest.mark.slow  # three training runs of the stale demo, 44 steps in all
def test_stale_rollouts_with_one_update_skip_the_prev_pass_exactly(tmp_path):
    (result,) = run_on_ranks(1, skipped_computed_and_resumed, str(tmp_path))
    skipped, computed, resumed = result["skipped"], result["computed"], result["resumed"]
    assert not skipped["plan"].compute_prev_logprobs and computed["plan"].compute_prev_logprobs
    assert not any(r["prev_pass_ran"] for r in skipped["records"])
    assert all(r["prev_pass_ran"] for r in computed["records"])
    assert [r["rollout_age"] for r in skipped["records"]] == [0] + [1] * (EXACT_STEPS - 1)
    # The rollouts, hence the rewards, are the same: the skipped pass changed nothing the sampler sees.
    assert [r["reward_mean"] for r in skipped["records"]] == [r["reward_mean"] for r in computed["records"]]
    # fp32 rounding: the pass and the training forward compute the same logprobs of the same weights, in
    # differently shaped calls (no entropy partial, all positions' targets), so they may differ by a few ulps of
    # logprobs of magnitude <= ~20; the IS weights (clamped at 2) and the exp-based metrics then differ by a few
    # ulps of their O(1) values, and the loss and gradient norm (sums over ~1000 tokens) by a few ulps more.
    for mine, theirs in zip(skipped["per_token"], computed["per_token"], strict=True):
        torch.testing.assert_close(_is_weights(mine), _is_weights(theirs), rtol=1e-5, atol=1e-6)
    for key in ("sampling_importance_ratio", "token_mult_prob_error", "gen_kl_error", "loss", "grad_norm",
                "probs_ratio"):
        for step, (mine, theirs) in enumerate(zip(skipped["records"], computed["records"], strict=True)):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (key, step, mine[key], theirs[key])
    assert all(r["probs_ratio_min"] == r["probs_ratio_max"] == 1.0 for r in skipped["records"])
    assert skipped["records"][-1]["token_mult_prob_error"] > 1.0  # the staleness shows against generation
    # A resume in the middle of the skipped run repeats it, bit for bit (fp32 on the CPU).
    assert resumed["records"] == skipped["records"][RESUME_AT:]


# --- The sequence mask by logprob error in the training forward: the prev pass skipped there too -------------------

MASK_STEPS = 12
THRESHOLD = 1.25


def masked_auto_and_compute(rank: int, world_size: int, root: str) -> dict:
    """The stale demo (TP=1, one update per rollout, rollouts one step stale) with the sequence mask by logprob
    error, 12 steps with the prev pass skipped (auto: the mask reads the training forward) and computed."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron import init_parallel
    from megatron_grpo.runner import loop
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import parallel_params
    from megatron_grpo.runner.reporting import read_metrics

    runs = {}
    for mode in ("auto", "compute"):
        cfg = stale_demo_with({"grpo.max_num_steps": MASK_STEPS, "grpo.seq_logprob_error_threshold": THRESHOLD,
                               "logprob_passes.prev": mode, "run_dir": f"{root}/{mode}",
                               "checkpoint.dir": f"{root}/{mode}/checkpoints", "checkpoint.every_n_steps": 0})
        plan = plan_for(cfg)
        layout = init_parallel(parallel_params(cfg))
        try:
            loop.train(cfg, plan, layout, resume_from=None)
        finally:
            parallel_state.destroy_model_parallel()
        runs[mode] = {"plan": (plan.compute_prev_logprobs, plan.reasons[1]),
                      "records": list(read_metrics(Path(cfg.run_dir)))}
    return runs


@pytest.mark.slow  # two training runs of the stale demo, 24 steps in all
def test_the_sequence_mask_reads_the_training_forward_and_skips_the_prev_pass_exactly(tmp_path):
    (runs,) = run_on_ranks(1, masked_auto_and_compute, str(tmp_path))
    auto, compute = runs["auto"], runs["compute"]
    assert auto["plan"][0] is False and compute["plan"][0] is True
    assert "masks sequences inside the training forward" in auto["plan"][1]
    assert not any(r["prev_pass_ran"] for r in auto["records"])
    assert all(r["prev_pass_ran"] for r in compute["records"])
    assert [r["rollout_age"] for r in auto["records"]] == [0] + [1] * (MASK_STEPS - 1)
    # The same rollouts (the sampler never sees prev), the same masks and, to fp32 rounding (see
    # test_stale_rollouts_with_one_update_skip_the_prev_pass_exactly), the same losses and gradients.
    assert [r["reward_mean"] for r in auto["records"]] == [r["reward_mean"] for r in compute["records"]]
    for step, (mine, theirs) in enumerate(zip(auto["records"], compute["records"], strict=True)):
        for key in ("num_masked_seqs_by_logprob_error", "masked_seqs_by_logprob_error_fraction",
                    "num_valid_samples_before_mask", "num_valid_samples"):
            assert mine[key] == theirs[key], (key, step)
        for key in ("loss", "grad_norm", "max_seq_mult_prob_error", "mean_seq_mult_prob_error"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (key, step, mine[key], theirs[key])
    masked = [r["num_masked_seqs_by_logprob_error"] for r in auto["records"]]
    assert masked[0] == 0 and sum(masked) > 0  # fresh at step 0; one step stale, the mask bites on some sequences
    assert all(r["num_masked_seqs_by_logprob_error"] < r["num_valid_samples_before_mask"] for r in auto["records"])
