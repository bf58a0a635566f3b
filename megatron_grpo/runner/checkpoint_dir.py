"""Where checkpoints live: one directory per step, published atomically with checksums, found again on resume.

    <dir>/latest                     name of the newest published step directory, replaced atomically
    <dir>/step_00000050/...          the checkpoint itself (see `checkpoint`)
    <dir>/step_00000050/COMPLETE     JSON: the world size that saved it and the SHA-256 of each of its files;
                                     written (atomically) once every rank's files are on disk

A step directory without a readable COMPLETE marker (a crash while saving, or a damaged marker) is incomplete:
it is named and skipped, and the newest complete one is resumed instead, so the previous checkpoint stays
loadable. No megatron.core here: the runner checks what it will resume before importing it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

LATEST_FILE = "latest"
COMPLETE_FILE = "COMPLETE"
STEP_PREFIX = "step_"
MARKER_FORMAT = 1
HASH_CHUNK_BYTES = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable or does not match its checksums."""


class AgreedCheckpointError(CheckpointError):
    """A checkpoint error that every rank raised alike (so one rank can report it for all)."""


@dataclass(frozen=True)
class Marker:
    """The content of a COMPLETE marker: who saved the checkpoint, and the SHA-256 of every file of it."""

    world_size: int
    checksums: dict[str, str]  # path relative to the step directory -> hex digest


@dataclass(frozen=True)
class Resumable:
    """The checkpoint a run would resume from, and the newer step directories that were skipped (and why)."""

    step_dir: Optional[Path]
    skipped: list[str] = field(default_factory=list)


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def checkpoint_files(step_dir: Path) -> list[str]:
    """Every file of a checkpoint (relative paths, sorted), the marker and temporary files excepted."""
    step_dir = Path(step_dir)
    return sorted(
        path.relative_to(step_dir).as_posix()
        for path in step_dir.rglob("*")
        if path.is_file() and path.name != COMPLETE_FILE and not path.name.endswith(".tmp")
    )


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(HASH_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def publish(step_dir: Path, world_size: int) -> None:
    """Marks `step_dir` complete, with the checksum of each of its files, and points `latest` at it; call on one
    rank once every rank has saved."""
    step_dir = Path(step_dir)
    marker = {"format": MARKER_FORMAT, "world_size": world_size,
              "files": {name: file_sha256(step_dir / name) for name in checkpoint_files(step_dir)}}
    _atomic_write_text(step_dir / COMPLETE_FILE, json.dumps(marker, indent=1, sort_keys=True) + "\n")
    _atomic_write_text(step_dir.parent / LATEST_FILE, step_dir.name + "\n")


def unpublish(step_dir: Path) -> None:
    """Withdraws `step_dir`'s COMPLETE marker before it is overwritten, so a crash mid-save cannot leave it
    looking complete."""
    (Path(step_dir) / COMPLETE_FILE).unlink(missing_ok=True)


def read_marker(step_dir: Path) -> Marker:
    """The COMPLETE marker of `step_dir`; a `CheckpointError` naming the marker if it is missing or damaged."""
    path = Path(step_dir) / COMPLETE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (a save that did not finish)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is unreadable: {err}") from err
    if text.strip().isdigit():  # the marker of earlier versions: the world size alone, no checksums
        return Marker(world_size=int(text), checksums={})
    try:
        data = json.loads(text)
        marker = Marker(world_size=int(data["world_size"]), checksums=dict(data["files"]))
    except (ValueError, TypeError, KeyError) as err:
        what = "empty" if not text.strip() else "not a valid marker"
        raise CheckpointError(f"{path} is {what} ({type(err).__name__}: {err})") from err
    if marker.world_size < 1 or not all(isinstance(v, str) for v in marker.checksums.values()):
        raise CheckpointError(f"{path} is not a valid marker (world size {marker.world_size})")
    return marker


def verify_checksums(step_dir: Path, share: tuple[int, int] = (0, 1)) -> None:
    """Hashes the files the marker lists (with `share=(i, n)`, only every n-th from the i-th, in name order); a
    missing file or a mismatch is a `CheckpointError` naming the file."""
    step_dir = Path(step_dir)
    marker = read_marker(step_dir)
    if not marker.checksums:
        raise CheckpointError(f"{step_dir / COMPLETE_FILE} records no checksums (a checkpoint of an earlier "
                              "version); set checkpoint.verify_checksums: false to load it unverified")
    index, count = share
    for name, expected in sorted(marker.checksums.items())[index::count]:
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing, but {step_dir / COMPLETE_FILE} lists it")
        if file_sha256(path) != expected:
            raise CheckpointError(f"{path} does not match its checksum in {step_dir / COMPLETE_FILE}: the file "
                                  "was changed or damaged after the save")


def step_dirs(directory: Path) -> list[Path]:
    """The step directories under `directory`, newest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX)
             and p.name[len(STEP_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]), reverse=True)


def find_resumable(directory: Path) -> Resumable:
    """The newest step directory with a valid COMPLETE marker, and the newer ones skipped with their reason."""
    skipped = []
    for step_dir in step_dirs(directory):
        try:
            read_marker(step_dir)
        except CheckpointError as err:
            skipped.append(f"skipped {step_dir.name}: {err}")
            continue
        return Resumable(step_dir, skipped)
    return Resumable(None, skipped)


def latest_checkpoint(directory: Path) -> Path:
    """The newest complete step directory under `directory`; a `CheckpointError` if there is none."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"--resume: checkpoint directory {directory} (checkpoint.dir) does not exist; "
                              "run without --resume to start from scratch")
    found = find_resumable(directory)
    if found.step_dir is None:
        reasons = "".join(f"\n  {line}" for line in found.skipped)
        raise CheckpointError(f"--resume: {directory} holds no complete checkpoint{reasons}")
    return found.step_dir


def saved_world_size(step_dir: Path) -> int:
    """The number of ranks that saved `step_dir` (recorded in its COMPLETE marker)."""
    return read_marker(step_dir).world_size


def loadable_sentence(directory: Path) -> str:
    """What a user can still resume from after a failure, in one true sentence."""
    try:
        step_dir = find_resumable(directory).step_dir
    except OSError as err:
        return f"whether a checkpoint in {directory} is loadable is unknown ({err})"
    if step_dir is None:
        return f"no checkpoint has been completed in {directory}, so a rerun starts from scratch"
    return f"{step_dir} is the newest complete checkpoint, and rerunning the same command resumes from it"


def describe_os_error(err: OSError) -> str:
    """`[Errno 28] No space left on device: '<path>'`: the errno, its meaning and the path, when known."""
    if err.errno is None:
        return str(err)
    return f"[Errno {err.errno}] {err.strerror}" + (f": '{err.filename}'" if err.filename else "")


def _atomic_write_text(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
