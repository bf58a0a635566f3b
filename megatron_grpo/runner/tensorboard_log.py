"""Every scalar of a step's metrics record, to TensorBoard event files (and W&B offline) in the run directory.

`metric_group(name)` says under which prefix a `metrics.jsonl` key is shown; `TensorBoardWriter` writes one record
per step under `group/name`; `WandbWriter` does the same through W&B in offline mode. Only the reporting rank
(global rank 0) writes; the other ranks build disabled writers, which do nothing.

Groups (`metric_group`; the first rule that matches wins):
- `timing/`: every key ending in `_time_s`;
- `passes/`: `reference_pass_ran`, `prev_pass_ran`, `reference_passes_skipped`, `prev_passes_skipped`, and any
  other key containing `_pass`;
- `loss/`: the loss's metrics (`megatron_grpo.loss.METRIC_AGGREGATION`: `loss`, `probs_ratio*`, `clip_fraction_*`,
  `entropy`, `approx_entropy`, `token_mult_prob_error`, `gen_kl_error`, `kl_penalty`, `is_oob_*`, the sequence
  mask's `num_masked_seqs_by_logprob_error`, `*_seq_mult_prob_error*`, ...) and the reward shaping's
  `reward_kl_penalty`;
- `rollout/`: `reward_*`, `advantages_*`, `response_*`, `rollout_*` (weight version, age), `perfect_fraction`,
  `groups_without_variance`, `num_groups`, `collapsed`;
- `moe/`: a Mixture-of-Experts policy's auxiliary losses (`load_balancing_loss`, `z_loss`, ... by Megatron's names) and
  routing replay's metrics (`router_replay_*`);
- `train/`: everything else: `grad_norm`, `grad_norm_after_clip`, `lr`, and any key no rule above claims.

Not written: `step` (it is TensorBoard's step axis), and values that are not numbers or booleans (`sample`, the
decoded text). Booleans are written as 0 / 1.

Measure the cost of one step's write: `python -m megatron_grpo.runner.tensorboard_log --measure`.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from megatron_grpo.runner.config import ConfigError
from megatron_grpo.runner.helptext import DefaultsHelpFormatter

TIMING_SUFFIX = "_time_s"  # as megatron_grpo.runner.reporting.TIMING_SUFFIX
STEP_KEY = "step"
GROUPS = ("train", "rollout", "loss", "timing", "passes", "moe")

# The errors of prev's approximations that `logprob_passes.prev: compute_and_compare` logs (loss/prev_approximation.py).
PREV_APPROXIMATION_ERROR_METRICS = frozenset(f"prox_{method}_{kind}" for method in ("generation", "loglinear", "linear")
                                   for kind in ("abs_error", "rel_error", "is_weight_abs_error", "ratio_abs_error"))
# The sequence mask by logprob error's metrics (loss/logprob_error_mask.py), with `grpo.seq_logprob_error_threshold`.
LOGPROB_ERROR_MASK_METRICS = frozenset({
    "num_masked_seqs_by_logprob_error", "num_valid_samples_before_mask", "masked_seqs_by_logprob_error_fraction",
    *(f"{stat}_seq_mult_prob_error{suffix}" for stat in ("max", "mean", "min") for suffix in ("", "_after_mask")),
    "masked_correct_pct",
})
# The loss's metrics of the rollout engine's kept sets (a top-k / top-p sampler's).
KEPT_SET_METRICS = frozenset({"kept_set_mass", "kept_set_differs", "kept_set_replayed_ratio_outside_band",
                              "kept_set_recomputed_ratio_outside_band"})
# The loss's metric names, as megatron_grpo.loss.metrics.METRIC_AGGREGATION declares them (kept here so that this
# module imports neither torch nor the loss; tests/runner/test_grpo_logging.py checks the two lists agree).
LOSS_METRICS = frozenset({
    "loss", "loss_normaliser", "num_valid_tokens", "num_valid_samples", "filtered_out_tokens",
    "nonfinite_generation_logprobs", "positive_nll_loss", "probs_ratio", "probs_ratio_min", "probs_ratio_max",
    "probs_ratio_clamped", "probs_ratio_clamped_min", "probs_ratio_clamped_max", "clip_fraction_lower",
    "clip_fraction_upper", "kl_penalty", "entropy", "approx_entropy", "token_mult_prob_error", "gen_kl_error",
    "sampling_importance_ratio", "is_oob_ratio", "is_oob_token_ratio", "reward_kl_penalty",
    "gen_ratio_outside_band", *KEPT_SET_METRICS, *PREV_APPROXIMATION_ERROR_METRICS, *LOGPROB_ERROR_MASK_METRICS,
})
PASS_METRICS = frozenset({"reference_pass_ran", "prev_pass_ran", "reference_passes_skipped", "prev_passes_skipped"})
ROLLOUT_PREFIXES = ("reward_", "advantages_", "response_", "rollout_")
ROLLOUT_METRICS = frozenset({"perfect_fraction", "groups_without_variance", "num_groups", "collapsed"})
# Megatron-Core's MoE auxiliary losses, by the names of its tracker (megatron_grpo.megatron.moe_losses)
MOE_METRICS = frozenset({"load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss"})
ROUTER_REPLAY_PREFIX = "router_replay_"


def metric_group(name: str) -> str:
    """The TensorBoard group (`train`, `rollout`, `loss`, `timing`, `passes` or `moe`) of a metrics-record key."""
    if name.endswith(TIMING_SUFFIX):
        return "timing"
    if name in MOE_METRICS or name.startswith(ROUTER_REPLAY_PREFIX):
        return "moe"
    if name in PASS_METRICS or "_pass" in name:
        return "passes"
    if name in LOSS_METRICS:
        return "loss"
    if name in ROLLOUT_METRICS or name.startswith(ROLLOUT_PREFIXES):
        return "rollout"
    return "train"


def scalar_tags(record: Mapping[str, Any]) -> dict[str, float]:
    """`{group/name: value}` for every scalar of a metrics record: numbers and booleans, `step` excepted."""
    tags = {}
    for name, value in record.items():
        if name == STEP_KEY or isinstance(value, str) or value is None:
            continue
        if isinstance(value, bool):
            value = float(value)
        if not isinstance(value, (int, float)):
            try:
                value = float(value)  # a 0-dim tensor or numpy scalar
            except (TypeError, ValueError):
                continue
        tags[f"{metric_group(name)}/{name}"] = float(value)
    return tags


class TensorBoardWriter:
    """Event files in `log_dir` (the run directory): one `Summary` of every scalar per step. Rank 0 only.

    Written with the `tensorboard` package's own event-file writer (the one torch's `SummaryWriter` wraps), one
    event per step rather than one per scalar, which is what keeps a step's write near a millisecond.
    `first_step` is the step a (resumed) run starts at: the writer first logs a session start at that step, so
    TensorBoard purges an earlier run's events in the same directory from that step on (torch's `purge_step`). A
    resumed run then shows as if it had never stopped, and a fresh run (`first_step=0`) hides an older run's
    curves. Events reach the file from a background thread at least every `flush_secs` seconds, and on `close`.
    """

    def __init__(self, log_dir: Path, *, enabled: bool, first_step: int = 0, flush_secs: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        if not enabled:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(self.log_dir), max_queue_size=1000, flush_secs=flush_secs)
        self._writer.add_event(Event(wall_time=time.time(), step=first_step,
                                     session_log=SessionLog(status=SessionLog.START)))

    def write(self, record: Mapping[str, Any]) -> None:
        """Writes every scalar of one step's metrics record at step `record["step"]`."""
        if self._writer is None:
            return
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)
                                       for tag, value in scalar_tags(record).items()])
        self._writer.add_event(self._event(wall_time=time.time(), step=int(record[STEP_KEY]), summary=summary))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wandb_available() -> bool:
    return importlib.util.find_spec("wandb") is not None


def check_wandb_available(requested: bool) -> None:
    """A ConfigError when `logging.wandb: true` and the `wandb` package cannot be imported."""
    if requested and not wandb_available():
        raise ConfigError("logging.wandb: true needs the wandb package, which is not installed "
                          "(pip install wandb, or set logging.wandb: false)")


class WandbWriter:
    """W&B in offline mode, files under `run_dir/wandb`; sync later with `wandb sync`. Rank 0 only.

    Offline mode and the directory are passed to `wandb.init` explicitly; no environment variable is set.
    """

    def __init__(self, run_dir: Path, *, enabled: bool, run_config: Optional[Mapping[str, Any]] = None,
                 name: Optional[str] = None) -> None:
        self._run = None
        if not enabled:
            return
        check_wandb_available(True)
        import wandb

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(mode="offline", dir=str(run_dir), name=name or run_dir.name,
                               config=dict(run_config) if run_config is not None else None)

    def write(self, record: Mapping[str, Any]) -> None:
        if self._run is not None:
            self._run.log(scalar_tags(record), step=int(record[STEP_KEY]))

    def flush(self) -> None:  # W&B offline writes as it logs
        pass

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class MetricWriters:
    """The writers `logging.tensorboard` and `logging.wandb` switch on, behind one write/flush/close."""

    def __init__(self, writers: list[Any]) -> None:
        self.writers = writers

    @classmethod
    def from_config(cls, logging_cfg: Any, run_dir: Path, *, enabled: bool, first_step: int = 0,
                    run_config: Optional[Mapping[str, Any]] = None) -> MetricWriters:
        """`logging_cfg` is the config's `logging` section; `enabled` is True on the reporting rank only."""
        writers: list[Any] = []
        if enabled and logging_cfg.tensorboard:
            writers.append(TensorBoardWriter(run_dir, enabled=True, first_step=first_step))
        if enabled and logging_cfg.wandb:
            writers.append(WandbWriter(run_dir, enabled=True, run_config=run_config))
        return cls(writers)

    def write(self, record: Mapping[str, Any]) -> None:
        for writer in self.writers:
            writer.write(record)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


# The loss's metrics that exist only with truncated importance sampling, a KL, VAPO's NLL term, a comparison of
# prev's approximations, the sequence mask by logprob error, deferred normalisation (whose normaliser the step uses
# up) or a top-k / top-p sampler's kept sets: not the demo's.
CONDITIONAL_LOSS_METRICS = frozenset({"is_oob_ratio", "is_oob_token_ratio", "kl_penalty", "reward_kl_penalty",
                                      "positive_nll_loss", "loss_normaliser", *PREV_APPROXIMATION_ERROR_METRICS,
                                      *LOGPROB_ERROR_MASK_METRICS, *KEPT_SET_METRICS})


def demo_record(step: int) -> dict[str, Any]:
    """A metrics record shaped like the tiny demo's (the same keys and value types: the runner's tests compare it
    with a real one), for measuring the write cost."""
    record: dict[str, Any] = {"step": step}
    for name in sorted(LOSS_METRICS - CONDITIONAL_LOSS_METRICS):
        record[name] = 1.0 + 1e-3 * step
    for stat in ("mean", "std", "min", "max"):
        record[f"reward_{stat}"] = 0.5
        record[f"advantages_{stat}"] = 0.0
    record.update({
        "perfect_fraction": 0.25, "response_length_mean": 5.0, "response_length_min": 5.0, "response_length_max": 5.0,
        "response_truncated_fraction": 0.0, "groups_without_variance": 2, "num_groups": 16,
        "grad_norm": 0.3, "grad_norm_after_clip": 0.3, "lr": 1e-3,
        "reference_pass_ran": False, "prev_pass_ran": False,
        "reference_passes_skipped": step + 1, "prev_passes_skipped": step + 1,
        "sample": "<bos> R 1 2 3 4 = 4 3 2 1 <eos>", "rollout_weight_version": step, "rollout_age": 0,
        "rollout_time_s": 0.08, "reference_pass_time_s": 0.0, "prev_pass_time_s": 0.0,
        "forward_backward_time_s": 0.06, "optimizer_time_s": 0.005, "checkpoint_time_s": 0.0,
        "train_time_s": 0.07, "step_time_s": 0.17, "collapsed": False,
    })
    return record


def measure(log_dir: Path, steps: int = 300, step_time_s: float = 0.17) -> dict[str, float]:
    """Seconds to write one demo-shaped step record (the mean includes the final flush and close, shared out over
    the steps), and the mean's share of a step of `step_time_s`."""
    records = [demo_record(step) for step in range(steps)]
    durations = []
    writer = TensorBoardWriter(log_dir, enabled=True)
    cpu_started = time.process_time()  # all threads: the event writer's CRC and file writes run in its own
    for record in records:
        started = time.perf_counter()
        writer.write(record)
        durations.append(time.perf_counter() - started)
    started = time.perf_counter()
    writer.close()  # the final flush, shared out over the steps below
    close_s = time.perf_counter() - started
    cpu_s = (time.process_time() - cpu_started) / len(durations)
    mean = (sum(durations) + close_s) / len(durations)
    return {"scalars_per_step": float(len(scalar_tags(records[0]))), "steps": float(steps),
            "mean_write_s": mean, "max_write_s": max(durations), "close_s": close_s, "cpu_s": cpu_s,
            "median_write_s": sorted(durations)[len(durations) // 2],
            "share_of_step": mean / step_time_s if step_time_s > 0 else math.nan}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_grpo.runner.tensorboard_log",
                                     description="Time writing one step's scalars to TensorBoard.",
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--measure", action="store_true",
                        help="write records shaped like the demo's (its scalars) and time each step")
    parser.add_argument("--steps", type=int, default=300, help="records to write")
    parser.add_argument("--step-time", type=float, default=0.17, help="the step time to compare with, in seconds")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    if not args.measure:
        parser.print_help()
        return 2
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = measure(args.dir or Path(tmp), steps=args.steps, step_time_s=args.step_time)
    step = args.step_time
    print(f"TensorBoard write cost, {int(result['scalars_per_step'])} scalars per step, {int(result['steps'])} steps:\n"
          f"  write call: median {result['median_write_s'] * 1e3:.3f} ms, max {result['max_write_s'] * 1e3:.1f} ms\n"
          f"  wall clock: {result['mean_write_s'] * 1e3:.3f} ms per step with the final flush and close "
          f"({result['close_s'] * 1e3:.0f} ms) shared out = {100 * result['share_of_step']:.2f}% of a "
          f"{step:.3f} s step\n"
          f"  CPU time:   {result['cpu_s'] * 1e3:.3f} ms per step, all threads = "
          f"{100 * result['cpu_s'] / step:.2f}% of a {step:.3f} s step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
