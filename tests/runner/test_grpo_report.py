"""`megatron-grpo report RUN_DIR ...`: one PNG comparing runs, tolerant of missing metrics and torn files."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest

from megatron_grpo.runner.cli import main as cli_main
from megatron_grpo.runner.report_cli import QUANTITIES, load_run, main, run_labels


def _write_run(run_dir: Path, steps: int, *, entropy_key: str | None = "entropy", torn: bool = False,
               drop: tuple[str, ...] = ()) -> Path:
    run_dir.mkdir(parents=True)
    lines = []
    for step in range(steps):
        record = {
            "step": step, "reward_mean": min(1.0, 0.1 + step / steps), "probs_ratio": 1.0 + 0.01 * math.sin(step),
            "clip_fraction_lower": 0.01, "clip_fraction_upper": 0.02 * (step % 3),
            "step_time_s": 0.17 + 0.01 * (step % 2),
            "sample": "<bos> R 1 2 3 4 = 4 3 2 1 <eos>",
        }
        if entropy_key:
            record[entropy_key] = 2.0 - step / steps
        for key in drop:
            record.pop(key, None)
        lines.append(json.dumps(record))
    text = "\n".join(lines) + "\n"
    if torn:
        text += '{"step": 999, "reward_me'  # a crash mid-write
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_report_of_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    on_policy = _write_run(tmp_path / "on_policy", 40)
    off_policy = _write_run(tmp_path / "stale_1", 30, entropy_key="approx_entropy", torn=True)
    out = tmp_path / "out" / "report.png"
    assert cli_main(["report", str(on_policy), str(off_policy), "--out", str(out)]) == 0
    width, height = _png_size(out)
    assert width >= 600 and height >= 800
    captured = capsys.readouterr()
    assert f"report: {out} (2 runs)" in captured.out
    assert "dropped the torn last line" in captured.err
    assert "no entropy" not in captured.err  # approx_entropy stands in for it


def test_missing_metrics_are_skipped_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    full = _write_run(tmp_path / "full", 10)
    partial = _write_run(tmp_path / "partial", 10, entropy_key=None, drop=("clip_fraction_upper", "probs_ratio"))
    out = tmp_path / "report.png"
    assert main([str(full), str(partial), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "note: partial: no entropy / approx_entropy in its metrics" in err
    assert "note: partial: no probs_ratio" in err
    assert "note: partial: no clip_fraction_lower / clip_fraction_upper" in err
    assert "full:" not in err
    assert out.exists()


def test_runs_without_metrics(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    good = _write_run(tmp_path / "good", 5, entropy_key=None)
    assert main([str(empty), str(nothing), "--out", str(tmp_path / "a.png")]) == 1
    err = capsys.readouterr().err
    assert "empty: metrics.jsonl holds no step records" in err and "nothing: no metrics.jsonl" in err
    assert "error: no run with metrics to plot" in err
    assert main([str(empty), str(good), "--out", str(tmp_path / "b.png")]) == 0  # the good run is still plotted
    assert (tmp_path / "b.png").exists()


def test_default_output_and_labels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _write_run(tmp_path / "a" / "run", 3)
    other = _write_run(tmp_path / "b" / "run", 3)
    assert run_labels([run, other]) == [str(run), str(other)]  # same name: full paths
    assert run_labels([run, tmp_path / "x"]) == ["run", "x"]
    assert main([str(run)]) == 0
    assert (run / "report.png").exists()
    monkeypatch.chdir(tmp_path / "a")  # several runs: runs/report.png, where git ignores it in a checkout
    assert main([str(run), str(other)]) == 0
    assert sorted(path.relative_to(tmp_path / "a").as_posix() for path in (tmp_path / "a").rglob("*.png")) == [
        "run/report.png", "runs/report.png"]


def test_every_quantity_reads_the_demo_keys(tmp_path: Path) -> None:
    run = load_run(_write_run(tmp_path / "r", 3), "r", [])
    assert run is not None
    for quantity in QUANTITIES:
        assert all(quantity.value(record) is not None for record in run.records), quantity.title


def test_centered_mean() -> None:
    from megatron_grpo.runner.report_cli import centered_mean

    assert centered_mean([1.0, 3.0, 5.0, 7.0], 3) == [2.0, 3.0, 5.0, 6.0]
    assert centered_mean([2.0], 10) == [2.0]
    assert centered_mean([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
