"""Megatron train-step hooks on a tiny GPTModel, TP=2 over gloo on the CPU.

One spawn of two ranks runs every scenario (Megatron's import and init dominate the cost); the tests below
assert on what the ranks report. References are float64 computations written here, from TP-gathered logits.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

import pytest
import torch
from _configs import config_with
from _dist import run_on_ranks
from _tolerances import FP32_U, MODEL_GRAD_RTOL, MODEL_LOGPROB_ATOL

VOCAB = 13  # odd, padded to 16 (divisible_by 8 × TP 2): rank 1 holds 3 real columns and 5 padding columns
ROWS, SEQ = 8, 7
PROMPT = 3
TINY_MODEL = {
    "policy.model.num_layers": 2,
    "policy.model.hidden_size": 24,
    "policy.model.num_attention_heads": 4,
    "policy.model.ffn_hidden_size": 40,
    "policy.model.max_position_embeddings": SEQ,
    "policy.model.make_vocab_size_divisible_by": 8,
    "policy.train_global_batch_size": ROWS,
    "policy.train_micro_batch_size": 2,
    "grpo.num_prompts_per_step": 2,
    "grpo.num_generations_per_prompt": ROWS // 2,
}
MICROBATCH_COUNTS = (1, 2, 4)
SGD_LR = 0.1  # the skipped-prev step's SGD: a clipped gradient of norm <= 1 moves some weight by well over 1e-3


def make_batch(seed: int) -> dict[str, torch.Tensor]:
    """Random rollouts: a 3-token prompt, a ragged response, one dropped sequence, per-sequence advantages."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    lengths = torch.randint(1, SEQ - PROMPT + 1, (ROWS,), generator=gen)
    positions = torch.arange(SEQ)
    token_mask = ((positions >= PROMPT) & (positions < PROMPT + lengths[:, None])).to(torch.float32)
    sample_mask = torch.ones(ROWS)
    sample_mask[5] = 0
    advantages = torch.randn(ROWS, generator=gen)
    return {"input_ids": input_ids, "token_mask": token_mask, "sample_mask": sample_mask, "advantages": advantages}


def reference_logprobs64(model, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """float64 [B, S] logprobs of softmax(logits / temperature) from a plain forward: all-gathered vocab shards,
    padding dropped, position 0 = 0."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    seq_len = input_ids.shape[1]
    position_ids = torch.arange(seq_len).expand_as(input_ids)
    causal_mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)[None, None]
    logits = gather_from_tensor_model_parallel_region(model(input_ids, position_ids, attention_mask=causal_mask))
    logprobs = torch.log_softmax(logits[..., :VOCAB].double() / temperature, dim=-1)
    picked = logprobs[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def reference_on_policy_loss64(model, batch) -> torch.Tensor:
    """On-policy clipped PG, token-mean: the ratio exp(lp - sg(lp)) is 1 (inside the clip range), its gradient
    is that of lp, so the loss is -sum(A * ratio) / trained tokens."""
    mask = (batch["token_mask"] * batch["sample_mask"][:, None]).double()
    mask[:, 0] = 0
    logprobs = reference_logprobs64(model, batch["input_ids"])
    ratio = torch.exp(logprobs - logprobs.detach())
    return -(batch["advantages"].double()[:, None] * ratio * mask).sum() / mask.sum()


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def grads_of(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def count_forwards(model) -> list[int]:
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def build(cfg):
    from megatron_grpo.megatron import build_gpt_model
    from megatron_grpo.runner.plugin_params import model_params

    torch.manual_seed(cfg.seed)  # identical initial weights for every model built with this config
    return build_gpt_model(model_params(cfg), VOCAB)


def scenario_microbatches(cfg) -> dict:
    """Megatron's schedule with 1, 2, 4 microbatches vs. a plain float64 full-batch gradient."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_grpo.loss import ClippedPGLoss, count_valid
    from megatron_grpo.megatron import compute_logprobs, make_forward_step, vocab_shard_of
    from megatron_grpo.ops import SamplingDistribution
    from megatron_grpo.runner.plan_inputs import plan_for

    model, batch = build(cfg), make_batch(seed=11)
    vocab = vocab_shard_of(model, VOCAB)
    position_ids = torch.arange(SEQ).expand(ROWS, SEQ)
    causal_mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(diagonal=1)[None, None]
    logits_shape = tuple(model(batch["input_ids"], position_ids, attention_mask=causal_mask).shape)
    reference_on_policy_loss64(model, batch).backward()
    expected, plan = grads_of(model), plan_for(cfg)
    tokens, seqs = count_valid(batch)
    errors, losses = {}, {}
    for count in MICROBATCH_COUNTS:
        model.zero_grad()
        rows = ROWS // count
        microbatches = [{k: v[i * rows:(i + 1) * rows] for k, v in batch.items()} for i in range(count)]
        forward_step = make_forward_step(ClippedPGLoss(cfg.loss_fn), plan, num_microbatches=count,
                                         global_valid_tokens=tokens, global_valid_seqs=seqs, vocab=vocab)
        metrics = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(microbatches),
                                              model=model, num_microbatches=count, seq_length=SEQ,
                                              micro_batch_size=rows, forward_only=False)
        got = grads_of(model)
        errors[count] = max((got[n] - expected[n]).abs().max().item() for n in expected)
        losses[count] = sum(m["loss"].item() for m in metrics)
    with torch.no_grad():
        logprob_error = (compute_logprobs(model, batch, micro_batch_size=2, vocab=vocab).double()
                         - reference_logprobs64(model, batch["input_ids"])).abs().max().item()
        tempered_error = (compute_logprobs(model, batch, micro_batch_size=2, vocab=vocab,
                                           distribution=SamplingDistribution.of_sampling(0.7)).double()
                          - reference_logprobs64(model, batch["input_ids"], temperature=0.7)).abs().max().item()
        tempered_shift = (reference_logprobs64(model, batch["input_ids"], temperature=0.7)
                          - reference_logprobs64(model, batch["input_ids"])).abs().max().item()
    return {"logits_shape": logits_shape, "vocab_sizes": (vocab.true_vocab_size, model.vocab_size),
            "vocab_start": vocab.start_index,
            "grad_errors": errors, "losses": losses, "reference_loss": reference_on_policy_loss64(model, batch).item(),
            "grad_scale": max(g.abs().max().item() for g in expected.values()), "logprob_error": logprob_error,
            "advantage_scale": batch["advantages"].abs().max().item(),
            "tempered_logprob_error": tempered_error, "tempered_logprob_shift": tempered_shift}


def scenario_skipped_prev(cfg) -> dict:
    """The same step with the prev pass skipped and computed: the same loss, gradient and update, and prev
    reported both ways.

    The step uses SGD: its update, -lr times the clipped gradient, is linear in the gradient, so it inherits the
    gradient's conditioning. Adam's first update, lr * g / (|g| + eps), is not: it maps a gradient element at the
    rounding level (one whose exact value is 0, such as a key bias's under the softmax's shift invariance) to
    anything in [-lr, lr], so its weights differ by whatever fp32 rounding each CPU's blocking produced."""
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import train_step, vocab_shard_of
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import step_config

    computed_cfg = dataclasses.replace(cfg, logprob_passes=dataclasses.replace(cfg.logprob_passes, prev="compute"))
    batch = make_batch(seed=12)
    outcome = {}
    for name, run_cfg in (("skipped", cfg), ("computed", computed_cfg)):
        model = build(run_cfg)
        initial = [p.detach().clone() for p in model.parameters()]
        forwards = count_forwards(model)
        plan = plan_for(run_cfg)
        result = train_step(step_config(run_cfg), model, torch.optim.SGD(model.parameters(), lr=SGD_LR),
                            ClippedPGLoss(run_cfg.loss_fn), plan, batch, vocab=vocab_shard_of(model, VOCAB))
        outcome[name] = {"initial": initial, "params": [p.detach().clone() for p in model.parameters()],
                         "grads": [p.grad.detach().clone() for p in model.parameters()],  # clipped, as stepped
                         "result": result, "forwards": forwards[0], "plan": plan}
    mask = (batch["token_mask"] * batch["sample_mask"][:, None]).bool()
    mask[:, 0] = False
    skipped, computed = outcome["skipped"], outcome["computed"]
    (skipped_step,), (computed_step,) = skipped["result"].step_metrics, computed["result"].step_metrics
    return {
        "loss": (skipped_step["loss"], computed_step["loss"]),
        "advantage_scale": batch["advantages"].abs().max().item(),
        "grad_error": max_difference(skipped["grads"], computed["grads"]),
        "grad_scale": max(g.abs().max().item() for g in skipped["grads"]),
        "update_error": max_difference(skipped["params"], computed["params"]),
        "weight_scale": max(p.abs().max().item() for p in skipped["params"]),
        "initial_difference": max_difference(skipped["initial"], computed["initial"]),
        "weights_moved": max_difference(skipped["params"], skipped["initial"]),
        "prev_error_on_mask": (skipped["result"].prev_logprobs
                               - computed["result"].prev_logprobs)[mask].abs().max().item(),
        "skipped_prev_is_curr": bool(torch.equal(skipped["result"].prev_logprobs, skipped["result"].curr_logprobs)),
        "passes_run": {name: o["result"].passes_run for name, o in outcome.items()},
        "forwards": {name: o["forwards"] for name, o in outcome.items()},
        "plans": {name: o["plan"] for name, o in outcome.items()},
        "step_metrics": {name: o["result"].step_metrics for name, o in outcome.items()},
    }


def scenario_reference(cfg) -> dict:
    """KL 0: no reference model is asked for and none runs; KL > 0: the reference runs one logprob pass."""
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import build_optimizer, train_step, vocab_shard_of
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, step_config

    kl_cfg = dataclasses.replace(cfg, loss_fn=dataclasses.replace(cfg.loss_fn, reference_policy_kl_penalty=0.1))
    batch = make_batch(seed=13)
    outcome = {}
    for name, run_cfg in (("kl0", cfg), ("kl", kl_cfg)):
        plan = plan_for(run_cfg)
        policy = build(run_cfg)
        reference = build(run_cfg) if plan.build_reference_model else None
        policy_forwards = count_forwards(policy)
        reference_forwards = count_forwards(reference) if reference is not None else None
        result = train_step(step_config(run_cfg), policy, build_optimizer(policy, adam_params(run_cfg)),
                            ClippedPGLoss(run_cfg.loss_fn), plan, batch, vocab=vocab_shard_of(policy, VOCAB),
                            reference_model=reference)
        outcome[name] = {"plan": plan, "policy_forwards": policy_forwards[0],
                         "reference_forwards": None if reference_forwards is None else reference_forwards[0],
                         "passes_run": result.passes_run,
                         "has_reference_logprobs": result.reference_policy_logprobs is not None}
    return outcome


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class OutOfPlace:
    """A `StepLoss` that declines the step's permission to write the logits' gradient in place."""

    def __init__(self, loss) -> None:
        self.loss, self.metric_aggregation = loss, loss.metric_aggregation

    def step_loss(self, output, batch, call):
        return self.loss.step_loss(output, batch, dataclasses.replace(call, inplace_backward=False))


def scenario_inplace_backward(cfg) -> dict:
    """make_forward_step through Megatron's schedule with the loss's in-place backward (the step's `LossCall` allows
    it) and without (a loss that declines it): the model's output logits after backward (their version counter:
    bumped once by the in-place write), and the gradients both ways."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_grpo.loss import ClippedPGLoss, count_valid
    from megatron_grpo.megatron import make_forward_step, vocab_shard_of
    from megatron_grpo.runner.plan_inputs import plan_for

    batch = make_batch(seed=12)
    tokens, seqs = count_valid(batch)
    out = {}
    for inplace in (True, False):
        model = build(cfg)
        outputs = []
        model.register_forward_hook(lambda module, args, output: outputs.append(output))
        loss = ClippedPGLoss(cfg.loss_fn)
        forward_step = make_forward_step(loss if inplace else OutOfPlace(loss), plan_for(cfg), num_microbatches=1,
                                         global_valid_tokens=tokens, global_valid_seqs=seqs,
                                         vocab=vocab_shard_of(model, VOCAB))
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([batch]), model=model,
                                    num_microbatches=1, seq_length=SEQ, micro_batch_size=ROWS, forward_only=False)
        (logits,) = outputs
        out[inplace] = {"logits_version": logits._version, "grads": grads_of(model)}
    return out


def cpu_support_is_idempotent() -> bool:
    from megatron.core.pipeline_parallel import schedules

    from megatron_grpo.megatron import apply_cpu_support

    patched = (schedules.torch, torch.cuda.current_device)
    return apply_cpu_support() and (schedules.torch, torch.cuda.current_device) == patched


def run_all_scenarios(rank: int, world_size: int) -> dict:
    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.plugin_params import parallel_params

    records = _Records()
    logger = logging.getLogger("megatron_grpo.megatron.step")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    cfg = config_with(TINY_MODEL)
    layout = init_parallel(parallel_params(cfg))
    try:
        results = {"layout": layout, "cpu_support_idempotent": cpu_support_is_idempotent(),
                   "microbatches": scenario_microbatches(cfg)}
        records.messages.clear()
        results["skipped_prev"] = scenario_skipped_prev(cfg)
        results["skipped_prev_log"] = list(records.messages)
        results["reference"] = scenario_reference(cfg)
        results["inplace"] = scenario_inplace_backward(cfg)
        return results
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(2, run_all_scenarios)


def test_layout_is_tp2_dp1(ranks):
    assert [(r["layout"].tp_rank, r["layout"].tp_size, r["layout"].dp_size) for r in ranks] == [(0, 2, 1), (1, 2, 1)]
    assert all(r["cpu_support_idempotent"] for r in ranks)


def test_model_logits_are_vocab_parallel_with_padded_vocab(ranks):
    for rank in ranks:
        assert rank["microbatches"]["vocab_sizes"] == (VOCAB, 16)
        # vocab_shard_of reads the output layer's columns: rank r holds ids from 8 r
        assert rank["microbatches"]["vocab_start"] == 8 * rank["layout"].tp_rank
        assert rank["microbatches"]["logits_shape"] == (ROWS, SEQ, 16 // 2)


@pytest.mark.parametrize("count", MICROBATCH_COUNTS)
def test_schedule_gradient_matches_full_batch_float64(ranks, count):
    for rank in ranks:
        result = rank["microbatches"]
        assert result["grad_scale"] > 1e-3  # a real gradient, not zeros
        # the same fp32 model backward, batched into microbatches, against a float64 loss head on the whole batch
        assert result["grad_errors"][count] <= MODEL_GRAD_RTOL * result["grad_scale"]
        # the on-policy loss is -sum(A * mask) / tokens: an fp32 sum of <= 56 terms of |A| < 3, each summand and
        # the running sum rounded, so within 56 * 2 u * 3 = 2e-5 however the microbatches split it
        assert result["advantage_scale"] < 3
        assert result["losses"][count] == pytest.approx(result["reference_loss"], abs=2e-5)


def test_the_training_forward_step_writes_the_logits_gradient_in_place(ranks):
    """The logits are the loss's alone in Megatron's schedule: backward overwrites them with their gradient (one
    version bump, so any other reader would fail loudly) and gives the same gradients bit for bit."""
    for rank in ranks:
        result = rank["inplace"]
        assert result[True]["logits_version"] == 1 and result[False]["logits_version"] == 0
        for name, grad in result[False]["grads"].items():
            assert torch.equal(result[True]["grads"][name], grad), name


def test_compute_logprobs_matches_float64_reference(ranks):
    assert all(rank["microbatches"]["logprob_error"] <= MODEL_LOGPROB_ATOL for rank in ranks)


def test_compute_logprobs_at_the_sampling_temperature(ranks):
    for rank in ranks:
        assert rank["microbatches"]["tempered_logprob_shift"] > 1e-2  # the temperature really changes them
        assert rank["microbatches"]["tempered_logprob_error"] <= MODEL_LOGPROB_ATOL


def test_skipped_prev_gives_the_same_update_as_computed_prev(ranks):
    for rank in ranks:
        result = rank["skipped_prev"]
        assert result["initial_difference"] == 0  # both runs start from the same weights
        assert result["weights_moved"] > 1e-3  # the step really changed the weights
        assert result["skipped_prev_is_curr"]  # backfilled from curr, no zero placeholder
        # the computed prev is another fp32 forward of the same weights, which need not round as the training forward
        # does: it and curr are each within MODEL_LOGPROB_ATOL of the float64 forward (as above), so within twice that
        prev_error = result["prev_error_on_mask"]
        assert prev_error <= 2 * MODEL_LOGPROB_ATOL
        # The training forward and backward are the same operations in both runs; only the ratio exp(curr - prev)
        # differs, by a factor within exp(+-prev_error) of 1 per token. So the loss moves by at most 3 prev_error
        # (|A| < 3), plus the rounding of its fp32 sum of 56 terms (2e-5, as above), and the gradient by about
        # prev_error relative to its terms, well within MODEL_GRAD_RTOL.
        assert result["advantage_scale"] < 3
        skipped_loss, computed_loss = result["loss"]
        assert computed_loss == pytest.approx(skipped_loss, rel=0, abs=3 * prev_error + 2e-5)
        assert result["grad_error"] <= MODEL_GRAD_RTOL * result["grad_scale"]
        # SGD's update is lr times the gradient, plus one fp32 rounding of each weight per run (u |w|)
        assert result["update_error"] <= (SGD_LR * MODEL_GRAD_RTOL * result["grad_scale"]
                                          + 2 * FP32_U * result["weight_scale"])


def test_prev_pass_runs_only_when_planned_and_is_counted_and_logged(ranks):
    for rank in ranks:
        result = rank["skipped_prev"]
        assert (result["plans"]["skipped"].compute_prev_logprobs, result["plans"]["computed"].compute_prev_logprobs) \
            == (False, True)
        assert result["passes_run"] == {"skipped": {}, "computed": {"prev": 1}}
        microbatches = ROWS // TINY_MODEL["policy.train_micro_batch_size"]
        assert result["forwards"] == {"skipped": microbatches, "computed": 2 * microbatches}
        assert rank["skipped_prev_log"] == ["logprob passes run: prev x1"]  # nothing about the skipped run


def test_step_metrics_are_aggregated_with_grad_norm(ranks):
    for rank in ranks:
        for metrics in rank["skipped_prev"]["step_metrics"].values():
            (step,) = metrics
            assert step["probs_ratio"] == pytest.approx(1.0, abs=1e-6)  # exact 1s, token-averaged: a few u
            assert step["num_valid_tokens"] > 0 and step["grad_norm"] > 0


def test_kl_zero_builds_no_reference_model_and_runs_no_reference_forward(ranks):
    microbatches = ROWS // TINY_MODEL["policy.train_micro_batch_size"]
    for rank in ranks:
        kl0, kl = rank["reference"]["kl0"], rank["reference"]["kl"]
        assert not kl0["plan"].build_reference_model and kl0["reference_forwards"] is None
        assert kl0["passes_run"] == {} and not kl0["has_reference_logprobs"]
        assert kl0["policy_forwards"] == microbatches  # the training forward only
        assert kl["plan"].build_reference_model
        assert kl["reference_forwards"] == microbatches and kl["passes_run"] == {"reference": 1}
        assert kl["has_reference_logprobs"] and kl["policy_forwards"] == microbatches


def megatron_lm_padded_vocab(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron-LM's _vocab_size_with_padding, as a loop."""
    padded = vocab_size
    while padded % (divisible_by * tp_size):
        padded += 1
    return padded


@pytest.mark.parametrize("vocab_size", [1, 13, 127, 128, 129, 50257])
@pytest.mark.parametrize("divisible_by, tp_size", [(1, 1), (8, 2), (128, 1), (128, 4)])
def test_padded_vocab_follows_megatron_lm(vocab_size, divisible_by, tp_size):
    from megatron_grpo.megatron.model import padded_vocab_size

    assert padded_vocab_size(vocab_size, divisible_by, tp_size) == megatron_lm_padded_vocab(vocab_size, divisible_by,
                                                                                            tp_size)


def test_transformer_engine_that_raises_runtime_error_is_not_usable(tmp_path, monkeypatch):
    from megatron_grpo.megatron import transformer_engine

    package = tmp_path / "transformer_engine"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "transformer_engine", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not transformer_engine.transformer_engine_usable()


def test_init_parallel_passes_the_timeout_to_torch_and_megatron(monkeypatch):
    """Wiring only: rank and world from torchrun's environment, gloo without CUDA, one timeout everywhere."""
    from datetime import timedelta

    from megatron_grpo.megatron import parallel
    from megatron_grpo.runner.plugin_params import parallel_params

    calls = {}
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(parallel, "apply_cpu_support", lambda: True)
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 4)
    monkeypatch.setattr(parallel.parallel_state, "initialize_model_parallel",
                        lambda **kw: calls.setdefault("megatron", kw))
    monkeypatch.setattr(parallel, "seed_all", lambda seed, on_cpu: calls.setdefault("seed", (seed, on_cpu)))
    monkeypatch.setattr(parallel, "current_layout", lambda: "layout")
    cfg = config_with({**TINY_MODEL, "distributed.timeout_seconds": 45})

    assert parallel.init_parallel(parallel_params(cfg)) == "layout"
    assert calls["init"] == {"backend": "gloo", "rank": 3, "world_size": 4, "timeout": timedelta(seconds=45)}
    assert calls["megatron"] == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                                 "context_parallel_size": 1, "expert_model_parallel_size": 1,
                                 "expert_tensor_parallel_size": None, "distributed_timeout_minutes": 0.75}
    assert calls["seed"] == (cfg.seed, True)


def test_init_parallel_rejects_a_world_that_tp_times_pp_does_not_divide(monkeypatch):
    from megatron_grpo.megatron import parallel

    monkeypatch.setattr(parallel, "apply_cpu_support", lambda: True)
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 3)
    with pytest.raises(ValueError, match=r"world size 3 is not a multiple of tensor_model_parallel_size \(2\)"):
        parallel.init_parallel(parallel.ParallelParams(tensor_model_parallel_size=2))


def test_init_parallel_rejects_an_expert_grid_the_world_does_not_hold(monkeypatch):
    from megatron_grpo.megatron import parallel

    monkeypatch.setattr(parallel, "apply_cpu_support", lambda: True)
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 2)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size: world size 2 is not a multiple of "
                                         r"expert_tensor_parallel_size \(2\) × expert_model_parallel_size \(2\)"):
        parallel.init_parallel(parallel.ParallelParams(tensor_model_parallel_size=2, expert_model_parallel_size=2))
    with pytest.raises(ValueError, match=r"expert_model_parallel_size: must be an integer >= 1, got 0"):
        parallel.init_parallel(parallel.ParallelParams(expert_model_parallel_size=0))


def test_train_step_without_the_planned_reference_model_names_it():
    from megatron_grpo.megatron import train_step
    from megatron_grpo.ops import VocabShard
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import step_config

    cfg = config_with({**TINY_MODEL, "loss_fn.reference_policy_kl_penalty": 0.1})
    with pytest.raises(ValueError, match="reference_model"):
        train_step(step_config(cfg), torch.nn.Linear(1, 1), None, None, plan_for(cfg), make_batch(seed=1),
                   vocab=VocabShard(true_vocab_size=VOCAB))


@pytest.mark.parametrize("mode, batch_versions, message", [
    ("loglinear", False, r"prev_version and batch\['rollout_weight_version'\]: required by the plan's prev "
                         r"\(loglinear\)"),
    ("compute_and_compare", True, r"prev_version: required by the plan's prev \(prev pass, compared with its "
                                  r"approximations\)"),
])
def test_train_step_without_the_versions_an_interpolation_needs_names_them(mode, batch_versions, message):
    from megatron_grpo.megatron import train_step
    from megatron_grpo.ops import VocabShard
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import step_config

    cfg = config_with({**TINY_MODEL, "logprob_passes.prev": mode})
    batch = make_batch(seed=1)
    if batch_versions:
        batch["rollout_weight_version"] = torch.zeros(batch["input_ids"].shape[0], dtype=torch.int64)
    with pytest.raises(ValueError, match=message):
        train_step(step_config(cfg), torch.nn.Linear(1, 1), None, None, plan_for(cfg), batch,
                   vocab=VocabShard(true_vocab_size=VOCAB))


def test_the_plans_prev_source_becomes_the_losss_call():
    from megatron_grpo.loss.call import PrevSource
    from megatron_grpo.loss.prev_approximation import PrevApproximation, StepVersions
    from megatron_grpo.megatron.step import prev_source
    from megatron_grpo.runner.plan_inputs import plan_for

    def plan(mode):
        return plan_for(config_with({**TINY_MODEL, "logprob_passes.prev": mode}))

    versions = StepVersions(2, 2.5)
    assert prev_source(plan("auto")) == PrevSource(from_current=True)
    assert prev_source(plan("compute")) == PrevSource(from_current=False)
    assert prev_source(plan("generation")) == PrevSource(from_current=False,
                                                         approximation=PrevApproximation("generation"))
    assert prev_source(plan("linear"), versions).approximation == PrevApproximation("linear", versions)
    assert prev_source(plan("compute_and_compare"), versions).compare_with == versions
    with pytest.raises(ValueError, match=r"versions: the plan's prev \(loglinear\) needs"):
        prev_source(plan("loglinear"))


@pytest.mark.parametrize("rows, dp_size, expected", [
    (ROWS - 2, 1, "not a multiple of global_batch_size / DP"),
    (ROWS, 3, "not a multiple of the data-parallel size"),
])
def test_batch_that_is_no_whole_number_of_steps_names_the_keys(monkeypatch, rows, dp_size, expected):
    module = importlib.import_module("megatron_grpo.megatron.step")  # the package exports a function of that name
    monkeypatch.setattr(module.parallel_state, "get_data_parallel_world_size", lambda: dp_size)
    with pytest.raises(ValueError, match=expected):
        module._rows_per_optimizer_step(module.StepConfig(global_batch_size=ROWS, micro_batch_size=2), rows)


def test_microbatch_split_names_the_micro_batch_size():
    from megatron_grpo.megatron.step import _split

    with pytest.raises(ValueError, match=r"not a positive multiple of micro_batch_size \(3\)"):
        _split(make_batch(seed=1), micro_batch_size=3)


def _shard_of(monkeypatch, model, true_vocab_size: int, tp_rank: int = 1, tp_size: int = 2):
    """`vocab_shard_of` on TP rank `tp_rank` of `tp_size`, without process groups (a stand-in group object)."""
    from megatron_grpo.megatron import vocab

    monkeypatch.setattr(vocab.parallel_state, "get_tensor_model_parallel_world_size", lambda: tp_size)
    monkeypatch.setattr(vocab.parallel_state, "get_tensor_model_parallel_rank", lambda: tp_rank)
    monkeypatch.setattr(vocab.parallel_state, "get_tensor_model_parallel_group", lambda: "tp-group")
    return vocab.vocab_shard_of(model, true_vocab_size)


def test_the_vocab_shard_comes_from_whichever_of_megatrons_vocab_layers_a_stage_holds(monkeypatch):
    """The last stage's output layer, else the first stage's input embedding, else (a middle pipeline stage) the
    model's padded vocab split evenly: rank 1 of 2 holds ids from 8 of a vocab padded to 16."""
    from types import SimpleNamespace

    from megatron_grpo.ops import VocabShard

    expected = VocabShard(start_index=8, true_vocab_size=VOCAB, group="tp-group")
    last = SimpleNamespace(output_layer=SimpleNamespace(output_size_per_partition=8))
    first = SimpleNamespace(embedding=SimpleNamespace(word_embeddings=SimpleNamespace(
        vocab_start_index=8, num_embeddings_per_partition=8)))
    middle = SimpleNamespace(vocab_size=16)
    assert [_shard_of(monkeypatch, model, VOCAB) for model in (last, first, middle)] == [expected] * 3
    assert _shard_of(monkeypatch, middle, VOCAB, tp_rank=0, tp_size=1) == VocabShard(0, VOCAB, None)
    with pytest.raises(ValueError, match=r"true_vocab_size: must be in \[1, 16\] .* got 17"):
        _shard_of(monkeypatch, last, 17)
    with pytest.raises(ValueError, match="no output layer, input embedding or vocab_size"):
        _shard_of(monkeypatch, SimpleNamespace(), VOCAB)


def test_the_parameter_objects_defaults_are_megatrons():
    """Each default of the Megatron layer's parameter objects is Megatron-Core's own for the same key."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_grpo.megatron import AdamParams, GPTModelParams, StepConfig

    transformer = {field.name: field.default for field in dataclasses.fields(TransformerConfig)}
    model = GPTModelParams(num_layers=2, hidden_size=24, num_attention_heads=4, max_position_embeddings=SEQ)
    for name in ("ffn_hidden_size", "init_method_std", "hidden_dropout", "attention_dropout"):
        assert getattr(model, name) == transformer[name], name
    optimizer = {field.name: field.default for field in dataclasses.fields(OptimizerConfig)}
    adam = AdamParams(lr=1e-3)
    for name in ("adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "clip_grad"):
        assert getattr(adam, name) == optimizer[name], name
    assert StepConfig(global_batch_size=ROWS, micro_batch_size=2).clip_grad == optimizer["clip_grad"]
