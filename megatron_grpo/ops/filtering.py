"""Top-k / top-p filtered distributions as one per-row logit threshold, exact on a vocab sharded over TP ranks.

The filtered distribution is the softmax over the kept tokens only (the rollout sampler and the training
logprobs both use this module, so they agree token for token):

- top-k keeps the logits `>=` the k-th largest logit of the whole unpadded row (ties with it are kept, as in
  NeMo-RL's and vLLM's top-k);
- top-p then keeps the most probable of those until their mass reaches p: a token is kept iff the mass (under
  the top-k distribution) of the strictly more probable kept tokens is `< p`. NeMo-RL keeps a token iff the
  ascending cumulative mass up to it is `> 1 - p`, which is the same rule; where tied tokens straddle the
  boundary, its unstable sort keeps an arbitrary part of the tie, and this rule keeps all of it.

Both rules keep the set `{x >= threshold}`, so a filter is one number per row. The kernels then count only
logits at or above it. Collectives, on a TP group of more than one rank:

- top-k: one all-gather of each rank's local top-k values, `[rows, k]`;
- top-p: one all-reduce (max) of `[rows]`, then an exact radix select over the ordered bit patterns of the
  fp32 logits, 8 bits per pass: 4 passes over the local logits, each with one all-reduce (sum) of
  `[rows, 256]` float64 masses (8 passes for float64 logits). No host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ROWS_PER_CHUNK = 1024


@dataclass(frozen=True)
class SamplingFilter:
    """`top_k` (None = off) and `top_p` (None or 1 = off), checked once."""

    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)
                                       or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                                       or not 0.0 < float(self.top_p) <= 1.0):
            raise ValueError(f"top_p must be None or a number in (0, 1], got {self.top_p!r}")

    def active(self, true_vocab_size: int) -> bool:
        """Whether this filter can drop any token of a row of `true_vocab_size` tokens."""
        return self.uses_top_k(true_vocab_size) or self.uses_top_p()

    def uses_top_k(self, true_vocab_size: int) -> bool:
        return self.top_k is not None and self.top_k < true_vocab_size

    def uses_top_p(self) -> bool:
        return self.top_p is not None and float(self.top_p) < 1.0


def kept_threshold(
    valid_logits: torch.Tensor,
    sampling: SamplingFilter,
    *,
    true_vocab_size: int,
    group: dist.ProcessGroup | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor | None:
    """Per-row threshold `[rows]` such that the kept tokens are exactly `z >= threshold`; None = keep all.

    `valid_logits` is `[rows, valid_cols]`: this rank's real (unpadded) vocab columns. The filter selects on the
    distribution of z = logit_scale * logits (1 / temperature: top-p depends on it), z rounded in the compute
    dtype as the kernels round it. Every rank of `group` must call this with the same rows, filter and scale.
    The threshold has the logits' compute dtype (float64 for float64 logits, else float32); comparing it with z
    in that dtype is exact.
    """
    if not sampling.active(true_vocab_size):
        return None
    x = valid_logits  # converted (and scaled) chunk by chunk: no full-size copy of the logits
    floor = (_top_k_threshold(x, sampling.top_k, group, logit_scale) if sampling.uses_top_k(true_vocab_size)
             else None)
    if sampling.uses_top_p():
        return _top_p_threshold(x, float(sampling.top_p), floor, group, logit_scale).contiguous()
    return floor.contiguous()


def _scaled(x: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """z = logit_scale * x in the compute dtype; rounding is monotone, so the order of x is kept."""
    x = x.to(_compute_dtype(x))
    return x if logit_scale == 1.0 else x * logit_scale


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mask_filtered(logits: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
    """`logits` with every filtered logit set to -inf (a copy; the input itself when nothing is filtered)."""
    if threshold is None:
        return logits
    return logits.masked_fill(logits < threshold.to(logits.dtype)[..., None], float("-inf"))


def _world(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _top_k_threshold(x: torch.Tensor, k: int, group: dist.ProcessGroup | None, logit_scale: float) -> torch.Tensor:
    """The k-th largest z of each row across all ranks: one all-gather of `[rows, k]`."""
    rows, local = x.shape
    values = torch.full((rows, k), float("-inf"), dtype=_compute_dtype(x), device=x.device)
    local_k = min(k, local)
    if local_k > 0:
        # Scaling after the selection: z = fl(s * x) is monotone in x, so the k largest z are those of x.
        values[:, :local_k] = _scaled(x.topk(local_k, dim=-1).values, logit_scale)
    world = _world(group)
    if world > 1:
        gathered = torch.empty((world * rows, k), dtype=values.dtype, device=x.device)
        all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        all_gather_single(gathered, values, group=group)
        values = gathered.view(world, rows, k).permute(1, 0, 2).reshape(rows, world * k)
    return values.topk(k, dim=-1).values[:, -1]


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if _world(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


BUCKET_BITS = 8  # top-p's radix select reads 8 bits of the logits' bit pattern per pass
BUCKETS = 1 << BUCKET_BITS


def _unsigned_keys(x: torch.Tensor) -> torch.Tensor:
    """Keys (int32 for float32, int64 for float64) whose bits, read as unsigned, are in the order of the float
    values (NaN aside): the float's bits with the magnitude bits of negatives flipped, then the sign bit."""
    int_dtype = torch.int64 if x.dtype == torch.float64 else torch.int32
    bits = x.contiguous().view(int_dtype)
    # Negative (sign bit set): all bits flipped; otherwise the sign bit only.
    return bits ^ ((bits >> (torch.iinfo(int_dtype).bits - 1)) | torch.iinfo(int_dtype).min)


def _value_of_unsigned_key(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The float whose `_unsigned_keys` bits are `keys` (int64 holding `width` bits)."""
    int_dtype, float_dtype = (torch.int64, torch.float64) if width == 64 else (torch.int32, torch.float32)
    info = torch.iinfo(int_dtype)
    signed = keys.to(int_dtype) ^ info.min
    return torch.where(signed < 0, signed ^ info.max, signed).view(float_dtype)


def _bucket_masses(x: torch.Tensor, shift: torch.Tensor, floor: torch.Tensor | None, prefix: torch.Tensor,
                   low_bit: int, width: int, group: dist.ProcessGroup | None, logit_scale: float) -> torch.Tensor:
    """float64 `[rows, 256]`: over all ranks, the kept mass `sum exp(x - shift)` of the logits whose key starts
    with the row's `prefix` (the bits above `low_bit + 8`), by the key's next 8 bits."""
    rows = x.shape[0]
    masses = torch.zeros(rows, BUCKETS, dtype=torch.float64, device=x.device)
    prefix_bit = low_bit + BUCKET_BITS
    for start in range(0, rows, ROWS_PER_CHUNK):
        sl = slice(start, start + ROWS_PER_CHUNK)
        chunk = _scaled(x[sl], logit_scale)
        keys = _unsigned_keys(chunk)
        mass = torch.exp(chunk - shift[sl, None].to(chunk.dtype)).to(torch.float64)  # NaN rows: see the caller
        dropped = None
        if prefix_bit < width:  # (the mask drops the sign extension of the arithmetic shift)
            dropped = ((keys >> prefix_bit) & ((1 << (width - prefix_bit)) - 1)) != prefix[sl, None].to(keys.dtype)
        if floor is not None:
            below = chunk < floor[sl, None].to(chunk.dtype)
            dropped = below if dropped is None else dropped.logical_or_(below)
        if dropped is not None:
            mass.masked_fill_(dropped, 0.0)
        masses[sl].scatter_add_(1, ((keys >> low_bit) & (BUCKETS - 1)).to(torch.int64), mass)
    return _all_reduce(masses, dist.ReduceOp.SUM, group)


def _top_p_threshold(x: torch.Tensor, p: float, floor: torch.Tensor | None,
                     group: dist.ProcessGroup | None, logit_scale: float) -> torch.Tensor:
    """The smallest logit v of each row whose strictly larger kept logits hold a mass `< p` of the kept mass.

    mass(v) = the kept mass of the logits `> v` is non-increasing in v, so v is found by a radix select over
    the logits' ordered bit patterns, 8 bits per pass (4 passes for float32): each pass histograms the kept
    mass of the logits sharing the prefix found so far by their next 8 bits, and keeps the highest bucket
    whose mass, together with the mass of the buckets above it, reaches what is left of p. The last bucket
    is one bit pattern: a logit of the row.
    """
    rows, dtype = x.shape[0], _compute_dtype(x)
    local_max = (_scaled(x.amax(dim=-1), logit_scale) if x.shape[1]
                 else torch.full((rows,), float("-inf"), dtype=dtype, device=x.device))
    row_max = _all_reduce(local_max, dist.ReduceOp.MAX, group)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    width = 64 if dtype == torch.float64 else 32
    prefix = torch.zeros(rows, dtype=torch.int64, device=x.device)
    target = None
    for low_bit in range(width - BUCKET_BITS, -1, -BUCKET_BITS):
        masses = _bucket_masses(x, shift, floor, prefix, low_bit, width, group, logit_scale)
        if target is None:
            target = p * masses.sum(dim=-1)  # p of the whole kept mass
        at_or_above = masses.flip(-1).cumsum(-1).flip(-1)  # mass of the buckets >= b
        reaching = (at_or_above >= target[:, None]).sum(dim=-1) - 1  # the highest bucket that reaches it
        lowest_filled = torch.where(masses > 0, torch.arange(BUCKETS, device=x.device), BUCKETS).amin(dim=-1)
        # Rounding between passes can leave the target a hair above the bucket's mass: then its lowest logit.
        bucket = torch.where(reaching >= 0, reaching, lowest_filled.clamp(max=BUCKETS - 1))
        above = at_or_above.gather(1, (bucket + 1).clamp(max=BUCKETS - 1)[:, None]).squeeze(1)
        above = torch.where(bucket == BUCKETS - 1, torch.zeros_like(above), above)
        target = target - above
        prefix = (prefix << BUCKET_BITS) | bucket
    threshold = _value_of_unsigned_key(prefix, width)
    # A NaN makes its row NaN: keep everything so that the kernels see it.
    threshold = torch.where(torch.isnan(row_max), torch.full_like(threshold, float("-inf")), threshold)
    return threshold if floor is None else torch.maximum(threshold, floor)
