"""`policy.fused_linear_logprobs` on the real tiny GPTModel: the train step from hidden states equals the train
step from materialised logits (logprobs, entropy, loss, gradients) at TP = 1 and TP = 2 over gloo, with a separate
output layer and with the output layer tied to the input embedding (`share_embeddings_and_output_weights`).

The vocab is Megatron-padded in every case: 13 real tokens padded to 16 (`VOCAB` of test_megatron_hooks), so at
TP = 2 rank 1's shard holds 3 real and 5 padding columns.

Each world size is one spawn that runs every case; the tests assert on what the ranks report.
"""

from __future__ import annotations

import pytest
import torch
from _configs import config_with, drop_key, tiny
from _dist import run_on_ranks
from test_megatron_hooks import ROWS, SEQ, TINY_MODEL, VOCAB, make_batch

from megatron_grpo.config import ConfigError, load_config

TOL = 1e-5
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
TIED = {"tied_embeddings"}
EMBEDDING = "embedding.word_embeddings.weight"


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def build(cfg, tied: bool = False):
    """The tiny GPTModel with identical initial weights for every build with this config (and `tied`)."""
    from megatron_grpo.megatron import build_gpt_model

    torch.manual_seed(cfg.seed)
    return build_gpt_model(cfg, VOCAB, share_embeddings_and_output_weights=tied)


def _tying(model) -> dict:
    """Where the fused path takes its weight from, and which parameters the model has."""
    from megatron_grpo.megatron.hidden_states import output_weight

    return {"weight_is_embedding": output_weight(model) is model.embedding.word_embeddings.weight,
            "weight_is_output_layer": output_weight(model) is model.output_layer.weight,
            "parameter_names": [name for name, _ in model.named_parameters()],
            "vocab_sizes": (model.true_vocab_size, model.padded_vocab_size)}


def _run_train_step(cfg, batch, tied: bool) -> dict:
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import build_optimizer, train_step
    from megatron_grpo.scheduler import plan_logprob_passes

    plan = plan_logprob_passes(cfg)
    model = build(cfg, tied)
    reference = build(cfg, tied) if plan.build_reference_model else None
    tying = _tying(model)
    output_layer = model.output_layer
    output_layer_calls = [0]
    output_layer.register_forward_hook(lambda *_: output_layer_calls.__setitem__(0, output_layer_calls[0] + 1))
    result = train_step(cfg, model, build_optimizer(model, cfg.policy.optimizer), ClippedPGLoss(cfg.loss_fn), plan,
                        batch, reference_model=reference)
    return {
        "result": result,
        "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()},
        "output_layer_calls": output_layer_calls[0],
        "output_layer_restored": model.output_layer is output_layer,
        "tying": tying,
    }


def _per_token(cfg, batch, tied: bool) -> dict:
    """Per-token logprobs and entropies of the trained tokens, both ways, at the config's temperature."""
    from megatron_grpo.loss import next_token_logprobs, trained_token_mask
    from megatron_grpo.megatron import model_forward
    from megatron_grpo.megatron.train_step import VocabShard, _linear_next_token_logprobs, tempered

    model, temperature = build(cfg, tied), cfg.generation.temperature
    vocab = VocabShard.of(model)
    trained = trained_token_mask(batch)
    with torch.no_grad():
        logits = model_forward(model, batch["input_ids"])
        hidden = model_forward(model, batch["input_ids"], hidden_states=True)
        materialised = next_token_logprobs(tempered(logits, temperature), batch["input_ids"], trained=trained,
                                           vocab_start_index=vocab.start_index, true_vocab_size=vocab.true_vocab_size,
                                           group=vocab.group, with_entropy=True)
        fused = _linear_next_token_logprobs(model, hidden, batch["input_ids"], vocab, temperature, trained=trained,
                                            with_entropy=True)
    return {"hidden_shape": tuple(hidden.shape), "logprob_error": _max_diff(materialised[0], fused[0]),
            "entropy_error": _max_diff(materialised[1], fused[1]), "entropy_scale": materialised[1].abs().max().item()}


def run_cases(rank: int, world_size: int) -> dict:
    from megatron_grpo.megatron import destroy_parallel, init_parallel

    base = {**TINY_MODEL, "policy.tensor_model_parallel_size": world_size}
    init_parallel(config_with(base))
    try:
        outcome = {}
        for name, overrides in CASES.items():
            tied = name in TIED
            runs = {fused: _run_train_step(config_with({**base, **overrides, "policy.fused_linear_logprobs": fused}),
                                           make_batch(seed=21), tied)
                    for fused in (False, True)}
            plain, fused = runs[False], runs[True]
            a, b = plain["result"], fused["result"]
            step_a, step_b = a.step_metrics[0], b.step_metrics[0]
            outcome[name] = {
                "curr_error": _max_diff(a.curr_logprobs, b.curr_logprobs),
                "prev_error": _max_diff(a.prev_logprobs, b.prev_logprobs),
                "reference_error": None if a.reference_policy_logprobs is None
                else _max_diff(a.reference_policy_logprobs, b.reference_policy_logprobs),
                "passes_run": (a.passes_run, b.passes_run),
                "metric_errors": {key: abs(step_a[key] - step_b[key]) for key in ("loss", "entropy", "grad_norm")
                                  if key in step_a},
                "kl_in_metrics": "kl_penalty" in step_a and "kl_penalty" in step_b,
                "grad_error": max(_max_diff(plain["grads"][n], fused["grads"][n]) for n in plain["grads"]),
                "grad_scale": max(g.abs().max().item() for g in plain["grads"].values()),
                "output_layer_calls": (plain["output_layer_calls"], fused["output_layer_calls"]),
                "output_layer_restored": fused["output_layer_restored"],
                "tying": fused["tying"],
                "embedding_grad_error": _max_diff(plain["grads"][EMBEDDING], fused["grads"][EMBEDDING]),
                "embedding_grad_scale": plain["grads"][EMBEDDING].abs().max().item(),
                "per_token": _per_token(config_with({**base, **overrides}), make_batch(seed=22), tied),
            }
        return outcome
    finally:
        destroy_parallel()


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request) -> list[dict]:
    return run_on_ranks(request.param, run_cases)


@pytest.mark.parametrize("case", list(CASES))
def test_fused_train_step_equals_materialised(ranks, case):
    for rank in ranks:
        result = rank[case]
        assert result["grad_scale"] > 1e-3  # a real gradient
        assert result["curr_error"] < TOL and result["prev_error"] < TOL
        # Gradients, not the updated weights: Adam's first step is nearly lr * sign(grad), so a 1e-9 rounding
        # difference in a ~1e-8 gradient entry can move that weight by a sizeable fraction of lr.
        assert result["grad_error"] < TOL
        assert all(error < TOL for error in result["metric_errors"].values()), result["metric_errors"]
        assert {"loss", "entropy"} <= set(result["metric_errors"])


def test_all_three_passes_run_fused_and_agree(ranks):
    for rank in ranks:
        result = rank["tempered_kl_entropy"]
        assert result["passes_run"] == ({"reference": 1, "prev": 1}, {"reference": 1, "prev": 1})
        assert result["reference_error"] < TOL and result["kl_in_metrics"]


def test_tied_embeddings_fused_weight_is_the_embedding_and_its_gradient_matches(ranks):
    """Tied: the fused op reads the embedding shard, and the embedding's gradient (input lookup + output layer)
    equals the materialised path's, where Megatron's output layer is handed the embedding weight."""
    for rank in ranks:
        result = rank["tied_embeddings"]
        tying = result["tying"]
        assert tying["weight_is_embedding"] and "output_layer.weight" not in tying["parameter_names"]
        assert EMBEDDING in tying["parameter_names"]
        assert result["embedding_grad_scale"] > 1e-3
        assert result["embedding_grad_error"] < TOL


def test_untied_fused_weight_is_the_output_layer(ranks):
    for rank in ranks:
        tying = rank["plain"]["tying"]
        assert tying["weight_is_output_layer"] and not tying["weight_is_embedding"]
        assert {"output_layer.weight", EMBEDDING} <= set(tying["parameter_names"])


def test_every_case_runs_on_a_padded_vocab(ranks):
    for rank in ranks:
        for case in CASES:
            true_size, padded_size = rank[case]["tying"]["vocab_sizes"]
            assert (true_size, padded_size) == (VOCAB, 16) and padded_size % len(ranks) == 0


def test_fused_per_token_logprobs_and_entropy(ranks):
    for rank in ranks:
        for case in CASES:
            per_token = rank[case]["per_token"]
            assert per_token["hidden_shape"] == (ROWS, SEQ, TINY_MODEL["policy.model.hidden_size"])
            assert per_token["entropy_scale"] > 0.1
            assert per_token["logprob_error"] < TOL and per_token["entropy_error"] < TOL


def test_fused_never_runs_the_output_layer_and_restores_it(ranks):
    for rank in ranks:
        for case in CASES:
            materialised_calls, fused_calls = rank[case]["output_layer_calls"]
            assert materialised_calls > 0 and fused_calls == 0
            assert rank[case]["output_layer_restored"]


@pytest.mark.parametrize("key, value", [("generation.top_k", 5), ("generation.top_p", 0.9)])
def test_fused_with_a_sampling_filter_is_a_config_error(key, value):
    with pytest.raises(ConfigError) as err:
        config_with({"policy.fused_linear_logprobs": True, key: value})
    message = str(err.value)
    assert "policy.fused_linear_logprobs" in message and "generation.top_k" in message \
        and "generation.top_p" in message
    assert config_with({"policy.fused_linear_logprobs": False, key: value}).generation is not None


def test_fused_linear_logprobs_key_is_required():
    with pytest.raises(ConfigError, match="policy.fused_linear_logprobs"):
        load_config(drop_key(tiny(), "policy.fused_linear_logprobs"))


def test_loss_takes_either_logits_or_precomputed_logprobs():
    from megatron_grpo.loss import ClippedPGLoss

    cfg = config_with({})
    loss = ClippedPGLoss(cfg.loss_fn)
    batch = make_batch(seed=3)
    logprobs = torch.zeros(ROWS, SEQ)
    counts = {"global_valid_tokens": 1.0, "global_valid_seqs": 1.0, "prev_logprobs_from_current": True}
    with pytest.raises(ValueError, match="curr_entropy"):
        loss(None, batch, curr_logprobs=logprobs, **counts)
    with pytest.raises(ValueError, match="not both"):
        loss(torch.zeros(ROWS, SEQ, 16), batch, curr_logprobs=logprobs, curr_entropy=logprobs, **counts)
    with pytest.raises(ValueError, match="top_k"):
        loss(None, batch, curr_logprobs=logprobs, curr_entropy=logprobs, top_k=3, **counts)
    value, metrics = loss(None, batch, curr_logprobs=logprobs, curr_entropy=logprobs, **counts)
    assert torch.isfinite(value) and metrics["entropy"] == 0
