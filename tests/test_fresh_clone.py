"""The commands of the README and docs/ leave a fresh clone's `git status --porcelain` empty.

The repository is cloned into a temporary directory (with the working tree's uncommitted edits committed on top,
so the clone is the code under test) and every shell command of README.md and docs/*.md (`DOC_COMMANDS`, the
same list `test_readme_commands.py` parses) is accounted for, in the clone, as cheaply as its outputs allow:
- `plan` and `report` run as written;
- `train` runs once for real, the demo config cut to 2 steps on one rank (its copy lies outside the clone, its
  run directory is the demo's), and every documented `train` command then runs the launcher's checks of its config
  and run directory (`train_cli.preflight`, which creates the directories), `--fresh` moving the earlier run aside;
- the benchmarks are too slow to run here: their default output directory must be one git ignores;
- `make` targets run the commands above (or refresh committed results on purpose: `make bench`, `make
  demo-figure`), and the scripts of `examples/` are checked by their own test to write nothing.
The venv is this checkout's; only the package in the clone is imported (PYTHONPATH and the working directory).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grpo_workers.launch import REPO, job_env, run
from test_readme_commands import DOC_COMMANDS

pytestmark = pytest.mark.slow  # a torchrun job, end to end

# The documented commands that are not run here, and why.
NOT_RUN = {
    "source .venv/bin/activate": "the venv of this checkout is used",
    "make demo": "runs the demo command, run below",
    "make test": "runs the tests",
    "make demo-figure": "refreshes the committed figure docs/demo_on_and_off_policy.png on purpose",
}
EXAMPLE_SCRIPT = "examples/"  # tests/megatron/test_example_training_loop.py: they write nothing
BENCHMARKS = ("megatron_grpo.bench.logprob", "megatron_grpo.bench.linear", "megatron_grpo.bench.scheduler")


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of this checkout, its uncommitted edits committed on top, the kernel extension copied in."""
    destination = tmp_path_factory.mktemp("clone") / "megatron-grpo"
    _git("clone", "--quiet", "--no-checkout", str(REPO), str(destination), cwd=REPO)
    _git("checkout", "--quiet", _git("rev-parse", "HEAD", cwd=REPO).strip(), cwd=destination)
    edited = _git("ls-files", "--modified", "--others", "--exclude-standard", cwd=REPO).splitlines()
    deleted = set(_git("ls-files", "--deleted", cwd=REPO).splitlines())
    for name in edited:
        if name not in deleted:
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, destination / name)
    for name in deleted:
        (destination / name).unlink(missing_ok=True)
    if _git("status", "--porcelain", cwd=destination):
        _git("add", "--all", cwd=destination)
        _git("-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "--quiet", "-m", "working tree",
             cwd=destination)
    for extension in (REPO / "megatron_grpo").glob("_C*.so"):  # a build output: ignored, as in a built clone
        shutil.copy2(extension, destination / "megatron_grpo" / extension.name)
    assert _git("status", "--porcelain", cwd=destination) == ""
    return destination


def _env(clone: Path) -> dict[str, str]:
    env = job_env()
    env["PYTHONPATH"] = str(clone)
    return env


def _megatron_grpo(command: str) -> list[str] | None:
    """The arguments after `megatron-grpo`, `python -m megatron_grpo` or `torchrun ... -m megatron_grpo` (torchrun's
    options first), after any leading environment assignments (`OMP_NUM_THREADS=1 megatron-grpo ...`); None for any
    other program."""
    words = shlex.split(command)
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        words = words[1:]
    if words[0] == "megatron-grpo":
        return words[1:]
    if words[:3] == ["python", "-m", "megatron_grpo"]:
        return words[3:]
    if words[0] == "torchrun" and "-m" in words and words[words.index("-m") + 1:][:1] == ["megatron_grpo"]:
        return [*words[1:words.index("-m")], *words[words.index("-m") + 2:]]
    return None


def _command_name(argv: list[str]) -> str:
    if not argv[0].startswith("-"):
        return argv[0]
    from torch.distributed.run import get_args_parser

    return get_args_parser().parse_args(argv).training_script


def _python(clone: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=clone, env=_env(clone), capture_output=True, text=True,
                          input=stdin, timeout=300)


PREFLIGHT = """
import shlex, sys
from torch.distributed.run import get_args_parser
from megatron_grpo.runner import train_cli
from megatron_grpo.runner.run_start import carry_out
from megatron_grpo.runner.launcher import _world_size
for line in sys.stdin.read().splitlines():
    parsed = get_args_parser().parse_args(shlex.split(line))
    args = train_cli.parse_args(parsed.training_script_args)
    cfg, plan, start = train_cli.preflight(args, world_size=_world_size(parsed))
    for note in carry_out(start):
        print(note)
"""


DEFAULT_OUT = """
import argparse, importlib, sys
class Parsed(Exception):
    pass
def stop(parser, args=None, namespace=None):
    print(parser.get_default("out"))
    raise Parsed()
argparse.ArgumentParser.parse_args = stop
for module in sys.argv[1:]:
    try:
        importlib.import_module(module).main([])
    except Parsed:
        pass
"""


def test_the_documented_commands_leave_a_fresh_clone_clean(clone, tmp_path):
    train, run_as_written, unaccounted = [], [], []
    for command in DOC_COMMANDS:
        argv = _megatron_grpo(command)
        if command in NOT_RUN or EXAMPLE_SCRIPT in command:
            continue
        if argv is None:
            unaccounted.append(command)
            continue
        if _command_name(argv) == "train":
            train.append(argv)
        elif _command_name(argv) == "bench":  # too slow to run here: where each benchmark writes is checked below
            continue
        elif argv[0] in ("plan", "report"):
            run_as_written.append(argv)
        elif _command_name(argv) == "bench" and "--out" not in argv:
            continue  # writes to its default output directory, checked below to be one git ignores
        else:
            unaccounted.append(command)
    assert unaccounted == [], f"documented commands this test does not account for: {unaccounted}"
    assert train and run_as_written
    train.sort(key=lambda argv: "--fresh" in argv)  # as the docs run them: --resume before --fresh

    # One real run of the demo, cut to 2 steps: everything a run writes lands in its run directory.
    demo = yaml.safe_load((clone / "configs" / "grpo_tiny_cpu.yaml").read_text())
    demo["grpo"]["max_num_steps"], demo["checkpoint"]["every_n_steps"] = 2, 1
    demo["policy"]["tensor_model_parallel_size"] = 1  # one rank starts faster; the paths are the demo's
    demo["logging"]["progress_bar"] = False
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(demo))
    command = [sys.executable, "-m", "megatron_grpo", "--nproc-per-node", "1", "train", "--config",
               str(tmp_path / "demo.yaml")]
    code, output = run(command, tmp_path / "demo.log", cwd=clone, env=_env(clone))
    assert code == 0, output
    assert (clone / demo["run_dir"] / "metrics.jsonl").is_file()

    for argv in run_as_written:  # `report` plots the run above
        result = _python(clone, "-m", "megatron_grpo", *argv)
        assert result.returncode == 0, (argv, result.stderr)
    # Every documented train command: the launcher's checks of its config and run directory (--fresh moves).
    result = _python(clone, "-c", PREFLIGHT, stdin="\n".join(shlex.join(argv) for argv in train))
    assert result.returncode == 0, result.stderr
    assert "moved the earlier run runs/grpo_tiny_cpu to runs/grpo_tiny_cpu.previous-" in result.stdout

    result = _python(clone, "-c", DEFAULT_OUT, *BENCHMARKS)  # where each benchmark writes without --out
    assert result.returncode == 0, result.stderr
    for out in result.stdout.split():
        assert subprocess.run(["git", "check-ignore", "-q", f"{out}/report.md"], cwd=clone).returncode == 0, out

    assert _git("status", "--porcelain", "--untracked-files=all", cwd=clone) == ""
