"""Benchmarks: `python -m megatron_grpo bench logprob|scheduler ...` (results under benchmarks/results/)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "logprob": "megatron_grpo.bench.logprob",
    "scheduler": "megatron_grpo.bench.scheduler",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m megatron_grpo bench {{{','.join(BENCHMARKS)}}} [--help]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0)
