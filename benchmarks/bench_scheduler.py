"""Scheduler benchmark; same as `python -m megatron_grpo bench scheduler` (see megatron_grpo/bench/scheduler.py).

Launch under torchrun: `torchrun --nproc-per-node 2 benchmarks/bench_scheduler.py --config configs/grpo_tiny_cpu.yaml`
"""

import sys

from megatron_grpo.bench.scheduler import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
