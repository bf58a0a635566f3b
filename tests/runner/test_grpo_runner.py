"""The GRPO runner end to end under torchrun (TP=2 over gloo): metrics, plan, resume, faults (PP=2 among them).

One 6-step run of the tiny config is the reference the other runs are compared with. Every run is a few steps
long, so the whole file stays around two minutes on 2 CPU cores.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from _tolerances import MODEL_LOGPROB_ATOL
from grpo_workers.launch import (
    REPO,
    job_processes,
    launcher_command,
    rank_process,
    run,
    start,
    stop_job,
    torchrun_command,
    wait_for_lines,
    write_config,
)

from megatron_grpo.runner import train_cli
from megatron_grpo.runner.checkpoint_dir import latest_checkpoint, saved_world_size, step_dir_name
from megatron_grpo.runner.config import load_config
from megatron_grpo.runner.reporting import METRICS_FILE, PLOT_FILE, read_metrics, without_timings
from megatron_grpo.runner.tensorboard_log import demo_record

STEPS = 6
pytestmark = pytest.mark.slow  # torchrun jobs, end to end


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run: 6 steps at TP=2, a checkpoint every 2 steps."""
    directory = tmp_path_factory.mktemp("reference")
    config = write_config(directory, **{"grpo.max_num_steps": STEPS, "checkpoint.every_n_steps": 2})
    code, output = run(torchrun_command(config, nproc=2), directory / "log.txt")
    assert code == 0, output
    return directory, output


def test_a_run_writes_finite_metrics_that_follow_the_plan(reference_run):
    directory, output = reference_run
    records = read_metrics(directory / "run")
    assert [r["step"] for r in records] == list(range(STEPS))
    # `tensorboard_log --measure` times records of the demo's shape: the scalars this run of its config writes
    assert {key: type(value) for key, value in demo_record(0).items()} == {
        key: type(value) for key, value in records[0].items()}
    for record in records:
        assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]) and record["grad_norm"] > 0
        assert 0.0 <= record["reward_mean"] <= 1.0
        # the tiny config is on-policy without KL: the plan skips both passes, and prev is backfilled from curr
        assert not record["reference_pass_ran"] and not record["prev_pass_ran"]
        assert record["reference_passes_skipped"] == record["prev_passes_skipped"] == record["step"] + 1
        assert record["probs_ratio"] == pytest.approx(1.0, abs=1e-6)  # exact 1s, token-averaged: a few u
        assert record["clip_fraction_lower"] == record["clip_fraction_upper"] == 0.0
        # the rollout's generation logprobs agree with the training forward's: same weights, same distribution, two
        # fp32 forwards batched differently, each within MODEL_LOGPROB_ATOL of the float64 values
        assert 1.0 <= record["token_mult_prob_error"] < 1.0 + 1e-4
        assert abs(record["gen_kl_error"]) <= 2 * MODEL_LOGPROB_ATOL
    assert "reference logprob passes skipped  6 of 6" in output
    assert "prev logprob passes skipped       6 of 6" in output
    assert (directory / "run" / PLOT_FILE).stat().st_size > 1000
    assert latest_checkpoint(directory / "run" / "checkpoints").name == step_dir_name(STEPS)
    # the resolved config, every key of it, written by rank 0 into the run directory
    assert load_config(directory / "run" / "config.yaml") == load_config(directory / "config.yaml")


def test_training_logprobs_use_the_sampling_temperature_and_filter(tmp_path):
    """At temperature 0.7 with top_k 6 and top_p 0.9, the trained policy is softmax(logits / 0.7) over the
    tokens that top-k then top-p keep: the filtered distribution the rollouts sampled from."""
    config = write_config(tmp_path, **{"grpo.max_num_steps": 2, "checkpoint.every_n_steps": 0,
                                       "generation.temperature": 0.7, "generation.top_k": 6,
                                       "generation.top_p": 0.9})
    code, output = run(torchrun_command(config, nproc=2), tmp_path / "log.txt")
    assert code == 0, output
    for record in read_metrics(tmp_path / "run"):
        assert 1.0 <= record["token_mult_prob_error"] < 1.0 + 1e-4  # as above
        assert abs(record["gen_kl_error"]) <= 2 * MODEL_LOGPROB_ATOL


def _megatron_forks_checkpoint_writers() -> bool:
    """Megatron-Core 0.16's checkpoint writer forks helper processes during a save; later versions use threads."""
    from megatron.core.package_info import __version__ as megatron_version

    return tuple(int(part) for part in megatron_version.split(".")[:2]) < (0, 17)


def _wait_for_a_save(process: psutil.Process, run_dir: Path, *, forks_writers: bool, before_step: int,
                     timeout: float = 60) -> None:
    """Waits until rank `process` is inside a checkpoint save. With a writer that forks, wait for a helper
    process, so that killing the rank shows they die with it. A writer of threads saves within a few
    milliseconds per step: poll for a step directory whose save has begun and is not yet published, but return
    by the time the metrics reach `before_step` lines either way (the rerun must resume before the reference
    run ends)."""
    checkpoints, metrics = run_dir / "checkpoints", run_dir / METRICS_FILE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if forks_writers:
            if process.children():
                return
            time.sleep(0.005)
        elif any(not (step / "COMPLETE").exists() for step in checkpoints.glob("step_*")) or \
                len(metrics.read_text().splitlines()) >= before_step:
            return
    raise TimeoutError(f"rank process {process.pid} was not seen saving a checkpoint within {timeout} s")


def _survivors(job, timeout: float = 10) -> list[str]:
    """The job's processes still alive `timeout` s after it ended (none should be)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for process in job_processes(job):
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    megabytes = process.memory_info().rss >> 20
                    alive.append(f"{process.pid} {' '.join(process.cmdline()[:6])} ({megabytes} MB)")
            except psutil.Error:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def test_a_rank_killed_mid_save_takes_its_writers_along_and_the_job_resumes_by_itself(reference_run, tmp_path):
    """Kill rank 1 while it saves: the `megatron-grpo` job exits within 60 s with exit code 4 and a line naming
    rank 1, leaves no process behind, and a plain rerun resumes from the last complete checkpoint (skipping a
    damaged newer one, dropping a torn metrics line), repeating the uninterrupted run's metrics exactly (fp32 on
    the CPU)."""
    reference_dir, _ = reference_run
    config = write_config(tmp_path, "long.yaml", **{"grpo.max_num_steps": 500, "checkpoint.every_n_steps": 1})
    forks_writers = _megatron_forks_checkpoint_writers()
    job = start(launcher_command(config, nproc=2), tmp_path / "killed.txt")
    try:
        wait_for_lines(tmp_path / "run" / METRICS_FILE, 3, job)
        victim = rank_process(job, 1)
        _wait_for_a_save(victim, tmp_path / "run", forks_writers=forks_writers, before_step=STEPS - 1)
        victim.kill()
        killed_at = time.monotonic()
        code = job.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
        survivors = _survivors(job)
    finally:
        stop_job(job)
    output = (tmp_path / "killed.txt").read_text()
    assert code == train_cli.EXIT_PEER_LOST and elapsed < 60, output
    assert not survivors, f"processes of the killed job still alive: {survivors}"
    checkpoints = tmp_path / "run" / "checkpoints"
    step_dir = latest_checkpoint(checkpoints)
    assert (f"error: rank 1 died (SIGKILL); the other ranks were stopped. {step_dir} is the newest complete "
            "checkpoint, and rerunning the same command resumes from it.") in output, output
    assert "stopped by torchrun" not in output and "Traceback" not in output, output
    assert saved_world_size(step_dir) == 2

    damaged = checkpoints / step_dir_name(90)
    shutil.copytree(step_dir, damaged)
    (damaged / "COMPLETE").write_text("")
    with open(tmp_path / "run" / METRICS_FILE, "a") as metrics:
        metrics.write('{"step": 3, "reward_me')
    config = write_config(tmp_path, "resume.yaml", **{"grpo.max_num_steps": STEPS, "checkpoint.every_n_steps": 2})
    code, output = run(torchrun_command(config, nproc=2), tmp_path / "resumed.txt")
    assert code == 0, output
    assert f"skipped {damaged.name}: {damaged / 'COMPLETE'} is empty" in output, output
    assert f"resuming from step {int(step_dir.name[5:])}: {step_dir}" in output, output
    assert "dropped the torn last line" in output, output
    resumed = [without_timings(r) for r in read_metrics(tmp_path / "run")]
    uninterrupted = [without_timings(r) for r in read_metrics(reference_dir / "run")]
    assert resumed == uninterrupted


def test_ctrl_c_ends_the_job_within_10_s_in_one_line_and_the_same_command_resumes_exactly(reference_run, tmp_path):
    """SIGINT to the process group of `megatron-grpo` (what Ctrl-C sends): exit code 130 within 10 s, at most 10
    lines of output, one of them saying at which step and from which checkpoint the same command resumes; no
    process left; the rerun repeats the uninterrupted run's metrics exactly."""
    reference_dir, _ = reference_run
    config = write_config(tmp_path, **{"grpo.max_num_steps": 500, "checkpoint.every_n_steps": 2})
    job = start(launcher_command(config, nproc=2), tmp_path / "interrupted.txt")
    try:
        wait_for_lines(tmp_path / "run" / METRICS_FILE, 3, job)
        os.killpg(job.pid, signal.SIGINT)
        interrupted_at = time.monotonic()
        code = job.wait(timeout=30)
        elapsed = time.monotonic() - interrupted_at
        survivors = _survivors(job)
    finally:
        stop_job(job)
    output = (tmp_path / "interrupted.txt").read_text()
    assert code == train_cli.EXIT_INTERRUPTED and elapsed < 10, (elapsed, output)
    assert not survivors, f"processes of the interrupted job still alive: {survivors}"
    assert len(output.splitlines()) <= 10, output
    (line,) = [line for line in output.splitlines() if line.startswith("interrupted")]
    step_dir = latest_checkpoint(tmp_path / "run" / "checkpoints")
    match = re.fullmatch(r"interrupted at step (\d+); newest complete checkpoint (\S+); run the same command to resume",
                         line)
    assert match and match.group(2) == str(step_dir), output
    assert int(match.group(1)) > int(step_dir.name[len("step_"):]), output

    config = write_config(tmp_path, **{"grpo.max_num_steps": STEPS, "checkpoint.every_n_steps": 2})
    code, output = run(launcher_command(config, nproc=2), tmp_path / "resumed.txt")
    assert code == 0, output
    assert f"resuming from step {int(step_dir.name[len('step_'):])}: {step_dir}" in output, output
    resumed = [without_timings(r) for r in read_metrics(tmp_path / "run")]
    assert resumed == [without_timings(r) for r in read_metrics(reference_dir / "run")]


def test_a_hung_rank_fails_the_survivor_within_the_configured_timeout(tmp_path):
    timeout_s = 8
    config = write_config(tmp_path, **{"grpo.max_num_steps": 500, "checkpoint.every_n_steps": 0,
                                       "distributed.timeout_seconds": timeout_s})
    job = start(torchrun_command(config, nproc=2), tmp_path / "log.txt")
    try:
        wait_for_lines(tmp_path / "run" / METRICS_FILE, 2, job)
        survivor, hung = rank_process(job, 0), rank_process(job, 1)
        hung.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        survivor_code = survivor.wait(timeout=timeout_s + 30)
        elapsed = time.monotonic() - stopped_at
        hung.kill()
        job.wait(timeout=60)
    except (psutil.TimeoutExpired, subprocess.TimeoutExpired) as still_running:
        raise AssertionError(f"the survivor was still running; log:\n{(tmp_path / 'log.txt').read_text()}") \
            from still_running
    finally:
        stop_job(job)
    output = (tmp_path / "log.txt").read_text()
    assert survivor_code != 0 and job.returncode != 0, output
    # the survivor finishes the computation it is in before it waits (its clock starts at that collective), then
    # reports and tears down: a few seconds on a quiet machine, up to some 10 more under a loaded test run
    assert elapsed < timeout_s + 15, f"survivor exited {elapsed:.1f} s after the hang\n{output}"
    assert "rank 0: lost contact with rank 1" in output, output


def test_a_killed_last_pipeline_stage_ends_the_job_naming_the_rank(tmp_path):
    """Under PP = 2, SIGKILL the last stage mid-run: the first stage, waiting on it in the pipeline schedule or
    the sampling broadcast, ends within the timeout; the output names rank 1."""
    timeout_s = 10
    config = write_config(tmp_path, **{"policy.tensor_model_parallel_size": 1, "policy.pipeline_model_parallel_size": 2,
                                       "grpo.max_num_steps": 500, "checkpoint.every_n_steps": 0,
                                       "distributed.timeout_seconds": timeout_s})
    job = start(torchrun_command(config, nproc=2), tmp_path / "log.txt")
    try:
        wait_for_lines(tmp_path / "run" / METRICS_FILE, 2, job)
        rank_process(job, 1).kill()
        killed_at = time.monotonic()
        code = job.wait(timeout=timeout_s + 50)
        elapsed = time.monotonic() - killed_at
    finally:
        stop_job(job)
    output = (tmp_path / "log.txt").read_text()
    assert code != 0 and elapsed < timeout_s + 50, output
    named_by_rank_0 = "rank 0: lost contact with rank 1" in output
    # torchrun's failure report: "rank      : 1 (local_rank: 1)" (its padding is torch's to choose)
    named_by_torchrun = ("rank 0: stopped by torchrun (SIGTERM)" in output
                         and re.search(r"^\s*rank\s*: 1 \(local_rank: 1\)", output, flags=re.M) is not None)
    assert named_by_rank_0 or named_by_torchrun, output


def test_a_shard_with_flipped_bytes_is_an_error_naming_the_file_and_fresh_moves_the_run_aside(reference_run, tmp_path):
    reference_dir, _ = reference_run
    shutil.copytree(reference_dir / "run", tmp_path / "run")
    step_dir = latest_checkpoint(tmp_path / "run" / "checkpoints")
    shard = sorted(step_dir.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    metrics_before = (tmp_path / "run" / METRICS_FILE).read_text()
    config = write_config(tmp_path, **{"grpo.max_num_steps": STEPS + 2})
    code, output = run(torchrun_command(config, nproc=2, resume=True), tmp_path / "log.txt")
    assert code != 0
    assert f"checkpoint.verify_checksums: {shard} does not match its checksum" in output, output
    assert output.count("does not match its checksum") == 1, output  # every rank agrees; rank 0 says it
    assert (tmp_path / "run" / METRICS_FILE).read_text() == metrics_before

    config = write_config(tmp_path, **{"grpo.max_num_steps": 1, "checkpoint.every_n_steps": 0})
    code, output = run(torchrun_command(config, nproc=2, extra=("--fresh",)), tmp_path / "fresh.txt")
    assert code == 0, output
    (previous,) = tmp_path.glob("run.previous-*")  # moved once, by one rank, nothing deleted
    assert f"moved the earlier run {tmp_path / 'run'} to {previous}" in output, output
    assert (previous / METRICS_FILE).read_text() == metrics_before
    assert (previous / "checkpoints" / step_dir.name / shard.name).read_bytes() == bytes(data)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [0]


def test_a_config_error_is_printed_once_with_its_own_exit_code_and_a_traceback_only_with_debug(tmp_path):
    config = write_config(tmp_path, **{"grpo.num_prompts_per_step": 0})
    code, output = run(torchrun_command(config, nproc=2), tmp_path / "log.txt")
    assert code != 0
    assert output.count("grpo.num_prompts_per_step: must be > 0") == 1, output
    assert f"exitcode  : {train_cli.EXIT_CONFIG} " in output, output  # torchrun's report of the ranks
    assert f'File "{REPO / "megatron_grpo"}' not in output, output  # no traceback of ours
    code, output = run(torchrun_command(config, nproc=2, extra=("--debug",)), tmp_path / "debug.txt")
    assert code != 0 and f'File "{REPO / "megatron_grpo" / "runner" / "config.py"}' in output, output
