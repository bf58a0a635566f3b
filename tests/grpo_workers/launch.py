"""Launch helpers for the runner's end-to-end tests: tiny configs in a temp dir, torchrun jobs, their ranks.

Jobs run `python -m torch.distributed.run` (torchrun) or `python -m megatron_grpo` (the `megatron-grpo` launcher, which
runs torchrun's agent itself) with the repo on PYTHONPATH and one thread per rank,
in their own session (`setsid`), so a test can signal a single rank or tear down the whole job. Every process
of a job, however deep and wherever re-parented, carries the job's `JOB_TOKEN_VARIABLE` in its environment:
`job_processes` finds them all (torchrun puts each rank in a session of its own).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import psutil
import yaml
from _configs import set_key

from megatron_grpo.runner.config_files import read_yaml_with_defaults

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "grpo_tiny_cpu.yaml"
JOB_TOKEN_VARIABLE = "MEGATRON_GRPO_TEST_JOB"


def write_config(directory: Path, name: str = "config.yaml", base: Path = TINY_CONFIG, **overrides: Any) -> Path:
    """The tiny config (or another shipped one, `base`) with run and checkpoint dirs under `directory` and
    dotted-key overrides applied."""
    data, _files = read_yaml_with_defaults(base)  # a shipped config's `defaults:` merged in
    data["run_dir"] = str(directory / "run")
    data["checkpoint"]["dir"] = str(directory / "run" / "checkpoints")
    data["logging"]["progress_bar"] = False
    for dotted, value in overrides.items():
        data = set_key(data, dotted, value)
    path = directory / name
    path.write_text(yaml.safe_dump(data))
    return path


def torchrun_command(config: Path, *, nproc: int, resume: bool = False, rdzv: Optional[str] = None,
                     nnodes: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if rdzv is None:
        command += ["--standalone"]
    else:
        command += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", "--rdzv-id=grpo-test"]
    command += ["-m", "megatron_grpo", "train", "--config", str(config)]
    return command + (["--resume"] if resume else []) + list(extra)


def launcher_command(config: Path, *, nproc: int, extra: tuple[str, ...] = ()) -> list[str]:
    """`megatron-grpo --nproc-per-node N train --config X.yaml`, as `python -m megatron_grpo`."""
    return [sys.executable, "-m", "megatron_grpo", f"--nproc-per-node={nproc}", "train", "--config", str(config),
            *extra]


def job_env(token: str = "") -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env[JOB_TOKEN_VARIABLE] = token
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def start(command: list[str], log: Path, *, cwd: Path = REPO, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Starts a job in its own session, stdout and stderr going to `log` (`env`: `job_env()`'s, changed)."""
    token = uuid.uuid4().hex
    environment = job_env(token) if env is None else {**env, JOB_TOKEN_VARIABLE: token}
    with open(log, "w") as handle:
        job = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=environment, cwd=cwd,
                               start_new_session=True)
    job.token = token
    return job


def run(command: list[str], log: Path, timeout: float = 240, *, cwd: Path = REPO,
        env: Optional[dict[str, str]] = None) -> tuple[int, str]:
    """Runs a job to completion; returns its exit code and output."""
    job = start(command, log, cwd=cwd, env=env)
    try:
        code = job.wait(timeout=timeout)
    finally:
        stop_job(job)
    return code, log.read_text()


def stop_job(job: subprocess.Popen) -> None:
    """Kills whatever is left of a job's session (the agent and its ranks)."""
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    for process in _session_processes(job.pid) + job_processes(job):
        try:
            process.kill()
        except psutil.Error:
            continue


def job_processes(job: subprocess.Popen) -> list[psutil.Process]:
    """Every live process started by `job` (at any depth, re-parented or not), found by its token."""
    token = getattr(job, "token", None)
    if not token:
        return []
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(JOB_TOKEN_VARIABLE) == token:
                found.append(process)
        except psutil.Error:
            continue
    return found


def rank_process(job: subprocess.Popen, rank: int, timeout: float = 60) -> psutil.Process:
    """The worker process of global `rank` in `job`, found by the RANK torchrun gives it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in psutil.Process(job.pid).children(recursive=True):
            try:
                if process.environ().get("RANK") == str(rank):
                    return process
            except psutil.Error:
                continue
        time.sleep(0.2)
    raise TimeoutError(f"rank {rank} of job {job.pid} did not appear within {timeout} s")


def wait_for_lines(path: Path, count: int, job: subprocess.Popen, timeout: float = 120) -> None:
    """Waits until `path` has `count` lines (the job is still running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        if job.poll() is not None:
            raise AssertionError(f"the job exited ({job.returncode}) before {path} had {count} lines")
        time.sleep(0.2)
    raise TimeoutError(f"{path} did not reach {count} lines within {timeout} s")


def _session_processes(session_id: int) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session_id:
                found.append(process)
        except (OSError, psutil.Error):
            continue
    return found
