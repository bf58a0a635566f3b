"""`python -m megatron_grpo COMMAND ...`: the `megatron-grpo` command (`megatron_grpo.runner.cli`)."""

import sys

from megatron_grpo.runner.cli import console_main

if __name__ == "__main__":
    sys.exit(console_main())
