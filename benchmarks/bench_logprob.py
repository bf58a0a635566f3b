"""Kernel benchmark; same as `python -m megatron_grpo bench logprob` (see megatron_grpo/bench/logprob.py)."""

import sys

from megatron_grpo.bench.logprob import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
