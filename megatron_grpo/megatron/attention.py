"""A core attention for Megatron-Core's local GPT layer spec that needs no Transformer Engine: causal self-attention
over padded batches, packed (THD) sequences and context-parallel shares, on any device.

Megatron-Core builds a layer's `core_attention` from its spec (`SelfAttentionSubmodules.core_attention`) and calls
it with `packed_seq_params=` (0.16 and 0.19). Its local `DotProductAttention` takes neither packed sequences nor
context parallelism (CP); `TorchDotProductAttention` keeps that class's contract (constructor keywords, shapes,
softmax scale, grouped-query heads) and takes both, with torch's attention kernels:

- padded `[s, b, h, d]`: one `F.scaled_dot_product_attention`, causal, or under the mask given;
- packed (`PackedSeqParams(qkv_format="thd")`, `[t, h, d]`): on CUDA in fp16 / bf16 without dropout, one call of
  torch's `varlen_attn` (FlashAttention) over the row, under its 2.10 or its 2.11+ signature (`VarlenSignature`);
  elsewhere causal attention within each sequence: on the CPU (without dropout) its flash kernels, one call for
  the sequences of each length, every output written into one tensor (`_CpuPackedAttention`), else one SDPA per
  sequence. Only each
  sequence's own `[L, L]` scores exist, never the row's `[t, t]`;
- context-parallel shares (CP > 1), padded or packed, split by Megatron's zigzag (rank r holds chunks r and
  2·CP−1−r of each sequence's 2·CP): K and V are all-gathered over the CP group (one collective per layer, its
  backward one reduce-scatter), put in sequence order, and each of the rank's two query chunks of a sequence
  attends causally to that sequence's keys up to its own last position (Llama 3's all-gather CP). Exact; each rank
  holds the layer's K and V of the whole sequences.

Its inputs are those Megatron gives Transformer Engine's attention: packed and CP-split batches carry no mask, and
THD `cu_seqlens` are the whole sequences' (under CP, `CP ×` the share's), each sequence's padding at its end included
(`cu_seqlens_q_padded`, where given, else `cu_seqlens_q`). `torch_attention_layer_spec()` gives a GPTModel this
attention; `takes_packed_sequences(model)` says whether a model's attention takes THD `packed_seq_params`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import itertools
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention.bias import causal_lower_right

from megatron_grpo.megatron.context_parallel import zigzag_positions
from megatron_grpo.megatron.transformer_engine import te_core_attention_class

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256  # FlashAttention's largest head dim; a multiple of 8 is required too


class TorchDotProductAttention(MegatronModule):
    """Megatron's `DotProductAttention` (same constructor keywords, `[sq, b, np·hn]` / `[t, np·hn]` outputs, scale
    `softmax_scale` or `1 / sqrt(hn)`, query head `h` on key/value head `h // (np / ng)`) computed with torch's
    attention kernels, taking packed (THD) sequences and context parallelism (the module docstring). Self-attention
    only; a sliding window, a softmax other than the vanilla one, an attention bias, QK clipping or a
    `cp_comm_type` other than all-gather is a ValueError naming its key."""

    takes_packed_sequences = True  # `megatron.forward` hands it THD `PackedSeqParams`

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        _check_supported(config, attention_type, cp_comm_type)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.cp_group = pg_collection.cp
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.causal = attn_mask_type == AttnMaskType.causal  # DotProductAttention's default mask, when given none
        if self.cp_group.size() > 1 and not self.causal:
            raise ValueError(f"attn_mask_type: context parallelism here is causal attention, got {attn_mask_type}")
        tp = pg_collection.tp.size()
        projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_partition = divide(projection_size, tp)
        self.head_dim = divide(projection_size, config.num_attention_heads)
        # DotProductAttention divides the scale by layer_number under apply_query_key_layer_scaling and its softmax
        # multiplies by it again: the scale applied is softmax_scale.
        self.softmax_scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """sbhd: query `[sq, b, np, hn]`, key / value `[sk, b, ng, hn]` -> `[sq, b, np·hn]`; thd (`packed_seq_params`):
        `[t, np, hn]`, `[t, ng, hn]` -> `[t, np·hn]`. `attention_mask`: bool, True = masked out (Megatron's), sbhd at
        CP 1 only; None: causal (the constructor's `attn_mask_type`, as DotProductAttention reads it)."""
        if attention_bias is not None:
            raise ValueError("attention_bias: TorchDotProductAttention takes none")
        context_parallel = self.cp_group.size() > 1
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format: TorchDotProductAttention packs 'thd', got "
                             f"{packed_seq_params.qkv_format!r}")
        if attention_mask is not None and (packed_seq_params is not None or context_parallel):
            raise ValueError("attention_mask: packed sequences and context-parallel shares take no mask (each "
                             "sequence is causal); pass None")
        if packed_seq_params is None:
            if context_parallel:
                rows = query.shape[0] * self.cp_group.size()  # each batch column is one whole sequence
                _check_context_parallel_lengths([rows], self.cp_group.size(), "query")
                cu_seqlens = torch.tensor([0, rows], dtype=torch.int32, device=query.device)
                out = self._context_parallel(query, key, value, cu_seqlens, [rows])
            else:
                out = self._padded(query, key, value, attention_mask)
            return out.reshape(*query.shape[:2], self.hidden_size_per_partition)
        if not self.causal:
            raise ValueError(f"attn_mask_type: packed sequences here are causal, got {self.attn_mask_type}")
        cu_seqlens, lengths = _packed_boundaries(packed_seq_params, query.shape[0] * self.cp_group.size(),
                                                 host=context_parallel or not self._varlen_usable(query))
        if context_parallel:
            _check_context_parallel_lengths(lengths, self.cp_group.size(), "packed_seq_params.cu_seqlens_q")
            out = self._context_parallel(query[:, None], key[:, None], value[:, None], cu_seqlens, lengths)
        elif lengths is None:
            out = varlen_causal(query, key, value, cu_seqlens, _max_seqlen(packed_seq_params, cu_seqlens),
                                scale=self.softmax_scale)
        else:
            out = self._per_sequence(query, key, value, lengths)
        return out.reshape(query.shape[0], self.hidden_size_per_partition)

    def _dropout(self) -> float:
        return self.dropout_p if self.training else 0.0

    def _varlen_usable(self, query: torch.Tensor) -> bool:
        """varlen_attn: torch has it, CUDA, fp16 / bf16, no dropout, a head dim FlashAttention takes."""
        return (VARLEN is not None and query.is_cuda and query.dtype in VARLEN_DTYPES and self._dropout() == 0
                and self.head_dim <= VARLEN_MAX_HEAD_DIM and self.head_dim % 8 == 0)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, causal: bool,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """SDPA of `[sq, b, h, d]` queries on `[sk, b, hkv, d]` keys and values -> `[sq, b, h, d]`. Causal is aligned
        at the lower right when sq != sk (the queries are the keys' last sq; SDPA's own is_causal aligns them at the
        top left). The 4-D `[b, h, s, d]` views let the CPU take its flash kernel (3-D inputs take the math path,
        which keeps every `[h, sq, sk]` probability for the backward)."""
        q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
        if causal and q.shape[-2] != k.shape[-2]:
            mask, causal = causal_lower_right(q.shape[-2], k.shape[-2]), False
        dropout = self._dropout()
        # DotProductAttention's dropout draws from Megatron's tracked RNG (a no-op fork on the CPU's tracker).
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 and not self.config.sequence_parallel \
            else nullcontext()
        with rng:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3)

    def _padded(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
        if attention_mask is None:
            return self._attend(query, key, value, causal=self.causal)
        if attention_mask.dtype != torch.bool:
            raise ValueError(f"attention_mask: expected a bool mask (True = masked out, Megatron's), got "
                             f"{attention_mask.dtype}")
        return self._attend(query, key, value, causal=False, mask=~attention_mask)

    def _per_sequence(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      lengths: list[int]) -> torch.Tensor:
        """One causal attention per sequence of the packed row (`[t, h, d]`): on the CPU without dropout through its
        flash kernels into one output (`_CpuPackedAttention`), else one SDPA each, concatenated."""
        if query.device.type == "cpu" and self._dropout() == 0 and _CPU_FLASH is not None:
            return _CpuPackedAttention.apply(query, key, value, lengths, self.softmax_scale)
        pieces = [self._attend(q[:, None], k[:, None], v[:, None], causal=True)[:, 0] for q, k, v in
                  zip(query.split(lengths), key.split(lengths), value.split(lengths), strict=True)]
        return torch.cat(pieces)

    def _context_parallel(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          cu_seqlens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """This CP rank's `[t, b, h, d]` share of the sequences of `lengths` (`cu_seqlens`, the whole sequences';
        padded: each batch column one sequence), attended against the whole sequences' keys: the all-gather of K
        and V, the zigzag undone, then per sequence the rank's two query chunks, each on the keys up to its end."""
        group = self.cp_group
        size, rank = group.size(), group.rank()
        gathered = _GatherOverContext.apply(torch.cat([key, value], dim=-1), group)  # rank by rank
        held = torch.cat([zigzag_positions(cu_seqlens, sum(lengths), size, r) for r in range(size)])
        order = torch.empty_like(held)
        order[held] = torch.arange(held.numel(), device=held.device)  # sequence position -> gathered row
        keys, values = gathered.index_select(0, order).split(key.shape[-1], dim=-1)
        pieces, local, start = [], 0, 0
        for length in lengths:
            chunk = length // (2 * size)
            for half, index in ((0, rank), (1, 2 * size - 1 - rank)):
                end = start + (index + 1) * chunk  # the keys up to this query chunk's last position
                q = query[local + half * chunk:local + (half + 1) * chunk]
                pieces.append(self._attend(q, keys[start:end], values[start:end], causal=True))
            local, start = local + 2 * chunk, start + length
        return torch.cat(pieces)


# The CPU's flash-attention kernels, which SDPA dispatches to for 4-D CPU inputs without dropout (torch 2.2+).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


class _CpuPackedAttention(torch.autograd.Function):
    """Causal attention within each sequence of a packed row, `[t, hq, d]` queries on `[t, hkv, d]` keys and values,
    through the CPU flash kernels SDPA itself uses, each sequence's output written into one `[t, hq, d]` tensor.
    Autograd keeps that output and a logsumexp per sequence and head: one SDPA call per sequence and a
    concatenation would keep every sequence's output twice (SDPA's own, and the concatenated copy the next layer
    reads). The sequences of one length go through one call, as a batch (a row of many short sequences would
    otherwise cost a call each); a sequence alone at its length is a view, not a copy. Grouped key heads are
    repeated (Megatron's grouping) and their gradients summed back."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                scale: float) -> torch.Tensor:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        batches = _same_length_batches(lengths, query.device)
        logsumexps = []
        for tokens in batches:
            q, k, v = _heads_first(query, key, value, tokens)
            piece, logsumexp = _CPU_FLASH(q, k, v, 0.0, True, scale=scale)
            _write(out, tokens, piece)
            logsumexps.append(logsumexp)
        ctx.save_for_backward(query, key, value, out, *logsumexps)
        ctx.batches, ctx.scale = batches, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        query, key, value, out, *logsumexps = ctx.saved_tensors
        grads = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for tensor in (query, key, value)]
        groups = query.shape[1] // key.shape[1]
        for tokens, logsumexp in zip(ctx.batches, logsumexps, strict=True):
            q, k, v = _heads_first(query, key, value, tokens)
            pieces = _CPU_FLASH_BACKWARD(_sequences(grad, tokens), q, k, v, _sequences(out, tokens), logsumexp, 0.0,
                                         True, scale=ctx.scale)
            for target, piece in zip(grads, pieces, strict=True):
                if target.shape[1] != piece.shape[1]:  # a key head's gradient: the sum over its query heads
                    piece = piece.unflatten(1, (target.shape[1], groups)).sum(dim=2)
                _write(target, tokens, piece)
        return *grads, None, None


def _same_length_batches(lengths: list[int], device: torch.device) -> list[slice | torch.Tensor]:
    """The packed positions of the sequences of each length: a `slice` where one sequence has that length, else an
    int64 `[n, L]` index (row i: the i-th such sequence's positions)."""
    starts: dict[int, list[int]] = {}
    for start, length in zip(itertools.accumulate([0, *lengths[:-1]]), lengths):
        starts.setdefault(length, []).append(start)
    return [slice(first[0], first[0] + length) if len(first) == 1 else
            torch.tensor(first, device=device)[:, None] + torch.arange(length, device=device)
            for length, first in starts.items()]


def _sequences(tensor: torch.Tensor, tokens: slice | torch.Tensor) -> torch.Tensor:
    """`[t, h, d]` at `tokens` as `[n, h, L, d]`: the flash kernels' 4-D layout (a view for a slice)."""
    if isinstance(tokens, slice):
        return tensor[tokens].transpose(0, 1)[None]
    return tensor[tokens].transpose(1, 2)


def _write(target: torch.Tensor, tokens: slice | torch.Tensor, piece: torch.Tensor) -> None:
    """`piece` `[n, h, L, d]` into `target` `[t, h, d]` at `tokens`."""
    if isinstance(tokens, slice):
        target[tokens] = piece[0].transpose(0, 1)
    else:
        target[tokens] = piece.transpose(1, 2)


def _heads_first(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 tokens: slice | torch.Tensor) -> list[torch.Tensor]:
    """Queries, keys and values at `tokens` as `[n, h, L, d]` (`_sequences`), the key and value heads repeated to
    the queries'."""
    groups = query.shape[1] // key.shape[1]
    pieces = [_sequences(tensor, tokens) for tensor in (query, key, value)]
    if groups > 1:
        pieces[1:] = [piece.repeat_interleave(groups, dim=1) for piece in pieces[1:]]
    return pieces


class _GatherOverContext(torch.autograd.Function):
    """`[n, ...]` on each rank of `group` -> `[size · n, ...]`, rank by rank. Backward: the gradient's reduce-scatter
    (every rank's queries read every rank's keys: the gradients are summed, and each rank keeps its own rows)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = local.new_empty((group.size() * local.shape[0], *local.shape[1:]))
        # torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (which now warn) to *_single.
        all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.new_empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]))
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None


def _check_supported(config: TransformerConfig, attention_type: str, cp_comm_type: str | None) -> None:
    problems = []
    if attention_type != "self":
        problems.append(f"attention_type: self-attention only, got {attention_type!r}")
    if config.window_size is not None:
        problems.append(f"window_size: no sliding-window attention, got {config.window_size}")
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        problems.append(f"softmax_type: the vanilla softmax only, got {config.softmax_type!r}")
    if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
        problems.append("qk_clip / log_max_attention_logit: the attention logits are not kept")
    if cp_comm_type not in (None, "all_gather"):
        problems.append(f"cp_comm_type: context parallelism all-gathers K and V here ('all_gather'), got "
                        f"{cp_comm_type!r}")
    if problems:
        raise ValueError("TorchDotProductAttention: " + "; ".join(problems))


def _packed_boundaries(params: PackedSeqParams, num_tokens: int,
                       *, host: bool) -> tuple[torch.Tensor, list[int] | None]:
    """The sequences' boundaries (`cu_seqlens_q_padded`, else `cu_seqlens_q`), which key and value must share, and
    with `host` their lengths, checked against the `num_tokens` they must cut (one host sync). Without `host`
    (varlen_attn takes them on the device, as TE's attention does) only their form is checked."""
    name = "cu_seqlens_q_padded" if params.cu_seqlens_q_padded is not None else "cu_seqlens_q"
    cu_seqlens = getattr(params, name)
    key_name = "cu_seqlens_kv_padded" if params.cu_seqlens_kv_padded is not None else "cu_seqlens_kv"
    kv_seqlens = getattr(params, key_name)
    where = f"packed_seq_params.{name}"
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{where}: expected an int32 tensor [N + 1] of sequence boundaries, got "
                         f"{cu_seqlens if not isinstance(cu_seqlens, torch.Tensor) else cu_seqlens.dtype}")
    if kv_seqlens is not None and kv_seqlens is not cu_seqlens and not torch.equal(kv_seqlens, cu_seqlens):
        raise ValueError(f"packed_seq_params.{key_name}: self-attention needs the keys' boundaries equal to the "
                         f"queries' ({name})")
    if not host:
        return cu_seqlens, None
    bounds = cu_seqlens.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    if bounds[0] != 0 or bounds[-1] != num_tokens or min(lengths) <= 0:
        raise ValueError(f"{where}: must rise strictly from 0 to the {num_tokens} tokens of the whole sequences "
                         f"(every sequence holds a token), got {bounds}")
    return cu_seqlens, lengths


def _check_context_parallel_lengths(lengths: list[int], size: int, where: str) -> None:
    """Megatron's zigzag cuts each whole sequence into 2·CP equal chunks: a ValueError naming `where` otherwise."""
    if any(length % (2 * size) for length in lengths):
        raise ValueError(f"{where}: context parallelism ({size} ranks) splits each sequence into 2·CP = {2 * size} "
                         f"equal chunks; every whole sequence's length must be a multiple of {2 * size}, got "
                         f"{lengths} (pad each sequence at its end, as Megatron's cu_seqlens_q_padded does)")


def _max_seqlen(params: PackedSeqParams, cu_seqlens: torch.Tensor) -> int:
    if params.max_seqlen_q is not None:
        return int(params.max_seqlen_q)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


# ---- torch's varlen_attn (torch 2.10+, CUDA): causal attention over packed sequences in one call ----

def _torch_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


VARLEN = _torch_varlen_attn()


@dataclass(frozen=True)
class VarlenSignature:
    """How to ask a `varlen_attn` for causal attention with a scale and grouped-query heads. Its signature changed:
    2.10 `(..., max_q, max_k, is_causal=False, return_aux=None)`; 2.11 `(..., *, return_aux=None, scale=None,
    window_size=(-1, -1))`, causal being `window_size=(-1, 0)` (a tuple: the op compares it with one); 2.13 adds
    `enable_gqa=False`. Every version's default is non-causal."""

    causal: dict  # the keyword that makes it causal
    takes_scale: bool
    takes_gqa: bool

    @classmethod
    @functools.lru_cache(maxsize=8)
    def of(cls, fn: Callable) -> VarlenSignature:
        parameters = inspect.signature(fn).parameters
        if "window_size" in parameters:
            causal = {"window_size": (-1, 0)}
        elif "is_causal" in parameters:
            causal = {"is_causal": True}
        else:
            raise TypeError(f"varlen_attn{inspect.signature(fn)}: neither window_size nor is_causal")
        return cls(causal, "scale" in parameters, "enable_gqa" in parameters)


def varlen_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_seqlen: int, *, scale: float, fn: Callable | None = None) -> torch.Tensor:
    """Causal attention of `[t, hq, d]` queries on `[t, hkv, d]` keys and values within each sequence of
    `cu_seqlens` (int32 `[N + 1]`, the longest `max_seqlen`) -> `[t, hq, d]`, through `fn` (default: torch's
    `varlen_attn`) whatever its signature: a scale it lacks is folded into the queries, grouped-query heads it
    cannot take are repeated (Megatron's grouping: query head h reads key head h // (hq / hkv))."""
    fn = VARLEN if fn is None else fn
    signature = VarlenSignature.of(fn)
    keywords = dict(signature.causal)
    if signature.takes_scale:
        keywords["scale"] = scale
    else:  # the kernel's own scale is 1 / sqrt(d)
        query = query * (scale * math.sqrt(query.shape[-1]))
    if query.shape[1] != key.shape[1]:
        if signature.takes_gqa:
            keywords["enable_gqa"] = True
        else:
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    cu_seqlens = cu_seqlens.to(torch.int32)
    return fn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **keywords)


# ---- the spec, and which models take packed sequences ----

def torch_attention_layer_spec(**local_spec_kwargs) -> ModuleSpec:
    """Megatron-Core's local GPT layer spec (`get_gpt_layer_local_spec(**local_spec_kwargs)`) with
    `TorchDotProductAttention` as its self-attention's core attention: packed (THD) batches and context parallelism
    without Transformer Engine. `GPTModel(config, transformer_layer_spec=torch_attention_layer_spec(), ...)`.
    Multi-latent attention has its own core attention contract: a ValueError."""
    if local_spec_kwargs.get("multi_latent_attention"):
        raise ValueError("multi_latent_attention: TorchDotProductAttention is the standard self-attention's core "
                         "attention; MLA keeps its own")
    spec = copy.deepcopy(get_gpt_layer_local_spec(**local_spec_kwargs))
    spec.submodules.self_attention.submodules.core_attention = TorchDotProductAttention
    return spec


def takes_packed_sequences(model: torch.nn.Module) -> bool | None:
    """Whether every core attention of `model` takes THD `packed_seq_params` (`TorchDotProductAttention`, Transformer
    Engine's); None for a model without attention (nothing it computes crosses positions)."""
    classes = tuple(cls for cls in (TorchDotProductAttention, te_core_attention_class()) if cls is not None)
    attentions = [module.core_attention for module in model.modules() if hasattr(module, "core_attention")]
    if not attentions:
        return None
    return all(isinstance(attention, classes) for attention in attentions)
