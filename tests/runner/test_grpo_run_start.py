"""How a run starts: resume by default, --resume insists, --fresh moves the old run aside; once for all ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from _dist import run_on_ranks

from megatron_grpo.runner.checkpoint_dir import CheckpointError, publish, step_dir_name
from megatron_grpo.runner.run_start import (
    RunDirectoryError,
    StartPlan,
    carry_out,
    check_writable,
    holds_a_run,
    plan_start,
)

NOW = 1_800_000_000.0  # 2027-01-15 08:00:00 UTC
STAMP = "20270115-080000"


def _old_run(run_dir: Path, checkpoint_dir: Path, steps: tuple[int, ...]) -> None:
    """A run directory with metrics and a published checkpoint for each of `steps`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    for step in steps:
        step_dir = checkpoint_dir / step_dir_name(step)
        step_dir.mkdir(parents=True)
        (step_dir / "__0_0.distcp").write_bytes(b"weights")
        publish(step_dir, world_size=2)


def test_without_a_flag_a_complete_checkpoint_is_resumed_and_named(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir, run_dir / "checkpoints", (2, 4))
    plan = plan_start(run_dir, run_dir / "checkpoints", "auto")
    assert plan.resume_from == run_dir / "checkpoints" / step_dir_name(4) and plan.move_aside == ()
    assert plan.notes == (f"resuming from step 4: {plan.resume_from}",)
    assert plan_start(run_dir, run_dir / "checkpoints", "resume") == plan


def test_without_a_flag_an_earlier_run_without_checkpoint_is_moved_aside_not_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir, run_dir / "checkpoints", ())
    plan = plan_start(run_dir, run_dir / "checkpoints", "auto")
    assert plan.resume_from is None and plan.move_aside == (run_dir,)
    assert carry_out(plan, NOW) == [f"moved the earlier run {run_dir} to {tmp_path / f'run.previous-{STAMP}'}"]
    assert (tmp_path / f"run.previous-{STAMP}" / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert not run_dir.exists()


def test_fresh_moves_the_run_and_an_outside_checkpoint_dir_aside_under_free_names(tmp_path):
    run_dir, checkpoint_dir = tmp_path / "run", tmp_path / "ckpt"
    _old_run(run_dir, checkpoint_dir, (2,))
    (tmp_path / f"run.previous-{STAMP}").mkdir()  # an earlier move in the same second
    plan = plan_start(run_dir, checkpoint_dir, "fresh")
    assert plan.resume_from is None and plan.move_aside == (run_dir, checkpoint_dir)
    carry_out(plan, NOW)
    assert (tmp_path / f"run.previous-{STAMP}-2" / "metrics.jsonl").is_file()
    assert (tmp_path / f"ckpt.previous-{STAMP}" / step_dir_name(2) / "COMPLETE").is_file()


def test_the_resolved_config_is_written_into_the_run_directory_fresh_has_just_moved_aside(tmp_path):
    from _configs import config_with

    from megatron_grpo.runner.config import RESOLVED_CONFIG, load_config, write_resolved_config

    run_dir = tmp_path / "run"
    _old_run(run_dir, run_dir / "checkpoints", (2,))
    carry_out(plan_start(run_dir, run_dir / "checkpoints", "fresh"), NOW)
    cfg = config_with({"run_dir": str(run_dir)})
    write_resolved_config(cfg, run_dir / RESOLVED_CONFIG)  # what rank 0 does next, as `train --fresh` does
    assert load_config(run_dir / RESOLVED_CONFIG) == cfg


def test_an_empty_run_directory_starts_from_scratch_with_nothing_to_move(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    plan = plan_start(tmp_path / "run", tmp_path / "run" / "checkpoints", "auto")
    assert plan.resume_from is None and plan.move_aside == () and plan.notes == ()


def test_a_run_directory_holding_only_a_planned_config_is_no_earlier_run(tmp_path):
    """`plan` writes the resolved config into an empty run directory; `train` rewrites it and moves nothing."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("seed: 1\n")
    assert plan_start(run_dir, run_dir / "checkpoints", "auto") == StartPlan(None, (), ())
    assert not holds_a_run(run_dir)
    (run_dir / "metrics.jsonl").write_text("")
    assert holds_a_run(run_dir) and plan_start(run_dir, run_dir / "checkpoints", "auto").move_aside == (run_dir,)


def test_resume_with_nothing_to_resume_is_an_error_naming_what_was_skipped(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir, run_dir / "checkpoints", (2,))
    (run_dir / "checkpoints" / step_dir_name(2) / "COMPLETE").write_text("garbage")
    with pytest.raises(CheckpointError, match=r"nothing to resume.*\n  skipped step_00000002: .*COMPLETE is not a"):
        plan_start(run_dir, run_dir / "checkpoints", "resume")


def test_an_unusable_directory_is_named_with_its_key_and_errno(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirectoryError, match=r"checkpoint\.dir: .*file/ckpt is not usable for this run: "
                                                r"\[Errno 20\] Not a directory"):
        check_writable({"run_dir": tmp_path / "run", "checkpoint.dir": tmp_path / "file" / "ckpt"})
    assert not list((tmp_path / "run").iterdir())  # the probe leaves nothing behind


def _start_fresh(rank: int, world_size: int, run_dir: Path):
    from megatron_grpo.runner.train_cli import agree_on_start

    plan = plan_start(run_dir, run_dir / "checkpoints", "fresh")
    return agree_on_start(plan, rank)


def test_fresh_on_two_ranks_moves_the_old_run_once_and_both_agree(tmp_path):
    run_dir = tmp_path / "run"
    _old_run(run_dir, run_dir / "checkpoints", (2,))
    plans = run_on_ranks(2, _start_fresh, run_dir)
    assert plans[0] == plans[1] and plans[0].move_aside == (run_dir,)
    moved = sorted(p.name for p in tmp_path.iterdir())
    assert len(moved) == 1 and moved[0].startswith("run.previous-"), moved
    assert (tmp_path / moved[0] / "checkpoints" / step_dir_name(2) / "COMPLETE").is_file()
