"""Every collective gets its tensors on the device its group wants on GPUs (tests/_collective_devices.py).

The DP group is NCCL on GPUs, so a CPU tensor all-reduced or all-gathered on it fails there, while gloo on the CPU
takes it. The check marks host tensors by provenance, so CPU-only CI sees the mistake:

- the patterns it must catch and let pass, on 2 gloo ranks, with the runner's own statistics function called as it
  was called before (no device: a host all-gather) and as the runner calls it now (the layout's device);
- the runner itself (`python -m megatron_grpo train` under torchrun) at DP 2 for two steps with a checkpoint and the
  prev-logprob shaping's reductions: no host tensor in any collective.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from _collective_devices import checked_collectives
from _dist import run_on_ranks
from grpo_workers.launch import REPO, run, write_config


def patterns(rank: int, world: int) -> dict[str, list[str]]:
    """Which of these collectives the check flags (the lines it logged, by case)."""
    from megatron_grpo.runner.loop import Trainer
    from megatron_grpo.runner.statistics import rollout_statistics

    device = torch.device("cpu")  # the layout's device: the accelerator's, as far as the check knows
    flagged = {}

    def case(name, fn):
        with checked_collectives() as log:
            fn()
        flagged[name] = log.host_tensors

    def rollout():
        """A rollout's host tensors, made inside the check (as the runner makes them)."""
        rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
        return SimpleNamespace(rewards=rewards, advantages=rewards - rewards.mean(), token_mask=torch.ones(4, 3),
                               responses=torch.tensor([[1, 2, 0], [1, 0, 0], [2, 2, 2], [0, 1, 1]]))

    def statistics(**device):
        r = rollout()
        return rollout_statistics(r.rewards, r.advantages, r.token_mask, r.responses, 0, group=dist.group.WORLD,
                                  **device)

    case("host totals, all-reduced", lambda: dist.all_reduce(torch.tensor([rollout().rewards.sum(), 4.0])))
    case("totals moved to the layout's device",
         lambda: dist.all_reduce(torch.tensor([rollout().rewards.sum(), 4.0]).to(device)))
    case("a factory given the layout's device", lambda: dist.all_reduce(torch.zeros(3, device=device)))
    case("a factory given a host tensor's device",
         lambda: dist.all_reduce(torch.zeros(3, device=rollout().rewards.device)))
    case("a host scalar times a device tensor",
         lambda: dist.all_reduce(torch.ones(2, device=device) * rollout().rewards.sum()))
    case("a device tensor moved to the host", lambda: dist.all_reduce(torch.ones(2, device=device).cpu()))
    case("rollout_statistics without a device (as before)", lambda: statistics())
    case("rollout_statistics on the layout's device", lambda: statistics(device=device))
    trainer = SimpleNamespace(layout=SimpleNamespace(device=device, dp_size=world, dp_group=dist.group.WORLD),
                              cfg=SimpleNamespace(grpo=SimpleNamespace(num_prompts_per_step=2)))
    case("Trainer._reward_metrics", lambda: Trainer._reward_metrics(trainer, rollout().rewards, rollout(), 1))
    return flagged


FLAGGED = {"host totals, all-reduced", "a factory given a host tensor's device", "a device tensor moved to the host",
           "rollout_statistics without a device (as before)"}


def test_the_check_flags_host_tensors_and_only_them():
    for flagged in run_on_ranks(2, patterns):
        assert {name for name, lines in flagged.items() if lines} == FLAGGED, flagged
        assert "statistics.py:rollout_statistics: all_gather got a host tensor" in \
            flagged["rollout_statistics without a device (as before)"][0]


@pytest.mark.slow  # a torchrun job of two ranks
def test_the_runner_at_dp2_hands_no_host_tensor_to_any_collective(tmp_path, monkeypatch):
    config = write_config(tmp_path, **{
        "policy.tensor_model_parallel_size": 1,
        "policy.train_global_batch_size": 16,
        "policy.train_micro_batch_size": 4,
        "grpo.num_prompts_per_step": 4,
        "grpo.num_generations_per_prompt": 4,
        "grpo.max_num_steps": 2,
        "loss_fn.kl_in_sequence_reward": True,  # a prev pass, and the shaping's DP reductions
        "loss_fn.reference_policy_kl_penalty": 0.05,
        "checkpoint.every_n_steps": 2,
    })
    logs = tmp_path / "collectives"
    logs.mkdir()
    monkeypatch.setenv("COLLECTIVE_LOG_DIR", str(logs))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(REPO / "tests" / "grpo_workers" / "checked_train.py"), "train", "--config", str(config)]
    code, output = run(command, tmp_path / "job.log", timeout=600)
    assert code == 0, output[-3000:]
    for rank in (0, 1):
        seen = json.loads((logs / f"rank{rank}.json").read_text())
        assert seen["host_tensors"] == [], seen["host_tensors"]
        checked = " ".join(seen["checked"])
        for site in ("loop.py:_reward_metrics all_reduce", "statistics.py:rollout_statistics all_gather",
                     "shaping.py:_reduced all_reduce", "megatron/step.py:_sum_over_data_parallel all_reduce",
                     "metrics.py:_all_reduced all_reduce"):
            assert site in checked, (site, seen["checked"])
