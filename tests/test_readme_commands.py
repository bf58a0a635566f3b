"""Every shell command of the README and docs/ works as written, after `make demo` and `source .venv/bin/activate`.

The commands are read from the ```bash blocks of README.md and docs/*.md, whoever wrote them. Each one is
checked as far as can be without running it: a `make` target exists (`make -n`), a `megatron-grpo ...`, `python -m
megatron_grpo ...` or `torchrun ... -m megatron_grpo ...` command gets through torchrun's and the subcommand's
argument parsers, a `torchrun
examples/...py ...` command through torchrun's and the script's own (`parse_args`), the repository files it names
exist, and any other program is on the PATH or in `.venv/bin`. Nothing is trained.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
VENV_BIN = REPO / ".venv" / "bin"
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell)\n(.*?)^```", re.MULTILINE | re.DOTALL)
ACTIVATE = "source .venv/bin/activate"
WRAPPERS = {"setsid", "nohup", "time", "env"}


class _Parsed(Exception):
    """Raised by the patched parser once a subcommand's arguments have parsed."""


def readme_commands(text: str) -> list[str]:
    """The commands of the shell blocks: continuation lines joined, comments dropped."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


COMMANDS = readme_commands(README.read_text())
DOC_COMMANDS = sorted({command for doc in DOCS for command in readme_commands(doc.read_text())})


def _program_and_args(command: str) -> tuple[str, list[str]]:
    words = shlex.split(command)
    while words and (words[0] in WRAPPERS or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0])):
        words = words[1:]
    return words[0], words[1:]


def _parse_subcommand(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs `python -m megatron_grpo <argv>` until its subcommand's arguments have parsed, and no further."""
    from megatron_grpo.runner.cli import COMMANDS as SUBCOMMANDS

    assert argv and argv[0] in SUBCOMMANDS, f"unknown subcommand in {argv}"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(parser, args=None, namespace=None):
        original(parser, args, namespace)
        raise _Parsed()

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    try:
        code = module.main(argv[1:])
    except _Parsed:
        return
    except SystemExit as exit_:
        raise AssertionError(f"`{shlex.join(argv)}` does not parse (exit {exit_.code})") from None
    raise AssertionError(f"`{shlex.join(argv)}` returned {code} before parsing any arguments")


def _check_repo_paths(args: list[str]) -> None:
    for arg in args:
        if re.fullmatch(r"(configs|benchmarks|csrc|tests|docs|examples)/[\w./-]+", arg):
            assert (REPO / arg).exists(), f"{arg} does not exist in the repository"


def _check_megatron_grpo(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    program, args = _program_and_args(command)
    if program == "megatron-grpo":
        args = ["-m", "megatron_grpo", *args]
        program = "python"
    if program == "python" and args[2:3] and args[2].startswith("-"):  # torchrun's options before the command
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args[2:])
        args = ["-m", "megatron_grpo", parsed.training_script, *parsed.training_script_args]
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        parsed = get_args_parser().parse_args(args)
        assert parsed.module and parsed.training_script == "megatron_grpo", f"{command}: not `-m megatron_grpo`"
        argv = parsed.training_script_args
    else:
        assert args[:2] == ["-m", "megatron_grpo"], f"{command}: not `python -m megatron_grpo`"
        argv = args[2:]
    _check_repo_paths(argv)
    _parse_subcommand(argv, monkeypatch)


def test_the_readme_has_commands_and_says_to_activate_the_venv_before_them():
    text = README.read_text()
    assert len(COMMANDS) >= 5, COMMANDS
    assert ACTIVATE in COMMANDS, f"the README must tell the reader to run `{ACTIVATE}`"
    first_bare = next(i for i, c in enumerate(COMMANDS)
                      if _program_and_args(c)[0] in {"python", "torchrun", "megatron-grpo"})
    assert COMMANDS.index(ACTIVATE) < first_bare, "activate the venv before the first python/torchrun command"
    assert "[--" not in "\n".join(SHELL_BLOCK.findall(text)), "a command with [optional] syntax does not run as written"


def _check_repo_script(command: str) -> None:
    """`torchrun ... examples/x.py ARGS`: the script is in the repository and its `parse_args` takes ARGS."""
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(_program_and_args(command)[1])
    script = REPO / parsed.training_script
    assert script.is_file(), f"{command}: {parsed.training_script} is not a file of the repository"
    spec = importlib.util.spec_from_file_location(f"readme_script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.parse_args(parsed.training_script_args)
    except SystemExit as exit_:
        raise AssertionError(f"`{command}` does not parse (exit {exit_.code})") from None


@pytest.mark.parametrize("command", DOC_COMMANDS)
def test_each_documented_command_parses(command, monkeypatch):
    program, args = _program_and_args(command)
    if command == ACTIVATE:
        assert (VENV_BIN / "activate").is_file() or shutil.which("python"), "no .venv/bin/activate"
    elif program == "make":
        result = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 0, f"{command}: {result.stderr}"
    elif program == "megatron-grpo" or program in {"python", "python3", "torchrun"} and "megatron_grpo" in args:
        _check_megatron_grpo(command, monkeypatch)
    elif program == "torchrun":
        _check_repo_script(command)
    elif program in {"python", "python3"}:
        _check_repo_paths(args)
    else:
        assert shutil.which(program) or (VENV_BIN / program).exists() or (REPO / program).exists(), (
            f"{command}: `{program}` is neither on the PATH, nor in .venv/bin, nor a file of the repository")
        _check_repo_paths(args)


def test_a_broken_command_is_caught(monkeypatch):
    """The checker itself: a misspelt flag fails."""
    with pytest.raises(AssertionError, match="does not parse"):
        _check_megatron_grpo("torchrun --nproc-per-node 2 -m megatron_grpo train --confg x.yaml", monkeypatch)


def test_the_design_is_in_the_repository_and_nothing_points_outside_it():
    text = README.read_text()
    assert (REPO / "docs" / "design.md").is_file() and "(docs/design.md)" in text
    sources = [README, *sorted((REPO / "megatron_grpo").rglob("*.py")), *sorted((REPO / "csrc").glob("*.*"))]
    citing = [str(path.relative_to(REPO)) for path in sources if "DESIGN.md" in path.read_text()]
    assert citing == [], f"these files cite DESIGN.md, which is not in the repository: {citing}"


def test_a_broken_script_command_is_caught():
    """The checker itself: a misspelt flag of the example script fails."""
    with pytest.raises(AssertionError, match="does not parse"):
        _check_repo_script("torchrun --nproc-per-node 2 examples/megatron_training_loop.py --stpes 5")
