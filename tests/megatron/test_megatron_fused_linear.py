"""`policy.fused_linear_logprobs` (and `policy.fused_linear_loss`) on the real tiny GPTModel: the train step from
hidden states, by the fused op or by the loss-fused path, equals the train step from materialised logits
(logprobs, entropy, loss, gradients) at TP = 1 and TP = 2 over gloo, with a separate output layer, with the output
layer tied to the input embedding (`share_embeddings_and_output_weights`), and with top-k and top-p sampling filters
(the loss-fused path too: the filter's threshold is per row, and its chunks hold whole rows).

The vocab is Megatron-padded in every case: 13 real tokens padded to 16 (`VOCAB` of test_megatron_hooks), so at
TP = 2 rank 1's shard holds 3 real and 5 padding columns.

Each world size is one spawn that runs every case; the tests assert on what the ranks report.
"""

from __future__ import annotations

import pytest
import torch
from _configs import config_with, drop_key, tiny
from _dist import run_on_ranks
from _tolerances import MODEL_GRAD_RTOL, MODEL_LOGPROB_ATOL
from test_megatron_hooks import ROWS, SEQ, TINY_MODEL, VOCAB, make_batch

from megatron_grpo.ops import SamplingDistribution
from megatron_grpo.runner.config import ConfigError, load_config

# The fused paths compute the materialised path's fp32 maths with the logits formed chunk by chunk (another GEMM
# blocking): logprobs and gradients to MODEL_LOGPROB_ATOL and MODEL_GRAD_RTOL. The loss and the mean entropy are
# token means of functions of the logprobs with slope below 4 (|A| ratio, the KL's, the entropy's own).
METRIC_ATOL = 4 * MODEL_LOGPROB_ATOL
CASES = {
    # temperature 1, the default passes (prev and reference skipped), no entropy term
    "plain": {},
    # temperature != 1, all three logprob passes (reference for the KL, prev computed), an entropy bonus
    "tempered_kl_entropy": {"generation.temperature": 0.7, "loss_fn.reference_policy_kl_penalty": 0.1,
                            "logprob_passes.prev": "compute", "loss_fn.entropy_coef": 0.01},
}
# Output layer tied to the input embedding: temperature != 1 and an entropy bonus, so that both gradient terms of
# the fused op reach the embedding (no reference model or prev pass: those are forward-only, checked above).
CASES["tied_embeddings"] = {"generation.temperature": 0.7, "loss_fn.entropy_coef": 0.01}
# A sampling filter with a KL in the loss: the fused paths filter, and the KL reads unfiltered current logprobs.
CASES["top_k_kl"] = {"generation.top_k": 5, "loss_fn.reference_policy_kl_penalty": 0.1}
CASES["top_p"] = {"generation.top_p": 0.9, "generation.temperature": 0.7, "loss_fn.entropy_coef": 0.01}
# Under Megatron's DDP (as the runner trains): the fused paths add dW into the output weight's fp32 `main_grad`
# (Megatron's protocol: `grad_added_to_main_grad`, and a zero dummy gradient for a weight tied to the embedding,
# whose own gradient arrives through the same hook), untied and tied.
CASES["ddp"] = {"generation.temperature": 0.7, "loss_fn.entropy_coef": 0.01}
CASES["ddp_tied"] = {"generation.temperature": 0.7, "loss_fn.entropy_coef": 0.01}
TIED = {"tied_embeddings", "ddp_tied"}
DDP = {"ddp", "ddp_tied"}
# (fused_linear_logprobs, fused_linear_loss): the fused op, and the loss-fused path.
MODES = {"fused": (True, False), "loss_fused": (True, True)}


EMBEDDING = "embedding.word_embeddings.weight"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def build(cfg, tied: bool = False):
    """The tiny GPTModel with identical initial weights for every build with this config (and `tied`)."""
    from megatron_grpo.megatron import build_gpt_model
    from megatron_grpo.runner.plugin_params import model_params

    torch.manual_seed(cfg.seed)
    return build_gpt_model(model_params(cfg), VOCAB, share_embeddings_and_output_weights=tied)


def _tying(model) -> dict:
    """Where the fused path takes its weight from, and which parameters the model has."""
    from megatron_grpo.megatron import vocab_shard_of
    from megatron_grpo.megatron.hidden_states import output_weight

    vocab = vocab_shard_of(model, VOCAB)  # a tied model's output layer holds no weight, but its columns
    return {"weight_is_embedding": output_weight(model) is model.embedding.word_embeddings.weight,
            "weight_is_output_layer": output_weight(model) is model.output_layer.weight,
            "parameter_names": [name for name, _ in model.named_parameters()],
            "vocab_sizes": (vocab.true_vocab_size, model.vocab_size), "vocab_start": vocab.start_index}


def _run_train_step(cfg, batch, tied: bool, ddp: bool = False) -> dict:
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import build_optimizer, train_step, vocab_shard_of, wrap_in_ddp
    from megatron_grpo.megatron.ddp import gradient
    from megatron_grpo.megatron.hidden_states import output_weight
    from megatron_grpo.runner.plan_inputs import plan_for
    from megatron_grpo.runner.plugin_params import adam_params, step_config

    plan = plan_for(cfg)
    model = build(cfg, tied)
    reference = build(cfg, tied) if plan.build_reference_model else None
    tying = _tying(model)
    output_layer = model.output_layer
    output_layer_calls = [0]
    output_layer.register_forward_hook(lambda *_: output_layer_calls.__setitem__(0, output_layer_calls[0] + 1))
    trained = wrap_in_ddp(model) if ddp else model
    result = train_step(step_config(cfg), trained, build_optimizer(trained, adam_params(cfg)),
                        ClippedPGLoss(cfg.loss_fn), plan, batch, vocab=vocab_shard_of(model, VOCAB),
                        reference_model=reference)
    return {
        "result": result,
        "grads": {name: gradient(p).detach().clone() for name, p in model.named_parameters()},
        "added_to_main_grad": getattr(output_weight(model), "grad_added_to_main_grad", None),
        "dense_grad": output_weight(model).grad is not None,
        "output_layer_calls": output_layer_calls[0],
        "output_layer_restored": model.output_layer is output_layer,
        "tying": tying,
    }


def _per_token(cfg, batch, tied: bool) -> dict:
    """Per-token logprobs and entropies of the trained tokens, both ways, at the config's temperature and filter."""
    from megatron_grpo.loss import trained_token_mask, trained_token_targets
    from megatron_grpo.megatron import model_forward, vocab_shard_of
    from megatron_grpo.megatron.hidden_states import output_weight
    from megatron_grpo.ops import HiddenStates, SamplingDistribution, current_logprobs, vocab_parallel_logprobs
    from megatron_grpo.runner.plugin_params import step_config

    model, temperature = build(cfg, tied), cfg.generation.temperature
    distribution = step_config(cfg).distribution
    filtered = SamplingDistribution(top_k=cfg.generation.top_k, top_p=cfg.generation.top_p)
    vocab = vocab_shard_of(model, VOCAB)
    targets = trained_token_targets(batch["input_ids"], trained_token_mask(batch))
    with torch.no_grad():
        logits = model_forward(model, batch["input_ids"])
        hidden = model_forward(model, batch["input_ids"], hidden_states=True)
        materialised = vocab_parallel_logprobs(logits / temperature, targets, shard=vocab, shift=True,
                                               with_entropy=True, distribution=filtered)
        current = current_logprobs(HiddenStates(hidden, output_weight(model)), targets, shard=vocab,
                                   distribution=distribution)
        fused = current.logprobs, current.entropy
    finite = torch.isfinite(materialised[0])
    assert torch.equal(finite, torch.isfinite(fused[0])), "filtered tokens differ"
    return {"hidden_shape": tuple(hidden.shape),
            "logprob_error": _max_diff(materialised[0][finite], fused[0][finite]),
            "entropy_error": _max_diff(materialised[1], fused[1]), "entropy_scale": materialised[1].abs().max().item()}


def _compare(plain: dict, fused: dict) -> dict:
    """How one hidden-states run differs from the materialised run."""
    a, b = plain["result"], fused["result"]
    step_a, step_b = a.step_metrics[0], b.step_metrics[0]
    return {
        "curr_error": _max_diff(a.curr_logprobs, b.curr_logprobs),
        "prev_error": _max_diff(a.prev_logprobs, b.prev_logprobs),
        "reference_error": None if a.reference_policy_logprobs is None
        else _max_diff(a.reference_policy_logprobs, b.reference_policy_logprobs),
        "passes_run": (a.passes_run, b.passes_run),
        "metric_errors": {key: abs(step_a[key] - step_b[key]) for key in ("loss", "entropy", "grad_norm")
                          if key in step_a},
        "grad_norm": step_a["grad_norm"],
        "kl_in_metrics": "kl_penalty" in step_a and "kl_penalty" in step_b,
        "grad_error": max(_max_diff(plain["grads"][n], fused["grads"][n]) for n in plain["grads"]),
        "grad_scale": max(g.abs().max().item() for g in plain["grads"].values()),
        "output_layer_calls": (plain["output_layer_calls"], fused["output_layer_calls"]),
        "output_layer_restored": fused["output_layer_restored"],
        "added_to_main_grad": (plain["added_to_main_grad"], fused["added_to_main_grad"]),
        "dense_grad": (plain["dense_grad"], fused["dense_grad"]),
        "tying": fused["tying"],
        "embedding_grad_error": _max_diff(plain["grads"][EMBEDDING], fused["grads"][EMBEDDING]),
        "embedding_grad_scale": plain["grads"][EMBEDDING].abs().max().item(),
    }


def run_cases(rank: int, world_size: int) -> dict:
    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.runner.plugin_params import parallel_params

    base = {**TINY_MODEL, "policy.tensor_model_parallel_size": world_size}
    init_parallel(parallel_params(config_with(base)))
    try:
        outcome = {"tp_rank": rank}  # TP is the whole world here
        for name, overrides in CASES.items():
            tied, ddp = name in TIED, name in DDP
            plain = _run_train_step(config_with({**base, **overrides, "policy.fused_linear_logprobs": False}),
                                    make_batch(seed=21), tied, ddp)
            outcome[name] = {mode: _compare(plain, _run_train_step(
                config_with({**base, **overrides, "policy.fused_linear_logprobs": MODES[mode][0],
                             "policy.fused_linear_loss": MODES[mode][1]}), make_batch(seed=21), tied, ddp))
                for mode in MODES}
            outcome[name]["per_token"] = _per_token(config_with({**base, **overrides}), make_batch(seed=22), tied)
        return outcome
    finally:
        destroy_parallel()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request) -> list[dict]:
    return run_on_ranks(request.param, run_cases)


CASE_MODES = [(case, mode) for case in CASES for mode in MODES]


@pytest.mark.parametrize("case, mode", CASE_MODES, ids=[f"{c}-{m}" for c, m in CASE_MODES])
def test_fused_train_step_equals_materialised(ranks, case, mode):
    for rank in ranks:
        result = rank[case][mode]
        assert result["grad_scale"] > 1e-3  # a real gradient
        assert result["curr_error"] <= MODEL_LOGPROB_ATOL and result["prev_error"] <= MODEL_LOGPROB_ATOL
        # Gradients, not the updated weights: Adam's first step is nearly lr * sign(grad), so a 1e-9 rounding
        # difference in a ~1e-8 gradient entry can move that weight by a sizeable fraction of lr.
        assert result["grad_error"] <= MODEL_GRAD_RTOL * result["grad_scale"]
        errors = result["metric_errors"]
        assert errors["loss"] <= METRIC_ATOL and errors["entropy"] <= METRIC_ATOL, errors
        assert errors["grad_norm"] <= MODEL_GRAD_RTOL * result["grad_norm"], errors


@pytest.mark.parametrize("case", ["tempered_kl_entropy", "top_k_kl"])
def test_all_three_passes_run_fused_and_agree(ranks, case):
    for rank in ranks:
        for mode in MODES:
            result = rank[case][mode]
            passes = {"reference": 1, "prev": 1} if case == "tempered_kl_entropy" else {"reference": 1}
            assert result["passes_run"] == (passes, passes)
            assert result["reference_error"] <= MODEL_LOGPROB_ATOL and result["kl_in_metrics"]


def test_tied_embeddings_fused_weight_is_the_embedding_and_its_gradient_matches(ranks):
    """Tied: the fused op reads the embedding shard, and the embedding's gradient (input lookup + output layer)
    equals the materialised path's, where Megatron's output layer is handed the embedding weight."""
    for rank in ranks:
        for mode in MODES:
            result = rank["tied_embeddings"][mode]
            tying = result["tying"]
            assert tying["weight_is_embedding"] and "output_layer.weight" not in tying["parameter_names"]
            assert EMBEDDING in tying["parameter_names"]
            assert result["embedding_grad_scale"] > 1e-3
            assert result["embedding_grad_error"] <= MODEL_GRAD_RTOL * result["embedding_grad_scale"]


def test_under_ddp_the_fused_paths_add_the_weight_gradient_into_main_grad(ranks):
    """The materialised path's output layer hands DDP's hook a dense gradient (Megatron's layer without
    gradient_accumulation_fusion); the fused paths add dW into `main_grad` themselves and say so. The gradients
    themselves (main_grad, tied or not) equal the materialised path's in test_fused_train_step_equals_materialised;
    without DDP the fused paths return a dense dW."""
    for rank in ranks:
        for case in DDP:
            for mode in MODES:
                assert rank[case][mode]["added_to_main_grad"] == (False, True), (case, mode)
        for mode in MODES:
            assert rank["plain"][mode]["added_to_main_grad"] == (None, None)
            assert rank["plain"][mode]["dense_grad"] == (True, True)


def test_untied_fused_weight_is_the_output_layer(ranks):
    for rank in ranks:
        tying = rank["plain"]["fused"]["tying"]
        assert tying["weight_is_output_layer"] and not tying["weight_is_embedding"]
        assert {"output_layer.weight", EMBEDDING} <= set(tying["parameter_names"])


def test_every_case_runs_on_a_padded_vocab(ranks):
    for rank in ranks:
        for case in CASES:
            tying = rank[case]["fused"]["tying"]
            true_size, padded_size = tying["vocab_sizes"]
            assert (true_size, padded_size) == (VOCAB, 16) and padded_size % len(ranks) == 0
            # vocab_shard_of reads Megatron's output layer, tied or not: rank r holds ids from r * 16 / TP
            assert tying["vocab_start"] == rank["tp_rank"] * padded_size // len(ranks)


def test_fused_per_token_logprobs_and_entropy(ranks):
    for rank in ranks:
        for case in CASES:
            per_token = rank[case]["per_token"]
            assert per_token["hidden_shape"] == (ROWS, SEQ, TINY_MODEL["policy.model.hidden_size"])
            assert per_token["entropy_scale"] > 0.1
            assert per_token["logprob_error"] <= MODEL_LOGPROB_ATOL
            # the entropy, like a logprob, from the same partials: relative to max(1, H) as the op's anchor tests
            assert per_token["entropy_error"] <= MODEL_LOGPROB_ATOL * max(1.0, per_token["entropy_scale"])


def test_fused_never_runs_the_output_layer_and_restores_it(ranks):
    for rank in ranks:
        for case, mode in CASE_MODES:
            materialised_calls, fused_calls = rank[case][mode]["output_layer_calls"]
            assert materialised_calls > 0 and fused_calls == 0
            assert rank[case][mode]["output_layer_restored"]


@pytest.mark.parametrize("key, value", [("generation.top_k", 5), ("generation.top_p", 0.9)])
def test_loss_fused_takes_a_sampling_filter(key, value):
    cfg = config_with({"policy.fused_linear_logprobs": True, "policy.fused_linear_loss": True, key: value})
    assert cfg.policy.fused_linear_loss and getattr(cfg.generation, key.split(".")[1]) == value
    replayed = config_with({"policy.fused_linear_logprobs": True, "policy.fused_linear_loss": True, key: value,
                            "generation.replay_kept_set": True, "loss_fn.reference_policy_kl_penalty": 0.1})
    assert replayed.generation.replay_kept_set  # the head replays the sampler's sets, the KL's unfiltered term too


def test_loss_fused_needs_the_fused_linear_path():
    with pytest.raises(ConfigError, match="policy.fused_linear_loss: true needs policy.fused_linear_logprobs: true"):
        config_with({"policy.fused_linear_logprobs": False, "policy.fused_linear_loss": True})


@pytest.mark.parametrize("key", ["policy.fused_linear_logprobs", "policy.fused_linear_loss"])
def test_fused_linear_keys_are_required(key):
    with pytest.raises(ConfigError, match=key):
        load_config(drop_key(tiny(), key))


def test_loss_takes_either_logits_or_precomputed_logprobs():
    from megatron_grpo.loss import ClippedPGLoss

    cfg = config_with({})
    loss = ClippedPGLoss(cfg.loss_fn)
    batch = make_batch(seed=3)
    logprobs = torch.zeros(ROWS, SEQ)
    counts = {"global_valid_tokens": 100.0, "global_valid_seqs": 100.0, "prev_logprobs_from_current": True}
    with pytest.raises(ValueError, match="curr_entropy"):
        loss(None, batch, curr_logprobs=logprobs, **counts)
    with pytest.raises(ValueError, match="not both"):
        loss(torch.zeros(ROWS, SEQ, 16), batch, curr_logprobs=logprobs, curr_entropy=logprobs, **counts)
    with pytest.raises(ValueError, match="curr_unfiltered_logprobs: only with a top-k / top-p distribution"):
        loss(None, batch, curr_logprobs=logprobs, curr_entropy=logprobs, curr_unfiltered_logprobs=logprobs, **counts)
    kl = ClippedPGLoss(config_with({"loss_fn.reference_policy_kl_penalty": 0.1}).loss_fn)
    with pytest.raises(ValueError,
                       match="curr_unfiltered_logprobs: required with a top-k / top-p distribution and a KL"):
        kl(None, batch, curr_logprobs=logprobs, curr_entropy=logprobs, distribution=SamplingDistribution(top_k=3),
           **counts)
    value, metrics = loss(None, batch, curr_logprobs=logprobs, curr_entropy=logprobs, **counts)
    assert torch.isfinite(value) and metrics["entropy"] == 0
