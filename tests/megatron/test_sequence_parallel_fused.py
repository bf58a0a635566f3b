"""Sequence parallelism on the fused paths, at TP 2 over gloo, below the model (the local spec's torch LayerNorm
refuses `sequence_parallel`; on CUDA with TE the GPTModel runs it).

Megatron's output layer under sequence parallelism takes `[S / TP, B, H]` hidden states on each rank: it all-gathers
them along the sequence in forward and reduce-scatters their gradient in backward. The fused paths take them the same
way through `hidden_states.without_output_layer`'s stand-in for the output layer (`_HiddenStatesOut`, built on
Megatron's `ColumnParallelLinear` with and without `sequence_parallel`). Here, from the same whole `[S, B, H]` hidden
states and the same output weight, split along S as sequence parallelism splits them
(`scatter_to_sequence_parallel_region`), each case compares:
- the fused path with sequence parallelism against the same path without it (the whole hidden states, replicated):
  logprobs, loss, entropy, the hidden states' gradient (this rank's slice of the summed one) and the weight's;
- the fused path with sequence parallelism against Megatron's own `ColumnParallelLinear` with sequence parallelism
  and the loss on its materialised logits.

The cases: the fused op (`loss_fused=False`) at temperature 0.7, with a top-k filter and a KL, and the loss-fused path,
each with small chunks (several per call), an entropy bonus, a padded vocab (13 real tokens of 16: rank 1 holds 3
real and 5 padding columns), untrained prompt tokens, a dropped sequence and one with no trained token. S = 14, so
each rank holds 7 positions. One 2-rank launch runs every case; the tests assert on what the ranks report.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_on_ranks
from _loss_inputs import batch_for_logits, loss_config
from _tolerances import FP32_U, MODEL_GRAD_RTOL, MODEL_LOGPROB_ATOL

TP = 2
VOCAB, PADDED_VOCAB = 13, 16  # rank 1's shard: 3 real columns, 5 padding
BATCH, SEQ, HIDDEN = 4, 14, 24  # SEQ / TP = 7 positions per rank
CHUNK_ROWS = 5  # several chunks per call (a longer sequence is a loss-fused chunk of its own)
# (temperature, top_k, loss_fused)
CASES = {"fused": (0.7, None, False), "fused_top_k": (1.0, 5, False), "loss_fused": (0.7, None, True)}
# Against the path without sequence parallelism: the same fp32 maths on the same rows in the same chunks (only where
# the whole hidden states come from differs), so they can differ only where a GEMM blocks its sums differently for a
# differently allocated buffer. Against Megatron's layer: its logits come from one GEMM over all rows, the fused
# paths' chunk by chunk, another blocking, as between the tiny model's materialised and fused paths. Either way
# MODEL_LOGPROB_ATOL and MODEL_GRAD_RTOL (relative to the largest element). The loss and the mean entropy are token
# means of functions of the logprobs with slope below 4 (|A| ratio, the KL's, the entropy's own), as in
# test_megatron_fused_linear.
METRIC_ATOL = 4 * MODEL_LOGPROB_ATOL


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Whole `[S, B, H]` hidden states (Megatron's layout) and the whole `[V_padded, H]` output weight, the same on
    every rank; the padding rows are large, so that any leak of them shows."""
    gen = torch.Generator().manual_seed(24)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=gen) * 0.4
    weight[VOCAB:] = 30.0
    return hidden, weight


def _output_layer(sequence_parallel: bool, weight_shard: torch.Tensor):
    """Megatron's ColumnParallelLinear output layer (as GPTModel builds it, without bias), holding `weight_shard`."""
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, tensor_model_parallel_size=TP,
                               sequence_parallel=sequence_parallel, use_cpu_initialization=True,
                               params_dtype=torch.float32)
    layer = ColumnParallelLinear(HIDDEN, PADDED_VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False,
                                 gather_output=False, skip_bias_add=False)
    with torch.no_grad():
        layer.weight.copy_(weight_shard)
    return layer


def _run(layer, hidden: torch.Tensor, batch: dict, case: tuple, *, fused: bool) -> dict:
    """The loss of `hidden` (this rank's input to `layer`) through `layer` (materialised logits) or through its
    stand-in and the fused paths, with its gradients w.r.t. `hidden` and the weight."""
    from megatron.core import parallel_state

    from megatron_grpo.loss import ClippedPGLoss, count_valid
    from megatron_grpo.megatron.hidden_states import _HiddenStatesOut
    from megatron_grpo.ops import SamplingDistribution, VocabShard

    temperature, top_k, loss_fused = case
    leaf = hidden.detach().clone().requires_grad_(True)
    layer.weight.grad = None
    loss_fn = ClippedPGLoss(loss_config(entropy_coef=0.01, reference_policy_kl_penalty=0.1))
    tokens, seqs = count_valid(batch)
    group = parallel_state.get_tensor_model_parallel_group()
    kwargs = dict(global_valid_tokens=tokens, global_valid_seqs=seqs, prev_logprobs_from_current=False,
                  shard=VocabShard(group.rank() * PADDED_VOCAB // TP, VOCAB, group),
                  distribution=SamplingDistribution.of_sampling(temperature, top_k, None))
    if fused:
        whole, _ = _HiddenStatesOut(layer)(leaf)
        loss, metrics = loss_fn.on_hidden_states(whole.transpose(0, 1).contiguous(), layer.weight, batch,
                                                 loss_fused=loss_fused, chunk_rows=CHUNK_ROWS, **kwargs)
    else:
        logits, _ = layer(leaf)
        whole = None
        loss, metrics = loss_fn(logits.transpose(0, 1).contiguous(), batch, **kwargs)
    loss.backward()
    return {"loss": loss.detach(), "entropy": metrics["entropy"], "logprobs": metrics["curr_logprobs"],
            "grad_hidden": leaf.grad, "grad_weight": layer.weight.grad.clone(),
            "whole": None if whole is None else whole.detach()}


def run_cases(rank: int, world_size: int) -> dict:
    from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

    from megatron_grpo.megatron import destroy_parallel, init_parallel
    from megatron_grpo.megatron.parallel import ParallelParams

    init_parallel(ParallelParams(tensor_model_parallel_size=world_size))
    try:
        hidden, weight = _inputs()
        columns = slice(rank * PADDED_VOCAB // TP, (rank + 1) * PADDED_VOCAB // TP)
        local = scatter_to_sequence_parallel_region(hidden)  # [S / TP, B, H]: this rank's positions
        positions = slice(rank * SEQ // TP, (rank + 1) * SEQ // TP)
        layers = {sp: _output_layer(sp, weight[columns]) for sp in (False, True)}
        outcome: dict = {"local_is_slice": torch.equal(local, hidden[positions]),
                         "sequence_parallel": {sp: layer.sequence_parallel for sp, layer in layers.items()}}
        for name, case in CASES.items():
            logits = (hidden.transpose(0, 1) @ weight.T) / case[0]  # the batch's prev and reference near the truth
            batch = batch_for_logits(logits, VOCAB, seed=7)
            whole = _run(layers[False], hidden, batch, case, fused=True)
            split = _run(layers[True], local, batch, case, fused=True)
            megatron_split = _run(layers[True], local, batch, case, fused=False)
            outcome[name] = {
                "reference_error": _reference_error(split["logprobs"], hidden, weight, batch, case),
                "gathered_is_whole": torch.equal(split["whole"], hidden),
                "grad_hidden_shapes": (tuple(whole["grad_hidden"].shape), tuple(split["grad_hidden"].shape)),
                "grad_hidden_scale": whole["grad_hidden"].abs().max().item(),
                "grad_weight_scale": whole["grad_weight"].abs().max().item(),
                "padding_grad": split["grad_weight"][VOCAB - columns.start:].abs().max().item()
                if columns.stop > VOCAB else 0.0,
                "finite_alike": torch.equal(torch.isfinite(whole["logprobs"]), torch.isfinite(split["logprobs"])),
                "vs_whole": _differences(split, whole, positions),
                "vs_megatron": _differences(split, megatron_split, slice(None)),
            }
        return outcome
    finally:
        destroy_parallel()


def _reference_error(logprobs: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, batch: dict,
                     case: tuple) -> tuple[float, float]:
    """Max error of the trained tokens' logprobs against float64 ones of the whole unpadded logits, and its bound
    (unfiltered cases; a filtered token's -inf is compared in `finite_alike`).

    The bound: an fp32 logit, an H-term GEMM, is off by at most H u sum_i |h_i w_i| / T; a logprob x_t - lse by twice
    that, plus a few ulps of the log-sum-exp and the subtraction at its own size."""
    from megatron_grpo.loss import trained_token_mask

    temperature, top_k, _ = case
    if top_k is not None:
        return 0.0, 0.0
    logits = hidden.double().transpose(0, 1) @ weight[:VOCAB].double().T / temperature
    reference = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    trained = trained_token_mask(batch)[:, 1:].bool()
    magnitude = (hidden.abs().double() @ weight[:VOCAB].abs().double().T).max().item() / temperature
    bound = 2 * HIDDEN * FP32_U * magnitude + 8 * FP32_U * max(1.0, reference[trained].abs().max().item())
    return _max_diff(logprobs[:, 1:][trained], reference[trained]), bound


def _differences(split: dict, other: dict, positions: slice) -> dict:
    """How the sequence-parallel fused run differs from `other`, whose hidden-state gradient covers `positions`."""
    finite = torch.isfinite(other["logprobs"])
    return {"logprobs": _max_diff(split["logprobs"][finite], other["logprobs"][finite]),
            "loss": _max_diff(split["loss"], other["loss"]), "entropy": _max_diff(split["entropy"], other["entropy"]),
            "grad_hidden": _max_diff(split["grad_hidden"], other["grad_hidden"][positions]),
            "grad_weight": _max_diff(split["grad_weight"], other["grad_weight"])}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(TP, run_cases)


def test_the_split_is_megatrons_and_the_stand_in_gathers_it_whole(ranks):
    for rank in ranks:
        assert rank["local_is_slice"]
        assert rank["sequence_parallel"] == {False: False, True: True}
        for name in CASES:
            assert rank[name]["gathered_is_whole"]  # an all-gather copies: exact
            assert rank[name]["grad_hidden_shapes"] == ((SEQ, BATCH, HIDDEN), (SEQ // TP, BATCH, HIDDEN))


@pytest.mark.parametrize("case", ["fused", "loss_fused"])
def test_sequence_parallel_logprobs_equal_float64_ones(ranks, case):
    """The anchor: the fp32 logprobs within the rounding bound of their GEMMs (`_reference_error`)."""
    for rank in ranks:
        error, bound = rank[case]["reference_error"]
        assert error <= bound, (error, bound)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("other", ["vs_whole", "vs_megatron"])
def test_sequence_parallel_fused_path_equals(ranks, case, other):
    """`vs_whole`: the same fused path without sequence parallelism (this rank's slice of its summed gradient);
    `vs_megatron`: Megatron's ColumnParallelLinear under sequence parallelism, logits materialised."""
    for rank in ranks:
        result = rank[case]
        assert result["grad_hidden_scale"] > 1e-3 and result["grad_weight_scale"] > 1e-3  # real gradients
        assert result["finite_alike"]  # top-k: the same tokens filtered out
        diff = result[other]
        assert diff["logprobs"] <= MODEL_LOGPROB_ATOL, diff
        assert diff["loss"] <= METRIC_ATOL and diff["entropy"] <= METRIC_ATOL, diff
        assert diff["grad_hidden"] <= MODEL_GRAD_RTOL * result["grad_hidden_scale"], diff
        assert diff["grad_weight"] <= MODEL_GRAD_RTOL * result["grad_weight_scale"], diff


def test_padding_columns_get_no_gradient(ranks):
    """Rank 1's 5 padding columns (their weights are 30, so a leak would be large) get a gradient of exactly 0."""
    for name in CASES:
        assert ranks[1][name]["padding_grad"] == 0.0


def _stub_model(**config):
    from types import SimpleNamespace

    settings = {"sequence_parallel": False, "use_mup": False, "mtp_num_layers": None, **config}
    return SimpleNamespace(config=SimpleNamespace(**settings), output_layer=SimpleNamespace(bias=None))


def test_sequence_parallel_is_supported_and_what_is_not_is_named():
    from megatron_grpo.megatron.hidden_states import check_supported

    check_supported(_stub_model(sequence_parallel=True))  # no error: the stand-in gathers the sequence
    with pytest.raises(ValueError, match=r"policy.fused_linear_logprobs: not supported with use_mup, mtp_num_layers"):
        check_supported(_stub_model(sequence_parallel=True, use_mup=True, mtp_num_layers=1))
