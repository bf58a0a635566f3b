"""`megatron-grpo report RUN_DIR [RUN_DIR ...] [--out FILE.png]`: compare runs in one PNG.

One subplot per quantity (mean reward, entropy, `probs_ratio`, clip fraction, step time) against the step, one
line per run, labelled by the run directory's name. Runs of 50 steps or more show a centred 10-step running mean
over their faint raw values (`--smooth N` sets the window, `--smooth 1` draws the raw values only).

The PNG goes to RUN_DIR/report.png for one run and to runs/report.png for several, unless `--out` names a place:
never into the checkout's tracked files. Reads each run's `metrics.jsonl`; a torn last line (a crash mid-write) is
dropped with a note. A quantity a run does not have is skipped for that run with a note, never an error. Needs
matplotlib (the `bench` extra).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from megatron_grpo.runner.helptext import DefaultsHelpFormatter
from megatron_grpo.runner.reporting import METRICS_FILE, read_metrics_for_resume

Record = dict[str, Any]
SEVERAL_RUNS_OUT = Path("runs") / "report.png"  # ignored by git, where the runs themselves live by default


@dataclass(frozen=True)
class Quantity:
    """One subplot: its title and how to read it from a record (None = the record lacks it)."""

    title: str
    value: Callable[[Record], Optional[float]]
    missing: str  # what the note says the run lacks


def _key(name: str) -> Callable[[Record], Optional[float]]:
    def read(record: Record) -> Optional[float]:
        value = record.get(name)
        return float(value) if isinstance(value, (int, float)) else None

    return read


def _entropy(record: Record) -> Optional[float]:
    """The exact entropy when the loss computed it, else NeMo-RL's `approx_entropy`."""
    value = _key("entropy")(record)
    return value if value is not None else _key("approx_entropy")(record)


def _clip_fraction(record: Record) -> Optional[float]:
    """Fraction of trained tokens whose ratio was clipped, either side (the two sides are disjoint)."""
    lower, upper = _key("clip_fraction_lower")(record), _key("clip_fraction_upper")(record)
    return None if lower is None or upper is None else lower + upper


QUANTITIES = (
    Quantity("mean reward", _key("reward_mean"), "reward_mean"),
    Quantity("entropy (exact, else approx_entropy)", _entropy, "entropy / approx_entropy"),
    Quantity("probs_ratio (token mean)", _key("probs_ratio"), "probs_ratio"),
    Quantity("clip fraction (lower + upper)", _clip_fraction, "clip_fraction_lower / clip_fraction_upper"),
    Quantity("step time (s)", _key("step_time_s"), "step_time_s"),
)


@dataclass(frozen=True)
class Run:
    label: str
    records: list[Record]


def load_run(run_dir: Path, label: str, notes: list[str]) -> Optional[Run]:
    """The run's records, or None (with a note) when it has no readable metrics."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        notes.append(f"note: {run_dir}: no {METRICS_FILE}; run skipped")
        return None
    try:
        records, torn = read_metrics_for_resume(path)
    except ValueError as err:  # a bad line before the last: the file is not a metrics file
        notes.append(f"note: {run_dir}: {err}; run skipped")
        return None
    if torn:
        notes.append(torn)
    records = [r for r in records if isinstance(r.get("step"), int)]
    if not records:
        notes.append(f"note: {run_dir}: {METRICS_FILE} holds no step records; run skipped")
        return None
    return Run(label, sorted(records, key=lambda r: r["step"]))


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name, or its whole path where two runs share a name."""
    names = [Path(d).resolve().name or str(d) for d in run_dirs]
    return [name if names.count(name) == 1 else str(d) for name, d in zip(names, run_dirs)]


def centered_mean(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value with up to `window // 2` neighbours on each side (fewer at the ends): no lag."""
    half = window // 2
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    means = []
    for index in range(len(values)):
        low, high = max(0, index - half), min(len(values), index + half + 1)
        means.append((prefix[high] - prefix[low]) / (high - low))
    return means


def plot_runs(runs: Sequence[Run], out: Path, notes: list[str], smooth: int = 10) -> None:
    """Writes the PNG: one subplot per quantity, one line per run that has it. With `smooth` > 1, a run of at
    least 5 * `smooth` steps shows its centred `smooth`-step running mean over its faint raw values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(QUANTITIES), 1, figsize=(8, 2.3 * len(QUANTITIES)), sharex=True)
    for axis, quantity in zip(axes, QUANTITIES):
        plotted = 0
        for index, run in enumerate(runs):
            points = [(r["step"] + 1, quantity.value(r)) for r in run.records]
            points = [(step, value) for step, value in points if value is not None]
            if not points:
                notes.append(f"note: {run.label}: no {quantity.missing} in its metrics; not in '{quantity.title}'")
                continue
            steps, values = zip(*points)
            color = f"C{index % 10}"
            if smooth > 1 and len(values) >= 5 * smooth:  # faint raw values under a running mean
                axis.plot(steps, values, color=color, linewidth=0.8, alpha=0.3)
                values = centered_mean(values, smooth)
            axis.plot(steps, values, label=run.label, color=color, linewidth=1.4)
            plotted += 1
        axis.set_title(quantity.title, fontsize=10, loc="left")
        axis.grid(True, alpha=0.3)
        if plotted:
            axis.legend(fontsize=8, loc="best")
        else:
            axis.text(0.5, 0.5, "no run has this metric", transform=axis.transAxes, ha="center", va="center",
                      color="gray")
    axes[-1].set_xlabel("step")
    long_runs = smooth > 1 and any(len(run.records) >= 5 * smooth for run in runs)
    smoothed = (f"\n(runs of {5 * smooth}+ steps: {smooth}-step running mean over the faint raw values)"
                if long_runs else "")
    figure.suptitle("GRPO runs: " + ", ".join(run.label for run in runs) + smoothed, fontsize=10)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="megatron-grpo report", formatter_class=DefaultsHelpFormatter,
        description="Plot runs' reward, entropy, probs_ratio, clip fraction and step time against the step.")
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="a run directory (the run_dir of its config, holding metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the PNG to write (default: RUN_DIR/report.png for one run, "
                             f"{SEVERAL_RUNS_OUT} for several)")
    parser.add_argument("--smooth", type=int, default=10, metavar="N",
                        help="for runs of 5N+ steps, draw the centred N-step running mean over the faint raw values "
                             "(1: the raw values only)")
    args = parser.parse_args(argv)
    out = args.out or (args.run_dirs[0] / "report.png" if len(args.run_dirs) == 1 else SEVERAL_RUNS_OUT)
    notes: list[str] = []
    runs = [run for run_dir, label in zip(args.run_dirs, run_labels(args.run_dirs))
            if (run := load_run(run_dir, label, notes)) is not None]
    if not runs:
        print("\n".join([*notes, "error: no run with metrics to plot"]), file=sys.stderr)
        return 1
    plot_runs(runs, out, notes, smooth=args.smooth)
    for note in notes:
        print(note, file=sys.stderr)
    print(f"report: {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
