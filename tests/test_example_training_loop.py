"""examples/megatron_training_loop.py, the Megatron-native GRPO loop: trains at TP = 2 on two gloo ranks, and
rejects bad arguments before it starts."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys

import pytest
from grpo_workers.launch import REPO, run

EXAMPLE = REPO / "examples" / "megatron_training_loop.py"
STEPS = 4
STEP_LINE = re.compile(r"^step (\d+): loss (\S+) grad_norm (\S+) is_weight (\S+) prev_pass (ran|skipped)$",
                       re.MULTILINE)


@pytest.mark.slow  # a torchrun job, end to end
def test_the_example_loop_runs_at_tp2_and_its_loss_falls_every_step(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE),
               "--steps", str(STEPS), "--tensor-model-parallel-size", "2", "--seed", "1234"]
    status_before = _git_status()
    code, output = run(command, tmp_path / "example.log", timeout=180)
    assert code == 0, output
    assert not re.search(r"\w+Warning: ", output), output  # Megatron's known notices are filtered
    assert _git_status() == status_before  # it writes nothing into the checkout
    steps = STEP_LINE.findall(output)
    assert [int(step) for step, *_ in steps] == list(range(1, STEPS + 1)), output
    losses = [float(loss) for _, loss, *_ in steps]
    grad_norms = [float(norm) for _, _, norm, *_ in steps]
    assert all(math.isfinite(value) for value in losses + grad_norms), output
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses
    # The rollout is reused with one update per use: the plan skips the prev pass (the training forward is the
    # proximal policy); at step 1 curr is the sampler's policy itself, so the importance weights are 1.
    assert "prev logprobs skipped" in output and "stale rollouts" in output, output
    assert {prev for *_, prev in steps} == {"skipped"}, output
    assert float(steps[0][3]) == 1.0, output


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout


def load_example():
    spec = importlib.util.spec_from_file_location("megatron_training_loop_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("argv", "message"), [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide the world size 2"),
    (["--steps", "0"], "--steps and --tensor-model-parallel-size must be >= 1"),
])
def test_the_example_rejects_bad_arguments_before_starting(argv, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 sets it
    with pytest.raises(SystemExit):
        load_example().parse_args(argv)
    assert message in capsys.readouterr().err
