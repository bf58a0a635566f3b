"""`megatron-grpo [torchrun options] train ...`: torchrun for this package, with one line per failure.

`megatron-grpo --nproc-per-node 2 train --config X.yaml` is `torchrun --nproc-per-node 2 -m megatron_grpo train
--config X.yaml`: the same options and defaults, parsed by torchrun's own parser, and the ranks run by torchrun's
own elastic agent, inside this process. What it adds:
- `train`'s config, plan and run directory are checked here (`train_cli.preflight`) before any rank starts: a bad
  config ends the job with its `error:` line and exit code 2, an unusable run or checkpoint directory with 3.
- When ranks fail, their exit codes become the job's (0 done, 1 a bug whose traceback a rank printed, 2 config,
  3 run or checkpoint directory, 4 a rank died or lost contact, 130 Ctrl-C), and a rank that died from a signal
  is named in one line. torchrun itself raises `ChildFailedError` instead: a 40-line traceback and exit code 1,
  whatever the ranks said.
- torchrun's own log lines (the OMP_NUM_THREADS banner, the agent's notes on stopping ranks) are hidden, unless
  `train --verbose` is given or LOGLEVEL is set.
- Ctrl-C: torchrun's agent forwards SIGINT to every rank; rank 0 says at which step the run stopped and which
  checkpoint the same command resumes from, and nothing else is printed.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

# The commands this launcher starts under torchrun; any other runs in one process (`megatron-grpo plan ...`).
LAUNCHED = (("train",), ("bench", "scheduler"), ("bench", "packing"), ("bench", "step"), ("bench", "replay"))
# torchrun's options that choose another program than `-m megatron_grpo`
FOREIGN_PROGRAM_OPTIONS = ("module", "no_python", "run_path")
# torchrun's modules that log through loggers of their own, some imported only when a job starts
TORCHRUN_LOGGING_MODULES = (
    "torch.distributed.run",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
)


def main(argv: list[str]) -> int:
    """Parses `[torchrun options] COMMAND ARGS`, checks a `train` job, runs it under torchrun's agent; returns
    the job's exit code."""
    import importlib

    from torch.distributed.run import get_args_parser

    from megatron_grpo.runner import train_cli

    parser = get_args_parser()
    parser.prog = "megatron-grpo"
    args = parser.parse_args(argv)
    command, command_args = args.training_script, list(args.training_script_args)
    foreign = [name for name in FOREIGN_PROGRAM_OPTIONS if getattr(args, name, False)]
    if foreign or not any([command, *command_args][:len(launched)] == list(launched) for launched in LAUNCHED):
        what = f"--{foreign[0].replace('_', '-')}" if foreign else f"`{command}`"
        print(f"error: megatron-grpo launches `train`, `bench scheduler`, `bench packing`, `bench step` and "
              f"`bench replay` under torchrun, not {what}; run other commands without torchrun options "
              "(`megatron-grpo plan ...`), and other programs with torchrun",
              file=sys.stderr)
        return train_cli.EXIT_CONFIG

    checkpoint_dir, verbose, debug = None, "LOGLEVEL" in os.environ, False
    if command == "train":
        train_args = train_cli.parse_args(command_args)  # a bad argument exits here, with argparse's message
        verbose, debug = verbose or train_args.verbose, train_args.debug
        try:
            cfg, _plan, _start = train_cli.preflight(train_args, world_size=_world_size(args))
        except Exception as err:  # noqa: BLE001 - the expected failures of the checks; anything else is a bug
            failure = train_cli.start_failure(err, train_args.config)
            if failure is None:
                raise
            message, code, _every_rank = failure
            if debug:
                traceback.print_exc()
            print(message, file=sys.stderr, flush=True)
            return code
        checkpoint_dir = Path(cfg.checkpoint.dir)

    for module in TORCHRUN_LOGGING_MODULES:
        importlib.import_module(module)
    if not verbose:
        _quiet_torchrun_logs()
    args.module, args.training_script, args.training_script_args = True, "megatron_grpo", [command, *command_args]
    os.environ[train_cli.LAUNCHER_VARIABLE] = "1"  # read by the ranks, which inherit this process's environment
    return _run(args, checkpoint_dir, debug)


def _run(args: Any, checkpoint_dir: Optional[Path], debug: bool) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    from megatron_grpo.runner import train_cli

    try:
        torchrun(args)
    except ChildFailedError as err:
        code, line = job_outcome({rank: failure.exitcode for rank, failure in err.failures.items()}, checkpoint_dir)
    except SignalException as err:  # the agent was signalled; it has passed the signal on to every rank
        code, line = stopped_outcome(signal.Signals(err.sigval), checkpoint_dir)
    except KeyboardInterrupt:  # Ctrl-C before the agent started any rank
        code, line = train_cli.EXIT_INTERRUPTED, "interrupted before any rank started; nothing was trained"
    except Exception as err:  # noqa: BLE001 - torchrun's own failures (rendezvous, ...): one line, or the traceback
        if debug:
            traceback.print_exc()
        code, line = train_cli.EXIT_FAILED, f"error: torchrun: {type(err).__name__}: {err}"
    else:
        return 0
    if line:
        print(line, file=sys.stderr, flush=True)
    return code


def job_outcome(exit_codes: dict[int, int], checkpoint_dir: Optional[Path]) -> tuple[int, Optional[str]]:
    """The job's exit code and the line to add (None: the ranks have said it), from the failed ranks' exit codes
    (negative: the signal that ended the rank).

    A rank's own verdict comes first: a config (2) or directory (3) error, or a bug (any other positive code, whose
    traceback the rank printed). Then a rank that died from a signal other than the agent's SIGTERM (which the
    agent sends to the other ranks once one has failed) is a lost peer (4), named here. Then 130 when the ranks
    were interrupted, else 4 (ranks that lost contact with a hung peer, each of which said so)."""
    from megatron_grpo.runner import train_cli

    codes = set(exit_codes.values())
    for code in (train_cli.EXIT_CONFIG, train_cli.EXIT_RUN_DIR):
        if code in codes:
            return code, None
    ours = {train_cli.EXIT_CONFIG, train_cli.EXIT_RUN_DIR, train_cli.EXIT_PEER_LOST, train_cli.EXIT_INTERRUPTED}
    bugs = sorted((rank, code) for rank, code in exit_codes.items() if code > 0 and code not in ours)
    if bugs:
        rank, code = bugs[0]
        return train_cli.EXIT_FAILED, f"error: rank {rank} failed (exit code {code}); its traceback is above"
    died = sorted((rank, -code) for rank, code in exit_codes.items() if code < 0 and -code != signal.SIGTERM)
    if died:
        names = "; ".join(f"rank {rank} died ({_signal_name(number)})" for rank, number in died)
        return train_cli.EXIT_PEER_LOST, (f"error: {names}; the other ranks were stopped. "
                                       f"{_resumable_sentence(checkpoint_dir)}").rstrip()
    if codes == {train_cli.EXIT_INTERRUPTED}:
        return train_cli.EXIT_INTERRUPTED, None
    return train_cli.EXIT_PEER_LOST, None


def stopped_outcome(sig: signal.Signals, checkpoint_dir: Optional[Path]) -> tuple[int, Optional[str]]:
    """The exit code (128 + the signal, as a shell reports it) and the line for a job stopped by a signal to this
    launcher. Ctrl-C gets no line here: rank 0 has said where the run stopped."""
    if sig == signal.SIGINT:
        return 128 + sig, None
    return 128 + sig, f"error: stopped by {sig.name}. {_resumable_sentence(checkpoint_dir)}".rstrip()


def _resumable_sentence(checkpoint_dir: Optional[Path]) -> str:
    if checkpoint_dir is None:
        return ""
    from megatron_grpo.runner.checkpoint_dir import loadable_sentence

    sentence = loadable_sentence(checkpoint_dir)
    return sentence[:1].upper() + sentence[1:] + "."


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _world_size(args: Any) -> Optional[int]:
    """The number of ranks torchrun will start, when it is fixed (None for an elastic number of nodes)."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if min_nodes != max_nodes:
        return None
    return max_nodes * determine_local_world_size(args.nproc_per_node)


def _quiet_torchrun_logs() -> None:
    """Hides the log lines of torchrun and its agent (warnings and errors included: the launcher reports the
    outcome itself). Only this process's loggers change; the ranks keep theirs."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
