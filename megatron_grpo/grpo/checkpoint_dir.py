"""Where checkpoints live: one directory per step, published atomically, found again on `--resume`.

    <dir>/latest                     name of the newest complete step directory, replaced atomically
    <dir>/step_00000050/...          the checkpoint itself (see `checkpoint`)
    <dir>/step_00000050/COMPLETE     the world size that saved it; written once every rank's files are on disk

A step directory without COMPLETE (a crash while saving) is never pointed to by `latest`, so the previous
checkpoint stays loadable. No megatron.core here: the runner checks `--resume` before importing it.
"""

from __future__ import annotations

import os
from pathlib import Path

LATEST_FILE = "latest"
COMPLETE_FILE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def publish(step_dir: Path, world_size: int) -> None:
    """Marks `step_dir` complete and points `latest` at it; call on one rank once every rank has saved."""
    step_dir = Path(step_dir)
    (step_dir / COMPLETE_FILE).write_text(f"{world_size}\n")
    _atomic_write_text(step_dir.parent / LATEST_FILE, step_dir.name + "\n")


def unpublish(step_dir: Path) -> None:
    """Withdraws `step_dir`'s COMPLETE marker before it is overwritten, so a crash mid-save cannot leave it
    looking complete."""
    (Path(step_dir) / COMPLETE_FILE).unlink(missing_ok=True)


def retire_latest(directory: Path) -> bool:
    """Unsets `latest` for a fresh run reusing `directory`, so `--resume` never picks up an older run's
    checkpoint; returns whether there was one."""
    latest = Path(directory) / LATEST_FILE
    existed = latest.is_file()
    latest.unlink(missing_ok=True)
    return existed


def latest_checkpoint(directory: Path) -> Path:
    """The newest complete step directory under `directory`; a `CheckpointError` if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"--resume: checkpoint directory {directory} (checkpoint.dir) does not exist; "
            "run without --resume to start from scratch"
        )
    latest = directory / LATEST_FILE
    if not latest.is_file():
        raise CheckpointError(f"--resume: {directory} holds no complete checkpoint ({latest} is missing)")
    step_dir = directory / latest.read_text().strip()
    if not (step_dir / COMPLETE_FILE).is_file():
        raise CheckpointError(f"--resume: {latest} points to {step_dir}, which is missing or incomplete")
    return step_dir


def saved_world_size(step_dir: Path) -> int:
    """The number of ranks that saved `step_dir` (recorded in its COMPLETE marker)."""
    return int((Path(step_dir) / COMPLETE_FILE).read_text())


def _atomic_write_text(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
