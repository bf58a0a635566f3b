"""What a training run shows and leaves behind: progress bar, per-step JSON lines, summary table and plot.

Only the reporting rank (global rank 0) writes; the others construct a silent `Reporter`. Timing keys end in
`_time_s`: they are the only metrics that differ between two runs of the same config and seed.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from megatron_grpo.timing import time_breakdown_rows

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "reward_and_step_time.png"
TIMING_SUFFIX = "_time_s"
LAST_N = 10


class MetricsFileError(ValueError):
    """A line of `metrics.jsonl` other than the last is not a JSON record."""


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step records of a run, in step order."""
    with open(Path(run_dir) / METRICS_FILE) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def read_metrics_for_resume(path: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The records of `path`, and a note when its last line was torn (a crash mid-write) and has been dropped.

    Only the last line can be torn, as records are appended one whole line at a time; a bad line before it is
    a `MetricsFileError` naming the file and line."""
    lines = [(number, line) for number, line in enumerate(Path(path).read_text().splitlines(), 1) if line.strip()]
    records, note = [], None
    for index, (number, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
        except ValueError as err:
            if index < len(lines) - 1:
                raise MetricsFileError(f"{path}:{number}: not a metrics record ({err})") from err
            shown = line if len(line) <= 60 else line[:57] + "..."
            note = f"note: {path}: dropped the torn last line {number} (a crash mid-write): {shown}"
            continue
        records.append(record)
    return records, note


def without_timings(record: dict[str, Any]) -> dict[str, Any]:
    """A record minus its wall-clock keys: what must match exactly between equivalent runs."""
    return {key: value for key, value in record.items() if not key.endswith(TIMING_SUFFIX)}


def is_collapsed(groups_without_variance: int, num_groups: int, reward_mean: float) -> bool:
    """True when no group has reward variance although rewards are not perfect: GRPO has no signal left."""
    return groups_without_variance == num_groups and reward_mean < 1.0


class Reporter:
    """Progress bar, `metrics.jsonl`, collapse warnings and the end-of-run summary of one training run."""

    def __init__(
        self,
        run_dir: Path,
        *,
        first_step: int,
        total_steps: int,
        enabled: bool,
        progress_bar: bool,
        stream: TextIO = sys.stderr,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.stream = stream
        self.records: list[dict[str, Any]] = []
        self._collapse_reported = False
        self._bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.records = self._keep_records_before(first_step)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=first_step, desc="GRPO", unit="step", file=stream)

    def _keep_records_before(self, first_step: int) -> list[dict[str, Any]]:
        """Drops records a resumed run will redo, so the file ends up as if the run had never stopped."""
        path = self.run_dir / METRICS_FILE
        kept: list[dict[str, Any]] = []
        if path.exists():
            records, note = read_metrics_for_resume(path)
            if note:
                self._write(note)
            kept = [r for r in records if r["step"] < first_step]
        with open(path, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)
        return kept

    def log_step(self, record: dict[str, Any]) -> None:
        """Appends one step's metrics, updates the bar and warns once per streak of collapsed steps."""
        if not self.enabled:
            return
        self.records.append(record)
        with open(self.run_dir / METRICS_FILE, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        collapsed = record["collapsed"]
        if collapsed and not self._collapse_reported:
            self._write(
                f"warning: step {record['step']}: collapse - none of the {record['num_groups']} groups has reward "
                f"variance (mean reward {record['reward_mean']:.3f}), so every advantage is 0 and the policy "
                "stops learning; try a larger init_method_std, a lower lr or a higher temperature"
            )
        self._collapse_reported = collapsed
        if self._bar is not None:
            self._bar.set_postfix(
                reward=f"{record['reward_mean']:.3f}",
                step_s=f"{record['step_time_s']:.2f}",
                skipped_ref=record["reference_passes_skipped"],
                skipped_prev=record["prev_passes_skipped"],
                refresh=False,
            )
            self._bar.update(1)

    def finish(self) -> str:
        """Closes the bar, writes the plot and returns (and prints) the summary table."""
        if not self.enabled:
            return ""
        if self._bar is not None:
            self._bar.close()
        table = summary_table(self.records)
        plot_path = self.run_dir / PLOT_FILE
        plot_reward_and_step_time(self.records, plot_path)
        self._write(f"{table}\nmetrics: {self.run_dir / METRICS_FILE}\nplot:    {plot_path}")
        return table

    def _write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)


def summary_table(records: list[dict[str, Any]]) -> str:
    """A two-column table of the run: steps, rewards at the start and end, time, and passes skipped."""
    if not records:
        return "no steps were run"
    rewards = [r["reward_mean"] for r in records]
    step_times = [r["step_time_s"] for r in records]
    last = records[-1]
    rows = [
        ("steps", f"{records[0]['step'] + 1}..{last['step'] + 1}"),
        (f"reward, first {min(LAST_N, len(rewards))} steps", f"{_mean(rewards[:LAST_N]):.3f}"),
        (f"reward, last {min(LAST_N, len(rewards))} steps", f"{_mean(rewards[-LAST_N:]):.3f}"),
        ("mean step time", f"{_mean(step_times):.3f} s"),
        ("total step time", f"{sum(step_times):.1f} s"),
        ("reference logprob passes skipped", f"{last['reference_passes_skipped']} of {last['step'] + 1}"),
        ("prev logprob passes skipped", f"{last['prev_passes_skipped']} of {last['step'] + 1}"),
        ("collapsed steps", str(sum(r["collapsed"] for r in records))),
        *time_breakdown_rows(records),
    ]
    width = max(len(name) for name, _ in rows)
    rule = "-" * (width + 2 + max(len(value) for _, value in rows))
    return "\n".join([rule, *(f"{name:<{width}}  {value}" for name, value in rows), rule])


def plot_reward_and_step_time(records: list[dict[str, Any]], path: Path) -> None:
    """Saves a PNG with the mean reward (left axis) and the step time (right axis) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] + 1 for r in records]
    figure, reward_axis = plt.subplots(figsize=(7, 4))
    reward_axis.plot(steps, [r["reward_mean"] for r in records], color="tab:blue", label="mean reward")
    reward_axis.set_xlabel("step")
    reward_axis.set_ylabel("mean reward", color="tab:blue")
    reward_axis.set_ylim(0.0, 1.05)
    time_axis = reward_axis.twinx()
    time_axis.plot(steps, [r["step_time_s"] for r in records], color="tab:orange", alpha=0.6, label="step time")
    time_axis.set_ylabel("step time (s)", color="tab:orange")
    figure.suptitle("GRPO: reward and step time")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan
