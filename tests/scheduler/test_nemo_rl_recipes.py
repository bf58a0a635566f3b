"""`plan --nemo-rl-config` on every recipe of a NeMo-RL checkout, when one is named: `NEMO_RL_EXAMPLES` is the
path of its `examples` directory (the recipes' `defaults:` reach into `examples/nemo_gym` and `examples/modelopt`).

NeMo-RL's files are not copied here (tests/nemo_rl_configs holds each situation in a small config of its own); this
is the check to run when the known-keys list is regenerated (`megatron_grpo/runner/nemo_rl_keys.py`). On every file
under `configs/recipes/llm`: no traceback; a config of another algorithm is one line; every GRPO recipe plans;
wherever something reads prev before the loss, prev is there (the pass, or the training forward for the sequence mask
alone where that forward is the prev policy), by an oracle read from the merged file here, not from the reader. At
the known-keys list's commit, the counts of the run that checked it hold too.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
from pathlib import Path

import pytest

from megatron_grpo.runner.nemo_rl_config import NEMO_RL_COMMIT, load_nemo_rl_config, nemo_rl_plan_view
from megatron_grpo.runner.plan_cli import main as plan_main
from megatron_grpo.scheduler import plan_logprob_passes

EXAMPLES = os.environ.get("NEMO_RL_EXAMPLES")
pytestmark = pytest.mark.skipif(EXAMPLES is None, reason="NEMO_RL_EXAMPLES (a NeMo-RL checkout's examples "
                                                         "directory) is not set")
# At NEMO_RL_COMMIT: recipes under recipes/llm, the GRPO-family ones among them, those with a reader of prev, and the
# one key of theirs that NeMo-RL does not know (a dead key: no nemo_rl code reads it).
AT_COMMIT = {"files": 229, "grpo": 172, "readers": 6,
             "unknown": {("grpo-moonlight-16b-automodel-1n8g-ep8.yaml", "policy.activation_checkpointing_enabled")}}


def checkout_commit(examples: Path) -> str | None:
    """The commit of the checkout holding `examples`: git's, or a `COMMIT` file beside it naming one."""
    try:
        return subprocess.run(["git", "-C", str(examples), "rev-parse", "HEAD"], check=True, capture_output=True,
                              text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        note = examples.parent / "COMMIT"
        found = re.search(r"\b[0-9a-f]{40}\b", note.read_text()) if note.is_file() else None
        return found.group(0) if found else None


def readers_of_prev(config: dict) -> list[str]:
    """What reads prev before the loss, from the merged file and NeMo-RL's defaults, written apart from the reader."""
    grpo, loss = config.get("grpo") or {}, config.get("loss_fn") or {}
    readers = []
    if grpo.get("seq_logprob_error_threshold") is not None:
        readers.append("threshold")
    if (grpo.get("adv_estimator") or {}).get("name") == "opd":
        readers.append("opd")
    if loss.get("use_kl_in_reward") and loss.get("reference_policy_kl_penalty", 0.01) > 0:
        readers.append("kl_in_reward")
    return readers


def test_every_recipe_plans_and_prev_is_there_wherever_it_is_read():
    root = Path(EXAMPLES) / "configs" / "recipes" / "llm"
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith((".yaml", ".yml", ".disabled")))
    counts = {"files": len(files), "grpo": 0, "readers": 0}
    unknown = set()
    for path in files:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = plan_main(["--nemo-rl-config", str(path)])
        config, _ = load_nemo_rl_config(path)
        if "grpo" not in config:
            assert code == 2 and "not a NeMo-RL GRPO config" in err.getvalue(), (path, err.getvalue())
            continue
        assert code == 0 and "Traceback" not in err.getvalue(), (path, err.getvalue())
        counts["grpo"] += 1
        view = nemo_rl_plan_view(path)
        plan = plan_logprob_passes(view.inputs)
        readers = readers_of_prev(config)
        counts["readers"] += bool(readers)
        if readers == ["threshold"]:
            assert plan.compute_prev_logprobs or view.inputs.error_mask_in_training_forward, path
        elif readers:
            assert plan.compute_prev_logprobs, (path, readers)
        unknown |= {(path.name, key) for key, _ in view.unknown_keys}
    if checkout_commit(Path(EXAMPLES)) == NEMO_RL_COMMIT:
        assert {**counts, "unknown": unknown} == AT_COMMIT
