"""The step benchmark: its four configurations' plans and step configs, the synthetic rollout, the report's maths on
fake rows, bad options (exit 2 naming the option), and one tiny run of the CLI under the launcher."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megatron_grpo.bench.step import (
    CONFIGURATIONS,
    PHASES,
    Setup,
    main,
    plans_and_steps,
    summarise,
    synthetic_rollout,
    tokens_per_pass,
    weighted_logprob,
)

TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--vocab", "300", "--prompts", "2", "--generations", "2",
        "--prompt-tokens", "2", "4", "--response-tokens", "3", "12", "--micro-batch-size", "2"]


def test_each_configuration_adds_one_feature_and_the_plan_keeps_the_reference_pass_while_the_kl_is_on():
    configurations, loss = plans_and_steps(Setup(micro_batch_size=4))
    (plan1, step1), (plan2, step2), (plan3, step3), (plan4, step4) = (configurations[n] for n in CONFIGURATIONS)
    assert loss.reference_policy_kl_penalty == 0.01
    assert plan1.compute_prev_logprobs and plan1.compute_reference_logprobs and not plan1.prev_from_current
    assert not plan2.compute_prev_logprobs and plan2.prev_from_current and plan2.compute_reference_logprobs
    assert step1 == step2 and not step2.fused_linear_logprobs and step2.max_tokens_per_microbatch is None
    assert step3.fused_linear_logprobs and step3.fused_linear_loss and step3.max_tokens_per_microbatch is None
    assert step4.fused_linear_logprobs and step4.max_tokens_per_microbatch == 4 * Setup().max_length
    assert plan3 == plan4 == plan2
    no_kl, _ = plans_and_steps(Setup(kl_penalty=0.0))
    assert no_kl["everything"][0].compute_reference_logprobs  # forced, as NeMo-RL computes it
    assert not no_kl["plan"][0].compute_reference_logprobs and not no_kl["plan"][0].compute_prev_logprobs


def test_the_rollout_is_ragged_trains_the_responses_and_has_group_relative_advantages():
    setup = Setup(prompts=3, generations=4, prompt_tokens=(2, 5), response_tokens=(3, 9), vocab=50)
    batch = synthetic_rollout(setup, seed=7)
    assert batch["input_ids"].shape[0] == 12 and batch["input_ids"].max() < 50
    responses = batch["token_mask"].sum(dim=1)
    assert responses.min() >= 3 and responses.max() <= 9
    first_trained = batch["token_mask"].argmax(dim=1)
    assert first_trained.min() >= 2 and first_trained.max() <= 5  # after a prompt of 2-5 tokens
    assert torch.allclose(batch["advantages"].view(3, 4).sum(dim=1), torch.zeros(3), atol=1e-5)  # mean removed
    assert torch.equal(synthetic_rollout(setup, seed=7)["input_ids"], batch["input_ids"])  # seeded


def test_tokens_and_the_objective_are_counted_on_the_trained_tokens():
    token_mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.int64), "token_mask": token_mask,
             "advantages": torch.tensor([1.0, -1.0])}
    assert tokens_per_pass(batch, packed=False) == 8 and tokens_per_pass(batch, packed=True) == 3 + 4
    logprobs = torch.tensor([[9.0, -1.0, -2.0, 9.0], [9.0, -1.0, -1.0, -1.0]])
    assert weighted_logprob(logprobs, batch) == pytest.approx(((-1 - 2) + 3) / 5)


def fake_rows(step_s: list[float], peak: float, tokens: int, loss: float) -> list[dict]:
    return [{"step_s": s, **{f"{phase}_time_s": s / len(PHASES) for phase in PHASES}, "peak_extra_mib": peak + i,
             "tokens_through_model": tokens, "passes_run": ["reference"], "loss": loss, "grad_norm": 2.0,
             "objective": -1.0 + 0.1 * i} for i, s in enumerate(step_s)]


def test_summary_takes_medians_after_warmup_and_ratios_against_configuration_1():
    records = {"everything": fake_rows([100.0, 4.0, 6.0, 5.0], 8.0, 300, -0.5),
               "plan": fake_rows([100.0, 2.0, 3.0, 2.5], 4.0, 200, -0.5),
               "fused": fake_rows([100.0, 2.0, 2.0, 2.0], 2.0, 200, -0.5 * (1 + 1e-6)),
               "packed": fake_rows([100.0, 1.0, 1.0, 1.0], 1.0, 100, -0.5)}
    live = {"everything": 40.0, "plan": 40.0, "fused": 10.0, "packed": 8.0}
    summary = summarise(records, live, 1, Setup(), {name: [] for name in CONFIGURATIONS}, device=torch.device("cpu"),
                        tp=1, sequential=False)
    everything, plan = summary["configurations"]["everything"], summary["configurations"]["plan"]
    assert everything["step_s"] == 5.0 and plan["step_s"] == 2.5  # the warm-up's 100 s left out
    assert everything["phases_s"]["forward_backward"] == pytest.approx(5.0 / len(PHASES))
    assert everything["peak_extra_mib"] == 11.0  # the largest timed peak
    assert plan["vs_everything"] == {"step_time": pytest.approx(2.0), "peak_memory": pytest.approx(11.0 / 7.0),
                                     "live_peak": 1.0, "tokens": pytest.approx(1.5)}
    assert summary["configurations"]["packed"]["vs_everything"]["live_peak"] == 5.0
    assert everything["vs_everything"]["step_time"] == 1.0
    fused = summary["configurations"]["fused"]
    assert fused["first_loss_rel_diff"] == pytest.approx(1e-6) and fused["first_grad_norm_rel_diff"] == 0.0
    assert everything["objective"] == pytest.approx([-1.0, -0.9, -0.8, -0.7])  # the warm-up's step included
    assert summary["steps"] == 4 and summary["steps_timed"] == 3


@pytest.mark.parametrize("options, named", [
    (["--steps", "0"], "--steps"),
    (["--warmup", "-1"], "--warmup"),
    (["--generations", "1"], "--generations"),
    (["--hidden", "30", "--heads", "4"], "--hidden (30) must be a multiple of --heads (4)"),
    (["--response-tokens", "9", "3"], "--response-tokens"),
    (["--prompts", "3", "--generations", "2", "--micro-batch-size", "4"], "--micro-batch-size (4) must divide"),
    (["--kl-penalty", "-1"], "--kl-penalty"),
    (["--top-p", "0"], "--top-p must be None or a number in (0, 1], got 0.0"),
    (["--dtype", "bf16"], "--dtype bf16 needs --device cuda"),
])
def test_bad_options_exit_2_naming_the_option(options, named, capsys):
    assert main(options) == 2
    assert named in capsys.readouterr().err


def test_without_torchrun_exits_2_with_the_launch_command(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    assert main(TINY) == 2
    assert "megatron-grpo --nproc-per-node 1 bench step" in capsys.readouterr().err


@pytest.mark.slow  # torchrun and a Megatron model: about 20 s
def test_the_cli_runs_the_four_configurations_and_they_train_the_same_objective(tmp_path):
    """Under top-p, so that every configuration trains the filtered distribution."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "megatron_grpo", "--nproc-per-node", "1", "bench", "step", *TINY,
                           "--top-p", "0.9", "--steps", "1", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((out / "step_cpu.json").read_text())
    configurations = summary["configurations"]
    assert list(configurations) == list(CONFIGURATIONS) and (out / "step_cpu.png").stat().st_size > 0
    assert configurations["everything"]["passes_run"] == ["prev", "reference"]
    assert configurations["plan"]["passes_run"] == ["reference"]
    # the prev pass is the generation forward again: the same no-grad forward of the same weights (the random
    # tokens the filter drops are -inf in both)
    assert configurations["everything"]["prev_vs_generation_max_abs"] == 0.0
    for c in configurations.values():
        # fp32 on ≤ 24 tokens: the paths differ by summation order only, far below 1e-5 relative
        assert c["first_loss_rel_diff"] < 1e-5 and c["first_grad_norm_rel_diff"] < 1e-5
        assert len(c["objective"]) == 2 and c["step_s"] > 0  # the counted step is not in the learning curve
    # the loss-fused head holds no [T, V] logits: at this vocab (300) and ≤ 24 tokens still less live memory
    assert configurations["fused"]["live_peak_mib"] < configurations["plan"]["live_peak_mib"]
    assert configurations["packed"]["tokens_through_model"] < configurations["fused"]["tokens_through_model"]
    report = (out / "step_cpu.md").read_text()
    assert "| 4. + packing |" in report and "megatron-grpo --nproc-per-node 1 bench step" in report


def test_every_configuration_trains_the_rollouts_distribution_and_configuration_3_is_loss_fused_under_a_filter():
    configurations, _ = plans_and_steps(Setup(temperature=0.7, top_k=20, top_p=0.9))
    for name in CONFIGURATIONS:
        step = configurations[name][1]
        assert (step.distribution.top_k, step.distribution.top_p) == (20, 0.9)
        assert step.distribution.logit_scale == pytest.approx(1 / 0.7)
    assert configurations["fused"][1].fused_linear_loss
