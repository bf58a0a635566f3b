"""How a run starts: resume what the run directory holds, or start over without ever deleting the old run.

- `auto` (no flag): resume from the newest complete checkpoint in `checkpoint.dir` when there is one. With
  none, an earlier run's files (metrics without a checkpoint, a crashed first save) are moved aside.
- `resume` (`--resume`): the same, but a run directory with nothing to resume is an error.
- `fresh` (`--fresh`): start over; the old run directory (and `checkpoint.dir`, if it lies outside it) is moved
  to `<dir>.previous-<UTC timestamp>`.

Every rank computes the same `StartPlan` from the files, read-only and before any process group exists, so each
can reject bad input on its own. Only rank 0 acts on it, and only after `init_process_group`: that rendezvous
completes once every rank has finished reading, so no rank can read a half-moved directory. Rank 0 then
broadcasts its plan, and every rank follows that one (on one machine or on shared storage across nodes).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from megatron_grpo.runner.checkpoint_dir import CheckpointError, describe_os_error, find_resumable
from megatron_grpo.runner.config import RESOLVED_CONFIG

StartMode = Literal["auto", "resume", "fresh"]
PREVIOUS_SUFFIX = ".previous-"
PROBE_PREFIX = ".write-probe-"


class RunDirectoryError(OSError):
    """The run or checkpoint directory cannot be used: not creatable, not writable, or full."""


@dataclass(frozen=True)
class StartPlan:
    """Where a run starts: the checkpoint it resumes from (None: from scratch), what is moved aside first, and
    what to tell the user."""

    resume_from: Optional[Path]
    move_aside: tuple[Path, ...]
    notes: tuple[str, ...]


def check_writable(directories: dict[str, Path]) -> None:
    """Creates each directory and writes, syncs and removes a small probe file in it; a `RunDirectoryError` names
    the key, the path and the errno of the first that fails."""
    for key, directory in directories.items():
        probe = Path(directory) / f"{PROBE_PREFIX}{os.uname().nodename}-{os.getpid()}"
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            with open(probe, "wb") as handle:
                handle.write(b"\0" * 4096)
                handle.flush()
                os.fsync(handle.fileno())
            probe.unlink()
        except OSError as err:
            raise RunDirectoryError(f"{key}: {directory} is not usable for this run: {describe_os_error(err)}") from err


def plan_start(run_dir: Path, checkpoint_dir: Path, mode: StartMode) -> StartPlan:
    """What this run would do with `run_dir` and `checkpoint_dir` (read-only); `CheckpointError` when `resume`
    finds nothing to resume."""
    run_dir, checkpoint_dir = Path(run_dir), Path(checkpoint_dir)
    found = find_resumable(checkpoint_dir)
    notes = list(found.skipped)
    if mode == "resume" and found.step_dir is None:
        if not checkpoint_dir.is_dir():
            raise CheckpointError(f"--resume: checkpoint directory {checkpoint_dir} (checkpoint.dir) does not exist; "
                                  "run without --resume to start from scratch")
        reasons = "".join(f"\n  {line}" for line in notes)
        raise CheckpointError(f"--resume: nothing to resume: {checkpoint_dir} (checkpoint.dir) holds no complete "
                              f"checkpoint{reasons}")
    if mode != "fresh" and found.step_dir is not None:
        notes.append(f"resuming from step {int(found.step_dir.name[len('step_'):])}: {found.step_dir}")
        return StartPlan(found.step_dir, (), tuple(notes))
    occupied = tuple(path for path in _run_locations(run_dir, checkpoint_dir) if _holds_files(path))
    if occupied and mode == "auto":
        notes.append(f"no complete checkpoint in {checkpoint_dir}, so the run starts from scratch; the earlier "
                     "run's files are moved aside (nothing is deleted)")
    return StartPlan(None, occupied, tuple(notes))


def carry_out(plan: StartPlan, now: Optional[float] = None) -> list[str]:
    """Moves the plan's directories aside (call on one rank only); returns one line per move."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    lines = []
    for path in plan.move_aside:
        target = _free_name(path, stamp)
        os.rename(path, target)
        lines.append(f"moved the earlier run {path} to {target}")
    return lines


def _run_locations(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """The run directory, and the checkpoint directory when it is not inside the run directory."""
    inside = checkpoint_dir.resolve().is_relative_to(run_dir.resolve())
    return [run_dir] if inside else [run_dir, checkpoint_dir]


def holds_a_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds the files of a run (metrics, checkpoints, logs), not just a resolved config that
    `plan` wrote (`train` rewrites that one at every start)."""
    return _holds_files(Path(run_dir))


def _holds_files(directory: Path) -> bool:
    """Whether `directory` holds any file, another rank's passing write probe and the resolved config aside."""
    resolved = directory / RESOLVED_CONFIG
    return directory.is_dir() and any(path.is_file() and not path.name.startswith(PROBE_PREFIX) and path != resolved
                                      for path in directory.rglob("*"))


def _free_name(path: Path, stamp: str) -> Path:
    target = path.with_name(f"{path.name}{PREVIOUS_SUFFIX}{stamp}")
    index = 2
    while target.exists():
        target = path.with_name(f"{path.name}{PREVIOUS_SUFFIX}{stamp}-{index}")
        index += 1
    return target

