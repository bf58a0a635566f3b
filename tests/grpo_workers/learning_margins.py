"""How much margin the learning tests have: their configs run over several seeds, and the step at which the 10-step
mean reward first reaches each level, printed per config and seed.

A learning test asserts one seed's run. Another CPU's rounding could change one sampled token and so the whole
trajectory after it, which then is like another seed's; the levels the tests assert are those every measured seed
reaches with steps to spare. Run from the repository root, e.g.

    .venv/bin/python tests/grpo_workers/learning_margins.py --seeds 1234,1,2,3,4,5 --steps 200

and with `MKL_CBWR=COMPATIBLE` or `ATEN_CPU_CAPABILITY=default` in front (other fp32 kernels) to see whether the
rounding changes the run at all: `--compare-to` an earlier run's `--out` file names any step whose reward differs.
The two-agent TP2 x PP2 test is run as one agent of 4 ranks here: the same global ranks, the same layout.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "runner")]  # the learning tests' layouts

from grpo_workers.launch import run, torchrun_command, write_config  # noqa: E402
from test_grpo_learning import LAYOUTS  # noqa: E402
from test_grpo_offpolicy_learning import STALE, TP1_NO_CHECKPOINTS, TWO_STEPS_PER_ROLLOUT  # noqa: E402

from megatron_grpo.runner.reporting import read_metrics  # noqa: E402

LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9)
WINDOW = 10


def configs() -> dict[str, tuple[Path | None, dict, int]]:
    """name: (base config or None for the tiny one, overrides, ranks)."""
    found = {name: (base, overrides, agents * nproc) for name, (base, overrides, agents, nproc) in LAYOUTS.items()}
    tp1 = {key: value for key, value in TP1_NO_CHECKPOINTS.items()
           if key not in ("grpo.max_num_steps", "checkpoint.every_n_steps")}
    found["staleness-1"] = (None, {**tp1, **STALE}, 1)
    found["two-steps-per-rollout"] = (None, {**tp1, **TWO_STEPS_PER_ROLLOUT}, 1)
    found["moe-tp2-router-replay"] = (TESTS.parent / "configs" / "grpo_tiny_cpu_moe.yaml", {}, 2)  # no test: docs
    return found


def first_step_reaching(rewards: list[float], level: float) -> int | None:
    """The number of steps done when the mean of the last WINDOW steps' rewards first is >= level."""
    for end in range(WINDOW, len(rewards) + 1):
        if sum(rewards[end - WINDOW:end]) / WINDOW >= level:
            return end
    return None


def run_one(base: Path | None, overrides: dict, ranks: int, seed: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        extra = {"grpo.max_num_steps": steps, "checkpoint.every_n_steps": 0, "seed": seed}
        config = write_config(directory, **({"base": base} if base is not None else {}), **{**overrides, **extra})
        started = time.monotonic()
        code, output = run(torchrun_command(config, nproc=ranks), directory / "log.txt", timeout=30 * steps)
        if code != 0:
            raise RuntimeError(f"seed {seed}: exit code {code}\n{output[-3000:]}")
        records = read_metrics(directory / "run")
    rewards = [record["reward_mean"] for record in records]
    return {"seed": seed, "seconds": round(time.monotonic() - started), "rewards": rewards,
            "grad_norm": [record["grad_norm"] for record in records]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(configs()), help="comma-separated, of: " + ", ".join(configs()))
    parser.add_argument("--seeds", default="1234,1,2,3,4,5")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, help="append each run as a JSON line here")
    parser.add_argument("--compare-to", type=Path, help="an earlier --out file: name the first step whose reward "
                                                        "differs for the same config and seed")
    args = parser.parse_args()
    earlier = {}
    if args.compare_to:
        for line in args.compare_to.read_text().splitlines():
            record = json.loads(line)
            earlier[(record["config"], record["seed"])] = record
    print("config, seed, first-10 mean, steps to reach " + ", ".join(map(str, LEVELS)) + ", seconds", flush=True)
    for name in args.configs.split(","):
        base, overrides, ranks = configs()[name]
        for seed in map(int, args.seeds.split(",")):
            result = {"config": name, **run_one(base, overrides, ranks, seed, args.steps)}
            rewards = result["rewards"]
            reached = [first_step_reaching(rewards, level) for level in LEVELS]
            line = (f"{name}, {seed}, {sum(rewards[:WINDOW]) / WINDOW:.3f}, "
                    + ", ".join("-" if step is None else str(step) for step in reached) + f", {result['seconds']}")
            if (name, seed) in earlier:
                before = earlier[(name, seed)]["rewards"]
                differ = next((step for step, (a, b) in enumerate(zip(before, rewards)) if a != b), None)
                line += ", rewards as before" if differ is None else f", rewards differ from step {differ}"
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as handle:
                    handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
