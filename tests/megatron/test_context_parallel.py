"""Context parallelism through the plugin's API: CP 2 and CP 2 × TP 2 equal CP 1 through Megatron's schedule.

The model is position-wise (token and position embeddings, a residual MLP, Megatron's ColumnParallelLinear output
layer; no attention), so its forward is CP-invariant by construction: any difference between the layouts comes from
the split, the label shift, the loss's CP reductions or the gradient scale. One world-size-4 launch runs three
layouts from the same weights and the same global batch: TP 1 × CP 1 × DP 4 (the reference, the DP path the other
tests check), TP 1 × CP 2 × DP 2, and TP 2 × CP 2 × DP 1; for each, a token-level aggregation, a sequence-level
one with `seq-mask-tis`, and GSPO with its sequence-level IS weights, on the materialised, fused linear and loss-fused
paths; each with padded microbatches and with the same sequences packed (THD, each sequence padded to a multiple of
2·CP = 4, Megatron's per-sequence split), and packed through `train_step`'s packing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_on_ranks
from _loss_inputs import batch_for_logits, loss_config
from _tolerances import MODEL_GRAD_RTOL, MODEL_LOGPROB_ATOL

VOCAB, PADDED, HIDDEN, FFN, SEQ, ROWS = 30, 32, 16, 32, 16, 8
LAYOUTS = {"cp1": (1, 1), "cp2": (1, 2), "cp2_tp2": (2, 2)}  # name: (TP, CP) on 4 ranks; DP = 4 / (TP · CP)
PACKED_TOKENS = 2 * SEQ  # packed microbatches of at most two sequences
PATHS = {"materialised": (False, False), "fused_linear": (True, False), "loss_fused": (True, True)}
GPT_LOSSES = ("seq_mean_token_mean",)  # the tiny GPTModel: the CP attention under a loss with CP sequence sums,
GPT_PATHS = ("materialised", "loss_fused")  # from its logits and from its hidden states
LOSSES = {
    "token_mean": dict(loss_agg_mode="token-mean", ratio_clip_c=1.3, reference_policy_kl_penalty=0.2,
                       use_importance_sampling_correction=True,
                       truncated_importance_sampling=dict(type="icepop", ratio_min=0.6, ratio_max=1.6),
                       entropy_coef=0.03),
    "seq_mean_token_mean": dict(loss_agg_mode="seq-mean-token-mean", reference_policy_kl_penalty=0.2,
                                use_importance_sampling_correction=True, entropy_coef=0.03,
                                truncated_importance_sampling=dict(type="seq-mask-tis", ratio_min=0.7,
                                                                   ratio_max=1.3)),
    "gspo": dict(loss_agg_mode="seq-mean-token-mean", sequence_level_importance_ratio=True,
                 use_importance_sampling_correction=True,
                 truncated_importance_sampling=dict(type="tis", ratio_max=1.5)),
}
# Loss and metrics: each layout computes every row's logprob with the same operations (only the GEMM's blocking
# differs: a few ulps, 2.4e-7 at |logprob| < 4), and each microbatch (one sequence padded, two packed) sums at most
# 32 fp32 terms, within 32 u = 1.9e-6 of their magnitudes in any order of summation; the sums over microbatches and
# ranks are float64.
METRIC_RTOL = 2e-6


def _master_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        "embedding": torch.randn(PADDED, HIDDEN, generator=gen),
        "position": 0.5 * torch.randn(SEQ, HIDDEN, generator=gen),
        "mlp_in.weight": 0.3 * torch.randn(FFN, HIDDEN, generator=gen),
        "mlp_in.bias": 0.1 * torch.randn(FFN, generator=gen),
        "mlp_out.weight": 0.3 * torch.randn(HIDDEN, FFN, generator=gen),
        "mlp_out.bias": 0.1 * torch.randn(HIDDEN, generator=gen),
        "output": 0.4 * torch.randn(PADDED, HIDDEN, generator=gen),
    }


def _reference_logits(weights: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    h = weights["embedding"][input_ids] + weights["position"][:input_ids.shape[1]]
    inner = torch.nn.functional.gelu(h @ weights["mlp_in.weight"].T + weights["mlp_in.bias"])
    h = h + inner @ weights["mlp_out.weight"].T + weights["mlp_out.bias"]
    return h @ weights["output"].T


def _global_batch() -> dict[str, torch.Tensor]:
    """8 sequences of 16 tokens (4 chunks of 4 under CP 2): ragged trained spans, one dropped sequence, one with no
    trained token; the prev / generation / reference logprobs near the model's own."""
    weights = _master_weights()
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    batch = batch_for_logits(_reference_logits(weights, input_ids), VOCAB, seed=6)
    batch["input_ids"] = input_ids
    # batch_for_logits drew its own ids: recompute its logprob inputs for these ones, near the model's.
    logprobs = torch.zeros(ROWS, SEQ)
    logprobs[:, 1:] = torch.log_softmax(_reference_logits(weights, input_ids)[:, :-1, :VOCAB], -1).gather(
        -1, input_ids[:, 1:, None]).squeeze(-1)
    # Chunk boundaries (positions 4, 8, 12) trained: a row's target from the next chunk matters.
    batch["token_mask"][1, 3:13] = 1
    batch["token_mask"][2] = 0
    batch["token_mask"][2, 13:15] = 1  # rows 12, 13: the last chunk only; one CP rank holds no trained row of it
    untrained = batch["token_mask"] == 0
    for key, spread in (("prev_logprobs", 0.2), ("generation_logprobs", 0.25), ("reference_policy_logprobs", 0.3)):
        values = logprobs + spread * torch.randn(ROWS, SEQ, generator=gen)
        batch[key] = values.masked_fill(untrained, -torch.inf if key == "prev_logprobs" else 1e6)
    return batch


def _build_model(tp: int, cp: int):
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, use_cpu_initialization=True,
                               tensor_model_parallel_size=tp, context_parallel_size=cp)

    class PositionWiseLM(MegatronModule):
        """Embedding -> residual MLP -> ColumnParallelLinear: every position's logits depend on its token and position
        only, computed in GPTModel's `[s, b, h]` layout and returned as `[b, s, V_local]`."""

        def __init__(self) -> None:
            super().__init__(config)
            self.post_process = True
            self.model_type = ModelType.encoder_or_decoder
            self.share_embeddings_and_output_weights = False
            self.embedding = torch.nn.Embedding(PADDED, HIDDEN)
            self.position = torch.nn.Embedding(SEQ, HIDDEN)
            self.mlp_in = torch.nn.Linear(HIDDEN, FFN)
            self.mlp_out = torch.nn.Linear(FFN, HIDDEN)
            self.output_layer = ColumnParallelLinear(HIDDEN, PADDED, config=config, init_method=torch.nn.init.zeros_,
                                                     bias=False, gather_output=False)

        def set_input_tensor(self, tensor) -> None:  # one pipeline stage: nothing comes from a previous one
            pass

        def forward(self, input_ids, position_ids, attention_mask=None):
            h = self.embedding(input_ids) + self.position(position_ids)
            h = h + self.mlp_out(torch.nn.functional.gelu(self.mlp_in(h)))
            logits, _ = self.output_layer(h.transpose(0, 1).contiguous())
            return logits.transpose(0, 1).contiguous()

    model = PositionWiseLM()
    weights = _master_weights()
    local = PADDED // tp
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        model.embedding.weight.copy_(weights["embedding"])
        model.position.weight.copy_(weights["position"])
        for name in ("mlp_in", "mlp_out"):
            getattr(model, name).weight.copy_(weights[f"{name}.weight"])
            getattr(model, name).bias.copy_(weights[f"{name}.bias"])
        model.output_layer.weight.copy_(weights["output"][rank * local:(rank + 1) * local])
    return model


def _build_gpt_model(tp: int, cp: int):
    """The tiny GPTModel on `torch_attention_layer_spec()` (the spec a user's own GPTModel takes): 2 layers, RoPE,
    4 heads in 2 query groups (one per rank at TP 2), from the same weights at every layout (CPU initialisation from
    one seed splits the same master weights over TP)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from megatron_grpo.megatron import torch_attention_layer_spec

    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=FFN, init_method_std=0.3, hidden_dropout=0.0, attention_dropout=0.0,
                               use_cpu_initialization=True, tensor_model_parallel_size=tp, context_parallel_size=cp)
    torch.manual_seed(17)
    return GPTModel(config=config, transformer_layer_spec=torch_attention_layer_spec(), vocab_size=PADDED,
                    max_sequence_length=SEQ, position_embedding_type="rope", parallel_output=True)


def _full_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's reduced gradient (DDP's main_grad), each TP-split one gathered along its partition dim."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron.ddp import gradient, unwrapped

    grads = {}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in unwrapped(model).named_parameters():
        grad = gradient(param).detach().clone()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            shards = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(shards, grad, group=parallel_state.get_tensor_model_parallel_group())
            grad = torch.cat(shards, dim=param.partition_dim)
        grads[name] = grad
    return grads


def _all_rows(local: torch.Tensor) -> torch.Tensor:
    """This DP rank's `[B_dp, S]` rows gathered over DP into the global batch's order."""
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group()
    if group.size() == 1:
        return local
    shares = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(shares, local.contiguous(), group=group)
    return torch.cat(shares)


def _microbatches(batch: dict[str, torch.Tensor], packed: bool):
    """This DP rank's microbatches: one row each, or its rows packed by two (each padded to a multiple of 2·CP = 4
    at every layout, CP 1 included), with the packing to unpack their per-token results."""
    from megatron_grpo.loss.packing import PackedMicrobatches

    if not packed:
        return [{key: value[row:row + 1] for key, value in batch.items()}
                for row in range(batch["input_ids"].shape[0])], None
    packing = PackedMicrobatches(batch, PACKED_TOKENS, pad_multiple=4)
    return packing.microbatches, packing


def _run_layout(tp: int, cp: int, packed: bool) -> dict:
    from megatron.core import parallel_state

    from megatron_grpo.loss import count_valid
    from megatron_grpo.megatron import ParallelParams, init_parallel, vocab_shard_of, wrap_in_ddp

    layout = init_parallel(ParallelParams(tensor_model_parallel_size=tp, context_parallel_size=cp))
    assert (layout.tp_size, layout.cp_size, layout.dp_size) == (tp, cp, 4 // (tp * cp))
    full = _global_batch()
    counts = count_valid(full)
    rows = ROWS // layout.dp_size
    batch = {key: value[layout.dp_rank * rows:(layout.dp_rank + 1) * rows] for key, value in full.items()}
    model = wrap_in_ddp(_build_model(tp, cp))
    vocab = vocab_shard_of(model, VOCAB)
    results = _step_paths(model, vocab, batch, packed, counts, LOSSES, PATHS)
    if packed:
        results["train_step"] = _packed_train_step(model, batch, vocab)
    gpt = wrap_in_ddp(_build_gpt_model(tp, cp))
    results["gpt"] = _step_paths(gpt, vocab_shard_of(gpt, VOCAB), batch, packed, counts,
                                 {name: LOSSES[name] for name in GPT_LOSSES}, GPT_PATHS)
    parallel_state.destroy_model_parallel()
    return results


def _step_paths(model, vocab, batch: dict[str, torch.Tensor], packed: bool, counts, losses: dict, paths) -> dict:
    """On each of `paths`: `compute_logprobs` of this DP rank's rows, and per loss one forward-backward through
    Megatron's schedule (its metrics, every parameter's gradient, the curr logprobs), all gathered whole."""
    from megatron.core import parallel_state

    from megatron_grpo.loss import ClippedPGLoss, aggregate_metrics
    from megatron_grpo.megatron import compute_logprobs, gather_from_context_parallel, make_forward_step
    from megatron_grpo.megatron.ddp import zero_grads
    from megatron_grpo.megatron.forward import run_schedule
    from megatron_grpo.scheduler import LogprobPlan

    microbatches, packing = _microbatches(batch, packed)
    plan = LogprobPlan(compute_reference_logprobs=False, compute_prev_logprobs=True, prev_from_current=False,
                       reasons=())
    results: dict = {"logprobs": {}}
    for path in paths:
        fused_linear, fused_loss = PATHS[path]
        # Packed: compute_logprobs packs the rows itself (each sequence padded to a multiple of 2·CP under CP).
        results["logprobs"][path] = _all_rows(compute_logprobs(
            model, batch, micro_batch_size=2, vocab=vocab, fused_linear=fused_linear,
            max_tokens_per_microbatch=PACKED_TOKENS if packed else None))
        for loss_name, overrides in losses.items():
            loss_fn = ClippedPGLoss(loss_config(**overrides))
            zero_grads(model)
            forward_step = make_forward_step(loss_fn, plan, num_microbatches=len(microbatches),
                                             global_valid_tokens=counts[0], global_valid_seqs=counts[1], vocab=vocab,
                                             fused_linear=fused_linear, fused_loss=fused_loss)
            outputs = run_schedule(forward_step, model, microbatches, forward_only=False)
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            metrics = aggregate_metrics(outputs, group=group if group.size() > 1 else None,
                                        aggregation=loss_fn.metric_aggregation)
            if packing is None:
                curr = gather_from_context_parallel(torch.cat([m["curr_logprobs"] for m in outputs]))
            else:
                curr = packing.unpack([gather_from_context_parallel(m["curr_logprobs"], mb["cu_seqlens"])
                                       for m, mb in zip(outputs, microbatches)])
            results[path, loss_name] = {"metrics": metrics, "grads": _full_gradients(model),
                                        "curr": _all_rows(curr)}
    return results


def _packed_train_step(model, batch: dict[str, torch.Tensor], vocab) -> dict:
    """One `train_step` packing the rows itself (`max_tokens_per_microbatch`; under CP each sequence padded to a
    multiple of 2·CP), with a prev pass: its metrics and the whole curr and prev logprobs. The learning rate is 0, so
    every layout steps from the same weights."""
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import StepConfig, train_step
    from megatron_grpo.scheduler import LogprobPlan

    plan = LogprobPlan(compute_reference_logprobs=False, compute_prev_logprobs=True, prev_from_current=False,
                       reasons=())
    step = StepConfig(global_batch_size=ROWS, micro_batch_size=1, clip_grad=0.0,
                      max_tokens_per_microbatch=PACKED_TOKENS)
    result = train_step(step, model, torch.optim.SGD(model.parameters(), lr=0.0),
                        ClippedPGLoss(loss_config(**LOSSES["seq_mean_token_mean"])), plan, batch, vocab=vocab)
    return {"metrics": result.step_metrics[0], "curr": _all_rows(result.curr_logprobs),
            "prev": _all_rows(result.prev_logprobs)}


PACKED_SPLIT_ROWS, PACKED_SPLIT_LENGTHS = [0, 1, 2], [8, 12, 16]  # cu_seqlens [0, 8, 20, 36]: chunks of 2, 3, 4


def _split_checks(rank: int, world_size: int) -> dict:
    """The split's labels at the chunk boundaries (padded and packed), the packed inverse, and `sum_over_context`'s
    gradient, at CP 2 × DP 2."""
    from megatron.core import parallel_state

    from megatron_grpo.loss.packing import pack_rows
    from megatron_grpo.megatron import (
        ParallelParams,
        gather_from_context_parallel,
        init_parallel,
        split_for_context_parallel,
    )
    from megatron_grpo.megatron.context_parallel import context_shard
    from megatron_grpo.ops.context_shard import sum_over_context

    init_parallel(ParallelParams(context_parallel_size=2))
    full = _global_batch()
    # an MoE model's routes, [B, S, L, k]: a distinct value at every position, layer and slot
    full["routed_experts"] = torch.arange(full["input_ids"].numel() * 4).view(*full["input_ids"].shape, 2, 2)
    local = split_for_context_parallel(full)
    packed = pack_rows(full, PACKED_SPLIT_ROWS, PACKED_SPLIT_LENGTHS)
    local_packed = split_for_context_parallel(packed)
    # The inverse of the packed split: the row-aligned labels come back as the tokens, 0 at each sequence's start.
    labels_back = gather_from_context_parallel(local_packed["labels"].to(torch.float32), packed["cu_seqlens"])
    # A verl #4250-style bug: the labels rolled within this rank's chunks instead of shifted on the full sequence.
    rolled = torch.roll(local["input_ids"], shifts=-1, dims=1)
    # sum_over_context: rank r's share of the loss is sum_t w_rt * exp(S), S the whole sequence's sum of x.
    cp_rank = parallel_state.get_context_parallel_rank()
    gen = torch.Generator().manual_seed(3)
    x_all, w_all = torch.randn(2, 2, 5, generator=gen, dtype=torch.float64).unbind(0)  # [CP rank, tokens]
    x = x_all[cp_rank].clone().requires_grad_()
    share = (w_all[cp_rank] * torch.exp(sum_over_context(x.sum()[None], context_shard()))).sum()
    share.backward()
    x_ref = x_all.clone().requires_grad_()
    (w_all * torch.exp(x_ref.sum())).sum().backward()
    # A tensor with trailing dims ([B, S / CP, 3]) gathers as each of its channels does alone, padded and packed.
    trailing = {}
    for name, labels, cu_seqlens in (("padded", local["labels"], None),
                                      ("packed", local_packed["labels"], packed["cu_seqlens"])):
        channels = torch.stack([labels.to(torch.float32) * (c + 1) for c in range(3)], dim=-1)
        trailing[name] = (gather_from_context_parallel(channels, cu_seqlens),
                          torch.stack([gather_from_context_parallel(channels[..., c].contiguous(), cu_seqlens)
                                       for c in range(3)], dim=-1))
    parallel_state.destroy_model_parallel()
    return {"local": local, "rolled": rolled, "grad": x.grad, "grad_expected": x_ref.grad[cp_rank],
            "packed": packed, "local_packed": local_packed, "labels_back": labels_back, "trailing": trailing}


def _refusals() -> dict[str, str]:
    """The ValueErrors of bad CP settings: a world size TP × PP × CP does not divide, a size below 1, and sequences
    that the CP split or the CP attention cannot cut into 2·CP chunks."""
    from megatron.core import parallel_state
    from test_attention import value_error_messages

    from megatron_grpo.megatron import ParallelParams, init_parallel

    messages = value_error_messages({"indivisible": lambda: init_parallel(ParallelParams(context_parallel_size=3)),
                                     "zero": lambda: init_parallel(ParallelParams(context_parallel_size=0))})
    init_parallel(ParallelParams(context_parallel_size=2))
    messages.update(_packed_refusals())
    messages.update(_attention_refusals())
    parallel_state.destroy_model_parallel()
    return messages


def _packed_refusals() -> dict[str, str]:
    """Under CP 2: a packed sequence whose length is not a multiple of 2·CP = 4, and a packed share's forward without
    its positions."""
    from test_attention import value_error_messages

    from megatron_grpo.loss.packing import pack_rows
    from megatron_grpo.megatron import model_forward, split_for_context_parallel

    full = _global_batch()
    ragged = pack_rows(full, [0, 1], [SEQ, 6])
    attempts = {
        "ragged_split": lambda: split_for_context_parallel(ragged),
        "share_without_positions": lambda: model_forward(None, ragged["input_ids"], cu_seqlens=ragged["cu_seqlens"]),
    }
    return value_error_messages(attempts)


ATTENTION_LENGTHS = [8, 24, 16]  # packed sequences of the core attention check: multiples of 2·CP at CP 2 and 4


def _attention_checks(rank: int, world_size: int) -> dict:
    """`TorchDotProductAttention` on this CP rank's zigzag share, float64, at CP 2 × DP 2 and CP 4: its output and
    dQ, dK, dV against `reference_attention` of the whole sequences at this rank's positions (dK, dV summed over
    every rank's queries: the reduce-scatter), packed (THD) and padded (b = 2 rows of 16)."""
    from megatron.core import parallel_state
    from test_attention import core_attention, cu_seqlens_of, reference_attention, relative_error, thd_params

    from megatron_grpo.megatron import ParallelParams, init_parallel
    from megatron_grpo.megatron.context_parallel import zigzag_positions

    errors = {}
    for cp in (2, 4):
        init_parallel(ParallelParams(context_parallel_size=cp))
        cp_rank = parallel_state.get_context_parallel_rank()
        attention = core_attention(2, megatron_groups=True, cp=cp)
        for layout, lengths, rows in (("packed", ATTENTION_LENGTHS, None), ("padded", [SEQ], 2)):
            gen = torch.Generator().manual_seed(cp)
            tokens = sum(lengths)
            shape = (tokens,) if rows is None else (tokens, rows)
            q = torch.randn(*shape, 4, 8, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(*shape, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
            upstream = torch.randn(*shape, 32, generator=gen, dtype=torch.float64)
            full = [t.clone().requires_grad_() for t in (q, k, v)]
            flat = [t if rows is None else t.transpose(0, 1).reshape(-1, *t.shape[2:]) for t in full]  # rows end to end
            expected = reference_attention(*flat, lengths * (rows or 1), 8 ** -0.5).reshape(-1, 32)
            if rows is not None:
                expected = expected.view(rows, tokens, 32).transpose(0, 1)
            expected_grads = torch.autograd.grad(expected, full, upstream)
            cu_seqlens = cu_seqlens_of(lengths)
            mine = zigzag_positions(cu_seqlens, tokens, cp, cp_rank)
            local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
            params = thd_params(cu_seqlens) if rows is None else None
            out = attention(*local, None, packed_seq_params=params)
            grads = torch.autograd.grad(out, local, upstream[mine])
            errors[cp, layout] = [relative_error(out, expected[mine].reshape(out.shape))] + [
                relative_error(g, e[mine]) for g, e in zip(grads, expected_grads)]
        parallel_state.destroy_model_parallel()
    return errors


def _attention_refusals() -> dict[str, str]:
    """Under CP 2: whole sequences that 2·CP = 4 chunks cannot split, packed and padded."""
    from test_attention import core_attention, cu_seqlens_of, thd_params, value_error_messages

    q, k, v = torch.zeros(8, 4, 8), torch.zeros(8, 2, 8), torch.zeros(8, 2, 8)
    attention = core_attention(2, megatron_groups=True, cp=2)
    params = thd_params(cu_seqlens_of([6, 10]))
    attempts = {"packed_lengths": lambda: attention(q, k, v, None, packed_seq_params=params),
                "padded_length": lambda: attention(q[:3, None], k[:3, None], v[:3, None], None)}
    return value_error_messages(attempts)


def _all_checks(rank: int, world_size: int) -> dict:
    from megatron_grpo.megatron.cpu_support import apply_cpu_support

    apply_cpu_support()
    out = {"refusals": _refusals(), "split": _split_checks(rank, world_size),
           "attention": _attention_checks(rank, world_size)}
    out.update({(name, packed): _run_layout(tp, cp, packed) for name, (tp, cp) in LAYOUTS.items()
                for packed in (False, True)})
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(4, _all_checks)


def test_bad_context_parallel_settings_are_value_errors_naming_the_key(ranks):
    messages = ranks[0]["refusals"]
    assert "context_parallel_size" in messages["indivisible"] and "world size 4" in messages["indivisible"]
    assert messages["zero"].startswith("context_parallel_size: must be an integer >= 1, got 0")


def test_the_attention_refuses_sequences_that_2cp_chunks_cannot_split(ranks):
    """Under CP 2, whole sequences of 6 and 10 tokens (packed) or 6 (3 rows on each rank, padded) are not multiples
    of 4: a ValueError naming the cu_seqlens, or the query, with the lengths."""
    messages = ranks[0]["refusals"]
    assert messages["packed_lengths"].startswith("packed_seq_params.cu_seqlens_q: context parallelism (2 ranks)")
    assert "[6, 10]" in messages["packed_lengths"] and "multiple of 4" in messages["packed_lengths"]
    assert messages["padded_length"].startswith("query: context parallelism (2 ranks)")
    assert "[6]" in messages["padded_length"]


def test_context_parallel_attention_equals_the_whole_sequences_attention(ranks):
    """Each CP rank's output and dQ, dK, dV (float64) are the whole sequences' at its zigzag positions, at CP 2 and
    CP 4, packed and padded; float64, the same maths in another order (test_attention.RTOL64)."""
    from test_attention import RTOL64

    for rank in ranks:
        assert set(rank["attention"]) == {(cp, layout) for cp in (2, 4) for layout in ("packed", "padded")}
        for case, errors in rank["attention"].items():
            assert max(errors) <= RTOL64, (case, errors)


def test_packed_sequences_not_a_multiple_of_2cp_are_value_errors_naming_cu_seqlens(ranks):
    """Under CP 2 each packed sequence splits into 4 equal chunks: a sequence of 6 tokens is a ValueError naming
    `batch['cu_seqlens']` that says how to pad; a packed share's forward without its positions names
    `position_ids`."""
    messages = ranks[0]["refusals"]
    message = messages["ragged_split"]
    assert message.startswith("batch['cu_seqlens']: context parallelism (2 ranks)"), message
    assert "multiple of 4" in message and "[16, 6]" in message and "cu_seqlens_padded" in message, message
    assert messages["share_without_positions"].startswith("position_ids: ")


def test_rows_padded_for_context_parallel_carry_their_kept_sets(monkeypatch):
    """At CP 2 a padded batch of width 6 is extended to 8 (a multiple of 2·CP) with zeros after every row's end; the
    kept sets stay with their tokens and the added positions hold none; an MoE model's routes there are `0 .. k-1`
    and its padding mask marks them."""
    from megatron_grpo.loss.kept_set_batch import KEPT_SET_IDS, KEPT_SET_OFFSETS, kept_set_of
    from megatron_grpo.megatron import context_parallel
    from megatron_grpo.ops.kept_set import KeptSet

    monkeypatch.setattr(context_parallel, "context_parallel_size", lambda: 2)
    input_ids = torch.arange(1, 13).view(2, 6)
    sets = [[] if t % 6 == 0 else [t % 5, 7 + t % 3] for t in range(12)]
    kept = KeptSet.from_lists(sets)
    batch = {"input_ids": input_ids, "token_mask": torch.ones(2, 6), "advantages": torch.ones(2),
             KEPT_SET_OFFSETS: kept.offsets, KEPT_SET_IDS: kept.ids,
             "routed_experts": torch.full((2, 6, 3, 2), 5, dtype=torch.int32),
             "moe_padding_mask": torch.zeros(2, 6, dtype=torch.bool)}
    padded = context_parallel.padded_for_context_parallel(batch)
    assert padded["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12, 0, 0]]
    assert padded["token_mask"][:, 6:].eq(0).all() and padded["advantages"] is batch["advantages"]
    routes = padded["routed_experts"]
    assert routes.dtype == torch.int32 and routes[:, :6].eq(5).all()
    assert routes[:, 6:].tolist() == [[[[0, 1]] * 3] * 2] * 2
    assert padded["moe_padding_mask"].tolist() == [[False] * 6 + [True] * 2] * 2
    got = kept_set_of(padded)
    expected = [sorted(s) for s in sets[:6]] + [[], []] + [sorted(s) for s in sets[6:]] + [[], []]
    assert [got.ids[a:b].tolist() for a, b in zip(got.offsets[:-1], got.offsets[1:])] == expected


def test_partition_without_transformer_engine_matches_hand_written_indices():
    """The no-TE stand-in of TE's `thd_get_partitioned_indices` at CP 2: each sequence in 4 chunks, rank 0 keeping
    chunks 0 and 3, rank 1 chunks 1 and 2, sequence after sequence."""
    from megatron_grpo.megatron.context_parallel import zigzag_positions

    cases = {  # cu_seqlens: (rank 0's positions, rank 1's)
        (0, 4, 12): ([0, 3, 4, 5, 10, 11], [1, 2, 6, 7, 8, 9]),
        (0, 8, 12, 16): ([0, 1, 6, 7, 8, 11, 12, 15], [2, 3, 4, 5, 9, 10, 13, 14]),
    }
    for cu, expected in cases.items():
        cu_seqlens = torch.tensor(cu, dtype=torch.int32)
        for rank in range(2):
            got = zigzag_positions(cu_seqlens, cu[-1], 2, rank)
            assert got.tolist() == expected[rank], (cu, rank, got.tolist())


def test_split_takes_each_chunks_last_target_from_the_next_chunk(ranks):
    """Every row's label is the next token of the full sequence (the next chunk's first one at a chunk's end), its
    token mask is that token's, and the rows are the zigzag chunks r and 2·CP−1−r; labels rolled within the local
    chunks (verl #4250) differ exactly at the chunk ends whose next chunk is another rank's. The end-to-end test
    below also compares every position's logprob, these included, with CP 1."""
    full = _global_batch()
    for rank in range(4):
        cp_rank = rank % 2  # Megatron's order: TP, CP, DP ... with TP 1, CP varies fastest
        split = ranks[rank]["split"]
        local, positions = split["local"], split["local"]["position_ids"]
        expected_positions = torch.cat([torch.arange(4 * cp_rank, 4 * cp_rank + 4),
                                        torch.arange(4 * (3 - cp_rank), 4 * (3 - cp_rank) + 4)])
        assert torch.equal(positions[0], expected_positions)
        assert torch.equal(local["input_ids"], full["input_ids"][:, expected_positions])
        # the routes belong to the input tokens: split with them, unshifted
        routes = torch.arange(full["input_ids"].numel() * 4).view(*full["input_ids"].shape, 2, 2)
        assert torch.equal(local["routed_experts"], routes[:, expected_positions])
        has_next = expected_positions < SEQ - 1
        next_positions = (expected_positions + 1).clamp(max=SEQ - 1)
        assert torch.equal(local["labels"][:, has_next], full["input_ids"][:, next_positions[has_next]])
        assert torch.equal(local["token_mask"][:, has_next], full["token_mask"][:, next_positions[has_next]])
        assert not local["token_mask"][:, ~has_next].any()  # the sequence's last row has no target
        assert torch.equal(local["sample_mask"], full["sample_mask"])  # per-sequence: not split
        # Rolling is wrong exactly where the next local row is not the next position: at the end of a chunk whose
        # successor another rank holds (rank 0: positions 3 and 15 -> none after 15; rank 1: 11 -> 12 on rank 0).
        jumps = (expected_positions.roll(-1) != expected_positions + 1) & has_next
        assert jumps.any()
        rolled_wrong = (split["rolled"] != local["labels"]).any(dim=0)
        assert torch.equal(rolled_wrong & has_next, jumps)


def _packed_split_positions(cp_rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed positions CP rank `cp_rank` of 2 holds (chunks r and 3 − r of each sequence of PACKED_SPLIT_LENGTHS,
    in sequence order), each one's position in its sequence, and its sequence's length."""
    positions, within, lengths = [], [], []
    start = 0
    for length in PACKED_SPLIT_LENGTHS:
        chunk = length // 4
        for index in (cp_rank, 3 - cp_rank):
            offsets = list(range(index * chunk, (index + 1) * chunk))
            positions += [start + offset for offset in offsets]
            within += offsets
            lengths += [length] * chunk
        start += length
    return torch.tensor(positions), torch.tensor(within), torch.tensor(lengths)


def test_packed_split_takes_targets_from_the_same_sequence(ranks):
    """Packed under CP 2: each rank holds chunks r and 3 − r of every sequence, `cu_seqlens // 2` and the positions
    within each sequence; every row's label is the next token of its own sequence (a chunk's last row takes it from
    the next chunk of the same sequence), and a sequence's last row has none (label 0, token mask 0), never the
    next sequence's first token; per-sequence tensors are not split; gathering the labels back gives the tokens, 0
    at each sequence's first."""
    for rank in range(4):
        split = ranks[rank]["split"]
        packed, local = split["packed"], split["local_packed"]
        positions, within, lengths = _packed_split_positions(rank % 2)
        assert torch.equal(local["cu_seqlens"], torch.tensor([0, 4, 10, 18], dtype=torch.int32))
        assert torch.equal(local["input_ids"][0], packed["input_ids"][0, positions])
        assert torch.equal(local["routed_experts"][0], packed["routed_experts"][0, positions])  # unshifted
        assert torch.equal(local["position_ids"][0], within)
        has_next = within < lengths - 1
        assert torch.equal(local["labels"][0, has_next], packed["input_ids"][0, positions[has_next] + 1])
        assert torch.equal(local["token_mask"][0, has_next], packed["token_mask"][0, positions[has_next] + 1])
        assert not local["labels"][0, ~has_next].any() and not local["token_mask"][0, ~has_next].any()
        if rank % 2 == 0:  # CP rank 0 holds every sequence's last chunk: a shift across the packed row would give
            # its last rows the next sequence's first token (nonzero for at least one boundary: the check bites)
            inner_ends = positions[~has_next & (positions < packed["input_ids"].shape[1] - 1)]
            assert len(inner_ends) == 2 and packed["input_ids"][0, inner_ends + 1].any()
        # A chunk's last row whose next position is the other chunk of the same sequence (on the other rank).
        crosses = has_next & (positions.roll(-1) != positions + 1)
        assert crosses.any()
        assert torch.equal(local["sample_mask"], packed["sample_mask"])
        starts = torch.zeros(packed["input_ids"].shape[1], dtype=torch.bool)
        starts[packed["cu_seqlens"][:-1].long()] = True
        expected = packed["input_ids"][0].masked_fill(starts, 0).to(torch.float32)
        assert torch.equal(split["labels_back"][0], expected)


def test_a_gathered_tensor_with_trailing_dims_keeps_them_and_shifts_the_sequence(ranks):
    for rank in ranks:
        for name, (wide, per_channel) in rank["split"]["trailing"].items():
            assert wide.shape[-1] == 3 and torch.equal(wide, per_channel), name
            assert torch.equal(wide[..., 1], 2 * wide[..., 0]), name  # the channels were not shifted into each other


def test_sum_over_context_sends_each_rank_the_whole_gradient_for_its_own_tokens(ranks):
    """The adjoint of the CP sum: a share that uses the whole sequence's sum gets every rank's contribution to that
    sum's gradient, applied to its own tokens only; the result is the single-process gradient."""
    for rank in range(4):
        split = ranks[rank]["split"]
        # float64, a handful of terms: rounding only.
        torch.testing.assert_close(split["grad"], split["grad_expected"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("layout", ["cp2", "cp2_tp2"])
def test_context_parallel_equals_cp1_through_megatrons_schedule(ranks, layout, packed):
    """Loss, every metric, every gradient and the curr logprobs (the chunk boundaries included) of each path and
    loss equal the CP 1 layout's, padded or packed alike; compute_logprobs returns the full token-aligned logprobs."""
    for rank in range(4):
        _assert_same_results(ranks[rank][layout, packed], ranks[rank]["cp1", packed], LOSSES, PATHS)


def _assert_same_results(actual: dict, expected: dict, losses, paths) -> None:
    for path in paths:
        # Logprobs: the same row maths, another GEMM blocking (MODEL_LOGPROB_ATOL's reason).
        torch.testing.assert_close(actual["logprobs"][path], expected["logprobs"][path], rtol=0,
                                   atol=MODEL_LOGPROB_ATOL)
        assert not expected["logprobs"][path][:, 0].any()
        for loss_name in losses:
            got, want = actual[path, loss_name], expected[path, loss_name]
            assert got["metrics"].keys() == want["metrics"].keys()
            for name, value in want["metrics"].items():
                assert got["metrics"][name] == pytest.approx(value, rel=METRIC_RTOL, abs=METRIC_RTOL), \
                    (path, loss_name, name)
            torch.testing.assert_close(got["curr"], want["curr"], rtol=0, atol=MODEL_LOGPROB_ATOL)
            for name, grad in want["grads"].items():
                scale = grad.abs().max().item()
                assert scale > 0, (path, loss_name, name)
                # Relative to the largest element (MODEL_GRAD_RTOL's reason).
                torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=MODEL_GRAD_RTOL * scale,
                                           msg=lambda m: f"{path} {loss_name} {name}: {m}")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("layout", ["cp2", "cp2_tp2"])
def test_gpt_model_with_the_torch_attention_under_context_parallelism_equals_cp1(ranks, layout, packed):
    """The tiny GPTModel (RoPE, grouped-query heads) on `torch_attention_layer_spec()`: its attention all-gathers K
    and V over CP. Loss, metrics, every gradient and the logprobs from its logits and from its hidden states (the
    loss-fused path) equal CP 1's, padded and packed."""
    for rank in range(4):
        expected, actual = ranks[rank]["cp1", packed]["gpt"], ranks[rank][layout, packed]["gpt"]
        _assert_same_results(actual, expected, GPT_LOSSES, GPT_PATHS)


@pytest.mark.parametrize("layout", ["cp2", "cp2_tp2"])
def test_train_step_packing_under_context_parallelism_equals_cp1(ranks, layout):
    """`train_step` with `max_tokens_per_microbatch` under CP (each sequence padded to a multiple of 2·CP): its prev
    pass, its loss metrics and gradient norm, and the whole curr and prev logprobs equal CP 1's packing."""
    for rank in range(4):
        expected, actual = ranks[rank]["cp1", True]["train_step"], ranks[rank][layout, True]["train_step"]
        assert actual["metrics"].keys() == expected["metrics"].keys()
        for name, value in expected["metrics"].items():
            # The gradient norms: the gradients' tolerance (MODEL_GRAD_RTOL's reason); the loss's metrics: METRIC_RTOL.
            rtol = MODEL_GRAD_RTOL if name.startswith("grad_norm") else METRIC_RTOL
            assert actual["metrics"][name] == pytest.approx(value, rel=rtol, abs=rtol), name
        assert expected["metrics"]["grad_norm"] > 0
        for key in ("curr", "prev"):
            assert expected[key].abs().sum() > 0
            # The same row maths, another GEMM blocking (MODEL_LOGPROB_ATOL's reason).
            torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=MODEL_LOGPROB_ATOL)
