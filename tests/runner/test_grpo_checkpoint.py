"""Checkpoints of a TP=2 Megatron GPTModel with Adam: bit-exact resume, TP resharding, clear errors."""

from __future__ import annotations

import ast
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_on_ranks
from grpo_workers.launch import TINY_CONFIG

from megatron_grpo.runner.checkpoint import CheckpointSaveError, load_checkpoint, save_checkpoint
from megatron_grpo.runner.checkpoint_dir import (
    CheckpointError,
    find_resumable,
    latest_checkpoint,
    loadable_sentence,
    read_marker,
    step_dir_name,
    verify_checksums,
)
from megatron_grpo.runner.config import load_config

VOCAB = 16


def _setup(tp: int):
    import yaml

    from megatron_grpo.megatron import build_gpt_model, build_optimizer, init_parallel
    from megatron_grpo.runner.plugin_params import adam_params, model_params, parallel_params

    torch.set_num_threads(1)
    data = yaml.safe_load(TINY_CONFIG.read_text())
    data["policy"]["tensor_model_parallel_size"] = tp
    cfg = load_config(data)
    init_parallel(parallel_params(cfg))
    return (cfg, lambda: build_gpt_model(model_params(cfg), VOCAB),
            lambda model: build_optimizer(model, adam_params(cfg)))


def _inputs() -> torch.Tensor:
    return torch.randint(0, VOCAB, (5, 7), generator=torch.Generator().manual_seed(0))


def _full_logits(model) -> torch.Tensor:
    from megatron_grpo.megatron import model_forward

    with torch.no_grad():
        shard = model_forward(model, _inputs())
    if dist.get_world_size() == 1:
        return shard
    shards = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
    dist.all_gather(shards, shard)
    return torch.cat(shards, dim=-1)


def _train(model, optimizer, steps: int) -> None:
    from megatron_grpo.megatron import model_forward

    for _ in range(steps):
        optimizer.zero_grad()
        model_forward(model, _inputs()).square().mean().backward()
        optimizer.step()


def _save(directory: Path, steps_done: int, model, optimizer) -> Path:
    return save_checkpoint(directory, steps_done=steps_done, model=model, optimizer=optimizer, rank=dist.get_rank(),
                           world_size=dist.get_world_size(), barrier=dist.barrier)


def _load(directory: Path, model, optimizer, verify: bool = True) -> int:
    return load_checkpoint(latest_checkpoint(directory), model=model, optimizer=optimizer, rank=dist.get_rank(),
                           world_size=dist.get_world_size(), verify=verify)


def _resume_is_bit_exact(rank: int, world_size: int, directory: Path) -> dict:
    _cfg, build_model, build_optimizer = _setup(tp=world_size)
    model = build_model()
    optimizer = build_optimizer(model)
    _train(model, optimizer, 2)
    _save(directory, 2, model, optimizer)
    draws = (torch.rand(3), random.random())
    _train(model, optimizer, 2)
    uninterrupted = [param.detach().clone() for param in model.parameters()]

    torch.manual_seed(1000 + rank)
    resumed_model = build_model()
    resumed_optimizer = build_optimizer(resumed_model)
    steps_done = _load(directory, resumed_model, resumed_optimizer)
    rng_restored = torch.equal(torch.rand(3), draws[0]) and random.random() == draws[1]
    _train(resumed_model, resumed_optimizer, 2)
    identical = all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed_model.parameters()))
    _save(directory, 4, resumed_model, resumed_optimizer)
    return {"steps_done": steps_done, "rng_restored": rng_restored, "identical": identical,
            "logits": _full_logits(resumed_model)}


def _load_logits(rank: int, world_size: int, directory: Path) -> torch.Tensor:
    _cfg, build_model, build_optimizer = _setup(tp=world_size)
    model = build_model()
    _load(directory, model, build_optimizer(model))
    return _full_logits(model)


def _load_error(rank: int, world_size: int, directory: Path, verify: bool) -> str:
    _cfg, build_model, build_optimizer = _setup(tp=world_size)
    model = build_model()
    with pytest.raises(CheckpointError) as caught:
        _load(directory, model, build_optimizer(model), verify)
    return str(caught.value)


def _save_error(rank: int, world_size: int, directory: Path) -> str:
    """Saves step 2, then step 4 where a directory blocks a shard file's path: the save fails with EISDIR."""
    _cfg, build_model, build_optimizer = _setup(tp=world_size)
    model = build_model()
    optimizer = build_optimizer(model)
    _save(directory, 2, model, optimizer)
    (directory / step_dir_name(4) / "__0_0.distcp").mkdir(parents=True)
    with pytest.raises(CheckpointSaveError) as caught:
        _save(directory, 4, model, optimizer)
    return str(caught.value)


@pytest.fixture(scope="module")
def tp2_checkpoints(tmp_path_factory):
    directory = tmp_path_factory.mktemp("checkpoints")
    return directory, run_on_ranks(2, _resume_is_bit_exact, directory)


def test_resume_at_tp2_continues_bit_exactly(tp2_checkpoints):
    _directory, results = tp2_checkpoints
    for result in results:
        assert result["steps_done"] == 2 and result["rng_restored"] and result["identical"]


def test_a_tp2_checkpoint_loads_into_tp1(tp2_checkpoints):
    directory, results = tp2_checkpoints
    (tp1_logits,) = run_on_ranks(1, _load_logits, directory)
    # the padded vocab differs (128 at TP=1, 256 at TP=2): compare the real tokens' logits, the same weights forwarded
    # with TP's other summation order: a few ulps of logits of a few units, well within 1e-5 (plus 1e-5 relative)
    torch.testing.assert_close(tp1_logits[..., :VOCAB], results[0]["logits"][..., :VOCAB], rtol=1e-5, atol=1e-5)


def test_a_corrupt_checkpoint_is_a_clear_error_without_checksums_too(tp2_checkpoints, tmp_path):
    source, _results = tp2_checkpoints
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    step_dir = latest_checkpoint(tmp_path)
    shards = sorted(step_dir.glob("*.distcp"))
    assert shards, f"no shard files in {sorted(p.name for p in step_dir.iterdir())}"
    for shard in shards:
        shard.write_bytes(b"garbage")
    for message in run_on_ranks(2, _load_error, tmp_path, False):
        assert f"{step_dir} is corrupt" in message


def test_the_marker_records_a_checksum_of_every_file_and_a_flipped_byte_is_named(tp2_checkpoints, tmp_path):
    source, _results = tp2_checkpoints
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    step_dir = latest_checkpoint(tmp_path)
    marker = read_marker(step_dir)
    files = sorted(p.relative_to(step_dir).as_posix() for p in step_dir.rglob("*") if p.is_file())
    assert marker.world_size == 2 and sorted(marker.checksums) == [name for name in files if name != "COMPLETE"]
    verify_checksums(step_dir)
    shard = sorted(step_dir.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard} does not match its checksum"):
        verify_checksums(step_dir)
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard} is missing, but {step_dir / 'COMPLETE'} lists it"):
        verify_checksums(step_dir)


@pytest.mark.parametrize("content, problem", [("", "is empty"), ("{garbage", "is not a valid marker"),
                                              ('{"world_size": 2}', "is not a valid marker")])
def test_a_damaged_marker_is_named_and_skipped_for_the_newest_complete_checkpoint(tp2_checkpoints, tmp_path,
                                                                                 content, problem):
    source, _results = tp2_checkpoints
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    (tmp_path / step_dir_name(4) / "COMPLETE").write_text(content)
    found = find_resumable(tmp_path)
    assert found.step_dir == tmp_path / step_dir_name(2)
    assert found.skipped == [f"skipped {step_dir_name(4)}: {tmp_path / step_dir_name(4) / 'COMPLETE'} {problem}"
                             + found.skipped[0].split(problem, 1)[1]]


def test_a_failed_save_names_the_path_and_errno_and_what_is_still_loadable(tmp_path):
    (message,) = run_on_ranks(1, _save_error, tmp_path)
    assert message.startswith(f"rank 0: could not save checkpoint {tmp_path / step_dir_name(4)}: [Errno 21] ")
    assert f"{tmp_path / step_dir_name(2)} is the newest complete checkpoint" in message
    assert "\n" not in message


def test_loadable_sentence_says_so_when_nothing_is_loadable(tmp_path):
    assert loadable_sentence(tmp_path) == (f"no checkpoint has been completed in {tmp_path}, so a rerun starts from "
                                           "scratch")


def test_latest_points_to_the_newest_complete_checkpoint(tp2_checkpoints, tmp_path):
    source, _results = tp2_checkpoints
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    (tmp_path / step_dir_name(6)).mkdir()  # a save that crashed before COMPLETE: never published
    assert latest_checkpoint(tmp_path) == tmp_path / step_dir_name(4)


def test_resume_from_a_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint\.dir.*does not exist"):
        latest_checkpoint(tmp_path / "nowhere")


def test_resume_from_an_empty_directory_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path)


def test_the_runner_reaches_megatron_core_only_through_megatron_grpo_megatron():
    """docs/design.md: `megatron_grpo/megatron/` is the only package that imports megatron.core."""
    package = Path(__file__).parents[2] / "megatron_grpo" / "runner"
    imports = {}
    for source in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            imports[source.name] = imports.get(source.name, []) + [name for name in names
                                                                    if name.split(".")[0] == "megatron"]
    assert "checkpoint.py" in imports
    assert {name: found for name, found in imports.items() if found} == {}
