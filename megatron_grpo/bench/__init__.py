"""Benchmarks: `python -m megatron_grpo bench logprob|scheduler|linear ...` (results under benchmarks/results/)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "logprob": ("megatron_grpo.bench.logprob", "the logprob kernels against their peers, per TP size and dtype"),
    "scheduler": ("megatron_grpo.bench.scheduler", "the auto logprob plan against computing every pass (torchrun)"),
    "linear": ("megatron_grpo.bench.linear", "the fused linear + logprob op against its peers, per TP, dtype, rows"),
}


def usage() -> str:
    lines = [f"  {name:<10} {help_}" for name, (_module, help_) in BENCHMARKS.items()]
    return (f"usage: python -m megatron_grpo bench {{{','.join(BENCHMARKS)}}} [--help]\n" + "\n".join(lines)
            + "\n`python -m megatron_grpo bench NAME --help` lists a benchmark's options.")


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        print(usage(), file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[argv[0]][0]).main(argv[1:]) or 0)
