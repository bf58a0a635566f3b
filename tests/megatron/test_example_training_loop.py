"""The Megatron-native examples at TP = 2 on two gloo ranks, one torchrun launch each, on a model built with
Megatron's own `GPTModel(...)`: examples/megatron_training_loop.py trains through `train_step` and its loss falls;
examples/megatron_forward_step.py, a Megatron-LM `forward_step` on `make_forward_step`, prints the same numbers.
Both reject bad arguments before they start."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys

import pytest
from grpo_workers.launch import REPO, run

EXAMPLES = REPO / "examples"
EXAMPLE = EXAMPLES / "megatron_training_loop.py"
FORWARD_STEP_EXAMPLE = EXAMPLES / "megatron_forward_step.py"
STEPS = 4
STEP_LINE = re.compile(r"^step (\d+): loss (\S+) grad_norm (\S+) is_weight (\S+) prev_pass (ran|skipped)$",
                       re.MULTILINE)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
    """Each example's output at TP 2, seed 1234; each must leave the checkout as it found it."""
    found = {}
    for script in (EXAMPLE, FORWARD_STEP_EXAMPLE):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                   "--steps", str(STEPS), "--tensor-model-parallel-size", "2", "--seed", "1234"]
        status_before = _git_status()
        code, output = run(command, tmp_path_factory.mktemp(script.stem) / "example.log", timeout=180)
        assert code == 0, output
        assert _git_status() == status_before  # it writes nothing into the checkout
        assert not re.search(r"\w+Warning: ", output), output  # Megatron's known notices are filtered
        found[script.name] = output
    return found


@pytest.mark.slow  # torchrun jobs, end to end
def test_the_example_loop_runs_train_step_at_tp2_and_its_loss_falls_every_step(outputs):
    output = outputs[EXAMPLE.name]
    steps = STEP_LINE.findall(output)
    assert [int(step) for step, *_ in steps] == list(range(1, STEPS + 1)), output
    losses = [float(loss) for _, loss, *_ in steps]
    grad_norms = [float(norm) for _, _, norm, *_ in steps]
    assert all(math.isfinite(value) for value in losses + grad_norms), output
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses
    # The rollout is reused with one update per use: the plan skips the prev pass (the training forward is the
    # prev policy); at step 1 curr is the sampler's policy itself, so the importance weights are 1.
    assert "prev logprobs skipped" in output and "stale rollouts" in output, output
    assert {prev for *_, prev in steps} == {"skipped"}, output
    assert float(steps[0][3]) == 1.0, output


@pytest.mark.slow
def test_a_megatron_lm_forward_step_on_make_forward_step_trains_as_train_step_does(outputs):
    """The same operations in the same order on the same machine: `train_step` and the script's own schedule call
    with `make_forward_step` give the same printed loss, gradient norm and importance weight at every step."""
    through_train_step = STEP_LINE.findall(outputs[EXAMPLE.name])
    assert len(through_train_step) == STEPS
    assert STEP_LINE.findall(outputs[FORWARD_STEP_EXAMPLE.name]) == through_train_step


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout


def load_example(path=EXAMPLE):
    spec = importlib.util.spec_from_file_location(f"{path.stem}_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("example", [EXAMPLE, FORWARD_STEP_EXAMPLE], ids=lambda path: path.stem)
@pytest.mark.parametrize(("argv", "message"), [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3 does not divide the world size 2"),
    (["--steps", "0"], "--steps and --tensor-model-parallel-size must be >= 1"),
])
def test_the_examples_reject_bad_arguments_before_starting(example, argv, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc-per-node 2 sets it
    with pytest.raises(SystemExit):
        load_example(example).parse_args(argv)
    assert message in capsys.readouterr().err
