"""`megatron-grpo --nproc-per-node N train --config X.yaml`: the GRPO job, one rank per process under torchrun.

Everything that can be checked without peers is checked before any process group or model exists: the
config (a `ConfigError` naming each bad key), then the logprob plan and the runner's own limits, CUDA for
bf16 among them (one `ConfigError` listing the problems of both), then that the run and checkpoint directories
are writable, and what the run directory holds: a complete checkpoint is resumed (`--resume` insists on one),
and `--fresh` moves an earlier run aside (see `run_start`). Rank 0 then writes the resolved config, every key
of it, to `<run_dir>/config.yaml`. Afterwards a failed collective means a peer died or
hung; the survivor says so, names the rank(s) it lost contact with, and exits non-zero instead of hanging.

Expected failures print one message (a config error only on rank 0, as every rank finds the same one) and
exit with their own code; `--debug` adds the Python traceback. Ctrl-C (SIGINT, which torchrun forwards to every
rank) ends every rank at once; rank 0 says at which step, and which checkpoint a rerun resumes from. The
`megatron-grpo` launcher (`megatron_grpo.runner.launcher`) runs the same checks before it starts any rank and turns the
ranks' exit codes into one line; under a bare `torchrun`, torchrun adds its own failure report.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megatron_grpo.megatron.notices import megatron_summary, quiet_megatron_notices
from megatron_grpo.runner.checkpoint_dir import (
    AgreedCheckpointError,
    CheckpointError,
    describe_os_error,
    find_resumable,
    loadable_sentence,
)
from megatron_grpo.runner.config import RESOLVED_CONFIG, Config, ConfigError, load_config, write_resolved_config
from megatron_grpo.runner.helptext import DefaultsHelpFormatter
from megatron_grpo.runner.lifetime import bind_forked_children, die_with_parent, on_signal
from megatron_grpo.runner.plan_inputs import plan_for
from megatron_grpo.runner.reporting import MetricsFileError
from megatron_grpo.runner.run_start import (
    RunDirectoryError,
    StartMode,
    StartPlan,
    carry_out,
    check_writable,
    plan_start,
)
from megatron_grpo.runner.tasks import DigitTask, DigitTokenizer
from megatron_grpo.scheduler import LogprobPlan

EXIT_FAILED = 1  # an unexpected error: a bug, shown with its traceback
EXIT_CONFIG = 2  # a bad config, or launched without torchrun
EXIT_RUN_DIR = 3  # the run or checkpoint directory: unusable, nothing to resume, corrupt, or a failed save
EXIT_PEER_LOST = 4  # another rank died or hung, or torchrun stopped this rank because one did
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT): 128 + 2, as a shell reports a process that SIGINT ended
EXIT_BAD_INPUT = EXIT_CONFIG
LAUNCHER_VARIABLE = "MEGATRON_GRPO_LAUNCHER"  # "1" in the ranks `megatron-grpo` starts: it reports for them
DIST_CHECKPOINT_METADATA = "metadata.json"  # what megatron.core.dist_checkpointing.save writes into every checkpoint
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# gloo reports a dead or hung peer as a plain RuntimeError; these are its messages for it (NCCL raises DistError)
PEER_FAILURE_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Read error", "Timed out waiting")


class NotLaunchedError(RuntimeError):
    """The rank was started without the variables torchrun sets."""


class RunProgress:
    """Where the run is, for the one line rank 0 prints when Ctrl-C stops it."""

    def __init__(self) -> None:
        self.checkpoint_dir: Optional[Path] = None  # known once the config is read
        self.step: Optional[int] = None  # the step in progress (0-based), once training has begun
        self.progress_bar = False

    def started(self, step: int) -> None:
        self.step = step

    def interrupted_line(self) -> str:
        """`interrupted at step N; newest complete checkpoint <dir>/step_M; run the same command to resume`."""
        if self.checkpoint_dir is None:
            return "interrupted while starting; nothing was trained"
        where = "interrupted before the first step" if self.step is None else f"interrupted at step {self.step + 1}"
        newest = find_resumable(self.checkpoint_dir).step_dir
        then = (f"newest complete checkpoint {newest}; run the same command to resume" if newest is not None else
                f"no complete checkpoint in {self.checkpoint_dir} yet; the same command starts over")
        return ("\n" if self.progress_bar and self.step is not None else "") + f"{where}; {then}"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    launched = os.environ.get(LAUNCHER_VARIABLE) == "1"
    progress = RunProgress()
    on_signal(signal.SIGINT, lambda: progress.interrupted_line() if rank == 0 else None, EXIT_INTERRUPTED)
    quiet_megatron_notices(verbose=args.verbose, cuda_available=torch.cuda.is_available())
    try:
        _require_torchrun()
        cfg, plan, start = preflight(args, world_size=int(os.environ["WORLD_SIZE"]))
    except Exception as err:  # noqa: BLE001 - every expected failure of the checks; the rest is re-raised
        failure = start_failure(err, args.config)
        if failure is None:
            raise
        message, code, found_by_every_rank = failure
        show = not found_by_every_rank or (rank == 0 if code == EXIT_CONFIG else local_rank == 0)
        return _fail(message, code, args.debug, show=show)
    checkpoint_dir = Path(cfg.checkpoint.dir)
    progress.checkpoint_dir, progress.progress_bar = checkpoint_dir, cfg.logging.progress_bar

    _bind_process_lifetimes(rank, checkpoint_dir, quiet=launched)
    summary = megatron_summary(cuda_available=torch.cuda.is_available())
    if summary and rank == 0:
        print(summary, flush=True)
    from megatron_grpo.megatron import ModelCheckpointError, destroy_parallel, init_parallel
    from megatron_grpo.runner.loop import train  # imports megatron.core: only once the input is known to be good
    from megatron_grpo.runner.plugin_params import parallel_params

    layout = init_parallel(parallel_params(cfg))
    try:
        start = agree_on_start(start, layout.rank)
        if layout.rank == 0:  # the run's whole configuration, inherited and default values included
            write_resolved_config(cfg, Path(cfg.run_dir) / RESOLVED_CONFIG)
        train(cfg, plan, layout, resume_from=start.resume_from, on_step=progress.started)
    except ModelCheckpointError as err:  # every rank finds the same one: rank 0 says it
        return _fail(f"error: policy.initial_checkpoint: {err}", EXIT_CONFIG, args.debug, show=layout.rank == 0)
    except (CheckpointError, MetricsFileError, OSError) as err:
        if isinstance(err, AgreedCheckpointError):  # every rank has it: rank 0 says it
            return _fail(f"error: {err}", EXIT_RUN_DIR, args.debug, show=layout.rank == 0)
        message = str(err) if str(err).startswith("rank ") else f"rank {layout.rank}: {err}"
        return _fail(f"error: {message}", EXIT_RUN_DIR, args.debug)
    except BaseException as err:  # a peer's failure surfaces as many types (torch's CheckpointException is no
        if isinstance(err, (KeyboardInterrupt, SystemExit)) or not is_peer_failure(err):  # Exception); else re-raise
            raise
        return _fail(_lost_peer_message(layout.rank, layout.world_size, err, checkpoint_dir), EXIT_PEER_LOST,
                     args.debug)
    destroy_parallel()
    return 0


def preflight(args: argparse.Namespace, *, world_size: Optional[int]) -> tuple[Config, LogprobPlan, StartPlan]:
    """Everything checked before any rank joins a process group (by every rank, and by the launcher before it
    starts them): the config and its plan for `world_size` ranks (None: not known yet), then what the run
    directory holds, read-only (so a `--resume` that finds nothing creates nothing), then that the run and
    checkpoint directories can be created and written. Raises what `start_failure` describes."""
    cfg = load_config(args.config)
    plan = checked_plan(cfg, world_size=world_size, cuda_available=torch.cuda.is_available())
    run_dir, checkpoint_dir = Path(cfg.run_dir), Path(cfg.checkpoint.dir)
    start = plan_start(run_dir, checkpoint_dir, _start_mode(args))
    check_writable({"run_dir": run_dir, "checkpoint.dir": checkpoint_dir})
    return cfg, plan, start


def start_failure(err: BaseException, config_path: str) -> Optional[tuple[str, int, bool]]:
    """The message, exit code and whether every rank finds it alike, for an error `preflight` (or the torchrun
    check) raises; None for anything else (a bug)."""
    if isinstance(err, ConfigError):
        return config_error_message(config_path, err), EXIT_CONFIG, True
    if isinstance(err, NotLaunchedError):
        return f"error: {err}", EXIT_CONFIG, False
    if isinstance(err, (CheckpointError, RunDirectoryError, MetricsFileError)):  # the same on every rank of a node
        return f"error: {err}", EXIT_RUN_DIR, True
    if isinstance(err, OSError):  # reading the run directory
        return f"error: {describe_os_error(err)}", EXIT_RUN_DIR, False
    return None


def config_error_message(config_path: str, err: ConfigError) -> str:
    """One line for one problem (`error: X.yaml: key: what is wrong`); a header and one line each for several.
    A problem that names the file already (a key given twice, an unreadable file) is not prefixed twice."""
    prefix = f"{config_path}: "
    problems = [problem[len(prefix):] if problem.startswith(prefix) else problem for problem in err.problems]
    if len(problems) == 1:
        return f"error: {prefix}{problems[0]}"
    return f"error: {prefix}{ConfigError(problems)}"


def agree_on_start(local: StartPlan, rank: int) -> StartPlan:
    """Rank 0's start plan, on every rank, after rank 0 has moved the earlier run aside (once for all ranks).

    Every rank read the run directory before `init_process_group`, whose rendezvous needs all ranks: so rank 0
    moves nothing until every rank has finished reading it."""
    plans = [local]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(plans, src=0)
    plan = plans[0]
    if rank == 0:
        for line in [*plan.notes, *carry_out(plan)]:
            print(line, flush=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return plan


def checked_plan(cfg: Config, *, world_size: Optional[int], cuda_available: bool) -> LogprobPlan:
    """The logprob plan of `cfg`, once the plan's and the runner's checks both pass; else one ConfigError with
    every problem of both."""
    problems = []
    plan = None
    try:
        plan = plan_for(cfg)
    except ConfigError as err:
        problems.extend(err.problems)
    problems.extend(runner_config_problems(cfg, world_size=world_size, cuda_available=cuda_available))
    if problems:
        raise ConfigError(problems)
    return plan


def runner_config_problems(cfg: Config, *, world_size: Optional[int], cuda_available: bool) -> list[str]:
    """Settings the config accepts in general but this runner cannot run on `world_size` ranks (None: not known
    yet, as for an elastic number of nodes) with or without CUDA, each naming its key."""
    problems = []
    if cfg.policy.precision != "fp32" and not cuda_available:
        problems.append(f"policy.precision: {cfg.policy.precision} needs CUDA, which is not available here; "
                        "use fp32 on the CPU")
    model_parallel = (cfg.policy.tensor_model_parallel_size * cfg.policy.pipeline_model_parallel_size
                      * cfg.policy.context_parallel_size)
    if world_size is None:
        pass
    elif world_size % model_parallel:
        sizes = "tensor × pipeline" + (" × context" if cfg.policy.context_parallel_size > 1 else "")
        problems.append(f"policy.tensor_model_parallel_size: {world_size} ranks do not split into groups of "
                        f"{sizes} parallel size {model_parallel} (launch a multiple of {model_parallel} ranks: "
                        "--nproc-per-node N, or N per node)")
    elif cfg.grpo.num_prompts_per_step % (world_size // model_parallel):
        problems.append(f"grpo.num_prompts_per_step ({cfg.grpo.num_prompts_per_step}) must be a multiple of the "
                        f"data-parallel size ({world_size // model_parallel}): each DP rank samples whole groups")
    expert_parallel = cfg.policy.expert_model_parallel_size
    if world_size is not None and not world_size % model_parallel and (world_size // model_parallel) % expert_parallel:
        problems.append(f"policy.expert_model_parallel_size: {expert_parallel} must divide the data-parallel size "
                        f"({world_size // model_parallel} of {world_size} ranks): the experts are split over ranks "
                        "that hold different data")
    if cfg.policy.model.moe_token_dispatcher_type == "flex" and not cuda_available:
        problems.append("policy.model.moe_token_dispatcher_type: flex (DeepEP / HybridEP) needs CUDA, which is not "
                        "available here; use allgather or alltoall")
    initial = cfg.policy.initial_checkpoint
    if initial is not None and not (Path(initial) / DIST_CHECKPOINT_METADATA).is_file():
        what = "has no metadata.json" if Path(initial).is_dir() else "is not a directory"
        problems.append(f"policy.initial_checkpoint: {initial} {what}: it must be a Megatron-Core dist_checkpointing "
                        "checkpoint of the model (dist_checkpointing.save(model.sharded_state_dict(), directory))")
    if cfg.grpo.num_generations_per_prompt < 2:
        problems.append("grpo.num_generations_per_prompt: a group-relative baseline needs >= 2 samples per "
                        f"prompt, got {cfg.grpo.num_generations_per_prompt}")
    task = DigitTask(cfg.task.name, cfg.task.num_digits, DigitTokenizer(), min_digits=cfg.task.min_digits)
    longest = task.prompt_length + cfg.generation.max_new_tokens
    sequence = (f"a prompt ({task.prompt_length} tokens) plus generation.max_new_tokens "
                f"({cfg.generation.max_new_tokens})")
    multiple = 2 * cfg.policy.context_parallel_size
    if multiple > 2 and longest % multiple:  # context parallelism cuts each sequence into 2·CP equal chunks
        sequence += f" padded to a multiple of 2 × policy.context_parallel_size ({multiple})"
        longest += -longest % multiple
    if cfg.policy.model.max_position_embeddings < longest:
        problems.append(f"policy.model.max_position_embeddings: {sequence} needs {longest}, got "
                        f"{cfg.policy.model.max_position_embeddings}")
    packing = cfg.policy.sequence_packing
    if packing.enabled:
        for name in ("train_mb_tokens", "logprob_mb_tokens"):
            budget = getattr(packing, name)
            if budget is not None and 0 < budget < longest:
                problems.append(f"policy.sequence_packing.{name}: a microbatch must hold the longest sequence, "
                                f"{sequence}: {longest} tokens, got {budget}")
    return problems


def is_peer_failure(err: BaseException) -> bool:
    """Whether a collective failed because another rank died or stopped answering."""
    return isinstance(err, dist.DistError) or any(message in str(err) for message in PEER_FAILURE_MESSAGES)


SILENT_RANK_EXIT_DELAY_S = 5.0  # how long a rank that leaves a config error to rank 0 waits before exiting


def _fail(message: str, code: int, debug: bool, *, show: bool = True) -> int:
    """Prints `message` (and with `debug` the traceback being handled) and returns the exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # said once: torchrun's SIGTERM needs no second sentence
    if show or debug:
        if debug:
            traceback.print_exc()
        print(message, file=sys.stderr, flush=True)
    elif code == EXIT_CONFIG and "TORCHELASTIC_RUN_ID" in os.environ:
        # Every rank found this config error; rank 0 says it. Torchrun stops every rank once one exits: a silent rank
        # that exits first could stop the one that reports before it has (on a loaded machine), so it leaves the
        # reporting rank time to.
        time.sleep(SILENT_RANK_EXIT_DELAY_S)
    return code


def _start_mode(args: argparse.Namespace) -> StartMode:
    return "resume" if args.resume else "fresh" if args.fresh else "auto"


def _bind_process_lifetimes(rank: int, checkpoint_dir: Path, *, quiet: bool) -> None:
    """This rank dies with its torchrun agent, its children with it; torchrun's SIGTERM gets a sentence (none
    under the `megatron-grpo` launcher, which reports the rank that failed itself).

    Bound to its parent only under torchrun's agent (which sets TORCHELASTIC_RUN_ID): a rank started by hand
    (`nohup`, the environment variables set by another launcher) must not die with the shell."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()
    bind_forked_children()
    on_signal(signal.SIGTERM, lambda: None if quiet else (
        f"error: rank {rank}: stopped by torchrun (SIGTERM), which stops every rank once one has failed or the job "
        f"is interrupted; torchrun's report names the rank that failed. "
        f"{_capitalised(loadable_sentence(checkpoint_dir))}."), EXIT_PEER_LOST)


def _require_torchrun() -> None:
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise NotLaunchedError(f"{', '.join(missing)} not set: launch with `megatron-grpo --nproc-per-node N train "
                               "--config X.yaml` (or `torchrun --nproc-per-node N -m megatron_grpo train --config "
                               "X.yaml`)")


def _lost_peer_message(rank: int, world_size: int, err: BaseException, checkpoint_dir: Path) -> str:
    peers = [r for r in range(world_size) if r != rank]
    who = f"rank {peers[0]}" if len(peers) == 1 else f"one of ranks {', '.join(map(str, peers))}"
    return (f"error: rank {rank}: lost contact with {who}: a collective failed because that rank died, or hung for "
            f"longer than distributed.timeout_seconds. {_capitalised(loadable_sentence(checkpoint_dir))}.\n"
            f"  cause: {type(err).__name__}: {_first_line(err)}")


def _capitalised(sentence: str) -> str:
    return sentence[:1].upper() + sentence[1:]


def _first_line(err: BaseException) -> str:
    """The first sentence of the error's first line, without a C++ source location (gloo's `[.../pair.cc:537]`)
    and unprintable characters."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", lines[0]) if lines else ""
    line = "".join(char for char in line if char.isprintable())
    sentence, _, rest = line.partition(". ")
    return sentence + "." if rest else line


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megatron-grpo [torchrun options] train", description=__doc__.splitlines()[0],
        formatter_class=DefaultsHelpFormatter,
        epilog="Launch: `megatron-grpo --nproc-per-node 2 train --config configs/grpo_tiny_cpu.yaml`; torchrun's own "
               "options (--nnodes, --rdzv-endpoint, ...) go before `train`. Exit codes: 0 done, 1 a bug (traceback "
               "shown), 2 bad config or arguments, 3 run or checkpoint directory, 4 a rank died or hung, "
               "130 interrupted (Ctrl-C).")
    parser.add_argument("--config", required=True, metavar="FILE",
                        help="the run's YAML config, e.g. configs/grpo_tiny_cpu.yaml (required)")
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true",
                       help="resume from the newest complete checkpoint in checkpoint.dir, and fail if there is none "
                            "(default: off; without --resume or --fresh a run resumes when there is a checkpoint, "
                            "and starts from scratch when there is none)")
    start.add_argument("--fresh", action="store_true",
                       help="start over: move the earlier run to <run_dir>.previous-<timestamp>, deleting nothing")
    parser.add_argument("--debug", action="store_true", help="print the Python traceback of an error as well")
    parser.add_argument("--verbose", action="store_true",
                        help="show every warning and torchrun's own log lines, including Megatron-Core's notices "
                             "that are filtered by default")
    return parser.parse_args(argv)
