"""A torchrun entry for the tests: `python -m megatron_grpo ...` with every collective checked for host tensors
(tests/_collective_devices.py). Each rank writes what it saw to `$COLLECTIVE_LOG_DIR/rank<RANK>.json`: the checked
collectives by caller, and one line per host tensor handed to one."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _collective_devices

from _collective_devices import checked_collectives  # noqa: E402


def main() -> int:
    from megatron_grpo.runner.cli import main as megatron_grpo_main

    out = Path(os.environ["COLLECTIVE_LOG_DIR"]) / f"rank{os.environ['RANK']}.json"
    with checked_collectives() as log:
        try:
            return megatron_grpo_main(sys.argv[1:])
        finally:
            out.write_text(json.dumps({"checked": dict(log.checked), "host_tensors": log.host_tensors}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
