"""`policy.initial_checkpoint`: a Megatron-Core `dist_checkpointing` model checkpoint saved at TP1 PP1 loads at TP2
and at PP2 into exactly the saved weights; a runner step directory loads too; a checkpoint of another model, of
another padded vocabulary, or a directory that is no checkpoint is an error that says what is wrong.

One spawn of two gloo ranks runs every layout in turn (Megatron's import dominates the cost); the tests below
assert on what rank 0 reports. Whole tensors are assembled from every rank's shards by their global offsets,
so TP shards and pipeline stages are compared by global layer index.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from grpo_workers.launch import REPO, run, torchrun_command, write_config
from test_megatron_hooks import TINY_MODEL, VOCAB

from megatron_grpo.runner.config import ConfigError
from megatron_grpo.runner.reporting import read_metrics
from megatron_grpo.runner.tasks import DigitTokenizer
from megatron_grpo.runner.train_cli import EXIT_CONFIG, runner_config_problems

SAVED = {**TINY_MODEL, "policy.tensor_model_parallel_size": 1, "policy.model.make_vocab_size_divisible_by": 128}
OTHER_SEED = 7  # the loading models start from other weights than the saved one
# padded vocab 128 in every layout: 128 × TP1, 64 × TP2
TP2 = {**TINY_MODEL, "seed": OTHER_SEED, "policy.model.make_vocab_size_divisible_by": 64}
PP2 = {**SAVED, "seed": OTHER_SEED, "policy.pipeline_model_parallel_size": 2}
OTHER_FFN = {**SAVED, "policy.model.ffn_hidden_size": 48}
LAYER_WEIGHTS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
RANDOM_INIT_KEYS = {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight",
                    *(f"decoder.layers.{name}.weight" for name in LAYER_WEIGHTS)}  # norms start at 1, biases at 0
VOCAB_16 = {**SAVED, "policy.model.make_vocab_size_divisible_by": 16}  # padded to 16, not 128
NO_POSITION_EMBEDDINGS = {**SAVED, "policy.model.position_embedding_type": "rope"}
# the runner's model (the digit task's 16 tokens also pad to 128), long enough for its prompts and answers
RUNNER_MODEL = {**{key: SAVED[key] for key in SAVED if key.startswith("policy.model.")},
                "policy.model.max_position_embeddings": 16}


def full_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model's sharded state dict, whole, by checkpoint key: each rank's shard placed at its
    global offset (layers stacked by global index), gathered from every rank."""
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    shards = [(t.key, tuple(t.global_shape), tuple(t.global_offset), t.prepend_axis_num, t.data.detach().clone())
              for t in model.sharded_state_dict().values() if isinstance(t, ShardedTensor)]
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, shards)
    whole: dict[str, torch.Tensor] = {}
    for key, global_shape, offset, prepended, data in (shard for rank in every_rank for shard in rank):
        target = whole.setdefault(key, torch.full(global_shape, float("nan")))
        local = data.reshape((1,) * prepended + tuple(data.shape))
        target[tuple(slice(start, start + size) for start, size in zip(offset, local.shape))] = local
    return whole


def build(overrides: dict):
    """Megatron's groups for the layout of `overrides` (tearing down the previous ones), and its model."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron import build_gpt_model, init_parallel
    from megatron_grpo.runner.plugin_params import model_params, parallel_params

    cfg = config_with(overrides)
    parallel_state.destroy_model_parallel()
    init_parallel(parallel_params(cfg))
    return build_gpt_model(model_params(cfg), VOCAB)


def error_of(model: torch.nn.Module, directory: Path) -> str:
    from megatron_grpo.megatron import CheckpointMismatchError, ModelCheckpointError, load_model_weights

    try:
        load_model_weights(model, directory, true_vocab_size=VOCAB)
    except ModelCheckpointError as err:
        return f"{type(err).__name__}{'(mismatch)' if isinstance(err, CheckpointMismatchError) else ''}: {err}"
    return "loaded"


def save_plain(overrides: dict, directory: Path, rank: int) -> dict[str, torch.Tensor]:
    """A model of `overrides` saved as Megatron users save one; returns its whole tensors."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    model = build(overrides)
    if rank == 0:
        directory.mkdir()
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(directory))
    return full_tensors(model)


def save_runner_step(directory: Path, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """A runner step directory (model, Adam state, RNG) of the saved model's layout with shifted weights."""
    import torch.distributed as dist

    from megatron_grpo.megatron import build_optimizer
    from megatron_grpo.runner.checkpoint import save_checkpoint
    from megatron_grpo.runner.plugin_params import adam_params

    cfg = config_with(SAVED)
    model = build(SAVED)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)
    save_checkpoint(directory, steps_done=3, model=model, optimizer=build_optimizer(model, adam_params(cfg)),
                    rank=rank, world_size=world_size, barrier=dist.barrier)
    return full_tensors(model)


def save_uniform_policy(directory: Path, rank: int) -> None:
    """The runner's model with a zero output layer (uniform next-token distribution), saved as Megatron users
    save one."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    model = build({**SAVED, **RUNNER_MODEL})
    with torch.no_grad():
        model.output_layer.weight.zero_()
    if rank == 0:
        directory.mkdir()
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(directory))


ERROR_CASES = ("other_ffn", "vocab_16", "no_position_embeddings", "not_a_checkpoint", "metadata_json_only")


def scenarios(rank: int, world_size: int, tmp: Path) -> dict:
    """Saves the checkpoints at TP1 PP1 (DP2), then loads them at TP2 and at PP2; what each load gave."""
    from megatron_grpo.megatron import destroy_parallel, load_model_weights

    report: dict = {"directory": str(tmp)}
    try:
        report["saved"] = save_plain(SAVED, tmp / "plain", rank)
        report["runner_saved"] = save_runner_step(tmp / "runner", rank, world_size)
        save_plain(OTHER_FFN, tmp / "other_ffn", rank)
        save_plain(VOCAB_16, tmp / "vocab_16", rank)
        save_plain(NO_POSITION_EMBEDDINGS, tmp / "no_position_embeddings", rank)
        save_uniform_policy(tmp / "uniform_policy", rank)
        (tmp / "not_a_checkpoint").mkdir(exist_ok=True)
        if rank == 0:  # a checkpoint's marker without its tensors' metadata; the loads below wait for rank 0
            (tmp / "metadata_json_only").mkdir()
            (tmp / "metadata_json_only" / "metadata.json").write_text((tmp / "plain" / "metadata.json").read_text())

        for name, layout in (("tp2", TP2), ("pp2", PP2)):
            model = build(layout)
            report[f"{name}_before"] = full_tensors(model)
            load_model_weights(model, tmp / "plain")
            report[name] = full_tensors(model)
        model = build(TP2)
        load_model_weights(model, tmp / "runner" / "step_00000003")
        report["runner_tp2"] = full_tensors(model)
        report["errors"] = {name: error_of(model, tmp / name) for name in ERROR_CASES}
        report["weights_after_errors"] = full_tensors(model)
    finally:
        destroy_parallel()
    return report if rank == 0 else {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def report(checkpoints) -> dict:
    return run_on_ranks(2, scenarios, checkpoints)[0]


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert not tensor.isnan().any(), key  # every element was gathered
        assert torch.equal(actual[key], tensor), key


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_tp1_checkpoint_loads_exactly_at_another_layout(report, layout):
    before, saved = report[f"{layout}_before"], report["saved"]
    differing = {key for key in saved if not torch.equal(before[key], saved[key])}
    assert differing == RANDOM_INIT_KEYS  # the loading model started from other weights
    assert_same_tensors(report[layout], saved)


def test_a_runner_step_directory_loads_its_model_weights(report):
    assert_same_tensors(report["runner_tp2"], report["runner_saved"])
    assert not torch.equal(report["runner_saved"]["output_layer.weight"], report["saved"]["output_layer.weight"])


def test_another_ffn_size_names_the_first_mismatching_tensor_and_both_shapes(report):
    message = report["errors"]["other_ffn"]
    assert message.startswith("CheckpointMismatchError(mismatch): ")
    assert "other_ffn: tensor decoder.layers.mlp.linear_fc1.weight has global shape (2, 48, 24) in the " \
           "checkpoint and (2, 40, 24) in this model" in message
    assert "make_vocab_size_divisible_by" not in message


def test_a_padded_vocab_mismatch_explains_make_vocab_size_divisible_by(report):
    message = report["errors"]["vocab_16"]
    assert message.startswith("CheckpointMismatchError(mismatch): ")
    assert "tensor embedding.word_embeddings.weight has global shape (16, 24) in the checkpoint and (128, 24) in " \
           "this model" in message
    assert "multiple of policy.model.make_vocab_size_divisible_by × the tensor-parallel size (2 here)" in message
    assert message.endswith("set policy.model.make_vocab_size_divisible_by to 8")


def test_a_tensor_missing_from_the_checkpoint_is_named(report):
    assert report["errors"]["no_position_embeddings"] == (
        f"CheckpointMismatchError(mismatch): {report['directory']}/no_position_embeddings: the model's tensor "
        "embedding.position_embeddings.weight (global shape (7, 24)) is missing from the checkpoint")


def test_a_directory_that_is_not_a_checkpoint_is_named(report):
    message = report["errors"]["not_a_checkpoint"]
    assert message.startswith("ModelCheckpointError: ")
    assert "not_a_checkpoint is not a Megatron-Core dist_checkpointing checkpoint (no metadata.json there)" in message


def test_unreadable_tensor_metadata_is_named(report):
    message = report["errors"]["metadata_json_only"]
    assert message.startswith(f"ModelCheckpointError: {report['directory']}/metadata_json_only: cannot read the "
                              "checkpoint's tensor metadata: FileNotFoundError: "), message
    assert "metadata_json_only/.metadata" in message


def test_a_failed_load_leaves_the_weights_alone(report):
    assert_same_tensors(report["weights_after_errors"], report["runner_saved"])


def preflight_problems(initial_checkpoint: str) -> list[str]:
    cfg = config_with({"policy.initial_checkpoint": initial_checkpoint})
    return runner_config_problems(cfg, world_size=2, cuda_available=False)


def test_preflight_names_a_missing_directory(tmp_path):
    missing = tmp_path / "missing"
    assert preflight_problems(str(missing)) == [
        f"policy.initial_checkpoint: {missing} is not a directory: it must be a Megatron-Core dist_checkpointing "
        "checkpoint of the model (dist_checkpointing.save(model.sharded_state_dict(), directory))"]


def test_preflight_names_a_directory_without_metadata(tmp_path):
    (problem,) = preflight_problems(str(tmp_path))
    assert problem.startswith(f"policy.initial_checkpoint: {tmp_path} has no metadata.json: ")


def test_preflight_accepts_a_checkpoint_directory_and_null(tmp_path):
    (tmp_path / "metadata.json").write_text("{}")
    assert preflight_problems(str(tmp_path)) == []
    assert runner_config_problems(config_with({}), world_size=2, cuda_available=False) == []
    assert config_with({}).policy.initial_checkpoint is None


def test_an_empty_path_is_a_config_error():
    with pytest.raises(ConfigError, match=r"policy\.initial_checkpoint: must be null or a directory, got an empty "):
        config_with({"policy.initial_checkpoint": ""})


def runner_config(directory: Path, initial_checkpoint: Path, overrides: dict) -> Path:
    """The tiny runner config (TP2) with the saved model's architecture, starting from `initial_checkpoint`."""
    return write_config(directory, **{**RUNNER_MODEL, "policy.initial_checkpoint": str(initial_checkpoint),
                                      **overrides})


@pytest.mark.slow
def test_the_runner_starts_from_the_initial_checkpoint(report, checkpoints, tmp_path):
    """The saved policy's output layer is zero: the first step's entropy is that of the uniform distribution over
    the digit task's 16 tokens, which no random initialisation gives."""
    config = runner_config(tmp_path, checkpoints / "uniform_policy", {"policy.model.make_vocab_size_divisible_by": 64,
                                                                      "grpo.max_num_steps": 1})
    code, output = run(torchrun_command(config, nproc=2), tmp_path / "log.txt")
    assert code == 0, output
    (first,) = read_metrics(tmp_path / "run")
    assert first["entropy"] == pytest.approx(math.log(DigitTokenizer().vocab_size), abs=1e-5)


@pytest.mark.slow
def test_the_runner_says_a_mismatch_in_one_line_naming_the_key(report, checkpoints, tmp_path):
    config = runner_config(tmp_path, checkpoints / "uniform_policy", {"policy.model.make_vocab_size_divisible_by": 8})
    code, output = run(torchrun_command(config, nproc=2), tmp_path / "log.txt")
    assert code != 0 and f"exitcode  : {EXIT_CONFIG} " in output, output
    (line,) = [line for line in output.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: policy.initial_checkpoint: {checkpoints / 'uniform_policy'}: tensor "
                           "embedding.word_embeddings.weight has global shape (128, 24) in the checkpoint and "
                           "(16, 24) in this model"), output
    assert line.endswith("set policy.model.make_vocab_size_divisible_by to 64"), output
    assert f'File "{REPO / "megatron_grpo"}' not in output, output  # no traceback of ours
