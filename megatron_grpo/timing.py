"""Where a step's time goes: a `StepTimer` of named sections, and the breakdown the end-of-run summary shows.

A step's phases, as `*_time_s` keys of its metrics record (verl's `timing_s/*` names in brackets):

| phase              | key                         | what it times                                               |
|--------------------|-----------------------------|-------------------------------------------------------------|
| `rollout`          | `rollout_time_s`            | generation and rewards (`gen`)                              |
| `reference_pass`   | `reference_pass_time_s`     | the reference-policy logprob pass (`ref`)                   |
| `prev_pass`        | `prev_pass_time_s`          | the previous-policy logprob pass (`old_log_prob`)           |
| `forward_backward` | `forward_backward_time_s`   | the training forward and backward, DP gradient sum included |
| `optimizer`        | `optimizer_time_s`          | gradient clipping and `optimizer.step()`                    |
| `checkpoint`       | `checkpoint_time_s`         | saving a checkpoint (`save_checkpoint`), 0 on other steps   |

`forward_backward` + `optimizer` is verl's `update_actor`. Everything else of a step (advantages, metrics) is
the rest of `step_time_s`, shown as "other" in the breakdown.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

TIMING_SUFFIX = "_time_s"
STEP_TIME = "step_time_s"
PHASES = ("rollout", "reference_pass", "prev_pass", "forward_backward", "optimizer", "checkpoint")
SKIP_FLAGS = {"reference_pass": "reference_pass_ran", "prev_pass": "prev_pass_ran"}  # record keys of the plan
LABELS = {"reference_pass": "reference pass", "prev_pass": "prev pass", "forward_backward": "training forward/backward"}


class StepTimer:
    """Named sections that accumulate wall-clock seconds, read out as `{name}_time_s` keys.

        timer = StepTimer()
        with timer.section("rollout"):
            ...
        record.update(timer.times())   # {"rollout_time_s": ...}; phases never entered are 0

    A section entered several times in a step (one optimizer step per minibatch) accumulates. Sections do not nest
    (that would count time twice in the breakdown): entering one inside another is a `RuntimeError`. `sync`, when
    given, runs at both ends of a section (e.g. `torch.cuda.synchronize`, so that GPU work lands in its section).
    """

    def __init__(self, phases: Sequence[str] = PHASES, *, sync: Optional[Callable[[], Any]] = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.phases = tuple(phases)
        self._sync = sync
        self._clock = clock
        self._totals: dict[str, float] = {}
        self._open: Optional[str] = None

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if self._open is not None:
            raise RuntimeError(f"StepTimer: section {name!r} entered inside {self._open!r}; sections do not nest")
        self._open = name
        if self._sync is not None:
            self._sync()
        started = self._clock()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.add(name, self._clock() - started)
            self._open = None

    def add(self, name: str, seconds: float) -> None:
        """Adds time measured elsewhere to a section."""
        self._totals[name] = self._totals.get(name, 0.0) + seconds

    def times(self) -> dict[str, float]:
        """`{name}_time_s` for every phase (0 when not entered) and every other section entered."""
        names = list(self.phases) + [name for name in self._totals if name not in self.phases]
        return {f"{name}{TIMING_SUFFIX}": self._totals.get(name, 0.0) for name in names}

    def reset(self) -> None:
        """Zeroes every section, for the next step."""
        self._totals.clear()


def time_breakdown_rows(records: Sequence[Mapping[str, Any]],
                        phases: Sequence[str] = PHASES) -> list[tuple[str, str]]:
    """Rows `(label, value)` for the summary table: each phase's mean seconds per step and share of the mean step
    time, then the rest ("other"). A step without a phase's key counts 0 for it (e.g. `checkpoint_time_s` only on
    the steps that saved one). A pass the plan skipped at every step says so. Phases absent from every record are
    left out; no rows when the records carry no step time."""
    timed = [r for r in records if isinstance(r.get(STEP_TIME), (int, float))]
    if not timed:
        return []
    step_mean = sum(r[STEP_TIME] for r in timed) / len(timed)
    rows: list[tuple[str, str]] = []
    accounted = 0.0
    for phase in phases:
        key = f"{phase}{TIMING_SUFFIX}"
        if not any(isinstance(r.get(key), (int, float)) for r in timed):
            continue
        mean = sum(r[key] for r in timed if isinstance(r.get(key), (int, float))) / len(timed)
        accounted += mean
        flag = SKIP_FLAGS.get(phase)
        label = f"  {LABELS.get(phase, phase)}"
        if flag is not None and all(r.get(flag) is False for r in timed):
            rows.append((label, "skipped by the plan"))
            continue
        rows.append((label, _share(mean, step_mean)))
    if not rows:
        return []
    rows.append(("  other", _share(max(step_mean - accounted, 0.0), step_mean)))
    return [("time per step, by phase", f"{step_mean:.3f} s"), *rows]


def format_time_breakdown(records: Sequence[Mapping[str, Any]], phases: Sequence[str] = PHASES) -> str:
    """The breakdown of `time_breakdown_rows` as a two-column text table ("" when there is nothing to show)."""
    rows = time_breakdown_rows(records, phases)
    if not rows:
        return ""
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _share(seconds: float, step_seconds: float) -> str:
    percent = 100.0 * seconds / step_seconds if step_seconds > 0 else 0.0
    return f"{seconds:.3f} s  {percent:5.1f}%"
