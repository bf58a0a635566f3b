"""TensorBoard event files (read back with tensorboard's own reader), metric groups, W&B offline, config keys."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import yaml

from megatron_grpo.runner.config import ConfigError, load_config
from megatron_grpo.runner.tensorboard_log import (
    GROUPS,
    LOSS_METRICS,
    MetricWriters,
    TensorBoardWriter,
    WandbWriter,
    demo_record,
    metric_group,
    scalar_tags,
)

REPO = Path(__file__).resolve().parents[2]


def _read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in `log_dir`, as TensorBoard shows it (older runs' purged steps hidden)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def _record(step: int) -> dict:
    return {
        "step": step, "reward_mean": 0.1 * step, "advantages_std": 1.0, "response_length_mean": 5.0,
        "perfect_fraction": 0.0, "probs_ratio": 1.0, "clip_fraction_upper": 0.01 * step, "entropy": 2.5,
        "grad_norm": 0.5 + step, "lr": 1e-3, "prev_pass_ran": False, "reference_passes_skipped": step + 1,
        "rollout_time_s": 0.1, "step_time_s": 0.2, "rollout_age": 0, "collapsed": False,
        "sample": "<bos> R 1 2 3 4 =", "shaping_note": None,
    }


def test_metric_groups() -> None:
    expected = {
        "train": ["grad_norm", "grad_norm_after_clip", "lr", "something_new"],
        "rollout": ["reward_mean", "reward_std", "advantages_min", "response_length_max", "response_truncated_fraction",
                    "perfect_fraction", "groups_without_variance", "num_groups", "collapsed", "rollout_age",
                    "rollout_weight_version"],
        "loss": ["loss", "probs_ratio", "probs_ratio_clamped_max", "clip_fraction_lower", "entropy", "approx_entropy",
                 "token_mult_prob_error", "gen_kl_error", "kl_penalty", "is_oob_ratio", "reward_kl_penalty"],
        "timing": ["step_time_s", "rollout_time_s", "reference_pass_time_s", "forward_backward_time_s"],
        "passes": ["reference_pass_ran", "prev_pass_ran", "reference_passes_skipped", "prev_passes_skipped"],
        "moe": ["load_balancing_loss", "z_loss", "router_replay_changed_fraction",
                "router_replay_token_mult_prob_error", "router_replay_off_token_mult_prob_error"],
    }
    assert set(expected) == set(GROUPS)
    for group, names in expected.items():
        for name in names:
            assert metric_group(name) == group, name


def test_loss_metric_list_matches_the_loss() -> None:
    """Every scalar the loss declares is grouped under loss/ (the list is kept here to avoid importing torch)."""
    from megatron_grpo.loss.metrics import METRIC_AGGREGATION, Aggregation

    scalars = {name for name, kind in METRIC_AGGREGATION.items() if kind is not Aggregation.PER_TOKEN}
    assert scalars <= LOSS_METRICS, scalars - LOSS_METRICS


def test_scalar_tags_skip_text_step_and_none() -> None:
    tags = scalar_tags(_record(3))
    assert "train/step" not in tags and not any(tag.endswith(("/sample", "/shaping_note")) for tag in tags)
    assert tags["passes/prev_pass_ran"] == 0.0 and tags["rollout/collapsed"] == 0.0
    assert tags["loss/entropy"] == 2.5 and tags["timing/step_time_s"] == 0.2
    assert len(tags) == len(_record(3)) - 3


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    records = [_record(step) for step in range(4)]
    with TensorBoardWriter(tmp_path, enabled=True) as writer:
        for record in records:
            writer.write(record)
    assert list(tmp_path.glob("events.out.tfevents.*"))
    scalars = _read_scalars(tmp_path)
    assert set(scalars) == set(scalar_tags(records[0]))
    for tag in scalars:
        group, name = tag.split("/")
        assert group == metric_group(name)
        assert [step for step, _ in scalars[tag]] == [0, 1, 2, 3]
        for (step, value), record in zip(scalars[tag], records):
            assert value == pytest.approx(float(record[name]), rel=1e-6), (tag, step)


def test_resumed_run_replaces_the_redone_steps(tmp_path: Path) -> None:
    """A run resumed at step 2 in the same directory: TensorBoard shows steps 0-1 of the first run, 2+ of the new."""
    with TensorBoardWriter(tmp_path, enabled=True) as writer:
        for step in range(4):
            writer.write({"step": step, "reward_mean": 1.0})
    with TensorBoardWriter(tmp_path, enabled=True, first_step=2) as writer:
        for step in range(2, 5):
            writer.write({"step": step, "reward_mean": 2.0})
    assert _read_scalars(tmp_path)["rollout/reward_mean"] == [(0, 1.0), (1, 1.0), (2, 2.0), (3, 2.0), (4, 2.0)]


def test_disabled_writers_write_nothing(tmp_path: Path) -> None:
    writer = TensorBoardWriter(tmp_path / "tb", enabled=False)
    writer.write(_record(0))
    writer.close()
    assert not (tmp_path / "tb").exists()
    cfg = load_config(REPO / "configs/grpo_tiny_cpu.yaml").logging
    writers = MetricWriters.from_config(cfg, tmp_path / "run", enabled=False)  # a rank other than 0
    writers.write(_record(0))
    writers.close()
    assert writers.writers == [] and not (tmp_path / "run").exists()


def test_writers_from_the_demo_config(tmp_path: Path) -> None:
    cfg = load_config(REPO / "configs/grpo_tiny_cpu.yaml").logging
    assert cfg.tensorboard and not cfg.wandb
    writers = MetricWriters.from_config(cfg, tmp_path, enabled=True)
    writers.write(demo_record(0))
    writers.close()
    assert "loss/probs_ratio" in _read_scalars(tmp_path)


def _config_data(**logging: bool) -> dict:
    data = yaml.safe_load((REPO / "configs/grpo_tiny_cpu.yaml").read_text())
    data["logging"].update(logging)
    return data


def test_wandb_without_the_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args))
    with pytest.raises(ConfigError, match="logging.wandb: true needs the wandb package"):
        load_config(_config_data(wandb=True))
    assert not load_config(_config_data(wandb=False)).logging.wandb


def test_logging_keys_are_required_booleans() -> None:
    data = _config_data()
    del data["logging"]["tensorboard"]
    data["logging"]["wandb"] = "offline"
    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert "logging.tensorboard: missing key" in str(err.value)
    assert "logging.wandb: expected true or false" in str(err.value)


def test_wandb_writer_is_offline_in_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a stand-in `wandb` module: offline mode and dir= are passed explicitly, scalars logged at their step."""
    calls: dict = {"log": []}

    class FakeRun:
        def log(self, data: dict, step: int) -> None:
            calls["log"].append((step, data))

        def finish(self) -> None:
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    fake = types.ModuleType("wandb")
    fake.init = init
    fake.__spec__ = types.SimpleNamespace(name="wandb")  # find_spec("wandb") finds it in sys.modules
    monkeypatch.setitem(sys.modules, "wandb", fake)
    import os

    environ = dict(os.environ)
    writer = WandbWriter(tmp_path, enabled=True, run_config={"seed": 1})
    writer.write(_record(7))
    writer.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["dir"] == str(tmp_path)
    assert calls["init"]["config"] == {"seed": 1}
    assert calls["log"] == [(7, scalar_tags(_record(7)))]
    assert calls["finished"] and dict(os.environ) == environ


def test_measure_command(capsys: pytest.CaptureFixture) -> None:
    from megatron_grpo.runner.tensorboard_log import main

    assert main(["--measure", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "scalars per step, 5 steps" in out and "CPU time" in out
