"""Command line: `megatron-grpo COMMAND ...`, the same as `python -m megatron_grpo COMMAND ...`.

Each command lives in its own module and exposes `main(argv) -> int`; this file only dispatches, so that `plan`,
`bench` and `report` never pay for importing Megatron-Core. `train` runs one rank per process under torchrun:
outside torchrun (no RANK in the environment), and whenever torchrun's options come first, the command goes to
`megatron_grpo.runner.launcher`, which starts the ranks under torchrun's agent itself.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

COMMANDS = {
    "train": ("megatron_grpo.runner.train_cli", "train a policy with GRPO, one rank per process under torchrun"),
    "plan": ("megatron_grpo.runner.plan_cli", "print the logprob-pass plan of a config, and why"),
    "bench": ("megatron_grpo.bench", "run a benchmark: `bench logprob`, `linear`, `scheduler`, `packing`, `step`, "
                                     "`roofline` or `replay`"),
    "report": ("megatron_grpo.runner.report_cli", "plot runs' reward, entropy, ratio, clip fraction and step time"),
}
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def usage() -> str:
    lines = [f"  {name:<7} {help_}" for name, (_module, help_) in COMMANDS.items()]
    return "\n".join([
        "usage: megatron-grpo [torchrun options] train --config FILE [--resume | --fresh] [--debug] [--verbose]",
        "       megatron-grpo [torchrun options] bench {scheduler,packing,step,replay} [options]",
        "       megatron-grpo {plan,bench,report} [options]",
        "(`python -m megatron_grpo` is the same command)",
        "",
        *lines,
        "",
        "torchrun options come before the command and are torchrun's own, with its defaults (`torchrun --help`):",
        "  megatron-grpo --nproc-per-node 2 train --config configs/grpo_tiny_cpu.yaml",
        "`megatron-grpo COMMAND --help` describes the options of a command.",
    ])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    under_torchrun = "RANK" in os.environ
    if argv and (argv[0].startswith("-") or (argv[0] == "train" and not under_torchrun)):
        from megatron_grpo.runner.launcher import main as launch

        return launch(argv)
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        return EXIT_USAGE
    if argv[0] == "train":  # a rank: until the runner installs its own handler, Ctrl-C ends it quietly
        signal.signal(signal.SIGINT, lambda signum, frame: os._exit(EXIT_INTERRUPTED))
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


def console_main() -> int:
    """`main`, where a closed stdout (`megatron-grpo --help | head -1`) ends the output quietly."""
    try:
        return main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 1

