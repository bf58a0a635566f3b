"""Every Python block of README.md runs as written.

The op's and the loss's blocks run in this process, each in a namespace of its own. The Megatron script and its
`forward_step` continuation run as one file under `torchrun --nproc-per-node 2` on the CPU, through a wrapper that
records, around each `train_step` and `optimizer_step` the script calls, how many of the model's parameters the step
changed: the script must train, not merely run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


def blocks_of_section(heading: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return PYTHON_BLOCK.findall(text[start:end if end >= 0 else None])


@pytest.mark.parametrize("heading, count", [("The op", 2), ("The loss", 1)])
def test_the_op_and_loss_blocks_run_as_written(heading, count):
    blocks = blocks_of_section(heading)
    assert len(blocks) == count
    for block in blocks:
        namespace: dict = {"__name__": "__readme__"}
        exec(compile(block, f"README.md: {heading}", "exec"), namespace)
        assert namespace["logprobs" if heading == "The op" else "loss"].grad_fn is not None


# Runs the README's script and records what each train_step / optimizer_step did to the model's parameters.
WRAPPER = """
import json, os, runpy, sys
import torch
from megatron_grpo.megatron import quiet_megatron_notices
quiet_megatron_notices()
import megatron_grpo.megatron.optimizer as optimizer_module
import megatron_grpo.megatron.step as step_module

moved = []

def recorded(function, model_position):
    def run(*args, **kwargs):
        model = args[model_position]
        before = [p.detach().clone() for p in model.parameters()]
        out = function(*args, **kwargs)
        after = list(model.parameters())
        moved.append([function.__name__, sum(not torch.equal(b, p.detach()) for b, p in zip(before, after)),
                      len(after)])
        return out
    return run

step_module.train_step = recorded(step_module.train_step, 1)
optimizer_module.optimizer_step = recorded(optimizer_module.optimizer_step, 0)
runpy.run_path(sys.argv[1], run_name="__main__")
with open(sys.argv[2] + f".rank{os.environ['RANK']}", "w") as out:
    json.dump(moved, out)
"""


@pytest.mark.slow
def test_the_megatron_script_trains_under_torchrun_at_tp2(tmp_path):
    script, continuation = blocks_of_section("In a Megatron training script")
    (tmp_path / "grpo_step.py").write_text(script + "\n" + continuation)
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "wrapper.py",
                           "grpo_step.py", "moved"], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("passes run: none") == 3  # rank 0's line per step: the plan skipped both passes
    assert "rollout_batch = global_batch" in done.stdout  # the plan in the names the script gave it
    for rank in (0, 1):
        moved = json.loads((tmp_path / f"moved.rank{rank}").read_text())
        assert [name for name, _, _ in moved] == ["train_step"] * 3 + ["optimizer_step"]
        for name, changed, total in moved:
            assert changed == total > 0, (rank, name, changed, total)
