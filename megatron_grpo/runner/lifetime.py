"""Process lifetime: a dying job takes every process it started with it, and a stopped rank says why.

Megatron's checkpoint writer starts helper processes in each rank: `dist_checkpointing`'s `torch_dist` strategy
spawns a `multiprocessing` Manager (a full interpreter, about 330 MB, which holds the writers' results queue
for the rest of the rank's life) and a resource tracker, and forks one writer per file bucket during each save.
They share the rank's process group, which torchrun kills only while the rank itself is alive: a rank killed
outright (SIGKILL, the OOM killer) left them running forever, adopted by init. `megatron.checkpointing` keeps the
results queue in the rank, so no Manager is spawned; this module covers the rest.

On Linux the kernel can send a signal to a process when its parent dies (`PR_SET_PDEATHSIG`). The runner sets
it in each rank under torchrun (it dies with its agent) and, through an at-fork hook, in every process the rank
forks (they die with the rank). Elsewhere these are no-ops. `on_signal` makes a rank stopped by a signal say why
in one line and exit at once.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable, Optional

PR_SET_PDEATHSIG = 1
_hooked = False


def die_with_parent(sig: signal.Signals = signal.SIGKILL) -> bool:
    """Asks the kernel to send `sig` to this process when its parent exits; returns whether it could.

    If the parent died before the request (the process was re-parented to init), exits at once."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent == 1 or os.getppid() != parent:
        os._exit(1)
    return True


def bind_forked_children() -> None:
    """Makes every process this one forks from now on die with it (SIGKILL), with default SIGTERM handling."""
    global _hooked
    if not _hooked and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_in_forked_child)
        _hooked = True


def _in_forked_child() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):  # the rank's handlers (`on_signal`) are not the child's business
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent()


def on_signal(sig: signal.Signals, describe: Callable[[], Optional[str]], exit_code: int) -> None:
    """On `sig`, prints `describe()` to stderr (nothing when it is None) and exits at once with `exit_code`.

    Used for torchrun's SIGTERM (it stops every rank once one has failed) and for Ctrl-C (SIGINT, which torchrun
    forwards to every rank). The exit is immediate (no unwinding, so no traceback and no second message from a
    collective that fails because a peer left first): a checkpoint being written then has no COMPLETE marker
    and is skipped on resume, and a metrics line is either whole or absent."""

    def handler(signum: int, frame: object) -> None:
        try:
            message = describe()
            if message:
                print(message, file=sys.stderr, flush=True)
        finally:
            os._exit(exit_code)

    signal.signal(sig, handler)
