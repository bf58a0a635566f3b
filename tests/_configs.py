"""Test helpers: the tiny exemplar config as a mutable mapping, and dotted-key edits of it."""

from __future__ import annotations

import copy
import pathlib

import yaml

from megatron_grpo.runner.config import Config, load_config

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
TINY = CONFIGS / "grpo_tiny_cpu.yaml"


def tiny() -> dict:
    """configs/grpo_tiny_cpu.yaml, freshly parsed."""
    return yaml.safe_load(TINY.read_text())


def set_key(data: dict, dotted: str, value: object) -> dict:
    """A copy of `data` with `dotted` (e.g. "policy.model.hidden_size") set to `value`."""
    data = copy.deepcopy(data)
    *parents, leaf = dotted.split(".")
    section = data
    for key in parents:
        section = section[key]
    section[leaf] = value
    return data


def drop_key(data: dict, dotted: str) -> dict:
    """A copy of `data` without `dotted`."""
    data = copy.deepcopy(data)
    *parents, leaf = dotted.split(".")
    section = data
    for key in parents:
        section = section[key]
    del section[leaf]
    return data


def config_with(overrides: dict[str, object]) -> Config:
    """The tiny config with every dotted key of `overrides` set."""
    data = tiny()
    for key, value in overrides.items():
        data = set_key(data, key, value)
    return load_config(data)
