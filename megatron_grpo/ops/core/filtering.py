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
- top-p: one all-reduce (max) of `[rows]`, then per piece of rows (some 2^23 logits per rank) one all-reduce of
  `[rows, 256]` float64 masses by distance below the row max, which leaves few candidates, and an exact radix
  select over the candidates' ordered bit patterns, 8 bits per pass, each pass one all-reduce of `[rows, 257]`
  float64 masses (4 passes for fp32 logits, 2 for bf16 and 3 for fp16 ones taken unscaled, 8 for float64).

Top-p runs as three fused kernels where the fused kernels serve the logits (fp32, bf16, fp16; csrc/top_p.h): the
value histogram (one pass over the logits), the boundary bin's candidates' keys into a compact buffer (a second
pass) and the radix passes over that buffer; no host synchronisation. On one CPU rank, with no all-reduce between
the stages, they and the choices between them run as one call (`top_p_threshold`), each row with per-thread
temporaries, to the same threshold bit for bit. Elsewhere (float64 logits, the plain-torch kernels) the same
algorithm runs in plain torch, which gathers the candidates with one host sync per piece.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_grpo.ops.core.backends import FUSED_DTYPES, FusedKernels, Kernels, fused_supports
from megatron_grpo.ops.core.chunking import piece_rows, pieces, threshold_piece_rows
from megatron_grpo.ops.core.dtypes import compute_dtype
from megatron_grpo.ops.distribution import SamplingDistribution


def kept_threshold(
    valid_logits: torch.Tensor,
    distribution: SamplingDistribution,
    *,
    true_vocab_size: int,
    group: dist.ProcessGroup | None = None,
    scaled: bool = False,
    chunk_rows: int | None = None,
    kernels: Kernels | None = None,
) -> torch.Tensor | None:
    """Per-row threshold `[rows]` such that the kept tokens are exactly `z >= threshold`; None = keep all.

    `valid_logits` is `[rows, valid_cols]`: this rank's real (unpadded) vocab columns. The filter selects on the
    distribution of z = logit_scale * logits (1 / temperature: top-p depends on it), z rounded in the compute
    dtype as the kernels round it; `scaled=True` says the logits are z already (the fused linear path forms them
    scaled). Every rank of `group` must call this with the same rows and distribution. The threshold has the
    logits' compute dtype (float64 for float64 logits, else float32); comparing it with z in that dtype is exact.
    `chunk_rows`: a fused path's chunk, whose bf16 buffer bounds top-p's temporaries
    (`chunking.threshold_piece_rows`); None: pieces of `chunking.piece_rows` of the vocab share.
    `kernels` are the op's (top-p runs fused with `FusedKernels`, in plain torch with the torch kernels); None: fused
    wherever the fused kernels serve these logits.
    """
    if not distribution.active(true_vocab_size):
        return None
    logit_scale = 1.0 if scaled else distribution.logit_scale
    x = valid_logits  # converted (and scaled) chunk by chunk: no full-size copy of the logits
    floor = (_top_k_threshold(x, distribution.top_k, group, logit_scale)
             if distribution.uses_top_k(true_vocab_size) else None)
    if distribution.uses_top_p():
        fused = (isinstance(kernels, FusedKernels) if kernels is not None
                 else fused_supports(x.device))
        fused = fused and x.dtype in FUSED_DTYPES and x.stride(-1) == 1
        return _top_p_threshold(x, distribution.top_p, floor, group, logit_scale, true_vocab_size,
                                fused, chunk_rows).contiguous()
    return floor.contiguous()


def _scaled(x: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """z = logit_scale * x in the compute dtype; rounding is monotone, so the order of x is kept."""
    x = x.to(compute_dtype(x.dtype))
    return x if logit_scale == 1.0 else x * logit_scale


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
    values = torch.full((rows, k), float("-inf"), dtype=compute_dtype(x.dtype), device=x.device)
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
# Top-p's first pass bins a row's logits by how far below the row max they lie: bins of 1/8 nat, 32 nats in all (the
# last bin also takes every lower logit), so that the boundary's bin holds few of the row's logits.
VALUE_BINS_PER_NAT = 8
VALUE_BINS = 256


def _unsigned_keys(x: torch.Tensor) -> torch.Tensor:
    """Keys (int32 for float32, int64 for float64) whose bits, read as unsigned, are in the order of the float
    values (NaN aside): the float's bits with the magnitude bits of negatives flipped, then the sign bit."""
    int_dtype = torch.int64 if x.dtype == torch.float64 else torch.int32
    bits = x.contiguous().view(int_dtype)
    # Negative (sign bit set): all bits flipped; otherwise the sign bit only.
    return bits ^ ((bits >> (torch.iinfo(int_dtype).bits - 1)) | torch.iinfo(int_dtype).min)


# float32 has 23 explicit mantissa bits, bf16 7 and fp16 10.
_ZERO_KEY_BITS = {torch.bfloat16: 23 - 7, torch.float16: 23 - 10}


def zero_key_bits(dtype: torch.dtype, logit_scale: float) -> int:
    """How many low bits of every float32 key are 0 when z is `dtype` logits converted (scale 1, or formed scaled):
    a bf16 / fp16 value in float32 has 16 / 13 zero mantissa bits, so the radix passes over those bits would each
    choose bucket 0. Other dtypes, or a scale still to apply (its product rounds to float32): none."""
    if logit_scale != 1.0:
        return 0
    return _ZERO_KEY_BITS.get(dtype, 0)


def _value_of_unsigned_key(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The float whose `_unsigned_keys` bits are `keys` (int64 holding `width` bits)."""
    int_dtype, float_dtype = (torch.int64, torch.float64) if width == 64 else (torch.int32, torch.float32)
    info = torch.iinfo(int_dtype)
    signed = keys.to(int_dtype) ^ info.min
    return torch.where(signed < 0, signed ^ info.max, signed).view(float_dtype)


# Top-p's fused path keeps up to this many candidates per row in its compact buffer (their int32 keys: each pass
# computes a candidate's mass again from its key); a row whose boundary bin holds more is read again from the logits
# at each radix pass.
CANDIDATE_CAPACITY = 1024


def _fused_search_row_bytes(cols: int) -> int:
    """The fused search's temporaries per row of `cols` columns: the value histogram and the bucket masses (float64),
    the counts, and the candidates' int32 keys, at most `CANDIDATE_CAPACITY` of them."""
    return (VALUE_BINS + BUCKETS + 2) * 8 + 4 * min(cols, CANDIDATE_CAPACITY)


def _histogram(index: torch.Tensor, mass: torch.Tensor, rows: int, bins: int,
               group: dist.ProcessGroup | None) -> torch.Tensor:
    """float64 `[rows, bins]`, summed over the ranks of `group`: the `mass` of each element added at its flat
    `index` (row * bins + bin). `index_add_` (int32 or int64 indices, no host sync)."""
    sums = torch.zeros(rows * bins, dtype=torch.float64, device=mass.device)
    sums.index_add_(0, index.reshape(-1), mass.reshape(-1))
    return _all_reduce(sums.view(rows, bins), dist.ReduceOp.SUM, group)


def _top_p_threshold(x: torch.Tensor, p: float, floor: torch.Tensor | None, group: dist.ProcessGroup | None,
                     logit_scale: float, true_vocab_size: int, fused: bool,
                     chunk_rows: int | None = None) -> torch.Tensor:
    """The smallest logit v of each row whose strictly larger kept logits hold a mass `< p` of the kept mass.

    mass(v) = the kept mass of the logits `> v` is non-increasing in v. After one all-reduce of the row max, each
    piece of rows (`chunking.piece_rows`) is selected in two stages:

    1. the logits are binned by their distance below the row max (`VALUE_BINS`, in the order of the logits; ties
       share a bin) and the bins' masses all-reduced: the boundary is in the last non-empty bin whose higher bins
       hold less than p of the row's kept mass. Every logit above that bin is kept, every logit below it is not.
    2. only that bin's logits go through an exact radix select over their ordered bit patterns, 8 bits per pass (4
       passes for float32, 2 for bf16 and 3 for fp16 logits with no scale to apply, whose low bits are 0; 8 for
       float64), each pass one all-reduce of `[rows, 257]` masses: the highest bucket
       whose mass, with the buckets above it, reaches what is left of p is kept, until the last bucket is one bit
       pattern: a logit of the row.

    Masses are `exp(z - row max)`, z in the compute dtype, the exponential and the sums in float64. A row with a NaN
    or infinite max keeps everything (the kernels then make it NaN). `fused`: the stages run as the fused kernels
    (`_select_top_p_fused`), else in plain torch (`_select_top_p`); the same on every rank, since it sets the pieces
    within a chunk (a rank holding only padding searches in plain torch, in the same pieces).
    """
    if fused and x.shape[1] > 0 and searches_in_one_call(x.device, group):
        return _top_p_threshold_on_one_rank(x, p, floor, logit_scale)
    rows, dtype = x.shape[0], compute_dtype(x.dtype)
    local_max = (_scaled(x.amax(dim=-1), logit_scale) if x.shape[1]
                 else torch.full((rows,), float("-inf"), dtype=dtype, device=x.device))
    row_max = _all_reduce(local_max, dist.ReduceOp.MAX, group)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    threshold = torch.empty(rows, dtype=dtype, device=x.device)
    # a rank that holds only padding (no valid column) searches in plain torch, with the pieces of the others
    select = _select_top_p_fused if fused and x.shape[1] > 0 else _select_top_p
    # every rank cuts the same pieces: by its share of the true vocab, never its own (padded) width
    share = -(-true_vocab_size // _world(group))
    per_piece = piece_rows(share)
    if chunk_rows is not None:
        per_piece = min(per_piece, threshold_piece_rows(chunk_rows, share,
                                                        _fused_search_row_bytes(share) if fused else None))
    for sl in pieces(rows, per_piece):
        threshold[sl] = select(x[sl], p, shift[sl], None if floor is None else floor[sl], group, logit_scale)
    threshold = torch.where(torch.isfinite(row_max), threshold, torch.full_like(threshold, float("-inf")))
    return threshold if floor is None else torch.maximum(threshold, floor)


def searches_in_one_call(device: torch.device, group: dist.ProcessGroup | None) -> bool:
    """Whether top-p's fused search runs whole in one call (`_top_p_threshold_on_one_rank`): on one rank (no
    all-reduce between its stages), on the CPU (CUDA runs the stages). Its temporaries are then per thread, none per
    row of the call."""
    return _world(group) == 1 and device.type == "cpu"


def _top_p_threshold_on_one_rank(x: torch.Tensor, p: float, floor: torch.Tensor | None,
                                 logit_scale: float) -> torch.Tensor:
    """`_top_p_threshold` on one rank with the fused CPU kernels: the whole search of every row in one call
    (`top_p_threshold`: the same stages and choices, with no all-reduce between them), each row with per-thread
    temporaries only, so no pieces; its threshold is the staged search's, bit for bit."""
    floor = None if floor is None else floor.to(torch.float32).contiguous()
    return torch.ops.megatron_grpo.top_p_threshold(x, floor, p, float(logit_scale),
                                                   min(x.shape[1], CANDIDATE_CAPACITY),
                                                   zero_key_bits(x.dtype, logit_scale))


def _boundary_bin(value_masses: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's choice from the rows' all-reduced value histograms `[rows, 256]`: the boundary bin (int64 `[rows]`)
    and the mass that the boundary bin's kept logits must still reach (p of the row's kept mass, less the bins
    above it)."""
    cumulative = value_masses.cumsum(dim=-1)  # in bin order (top_p.h's choose_boundary sums in the same order)
    target = p * cumulative[:, -1]  # p of the whole kept mass
    higher = cumulative - value_masses  # the mass of the bins above each bin
    open_bins = (higher < target[:, None]) & (value_masses > 0)
    bin_index = torch.arange(VALUE_BINS, device=value_masses.device)
    boundary = torch.where(open_bins, bin_index, -1).amax(dim=-1).clamp(min=0)
    return boundary, target - higher.gather(1, boundary[:, None]).squeeze(1)


def _select_top_p(x: torch.Tensor, p: float, shift: torch.Tensor, floor: torch.Tensor | None,
                  group: dist.ProcessGroup | None, logit_scale: float) -> torch.Tensor:
    """`_top_p_threshold` of one piece of rows in plain torch (the fused kernels' twin; gathering the boundary bin's
    logits is a host sync)."""
    rows = x.shape[0]
    z = _scaled(x, logit_scale)
    width = 64 if z.dtype == torch.float64 else 32
    centered = z - shift[:, None].to(z.dtype)
    mass = torch.empty(z.shape, dtype=torch.float64, device=z.device).copy_(centered).exp_()
    below = None
    if floor is not None:  # the top-k floor: never kept, no mass
        below = z < floor[:, None].to(z.dtype)
        mass.masked_fill_(below, 0.0)
    # Stage 1. Bins in the order of z: fl(z - shift) is monotone in z, the scaling by a power of 2 exact.
    bins = (centered.mul_(-VALUE_BINS_PER_NAT).nan_to_num_(nan=VALUE_BINS - 1).clamp_(0, VALUE_BINS - 1)
            .to(torch.int32))
    del centered
    row_offsets = torch.arange(rows, dtype=torch.int32, device=z.device)[:, None] * VALUE_BINS
    flat_bins = bins.add_(row_offsets)  # in place: each row's bins after the rows above
    boundary, target = _boundary_bin(_histogram(flat_bins, mass, rows, VALUE_BINS, group), p)
    # Stage 2, over the boundary bin's logits only.
    candidates = flat_bins == (boundary.to(torch.int32)[:, None] + row_offsets)
    if below is not None:
        candidates &= ~below
    del flat_bins, bins
    flat = candidates.view(-1).nonzero().squeeze(1)
    candidate_rows, candidate_cols = flat // z.shape[1], flat % z.shape[1]
    keys = _unsigned_keys(z[candidate_rows, candidate_cols])  # (z may be a strided view: no copy of it)
    candidate_mass = mass.view(-1).index_select(0, flat)
    del mass, candidates
    flat_rows = candidate_rows * (BUCKETS + 1)  # one more bucket per row takes the candidates off the prefix

    def bucket_masses(low_bit: int, prefix: torch.Tensor) -> torch.Tensor:
        prefix_bit = low_bit + BUCKET_BITS
        bucket = (keys >> low_bit) & (BUCKETS - 1)
        if prefix_bit < width:  # (the mask drops the sign extension of the arithmetic shift)
            on_prefix = ((keys >> prefix_bit) & ((1 << (width - prefix_bit)) - 1)) == prefix[candidate_rows].to(
                keys.dtype)
            bucket = torch.where(on_prefix, bucket, BUCKETS)
        return _histogram(flat_rows + bucket, candidate_mass, rows, BUCKETS + 1, group)

    zero_bits = zero_key_bits(x.dtype, logit_scale) if width == 32 else 0
    return _radix_select(bucket_masses, target, rows, width, z.device, zero_bits)


def _select_top_p_fused(x: torch.Tensor, p: float, shift: torch.Tensor, floor: torch.Tensor | None,
                        group: dist.ProcessGroup | None, logit_scale: float) -> torch.Tensor:
    """`_top_p_threshold` of one piece of rows with the fused kernels (csrc/top_p.h): the value histogram, the
    boundary bin's candidates (the keys of at most `CANDIDATE_CAPACITY` per row in a compact buffer), then the radix
    passes over them. No host sync."""
    ops = torch.ops.megatron_grpo
    shift = shift.to(torch.float32).contiguous()
    floor = None if floor is None else floor.to(torch.float32).contiguous()
    scale = float(logit_scale)
    boundary, target = _boundary_bin(
        _all_reduce(ops.top_p_value_histogram(x, shift, floor, scale), dist.ReduceOp.SUM, group), p)
    keys, counts = ops.top_p_candidates(x, shift, floor, boundary, min(x.shape[1], CANDIDATE_CAPACITY), scale)

    def bucket_masses(low_bit: int, prefix: torch.Tensor) -> torch.Tensor:
        return _all_reduce(ops.top_p_bucket_masses(x, shift, floor, boundary, keys, counts, prefix, low_bit, scale),
                           dist.ReduceOp.SUM, group)

    return _radix_select(bucket_masses, target, x.shape[0], 32, x.device, zero_key_bits(x.dtype, scale))


def _radix_select(bucket_masses, target: torch.Tensor, rows: int, width: int, device: torch.device,
                  zero_bits: int = 0) -> torch.Tensor:
    """Each row's threshold among its candidates: the smallest whose strictly larger candidates hold less than the
    row's `target` mass (see `_top_p_threshold`). `bucket_masses(low_bit, prefix)` is the all-reduced `[rows, 257]`
    float64 mass of the candidates by their bits `[low_bit, low_bit + 8)`, slot 256 for those off `prefix` (the bits
    chosen so far).

    Each pass keeps the highest bucket whose mass, with the buckets above it, reaches the target. The target is first
    lowered to the prefix's whole mass where rounding between passes left it a hair above: the highest such bucket
    is then the lowest filled one, the prefix's lowest logit (fmin also takes a NaN target there).

    `zero_bits` low bits of every candidate's key are 0 (`zero_key_bits`): the passes that read only such bits are
    not run (each would choose bucket 0), and the prefix is shifted over them: 2 passes for bf16 logits, 3 for fp16.
    """
    prefix = torch.zeros(rows, dtype=torch.int64, device=device)
    lowest = zero_bits // BUCKET_BITS * BUCKET_BITS  # the lowest pass that reads a bit which may be 1
    for low_bit in range(width - BUCKET_BITS, lowest - 1, -BUCKET_BITS):
        masses = bucket_masses(low_bit, prefix)
        masses[:, BUCKETS] = 0.0  # the slot off the prefix becomes the empty end of the suffix sums
        # The mass of the buckets >= b, at column 256 - b (slot 256's zero first): the suffix sums, not flipped back.
        at_or_above = masses.flip(-1).cumsum(-1)
        reach = torch.fmin(target, at_or_above[:, BUCKETS])[:, None]
        chosen = ((at_or_above[:, 1:] >= reach).sum(dim=-1) - 1).clamp_(min=0)
        # less the mass of the buckets above the chosen one
        target = target - at_or_above.gather(1, (BUCKETS - 1 - chosen)[:, None]).squeeze(1)
        prefix = (prefix << BUCKET_BITS) | chosen
    return _value_of_unsigned_key(prefix << lowest, width)
