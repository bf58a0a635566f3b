"""Command line: `python -m megatron_grpo {train,plan,bench,report} ...`.

Each subcommand lives in its own module and exposes `main(argv) -> int`; this file only dispatches, so that
`plan`, `bench` and `report` never pay for importing Megatron-Core.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("megatron_grpo.grpo.runner", "train a policy with GRPO (run under torchrun)"),
    "plan": ("megatron_grpo.scheduler_cli", "print the logprob-pass plan of a config and why"),
    "bench": ("megatron_grpo.bench", "run a benchmark: `bench logprob`, `bench scheduler` or `bench linear`"),
    "report": ("megatron_grpo.grpo.report_cli", "plot runs' reward, entropy, ratio, clip fraction, step time"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        lines = [f"  {name:<6} {help_}" for name, (_module, help_) in COMMANDS.items()]
        print("usage: python -m megatron_grpo {" + ",".join(COMMANDS) + "} ...\n" + "\n".join(lines), file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
