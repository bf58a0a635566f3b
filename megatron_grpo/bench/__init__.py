"""Benchmarks: `megatron-grpo bench logprob|linear|scheduler|packing|step|roofline|replay ...`.

Each writes its report, data and plot under runs/bench unless `--out` names a place; `make bench` and
`make bench-linear` refresh the committed results in benchmarks/results/."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "logprob": ("megatron_grpo.bench.logprob", "the logprob kernels against their peers, per TP size and dtype"),
    "scheduler": ("megatron_grpo.bench.scheduler", "the auto logprob plan against computing every pass (under "
                                                   "torchrun: `megatron-grpo --nproc-per-node 2 bench scheduler`)"),
    "linear": ("megatron_grpo.bench.linear", "the fused linear + logprob op against its peers, per TP, dtype, rows"),
    "packing": ("megatron_grpo.bench.packing", "padded against packed microbatches on the ragged task (under "
                                               "torchrun: `megatron-grpo --nproc-per-node 2 bench packing`)"),
    "roofline": ("megatron_grpo.bench.roofline", "the CUDA kernels alone and the op per call against a "
                                                 "device-to-device copy's bandwidth (a CUDA machine)"),
    "step": ("megatron_grpo.bench.step", "the whole GRPO train step in four configurations, each adding one feature "
                                         "(under torchrun: `megatron-grpo --nproc-per-node 1 bench step`)"),
    "replay": ("megatron_grpo.bench.replay", "the runner with a top-p sampler and stale rollouts, recomputing against "
                                             "replaying the kept sets (under torchrun: `megatron-grpo "
                                             "--nproc-per-node 2 bench replay`)"),
}


def usage() -> str:
    lines = [f"  {name:<10} {help_}" for name, (_module, help_) in BENCHMARKS.items()]
    return (f"usage: megatron-grpo bench {{{','.join(BENCHMARKS)}}} [options]\n" + "\n".join(lines)
            + "\n`megatron-grpo bench NAME --help` lists a benchmark's options; each writes under runs/bench unless "
              "--out names a place.")


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        print(usage(), file=sys.stderr)
        return 2
    import torch  # every benchmark imports it

    from megatron_grpo.megatron.notices import quiet_megatron_notices

    # in this process (and the ranks torchrun starts for `bench scheduler`); benchmarks' own child ranks do the same
    quiet_megatron_notices(verbose="--verbose" in argv, cuda_available=torch.cuda.is_available())
    return int(importlib.import_module(BENCHMARKS[argv[0]][0]).main(argv[1:]) or 0)
