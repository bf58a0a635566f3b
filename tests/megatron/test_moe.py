"""A tiny Mixture-of-Experts GPTModel (4 experts, top-2, load-balancing and z-loss on) through the plugin on the CPU:
`train_step` at TP 1 (DP 2), TP 2 (sequence parallel, a sequence of odd length padded for it), PP 2 and EP 2 (the
alltoall dispatcher, DP 2) against one single-rank float64 reference, and routing replay (R3) in every layout.

One job of two ranks: at TP 1 each rank builds the model, computes the reference and records the routes (the same on
both: the same operations on the same inputs); then it loads the same weights into each layout (`load_full_state`)
and replays those routes (R3 takes routes from any engine: here another layout's).

The reference: the loss head in float64 on the fp32 model's logits of the whole batch (the on-policy clipped loss,
whose gradient is that of -sum(A · logprob) / tokens), plus each microbatch's auxiliary losses at the scale
Megatron's schedule gives them, 1 / (microbatches × DP), with the padding after each row's last scored token left out
(the model's own `padding_mask`). Gradients are compared relative to their largest element (`MODEL_GRAD_RTOL`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _dist import run_on_ranks
from _tolerances import MODEL_GRAD_RTOL
from test_megatron_hooks import VOCAB, reference_logprobs64

ROWS, SEQ, PROMPT = 8, 8, 3
REPLAY_SEQ = SEQ - 1  # the replay checks' rows: of odd length, padded for sequence parallelism at TP 2
MICRO_BATCH = 2
EXPERTS, TOPK = 4, 2


def make_batch(seed: int, ragged: bool = True) -> dict[str, torch.Tensor]:
    """Random rollouts of a 3-token prompt and a response to the end of the row, or (`ragged`) of random length
    with untrained padding after it; one sequence dropped, per-sequence advantages."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    lengths = torch.randint(1, SEQ - PROMPT + 1, (ROWS,), generator=gen) if ragged else torch.full((ROWS,), SEQ)
    positions = torch.arange(SEQ)
    token_mask = ((positions >= PROMPT) & (positions < PROMPT + lengths[:, None])).to(torch.float32)
    sample_mask = torch.ones(ROWS)
    sample_mask[5] = 0
    return {"input_ids": input_ids, "token_mask": token_mask, "sample_mask": sample_mask,
            "advantages": torch.randn(ROWS, generator=gen)}


def moe_params(**changes):
    from megatron_grpo.megatron import GPTModelParams

    return dataclasses.replace(GPTModelParams(
        num_layers=2, hidden_size=24, num_attention_heads=4, ffn_hidden_size=40, max_position_embeddings=SEQ,
        hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8, add_bias_linear=False,
        num_moe_experts=EXPERTS, moe_ffn_hidden_size=32, moe_router_topk=TOPK, moe_aux_loss_coeff=0.1,
        moe_z_loss_coeff=0.01, moe_enable_routing_replay=True), **changes)


def layout_params(tp: int = 1, dispatcher: str = "allgather"):
    return moe_params(sequence_parallel=tp > 1, moe_token_dispatcher_type=dispatcher)


def built(params, full: dict[str, torch.Tensor] | None = None, ddp: bool = True) -> torch.nn.Module:
    from megatron_grpo.megatron import build_gpt_model, wrap_in_ddp

    torch.manual_seed(5)
    model = build_gpt_model(params, VOCAB)
    if full is not None:
        load_full_state(model, full)
    return wrap_in_ddp(model) if ddp else model


def _global(name: str, model) -> tuple[str, bool]:
    """The TP-1 / PP-1 / EP-1 name of a local parameter, and whether it is an expert's."""
    from megatron.core import parallel_state

    parts = name.split(".")
    if "layers" in parts:
        at = parts.index("layers") + 1
        per_stage = model.config.num_layers // parallel_state.get_pipeline_model_parallel_world_size()
        parts[at] = str(int(parts[at]) + parallel_state.get_pipeline_model_parallel_rank() * per_stage)
    expert = "local_experts" in parts
    if expert:
        at = parts.index("local_experts") + 1
        local = model.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
        parts[at] = str(int(parts[at]) + parallel_state.get_expert_model_parallel_rank() * local)
    return ".".join(parts), expert


def local_part(model, name: str, param: torch.Tensor, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's part of the whole model's tensor `full[...]` for `param`: its layer and expert, its TP slice."""
    from megatron.core import parallel_state

    key, expert = _global(name, model)
    whole = full[key]
    if getattr(param, "tensor_model_parallel", False):
        size = (parallel_state.get_expert_tensor_parallel_world_size() if expert
                else parallel_state.get_tensor_model_parallel_world_size())
        rank = (parallel_state.get_expert_tensor_parallel_rank() if expert
                else parallel_state.get_tensor_model_parallel_rank())
        whole = whole.chunk(size, dim=param.partition_dim)[rank]
    return whole


def load_full_state(model, full: dict[str, torch.Tensor]) -> None:
    from megatron_grpo.megatron import unwrapped

    core = unwrapped(model)
    with torch.no_grad():
        for name, param in core.named_parameters():
            param.copy_(local_part(core, name, param, full))


def perturbed(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other weights (so that some tokens' natural routes change), the same in every layout."""
    gen = torch.Generator().manual_seed(7)
    return {name: value + 0.5 * value.std() * torch.randn(value.shape, generator=gen) if value.numel() > 1 else value
            for name, value in sorted(full.items())}


def padding_after_last_scored(batch) -> torch.Tensor:
    """True after each row's last trained token (written here from the batch contract, not the plugin's)."""
    positions = torch.arange(batch["token_mask"].shape[1])
    last = torch.where(batch["token_mask"] > 0, positions, torch.zeros_like(positions)).amax(dim=1)
    return positions[None] > last[:, None]


def reference(model, batch) -> tuple[dict[str, torch.Tensor], float]:
    """float64-headed gradient of the on-policy loss plus Megatron-scaled auxiliary losses; its global norm."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    mask = (batch["token_mask"] * batch["sample_mask"][:, None]).double()
    mask[:, 0] = 0
    model.eval()  # no auxiliary losses in eval mode: the main loss alone
    logprobs = reference_logprobs64(model, batch["input_ids"])
    (-(batch["advantages"].double()[:, None] * logprobs * mask).sum() / mask.sum()).backward()
    model.train()
    microbatches = ROWS // MICRO_BATCH
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([1.0 / microbatches]))
    padding = padding_after_last_scored(batch)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(diagonal=1)[None, None]
    for start in range(0, ROWS, MICRO_BATCH):
        rows = slice(start, start + MICRO_BATCH)
        ids = batch["input_ids"][rows]
        output = model(ids, torch.arange(SEQ).expand_as(ids), attention_mask=causal, padding_mask=padding[rows])
        (output * 0).sum().backward()  # the auxiliary losses' gradients alone
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    return grads, torch.sqrt(sum(g.double().square().sum() for g in grads.values())).item()


def train_once(params, full, batch, layout, **step_changes) -> dict:
    """One `train_step` (on-policy, prev skipped, no clip) of the model with weights `full`: its gradients and
    metrics."""
    from megatron_grpo import ClippedPGLossConfig, PlanInputs, plan_logprob_passes
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import AdamParams, StepConfig, build_optimizer, train_step, unwrapped, vocab_shard_of

    model = built(params, full)
    loss = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
    plan = plan_logprob_passes(PlanInputs.for_loss(loss, rollout_batch=ROWS, global_batch=ROWS, dropout=False))
    share = ROWS // layout.dp_size
    mine = {key: value[layout.dp_rank * share:(layout.dp_rank + 1) * share] for key, value in batch.items()}
    step = StepConfig(global_batch_size=ROWS, micro_batch_size=MICRO_BATCH, clip_grad=0.0, **step_changes)
    result = train_step(step, model, build_optimizer(model, AdamParams(lr=1e-3, clip_grad=0.0)), ClippedPGLoss(loss),
                        plan, mine, vocab=vocab_shard_of(model, VOCAB))
    core = unwrapped(model)
    return {"grads": {name: param.main_grad.detach().clone() for name, param in core.named_parameters()},
            "metrics": result.step_metrics[0], "model": model}


def gradient_error(model, grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Largest |local - reference| over the parameters, and the reference's largest element."""
    from megatron_grpo.megatron import unwrapped

    core = unwrapped(model)
    error = max((grads[name] - local_part(core, name, param, expected)).abs().max().item()
                for name, param in core.named_parameters())
    return error, max(g.abs().max().item() for g in expected.values())


class RouteCapture:
    """The routing map every router of a model hands its dispatcher, per forward (forward hooks)."""

    def __init__(self, model) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_grpo.megatron import unwrapped
        from megatron_grpo.megatron.routing_replay import moe_layer_numbers

        core = unwrapped(model)
        index = {number: i for i, number in enumerate(moe_layer_numbers(core.config))}
        self.maps: dict[int, list[torch.Tensor]] = {}
        for module in core.modules():
            if isinstance(module, TopKRouter):
                layer = index[module.layer_number]
                module.register_forward_hook(
                    lambda _module, _args, output, layer=layer: self.maps.setdefault(layer, []).append(
                        output[1].detach().clone()))


def router_order(layer_routes: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """`[b, s, k]` as a router sees it (written here, not the plugin's): the sequence padded to a multiple of TP
    with experts 0 .. k-1, s-major, this TP rank's slice under sequence parallelism."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    b, s, k = layer_routes.shape
    if sequence_parallel and s % tp:
        layer_routes = torch.cat([layer_routes, torch.arange(k).expand(b, tp - s % tp, k)], dim=1)
    order = layer_routes.transpose(0, 1)
    if sequence_parallel:
        order = order.chunk(tp)[parallel_state.get_tensor_model_parallel_rank()]
    return order.reshape(-1, k)


def routing_map(indices: torch.Tensor) -> torch.Tensor:
    return torch.zeros(indices.shape[0], EXPERTS, dtype=torch.int).scatter(1, indices.long(), 1).bool()


class ForcedRoutes:
    """A model made to route as told by other means than `RouterReplay`: each router's `routing` (logits to probs
    and map) replaced, for eval forwards, by the softmax over the given experts' logits, scattered: Megatron's top-k
    routing with those experts chosen."""

    def __init__(self, model, routes: torch.Tensor, sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_grpo.megatron import unwrapped
        from megatron_grpo.megatron.routing_replay import moe_layer_numbers

        core = unwrapped(model)
        index = {number: i for i, number in enumerate(moe_layer_numbers(core.config))}
        self.routers = [module for module in core.modules() if isinstance(module, TopKRouter)]
        for router in self.routers:
            router.routing = self._forced(router_order(routes[:, :, index[router.layer_number]], sequence_parallel))

    @staticmethod
    def _forced(indices: torch.Tensor):
        def routing(logits: torch.Tensor, padding_mask=None):
            logits = logits.view(-1, EXPERTS)
            probs = torch.softmax(logits.gather(1, indices), dim=-1, dtype=torch.float32).type_as(logits)
            return torch.zeros_like(logits).scatter(1, indices, probs), routing_map(indices)

        return routing

    def remove(self) -> None:
        for router in self.routers:
            del router.routing


def recorded_routes(params, full, batch) -> torch.Tensor:
    """The routes a decoding loop over the batch's rows records (the prompt's at the first step, then one token's per
    step), as the runner's sampler records them."""
    from megatron_grpo.megatron import RouteRecorder, last_position_logits

    model = built(params, full)
    model.eval()
    recorder = RouteRecorder(model, ROWS, REPLAY_SEQ)
    for length in range(PROMPT, REPLAY_SEQ):
        last_position_logits(model, batch["input_ids"][:, :length], routes=recorder)
    return recorder.routes(REPLAY_SEQ, torch.device("cpu"))


def recorder_checks(params, full, batch) -> bool:
    """Whether the recorder kept, for every position, the route of the decoding forward that read it first: the
    prompt's from the first forward, then one position per forward (this rank's routers' maps, in their order)."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron import RouteRecorder, last_position_logits

    model = built(params, full)
    model.eval()
    maps = RouteCapture(model)
    recorder = RouteRecorder(model, ROWS, REPLAY_SEQ)
    lengths = range(PROMPT, REPLAY_SEQ)
    for length in lengths:
        last_position_logits(model, batch["input_ids"][:, :length], routes=recorder)
    routes = recorder.routes(REPLAY_SEQ, torch.device("cpu"))
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    sequence_parallel = params.sequence_parallel and tp > 1
    agree = []
    for layer, per_forward in maps.maps.items():
        for length, routing in zip(lengths, per_forward, strict=True):
            padded = -(-length // tp) * tp if sequence_parallel else length
            local = range(tp_rank * padded // tp, (tp_rank + 1) * padded // tp) if sequence_parallel else range(padded)
            for position in range(PROMPT) if length == PROMPT else [length - 1]:
                if position in local:
                    rows = (position - local.start) * ROWS + torch.arange(ROWS)
                    agree.append(torch.equal(routing[rows], routing_map(routes[:, position, layer])))
    return bool(agree) and all(agree)


def replay_checks(params, full, batch, routes, layout) -> dict:
    """`train_step` under R3 from other weights than the routes were recorded with: the routing maps of its prev
    pass, reference pass (replaying too) and training forward against the given routes; prev against curr; then an
    altered set of routes against a model forced to them by other means."""
    from megatron_grpo import ClippedPGLossConfig, PlanInputs, plan_logprob_passes
    from megatron_grpo.loss import ClippedPGLoss, trained_token_mask
    from megatron_grpo.megatron import (
        ROUTED_EXPERTS,
        AdamParams,
        StepConfig,
        build_optimizer,
        compute_logprobs,
        train_step,
        vocab_shard_of,
    )

    share = ROWS // layout.dp_size
    rows = slice(layout.dp_rank * share, (layout.dp_rank + 1) * share)
    gen = torch.Generator().manual_seed(43)
    generation = -torch.rand(ROWS, REPLAY_SEQ, generator=gen)
    mine = {key: value[rows] for key, value in {**batch, ROUTED_EXPERTS: routes,
                                                  "generation_logprobs": generation}.items()}
    policy = built(params, perturbed(full))
    reference_model = built(params, full, ddp=False).requires_grad_(False)
    policy_maps, reference_maps = RouteCapture(policy), RouteCapture(reference_model)
    loss = ClippedPGLossConfig(reference_policy_kl_penalty=0.05)
    plan = plan_logprob_passes(PlanInputs.for_loss(loss, rollout_batch=ROWS, global_batch=ROWS, dropout=False,
                                                   prev_mode="compute", moe=True, router_replay=True))
    step = StepConfig(global_batch_size=ROWS, micro_batch_size=MICRO_BATCH, reference_replays_routes=True,
                      compare_without_replay=True)
    result = train_step(step, policy, build_optimizer(policy, AdamParams(lr=1e-3)), ClippedPGLoss(loss), plan, mine,
                        vocab=vocab_shard_of(policy, VOCAB), reference_model=reference_model)
    sequence_parallel = params.sequence_parallel and layout.tp_size > 1
    expected = {layer: [routing_map(router_order(mine[ROUTED_EXPERTS][start:start + MICRO_BATCH, :, layer],
                                                 sequence_parallel))
                        for start in range(0, share, MICRO_BATCH)] for layer in policy_maps.maps}
    count = share // MICRO_BATCH  # forwards per pass: prev, then natural (compare_without_replay), then training
    trained = trained_token_mask(mine).bool()

    vocab = vocab_shard_of(policy, VOCAB)
    forced_model = built(params, perturbed(full))
    altered = (mine[ROUTED_EXPERTS] + 1) % EXPERTS
    with torch.no_grad():
        as_recorded = compute_logprobs(forced_model, {"input_ids": mine["input_ids"],
                                                      ROUTED_EXPERTS: mine[ROUTED_EXPERTS]},
                                       micro_batch_size=share, vocab=vocab)
        replayed_altered = compute_logprobs(forced_model, {"input_ids": mine["input_ids"], ROUTED_EXPERTS: altered},
                                            micro_batch_size=share, vocab=vocab)
        forced = ForcedRoutes(forced_model, altered, sequence_parallel)
        forced_altered = compute_logprobs(forced_model, {"input_ids": mine["input_ids"]}, micro_batch_size=share,
                                          vocab=vocab)
        forced.remove()
    return {
        "local_layers": sorted(policy_maps.maps),
        "prev_maps_replayed": all(torch.equal(got, want) for layer, maps in policy_maps.maps.items()
                                  for got, want in zip(maps[:count], expected[layer], strict=True)),
        "natural_maps_differ": any(not torch.equal(got, want) for layer, maps in policy_maps.maps.items()
                                   for got, want in zip(maps[count:2 * count], expected[layer], strict=True)),
        "training_maps_replayed": all(torch.equal(got, want) for layer, maps in policy_maps.maps.items()
                                      for got, want in zip(maps[2 * count:], expected[layer], strict=True)),
        "forwards": {layer: len(maps) for layer, maps in policy_maps.maps.items()},
        "reference_maps_replayed": all(torch.equal(got, want) for layer, maps in reference_maps.maps.items()
                                       for got, want in zip(maps, expected[layer], strict=True)),
        "reference_forwards": {layer: len(maps) for layer, maps in reference_maps.maps.items()},
        "prev_equals_curr": bool(torch.equal(result.prev_logprobs[trained], result.curr_logprobs[trained])),
        "metrics": {**result.step_metrics[0], **result.routing_metrics},
        "altered_equals_forced": bool(torch.equal(replayed_altered, forced_altered)),
        "altered_change": (replayed_altered - as_recorded)[trained].abs().max().item(),
    }


def replay_batch(batch) -> dict[str, torch.Tensor]:
    """The replay checks' rows: the batch's first REPLAY_SEQ columns."""
    return {key: value[:, :REPLAY_SEQ] if value.dim() == 2 else value for key, value in batch.items()}


def layout_checks(params, full, references, routes, layout) -> dict:
    """Under sequence parallelism Megatron's z-loss is the mean of each TP rank's token mean, so it equals the one
    of TP 1 only where every rank holds as many counted tokens: the reference without padding there."""
    batch, expected, norm = references["unpadded" if params.sequence_parallel else "ragged"]
    trained = train_once(params, full, batch, layout)
    error, scale = gradient_error(trained["model"], trained["grads"], expected)
    rows = replay_batch(references["ragged"][0])
    return {"grad_error": error, "grad_scale": scale, "metrics": trained["metrics"], "expected_norm": norm,
            "replay": replay_checks(params, full, rows, routes, layout),
            "recorder_keeps_the_first_reading_route": recorder_checks(params, full, rows)}


def named_errors(params, batch) -> dict[str, str]:
    """The errors of bad routes, each as its message (compute_logprobs checks them before any forward)."""
    from megatron_grpo.megatron import ROUTED_EXPERTS, RouteRecorder, compute_logprobs, vocab_shard_of

    model = built(params)
    dense = built(moe_params(num_moe_experts=None, moe_enable_routing_replay=False, add_bias_linear=True))
    unreplayable = built(moe_params(moe_enable_routing_replay=False))
    ids = batch["input_ids"][:2]
    good = torch.zeros(2, SEQ, 2, TOPK, dtype=torch.int64)
    cases = {
        "shape": (model, good[:, :, 0]),
        "layers": (model, torch.zeros(2, SEQ, 3, TOPK, dtype=torch.int64)),
        "topk": (model, torch.zeros(2, SEQ, 2, TOPK + 1, dtype=torch.int64)),
        "dtype": (model, good.float()),
        "too_large": (model, good + EXPERTS),
        "negative": (model, good - 1),
        "dense": (dense, good),
        "not_replayable": (unreplayable, good),
    }
    messages = {}
    for name, (target, routes) in cases.items():
        try:
            compute_logprobs(target, {"input_ids": ids, ROUTED_EXPERTS: routes}, micro_batch_size=2,
                             vocab=vocab_shard_of(target, VOCAB))
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    for name, target in (("record_dense", dense), ("record_unreplayable", unreplayable)):
        try:
            RouteRecorder(target, 2, SEQ)
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    messages["deferred_aux"] = deferred_normalisation_error(model, batch)
    messages.update(build_errors({"bias": {"add_bias_linear": True}, "flex": {"moe_token_dispatcher_type": "flex"},
                                  "grouped_gemm": {"moe_grouped_gemm": True},
                                  "replay_dense": {"num_moe_experts": None}}))
    return messages


def deferred_normalisation_error(model, batch) -> str:
    """`train_step` under the sequence mask by logprob error (its normalisation deferred) with auxiliary losses on."""
    from megatron_grpo import ClippedPGLossConfig, PlanInputs, plan_logprob_passes
    from megatron_grpo.loss import ClippedPGLoss
    from megatron_grpo.megatron import AdamParams, StepConfig, build_optimizer, train_step, vocab_shard_of

    loss = ClippedPGLossConfig(reference_policy_kl_penalty=0.0)
    plan = plan_logprob_passes(PlanInputs.for_loss(loss, rollout_batch=ROWS, global_batch=ROWS, dropout=False,
                                                   error_threshold=2.0))
    gen = torch.Generator().manual_seed(44)
    try:
        train_step(StepConfig(global_batch_size=ROWS, micro_batch_size=MICRO_BATCH), model,
                   build_optimizer(model, AdamParams(lr=1e-3)), ClippedPGLoss(loss), plan,
                   {**batch, "generation_logprobs": -torch.rand(ROWS, SEQ, generator=gen)},
                   vocab=vocab_shard_of(model, VOCAB))
    except ValueError as err:
        return str(err)
    return "no error"


def build_errors(cases: dict[str, dict]) -> dict[str, str]:
    """`build_gpt_model`'s ValueError for each case of MoE settings it cannot build here."""
    messages = {}
    for name, changes in cases.items():
        try:
            built(moe_params(**changes))
            messages[name] = "no error"
        except ValueError as err:
            messages[name] = str(err)
    return messages


LAYOUTS = {"tp2": ({"tensor_model_parallel_size": 2}, 2, "allgather"),
           "pp2": ({"pipeline_model_parallel_size": 2}, 1, "allgather"),
           "ep2": ({"expert_model_parallel_size": 2}, 1, "alltoall")}


def world(rank: int, world_size: int) -> dict:
    """The reference, the recorded routes, the named errors and the TP-1 checks (TP 1 over DP 2), then the checks of
    each of `LAYOUTS`: one process group, Megatron's groups per layout."""
    from megatron.core import parallel_state

    from megatron_grpo.megatron import ParallelParams, destroy_parallel, init_parallel
    from megatron_grpo.megatron.routing_replay import RouterReplay

    try:
        layout = init_parallel(ParallelParams())
        params = layout_params()
        full = {name: param.detach().clone() for name, param in built(params, ddp=False).named_parameters()}
        references = {}
        for name, ragged in (("ragged", True), ("unpadded", False)):
            batch = make_batch(seed=41, ragged=ragged)
            references[name] = (batch, *reference(built(params, full, ddp=False), batch))
        routes = recorded_routes(params, full, replay_batch(references["ragged"][0]))
        outcome = {"tp1": {"layout": (layout.tp_size, layout.pp_size, layout.ep_size, layout.dp_size),
                           **layout_checks(params, full, references, routes, layout)}}
        shared = {"routes": routes, "errors": named_errors(params, references["ragged"][0])}
        RouterReplay.clear_global_router_replay_instances()
        parallel_state.destroy_model_parallel()
        for name, (sizes, tp, dispatcher) in LAYOUTS.items():
            layout = init_parallel(ParallelParams(**sizes))
            params = layout_params(tp, dispatcher)
            outcome[name] = {"layout": (layout.tp_size, layout.pp_size, layout.ep_size, layout.dp_size),
                             **layout_checks(params, full, references, routes, layout)}
            if name == "tp2":
                outcome[name]["errors"] = build_errors({"without_sequence_parallel": {"sequence_parallel": False}})
            RouterReplay.clear_global_router_replay_instances()
            parallel_state.destroy_model_parallel()
    finally:
        RouterReplay.clear_global_router_replay_instances()
        destroy_parallel()
    return {**shared, "layouts": outcome}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_on_ranks(2, world)


@pytest.fixture(scope="module")
def one(ranks) -> dict:
    """Rank 0's reference-side results: the recorded routes and the named errors."""
    return ranks[0]


@pytest.fixture(scope="module")
def two(ranks) -> list[dict]:
    """Each rank's checks, by layout."""
    return [rank["layouts"] for rank in ranks]


def every_layout(two):
    for rank in two:
        yield from rank.items()


def test_layouts_are_tp1_over_dp2_tp2_pp2_and_ep2_over_dp2(two):
    assert [rank["tp1"]["layout"] for rank in two] == [(1, 1, 1, 2)] * 2
    assert [rank["tp2"]["layout"] for rank in two] == [(2, 1, 1, 1)] * 2
    assert [rank["pp2"]["layout"] for rank in two] == [(1, 2, 1, 1)] * 2
    assert [rank["ep2"]["layout"] for rank in two] == [(1, 1, 2, 2)] * 2


def test_train_step_gradient_equals_the_float64_reference_with_the_auxiliary_losses(two):
    for name, result in every_layout(two):
        assert result["expected_norm"] > 1e-3
        assert result["grad_error"] <= MODEL_GRAD_RTOL * result["grad_scale"], (name, result["grad_error"])
        # the norm of every rank's gradient, expert parallelism included, is the whole model's
        assert result["metrics"]["grad_norm"] == pytest.approx(result["expected_norm"], rel=MODEL_GRAD_RTOL), name


def test_the_auxiliary_losses_are_reported_the_same_in_every_layout_of_the_same_batch(two):
    reference = two[0]["tp1"]["metrics"]
    assert reference["load_balancing_loss"] > 0 and reference["z_loss"] > 0
    for name, result in every_layout(two):
        if name == "tp2":  # another batch (see layout_checks)
            continue
        for key in ("load_balancing_loss", "z_loss"):  # means of fp32 sums of a few dozen tokens
            assert result["metrics"][key] == pytest.approx(reference[key], rel=1e-5), (name, key)


def test_replayed_routes_are_the_routes_of_the_prev_reference_and_training_forwards_bitwise(two):
    for name, result in every_layout(two):
        replay = result["replay"]
        assert replay["local_layers"], name
        forwards = ROWS // MICRO_BATCH // result["layout"][3]  # microbatches per pass on this rank (of DP)
        assert set(replay["forwards"].values()) == {3 * forwards}, name  # prev, natural (for the metric), training
        assert set(replay["reference_forwards"].values()) == {forwards}, name
        assert replay["prev_maps_replayed"] and replay["training_maps_replayed"], name
        assert replay["reference_maps_replayed"], name
        # the weights were changed after recording: the router's own routes differ, so replay did something
        assert replay["natural_maps_differ"], name
        assert replay["metrics"]["router_replay_changed_fraction"] > 0, name


def test_the_recorder_keeps_each_tokens_route_from_the_forward_that_read_it_first(ranks, one, two):
    for name, result in every_layout(two):
        assert result["recorder_keeps_the_first_reading_route"], name
    # every layer of the whole model, on every rank (a pipeline stage records its own: all-reduced), [B, S, L, k]
    assert one["routes"].shape == (ROWS, REPLAY_SEQ, 2, TOPK) and one["routes"].dtype == torch.int64
    assert torch.equal(one["routes"][:, -1], torch.arange(TOPK).expand(ROWS, 2, TOPK))  # never read: 0 .. k-1
    assert torch.equal(ranks[1]["routes"], one["routes"])  # each rank recorded them: the same


def test_under_replay_the_prev_pass_equals_the_training_forward_bitwise(two):
    for name, result in every_layout(two):
        assert result["replay"]["prev_equals_curr"], name


def test_altered_routes_change_the_logprobs_as_a_model_forced_to_them_predicts(two):
    for name, result in every_layout(two):
        assert result["replay"]["altered_equals_forced"], name
        assert result["replay"]["altered_change"] > 1e-3, name


def test_the_routing_metrics_are_the_same_on_every_rank_and_say_what_replay_changed(two):
    for name in ("tp1", *LAYOUTS):
        metrics = [rank[name]["replay"]["metrics"] for rank in two]
        for key in ("router_replay_changed_fraction", "router_replay_token_mult_prob_error",
                    "router_replay_off_token_mult_prob_error", "load_balancing_loss", "z_loss"):
            assert metrics[0][key] == metrics[1][key], (name, key)
        # the weights moved since the routes were recorded: replay and the router's own routes give other logprobs
        replayed = metrics[0]["router_replay_token_mult_prob_error"]
        assert metrics[0]["router_replay_off_token_mult_prob_error"] != replayed, name


@pytest.mark.parametrize(("case", "message"), [
    ("shape", r"batch\['routed_experts'\]: expected \[B, S, L, k\] = \[2, 8, 2, 2\] .*got \[2, 8, 2\]"),
    ("layers", r"routes for 3 MoE layers, the model has 2"),
    ("topk", r"3 experts per token, the model routes each token to moe_router_topk = 2"),
    ("dtype", r"expected an integer dtype \(expert ids\), got torch.float32"),
    ("too_large", r"expert ids must be in \[0, 4\) \(num_moe_experts\), got ids from 4 to 4"),
    ("negative", r"expert ids must be in \[0, 4\) \(num_moe_experts\), got ids from -1 to -1"),
    ("dense", r"routes for a dense model"),
    ("not_replayable", r"build it with moe_enable_routing_replay=True"),
    ("record_dense", r"a dense model has no routes to record"),
    ("record_unreplayable", r"build it with moe_enable_routing_replay=True"),
    ("bias", r"add_bias_linear: an MoE model's experts take no bias"),
    ("flex", r"moe_token_dispatcher_type: flex \(DeepEP / HybridEP\) needs CUDA"),
    ("grouped_gemm", r"moe_grouped_gemm: needs Transformer Engine's grouped GEMM"),
    ("replay_dense", r"moe_enable_routing_replay: routing replay needs an MoE model"),
    ("deferred_aux", r"defer_normalisation: .* would divide the MoE auxiliary losses' gradients"),
])
def test_bad_routes_and_moe_settings_are_named_errors(one, case, message):
    import re

    assert re.search(message, one["errors"][case]), one["errors"][case]


def test_an_moe_model_under_tensor_parallelism_needs_sequence_parallelism(two):
    for rank in two:
        assert rank["tp2"]["errors"]["without_sequence_parallel"].startswith(
            "sequence_parallel: an MoE model at tensor_model_parallel_size 2 needs sequence_parallel=True")


def test_clearing_the_auxiliary_losses_forgets_an_earlier_models_layer_count():
    """Megatron's tracker sizes a loss by the first model that logs it; after `clear_aux_losses` a model of more MoE
    layers in the same process logs its own (it indexed past the old size: an IndexError in its forward)."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker, save_to_aux_losses_tracker

    from megatron_grpo.megatron.moe_losses import clear_aux_losses

    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0), layer_number=1, num_layers=1)
    clear_aux_losses()
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2.0), layer_number=2, num_layers=2)
    assert get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].tolist() == [0.0, 2.0]
    clear_aux_losses()
    assert get_moe_layer_wise_logging_tracker() == {}
