"""Routing replay (R3) for Mixture-of-Experts GPTModels: the routes of each token, recorded at rollout and replayed
in the logprob passes and the training forward, through Megatron-Core's `RouterReplay` (docs/moe.md).

The routes travel in the batch as one per-token tensor, `batch["routed_experts"]`: integer `[B, S, L, k]` (packed
`[1, T, L, k]`), aligned with `input_ids` and not shifted: `routed_experts[b, t, l]` are the `k` experts (global ids
`0 .. num_moe_experts - 1`, in any order) that token `input_ids[b, t]` went to in the model's `l`-th MoE layer, whole
model, pipeline stages included. It is vLLM's and NeMo-RL's `routed_experts` per sequence (`[tokens, L, k]`) stacked
into the batch; any rollout engine's routes can be fed in so. A position the engine did not route (the last sampled
token, padding) needs some in-range ids: a route changes only its own token's output and what later tokens read of it,
so after a sequence's last scored token nothing is read (the recorder fills such positions with `0 .. k-1`). Being a
per-token tensor, the routes are sliced, packed and split for context parallelism with the other per-token tensors
(under CP like `input_ids`, unshifted).

Each forward through this package sets every local router's `RouterReplay` first (`forward_routing`): replay the
given routes (`REPLAY_FORWARD`, then `REPLAY_BACKWARD` for an activation recompute in backward), record the natural
routes (`RECORD`), or route naturally. The routers of one model are found by walking it (`moe_layers`), never through
`RouterReplay`'s process-wide list, which the policy and the reference model share. In Megatron's token order a
router sees its `[s, b]` hidden states flattened s-major, under sequence parallelism only this TP rank's slice of the
sequence (`to_router_order`).

While replaying, each router also computes its own top-k on the same scores (one `topk` over `[tokens, E]`, no
gradient), so a training forward reports which tokens replay changed (`RouteChanges`): for the first MoE layer what a
forward with the router's own routes would choose, for deeper layers what the router chooses given the replayed
layers before it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_grpo.megatron.ddp import unwrapped

ROUTED_EXPERTS = "routed_experts"  # the batch key of the routes, [B, S, L, k] integer
MOE_PADDING_MASK = "moe_padding_mask"  # the training forward's [B, S] bool, True past a sequence's scored tokens
ROUTES_COUNTED = "routes_counted"  # the training forward's [B, S] bool, True where a route reaches a scored logprob
INPUT_ALIGNED_KEYS = (ROUTED_EXPERTS, MOE_PADDING_MASK, ROUTES_COUNTED)  # per-token keys of input tokens, not targets


@dataclass(frozen=True)
class MoELayers:
    """A model's Mixture-of-Experts layers as the routes address them."""

    num_layers: int  # MoE layers of the whole model (every pipeline stage): the routes' L
    topk: int
    num_experts: int
    local: tuple[tuple[int, TopKRouter], ...]  # (MoE layer index, router) of this pipeline stage, in layer order
    replayable: bool  # built with moe_enable_routing_replay: each router has a RouterReplay
    sequence_parallel: bool  # each router sees this TP rank's slice of the sequence
    recomputes_routers: bool  # activation recompute runs the routers again in backward


def moe_layer_numbers(config) -> list[int]:
    """The 1-based global numbers of the MoE layers (Megatron's `moe_layer_freq`: every n-th layer from the first, or
    a 0/1 pattern over the layers)."""
    pattern = config.moe_layer_freq
    if isinstance(pattern, int):
        pattern = [int(i % pattern == 0) for i in range(config.num_layers)]
    return [i + 1 for i, is_moe in enumerate(pattern) if is_moe]


def moe_layers(model: torch.nn.Module) -> MoELayers | None:
    """The MoE layers of `model` (in Megatron's wrappers or not), or None for a dense model. Found once per model
    (its routers do not change) and kept with it."""
    core = unwrapped(model)
    config = getattr(core, "config", None)  # a module that is no Megatron model has none
    if getattr(config, "num_moe_experts", None) is None:
        return None
    found = _LAYERS.get(core)
    if found is None:
        found = _LAYERS[core] = _find_moe_layers(core, config)
    return found


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _find_moe_layers(core: torch.nn.Module, config) -> MoELayers:
    index = {number: i for i, number in enumerate(moe_layer_numbers(config))}
    decoder = getattr(core, "decoder", core)  # multi-token-prediction layers (outside the decoder) are not routed
    routers = sorted(((index[module.layer_number], module) for module in decoder.modules()
                      if isinstance(module, TopKRouter)), key=lambda pair: pair[0])
    recompute = config.recompute_granularity == "full" or (
        config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ()))
    return MoELayers(num_layers=len(index), topk=config.moe_router_topk, num_experts=config.num_moe_experts,
                     local=tuple(routers), replayable=bool(config.moe_enable_routing_replay),
                     sequence_parallel=bool(config.sequence_parallel) and _tp_size() > 1,
                     recomputes_routers=recompute)


def check_routes(model: torch.nn.Module, routes: object, input_ids: torch.Tensor, *, check_values: bool = True,
                 key: str = f"batch[{ROUTED_EXPERTS!r}]") -> None:
    """A ValueError naming `key` unless `routes` fits `model` and `input_ids`: an integer `[*input_ids.shape, L, k]`
    for a model of L MoE layers routing to k experts, built for replay, with settings under which its routers replay;
    with `check_values`, every id in `[0, num_moe_experts)` (one host sync)."""
    layers = moe_layers(model)
    if layers is None:
        raise ValueError(f"{key}: routes for a dense model (it has no MoE layer, num_moe_experts is None)")
    if not isinstance(routes, torch.Tensor):
        raise ValueError(f"{key}: expected a torch.Tensor, got {type(routes).__name__}")
    if routes.dtype.is_floating_point or routes.dtype.is_complex or routes.dtype == torch.bool:
        raise ValueError(f"{key}: expected an integer dtype (expert ids), got {routes.dtype}")
    expected = [*input_ids.shape, layers.num_layers, layers.topk]
    if routes.dim() != 4 or list(routes.shape[:2]) != list(input_ids.shape):
        raise ValueError(f"{key}: expected [B, S, L, k] = {expected} (input_ids {list(input_ids.shape)}, the model's "
                         f"MoE layers and moe_router_topk), got {list(routes.shape)}")
    if routes.shape[2] != layers.num_layers:
        raise ValueError(f"{key}: routes for {routes.shape[2]} MoE layers, the model has {layers.num_layers} "
                         f"(expected {expected})")
    if routes.shape[3] != layers.topk:
        raise ValueError(f"{key}: {routes.shape[3]} experts per token, the model routes each token to "
                         f"moe_router_topk = {layers.topk} (expected {expected})")
    _check_replayable(model, layers, key)
    if check_values and routes.numel():
        low, high = torch.stack([routes.min(), routes.max()]).tolist()
        if low < 0 or high >= layers.num_experts:
            raise ValueError(f"{key}: expert ids must be in [0, {layers.num_experts}) (num_moe_experts), got ids from "
                             f"{low} to {high}")


def _check_replayable(model: torch.nn.Module, layers: MoELayers, key: str) -> None:
    """The settings under which Megatron-Core's routers use the replayed routes as given."""
    config = unwrapped(model).config
    if not layers.replayable:
        raise ValueError(f"{key}: the model's routers cannot replay routes: build it with "
                         "moe_enable_routing_replay=True")
    problems = []
    if config.moe_router_fusion:
        problems.append("moe_router_fusion (the fused top-k bypasses RouterReplay)")
    balancing = config.moe_router_load_balancing_type
    if "sinkhorn" in ([balancing] if isinstance(balancing, str) else balancing):
        problems.append("moe_router_load_balancing_type sinkhorn (it does not go through RouterReplay)")
    if config.moe_expert_capacity_factor is not None:
        problems.append("moe_expert_capacity_factor (token dropping after the top-k would drop replayed tokens)")
    if problems:
        raise ValueError(f"{key}: the model's routers would not replay routes exactly with {'; '.join(problems)}")


def _tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def to_router_order(layer_routes: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """One layer's `[b, s, k]` routes in the order its router sees the tokens: int64 `[s_local · b, k]`, s-major,
    under sequence parallelism this TP rank's contiguous slice of the sequence (`s` a multiple of TP)."""
    order = layer_routes.transpose(0, 1)
    if sequence_parallel:
        order = order.chunk(_tp_size(), dim=0)[parallel_state.get_tensor_model_parallel_rank()]
    return order.reshape(-1, layer_routes.shape[-1]).to(torch.int64).contiguous()


def from_router_order(local: torch.Tensor, batch_size: int, sequence_parallel: bool) -> torch.Tensor:
    """The inverse of `to_router_order`: `[b, s, k]` from a router's `[s_local · b, k]`, all-gathered over TP under
    sequence parallelism."""
    if sequence_parallel:
        shares = [torch.empty_like(local) for _ in range(_tp_size())]
        dist.all_gather(shares, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        local = torch.cat(shares)
    return local.view(-1, batch_size, local.shape[-1]).transpose(0, 1).contiguous()


def placeholder_routes(shape: tuple[int, ...], topk: int, device: torch.device) -> torch.Tensor:
    """int64 routes `[*shape, k]` to `0 .. k-1` (k distinct experts): for positions that were never routed."""
    return torch.arange(topk, device=device).expand(*shape, topk)


def padding_mask_of(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`[B, S]` (packed `[1, T]`) bool, True on the positions after the last scored token of their sequence (at least
    each sequence's first token counts): what Megatron's MoE auxiliary losses must leave out (`padding_mask`).

    Right padding, a packed sequence's padding and the untrained tail of a row change no scored logprob under causal
    attention, so the same tokens count as in the row cut to its scored length (what packing keeps)."""
    positions, last = _last_scored(batch)
    return positions > last


def routes_counted_of(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """`[B, S]` (packed `[1, T]`) bool, True on the positions before the last scored token of their sequence: the
    tokens whose routes reach a scored logprob (the last scored token's logprob reads the tokens before it)."""
    positions, last = _last_scored(batch)
    return positions < last


def _last_scored(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position, and the position of the last scored token (`token_mask`) of its sequence (its first token
    where none is scored), both `[B, S]` (packed `[1, T]`)."""
    from megatron_grpo.loss.packing import CU_SEQLENS, SequenceLayout

    mask = batch["token_mask"] != 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    if CU_SEQLENS not in batch:
        return positions, (mask * positions).amax(dim=1, keepdim=True).expand_as(mask)
    sequence = SequenceLayout.of_batch(batch).sequence_ids[0]
    starts = batch[CU_SEQLENS][:-1].to(torch.int64)
    scored = torch.where(mask[0], positions[0], starts[sequence])
    last = torch.full_like(starts, -1).scatter_reduce(0, sequence, scored, reduce="amax")
    return positions, last[sequence][None]


class _NaturalTopk:
    """Stands in for one `RouterReplay.get_replay_topk` (an instance attribute): Megatron's, and while it replays
    a forward, the router's own top-k of the same scores alongside (`natural`, with the `replayed` indices)."""

    def __init__(self, replay: RouterReplay) -> None:
        self.replay = replay
        self.original = replay.get_replay_topk
        self.natural: torch.Tensor | None = None
        self.replayed: torch.Tensor | None = None

    def __call__(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, indices = self.original(scores, topk, num_groups, group_topk, default_compute_topk)
        if self.replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                _, self.natural = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.replayed = indices
        return probs, indices


def _tracker(replay: RouterReplay) -> _NaturalTopk:
    """The router's `_NaturalTopk`, installed on first use."""
    if not isinstance(replay.get_replay_topk, _NaturalTopk):
        replay.get_replay_topk = _NaturalTopk(replay)
    return replay.get_replay_topk


class RouteChanges:
    """Which tokens of the training forwards of one optimizer step replay gave other experts than the router's own
    top-k would have, in any MoE layer, among the tokens whose routes reach a scored logprob (`routes_counted_of`:
    not the last scored token, whose recorded route a rollout may lack); `fraction()` reduces it over the ranks."""

    def __init__(self) -> None:
        self.changed: list[torch.Tensor] = []  # per forward, [local tokens] bool in router order
        self.counted: list[torch.Tensor] = []  # the same tokens, True where not padding

    def add(self, changed: torch.Tensor, counted: torch.Tensor) -> None:
        self.changed.append(changed)
        self.counted.append(counted)

    def fraction(self, sequence_parallel: bool) -> float:
        """The fraction of the counted tokens changed in some MoE layer, over all microbatches, pipeline stages (a
        token counts as changed if any stage's layers changed it), TP slices (under sequence parallelism) and
        DP × CP ranks; the same on every rank. 0 without counted tokens."""
        if self.changed:
            changed, counted = torch.cat(self.changed), torch.cat(self.counted)
        else:  # a stage without MoE layers still takes part in the reductions
            changed = counted = torch.zeros(0, dtype=torch.bool, device=_collective_device())
        flags = changed.to(torch.int32)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            flags = _max_over_pipeline(flags)
        totals = torch.stack([(flags.bool() & counted).sum(), counted.sum()]).to(torch.float64)
        groups = [parallel_state.get_data_parallel_group(with_context_parallel=True)]
        if sequence_parallel:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        for group in groups:
            if group.size() > 1:
                dist.all_reduce(totals, group=group)
        changed_count, counted_count = totals.tolist()
        return changed_count / counted_count if counted_count else 0.0


def _max_over_pipeline(flags: torch.Tensor) -> torch.Tensor:
    """Per-token flags ORed over the pipeline stages, which saw the same microbatches in the same order; a stage
    without MoE layers (no flags) takes the others'."""
    group = parallel_state.get_pipeline_model_parallel_group()
    length = torch.tensor([flags.numel()], dtype=torch.int64, device=flags.device)
    dist.all_reduce(length, group=group, op=dist.ReduceOp.MAX)
    whole = torch.zeros(int(length), dtype=torch.int32, device=flags.device)
    whole[:flags.numel()] = flags
    dist.all_reduce(whole, group=group, op=dist.ReduceOp.MAX)
    return whole


def _collective_device() -> torch.device:
    """Where this process's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


OnRoutes = Callable[[dict[int, torch.Tensor]], None]  # {MoE layer index: [b, s, k] int64} of one forward


@contextmanager
def forward_routing(model: torch.nn.Module, batch_size: int, *, routes: torch.Tensor | None = None,
                    record: OnRoutes | None = None, changes: RouteChanges | None = None,
                    counted: torch.Tensor | None = None) -> Iterator[None]:
    """Sets every local router of `model` for the one forward of `batch_size` rows run inside the block.

    - `routes` `[b, s, L, k]` (`s` as the model is run: padded for sequence parallelism): replayed. After the
      forward the routers switch to `REPLAY_BACKWARD`, whose queue an activation recompute pops in backward; without
      recompute they are left natural and empty. `changes` collects which tokens replay changed, among those
      `counted` `[b, s]` marks (all without it);
    - `record`: the routers record their own routes, handed after the forward to `record` as
      `{MoE layer: [b, s, k]}` (TP-gathered under sequence parallelism);
    - neither: the routers route naturally (a router left replaying by an earlier forward is reset).
    Routes for a model that cannot replay them are `check_routes`' ValueError."""
    layers = moe_layers(model)
    if routes is not None and (layers is None or not layers.replayable):
        check_routes(model, routes, routes.new_zeros(routes.shape[:2]), check_values=False)
    if layers is None or not layers.replayable:
        yield
        return
    local = [(index, router.router_replay) for index, router in layers.local]
    for index, replay in local:
        replay.clear_router_replay_action()
        if not layers.recomputes_routers:  # nothing pops the backward queue: keep it empty
            replay.clear_indices()
        if routes is not None:
            _tracker(replay).natural = None
            replay.set_target_indices(to_router_order(routes[:, :, index], layers.sequence_parallel))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        elif record is not None:
            replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield
    except BaseException:
        clear_routing(model)
        raise
    if routes is not None:
        if changes is not None and local:
            changes.add(*_changed_tokens(local, counted, layers.sequence_parallel))
        for _, replay in local:
            if layers.recomputes_routers:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.clear_router_replay_action()
                replay.clear_indices()
    elif record is not None:
        recorded = {}
        for index, replay in local:
            recorded[index] = from_router_order(replay.get_recorded_indices(), batch_size, layers.sequence_parallel)
            replay.clear_router_replay_action()
            replay.clear_indices()
        record(recorded)


def _changed_tokens(local: list[tuple[int, RouterReplay]], counted: torch.Tensor | None,
                    sequence_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of this forward (router order): whether the replayed top-k set differs from the router's own in
    any local MoE layer, and whether the token counts."""
    changed = None
    for _, replay in local:
        tracker = _tracker(replay)
        natural, replayed = tracker.natural.sort(dim=-1).values, tracker.replayed.sort(dim=-1).values
        differs = (natural != replayed).any(dim=-1)
        changed = differs if changed is None else changed | differs
        tracker.natural = tracker.replayed = None
    if counted is None:
        return changed, torch.ones_like(changed)
    return changed, to_router_order(counted[..., None], sequence_parallel)[:, 0].bool()


def clear_routing(model: torch.nn.Module) -> None:
    """Every local router of `model` natural again, with no recorded, replayed or queued routes: after a schedule
    whose forwards replayed (an activation recompute's queue included)."""
    layers = moe_layers(model)
    if layers is None or not layers.replayable:
        return
    for _, router in layers.local:
        router.router_replay.clear_router_replay_action()
        router.router_replay.clear_indices()


class RouteRecorder:
    """The routes of a rollout's tokens, recorded by the forwards of a decoding loop that reads each row's growing
    prefix (`generation.last_position_logits(..., routes=recorder)`). Each forward records, per row, the positions
    it reads for the first time, up to the row's last one: a token keeps the route of the forward that read it first,
    the one its next token was sampled from (the prompt's tokens: the first step's). The last sampled token of a
    row is never read: `routes()` gives it, and every other position never read, `0 .. k-1`."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_length: int) -> None:
        layers = moe_layers(model)
        if layers is None:
            raise ValueError("routes: a dense model has no routes to record (num_moe_experts is None)")
        if not layers.replayable:
            raise ValueError("routes: the model's routers cannot record routes: build it with "
                             "moe_enable_routing_replay=True")
        self.layers = layers
        self.recorded = torch.zeros(batch_size, max_length, layers.num_layers, layers.topk, dtype=torch.int64)
        self.read = torch.zeros(batch_size, dtype=torch.int64)  # positions recorded so far, per row

    def on_forward(self, last_positions: torch.Tensor) -> OnRoutes:
        """What one forward over the rows' prefixes (row `b` read up to `last_positions[b]`) hands its routes to."""
        last = last_positions.to("cpu", torch.int64)

        def store(routes: dict[int, torch.Tensor]) -> None:
            for layer, layer_routes in routes.items():
                length = layer_routes.shape[1]
                positions = torch.arange(length)
                new = (positions >= self.read[:, None]) & (positions <= last[:, None])
                self.recorded[:, :length, layer][new] = layer_routes.to("cpu")[new]
            self.read = torch.maximum(self.read, last + 1)

        return store

    def routes(self, length: int, device: torch.device) -> torch.Tensor:
        """int64 `[B, length, L, k]` on the CPU: every MoE layer's recorded routes on every rank (each pipeline stage
        recorded its own layers: one all-reduce over the pipeline group, through `device`), `0 .. k-1` where no
        forward read the position."""
        recorded, read = self.recorded[:, :length], self.read
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            group = parallel_state.get_pipeline_model_parallel_group()
            recorded = recorded.to(device)
            read = read.to(device)
            dist.all_reduce(recorded, group=group)  # each layer's routes are non-zero on one stage only
            dist.all_reduce(read, group=group, op=dist.ReduceOp.MAX)  # a stage without MoE layers read none
            recorded, read = recorded.to("cpu"), read.to("cpu")
        unread = torch.arange(length)[None] >= read[:, None]
        placeholder = placeholder_routes(recorded.shape[2:3], self.layers.topk, recorded.device)
        return torch.where(unread[:, :, None, None], placeholder, recorded)
