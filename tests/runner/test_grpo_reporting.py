"""The run reporter: per-step JSON lines, resume truncation, summary table, plot and collapse warning."""

from __future__ import annotations

import io
import json
import sys

import pytest

from megatron_grpo.runner.reporting import (
    METRICS_FILE,
    PLOT_FILE,
    MetricsFileError,
    Reporter,
    read_metrics,
    summary_table,
)


def _record(step: int, reward: float, collapsed: bool = False) -> dict:
    return {
        "step": step, "reward_mean": reward, "step_time_s": 0.5 + step,
        "groups_without_variance": 4 if collapsed else 1, "num_groups": 4, "collapsed": collapsed,
        "reference_passes_skipped": step + 1, "prev_passes_skipped": step + 1,
    }


def test_reporter_writes_metrics_summary_and_plot_and_warns_on_collapse(tmp_path, capsys):
    reporter = Reporter(tmp_path, first_step=0, total_steps=3, enabled=True, progress_bar=False, stream=sys.stdout)
    for record in [_record(0, 0.1), _record(1, 0.2, collapsed=True), _record(2, 0.2, collapsed=True)]:
        reporter.log_step(record)
    table = reporter.finish()
    out = capsys.readouterr().out
    assert out.count("warning: step 1: collapse") == 1 and out.count("warning") == 1  # once per streak
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert (tmp_path / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reference logprob passes skipped  3 of 3" in table
    assert "prev logprob passes skipped       3 of 3" in table
    assert "collapsed steps                   2" in table


def test_a_resumed_reporter_drops_the_steps_it_will_redo(tmp_path):
    lines = [json.dumps(_record(step, 0.1)) + "\n" for step in range(5)]
    (tmp_path / METRICS_FILE).write_text("".join(lines))
    reporter = Reporter(tmp_path, first_step=3, total_steps=6, enabled=True, progress_bar=False)
    reporter.log_step(_record(3, 0.9))
    assert [(r["step"], r["reward_mean"]) for r in read_metrics(tmp_path)] == [(0, 0.1), (1, 0.1), (2, 0.1), (3, 0.9)]


def test_a_resumed_reporter_drops_a_torn_last_line_says_so_and_goes_on(tmp_path):
    lines = [json.dumps(_record(step, 0.1)) + "\n" for step in range(3)]
    (tmp_path / METRICS_FILE).write_text("".join(lines) + '{"step": 3, "rew')
    stream = io.StringIO()
    reporter = Reporter(tmp_path, first_step=2, total_steps=6, enabled=True, progress_bar=False, stream=stream)
    reporter.log_step(_record(2, 0.9))
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
    assert stream.getvalue() == (f'note: {tmp_path / METRICS_FILE}: dropped the torn last line 4 (a crash mid-write): '
                                 '{"step": 3, "rew\n')


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 0}\nnot json\n{"step": 1}\n')
    with pytest.raises(MetricsFileError, match=f"{tmp_path / METRICS_FILE}:2: not a metrics record"):
        Reporter(tmp_path, first_step=1, total_steps=6, enabled=True, progress_bar=False)


def test_summary_of_first_and_last_ten_steps():
    records = [_record(step, step / 20) for step in range(20)]
    table = summary_table(records)
    assert "reward, first 10 steps            0.225" in table  # mean of 0.00..0.45
    assert "reward, last 10 steps             0.725" in table  # mean of 0.50..0.95
