"""The command line as a user meets it: help on stdout with every option described, the `megatron-grpo` launcher's
one line and exit code per failure (on the real command line), and no internal names or issue numbers shown."""

from __future__ import annotations

import argparse
import importlib
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_workers.launch import REPO, job_env, write_config

from megatron_grpo.runner import train_cli
from megatron_grpo.runner.cli import COMMANDS
from megatron_grpo.runner.cli import main as cli_main
from megatron_grpo.runner.helptext import DefaultsHelpFormatter
from megatron_grpo.runner.launcher import job_outcome, stopped_outcome

# Every command line of the project: (module, argv that reaches its parser).
PARSERS = {
    "train": ("megatron_grpo.runner.train_cli", []),
    "plan": ("megatron_grpo.runner.plan_cli", []),
    "report": ("megatron_grpo.runner.report_cli", []),
    "bench logprob": ("megatron_grpo.bench.logprob", []),
    "bench linear": ("megatron_grpo.bench.linear", []),
    "bench scheduler": ("megatron_grpo.bench.scheduler", []),
    "bench packing": ("megatron_grpo.bench.packing", []),
    "tensorboard_log": ("megatron_grpo.runner.tensorboard_log", []),
}
INTERNAL_NAMES = ("CANDIDATES", "`Step`", "run_ranks", "measure.", "issue")


class _Captured(Exception):
    pass


def captured_parser(command: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The ArgumentParser a command builds, taken at its `parse_args` call."""
    module_name, argv = PARSERS[command]
    module = importlib.import_module(module_name)
    found = []

    def capture(parser, args=None, namespace=None):
        found.append(parser)
        raise _Captured()

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Captured):
        module.main(argv)
    return found[0]


@pytest.mark.parametrize("command", PARSERS)
def test_every_option_has_a_description_and_its_default(command, monkeypatch):
    parser = captured_parser(command, monkeypatch)
    assert parser.formatter_class is DefaultsHelpFormatter, command
    formatter = DefaultsHelpFormatter(parser.prog)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = formatter._get_help_string(action)
        assert text and len(text) > 12, f"{command} {action.option_strings or action.dest}: no description"
        if action.option_strings and not action.required:
            assert "default" in text, f"{command} {action.option_strings}: no default shown: {text!r}"
    shown = parser.format_help()
    assert not [name for name in INTERNAL_NAMES if name in shown], shown


def test_help_goes_to_stdout_on_the_real_command_line():
    result = subprocess.run([sys.executable, "-m", "megatron_grpo", "--help"], capture_output=True, text=True,
                            cwd=REPO, env=job_env(), timeout=120)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith("usage: megatron-grpo [torchrun options] train --config FILE")
    for name in COMMANDS:
        assert f"\n  {name} " in result.stdout


@pytest.mark.parametrize("argv", [["plan", "--help"], ["report", "--help"], ["bench", "--help"],
                                  ["bench", "linear", "--help"], ["train", "--help"]])
def test_each_commands_help_goes_to_stdout(argv, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    try:
        code = cli_main(argv)
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 0 and captured.err == "" and "usage: megatron-grpo" in captured.out


def test_no_issue_numbers_in_code_docs_or_results():
    sources = [REPO / "README.md", REPO / "Makefile", *REPO.glob("megatron_grpo/**/*.py"), *REPO.glob("docs/*.md"),
               *REPO.glob("benchmarks/**/*.md"), *REPO.glob("benchmarks/**/*.json"), *REPO.glob("benchmarks/*.sh"),
               *REPO.glob("benchmarks/*.py"), *REPO.glob("examples/*.py"), *REPO.glob("configs/*.yaml")]
    pattern = re.compile(r"\bissues?\s*#?\d+|\(#\d+\)", re.IGNORECASE)
    found = [f"{path.relative_to(REPO)}: {match.group(0)}" for path in sources
             for match in pattern.finditer(path.read_text(errors="replace"))]
    assert found == []


# ---- the launcher on the real command line: one line, the documented exit code ----

def _launch(tmp_path: Path, config: Path, *extra: str) -> tuple[int, str, str]:
    command = [sys.executable, "-m", "megatron_grpo", "--nproc-per-node", "2", "train", "--config", str(config),
               *extra]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=job_env(), timeout=180)
    return result.returncode, result.stdout, result.stderr


def test_a_config_error_is_one_line_and_exit_code_2_before_any_rank_starts(tmp_path):
    config = write_config(tmp_path, **{"policy.optimizer.lr": -1.0})
    code, out, err = _launch(tmp_path, config)
    assert code == train_cli.EXIT_CONFIG
    assert out == "" and err == f"error: {config}: policy.optimizer.lr: must be > 0, got -1.0\n"
    assert not (tmp_path / "run").exists()


def test_a_run_dir_that_cannot_be_created_is_one_line_and_exit_code_3(tmp_path):
    (tmp_path / "a-file").write_text("")
    config = write_config(tmp_path, **{"run_dir": str(tmp_path / "a-file" / "run")})
    code, out, err = _launch(tmp_path, config)
    assert code == train_cli.EXIT_RUN_DIR and out == ""
    assert err.startswith(f"error: run_dir: {tmp_path / 'a-file' / 'run'} is not usable for this run: "
                          "[Errno 20] Not a directory") and err.count("\n") == 1


def test_resume_that_finds_nothing_is_exit_code_3_and_leaves_no_new_folder(tmp_path):
    config = write_config(tmp_path)
    before = sorted(tmp_path.iterdir())
    code, _out, err = _launch(tmp_path, config, "--resume")
    assert code == train_cli.EXIT_RUN_DIR and err.count("\n") == 1 and "--resume" in err
    assert sorted(tmp_path.iterdir()) == before


def test_a_command_that_is_not_launched_under_torchrun_is_exit_code_2():
    result = subprocess.run([sys.executable, "-m", "megatron_grpo", "--nproc-per-node", "2", "plan", "--config",
                             "configs/grpo_tiny_cpu.yaml"], capture_output=True, text=True, cwd=REPO, env=job_env(),
                            timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "`plan`" in result.stderr


# ---- how the launcher reads the ranks' exit codes ----

@pytest.mark.parametrize(("codes", "expected", "line"), [
    ({0: 2, 1: -signal.SIGTERM}, 2, None),  # rank 0's config error; rank 1 stopped before its handler was set
    ({0: 3, 1: 4}, 3, None),
    ({0: 4, 1: -signal.SIGKILL}, 4, "error: rank 1 died (SIGKILL); the other ranks were stopped."),
    ({0: -signal.SIGSEGV, 1: -signal.SIGTERM}, 4, "error: rank 0 died (SIGSEGV); the other ranks were stopped."),
    ({0: 4, 1: 4}, 4, None),  # ranks that lost contact with a hung peer: each said so
    ({0: 130, 1: 130}, 130, None),
    ({0: 1, 1: 4}, 1, "error: rank 0 failed (exit code 1); its traceback is above"),
])
def test_the_ranks_exit_codes_become_the_jobs(codes, expected, line):
    assert job_outcome(codes, checkpoint_dir=None) == (expected, line)


def test_a_dead_rank_line_names_the_checkpoint_a_rerun_resumes_from(tmp_path):
    code, line = job_outcome({0: 4, 1: -signal.SIGKILL}, checkpoint_dir=tmp_path / "checkpoints")
    assert code == 4 and line.endswith(f"No checkpoint has been completed in {tmp_path / 'checkpoints'}, so a rerun "
                                       "starts from scratch.")


def test_a_signal_to_the_launcher_is_128_plus_the_signal():
    assert stopped_outcome(signal.SIGINT, None) == (130, None)  # rank 0 has said where the run stopped
    assert stopped_outcome(signal.SIGTERM, None) == (143, "error: stopped by SIGTERM.")
