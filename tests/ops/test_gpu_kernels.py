"""GPU-specific cases of the CUDA logprob kernels (on a GPU machine: `pytest -m gpu`).

The ops' general cases run on every device through conftest's `device` fixture (the cuda case marked `gpu`):
vocab_parallel_logprobs in test_logprob_op.py (odd shapes, dtypes, padding, ignored targets, -inf, NaN, strides,
offsets), test_logprob_errors.py, test_logprob_filtered.py (top-k/top-p) and test_logprob_temperature.py
(logit_scale); vocab_parallel_linear_logprobs in test_linear_logprobs.py and the loss-fused path in
test_linear_loss.py. This file holds what only the CUDA kernels have: the raw partials, rows split across blocks
and merged (also with logit_scale), the launch rules' boundaries (one warp per row, one block, split blocks: the
plans themselves come from the extension, `cuda_launch_plan`), production shapes, offsets beyond 2^31 elements,
streams, several devices, CUDA graph capture, the TP 1 outputs against the partials' combine, the combine kernel,
top-p's fused search against its plain-torch twin, a random-layout fuzz against the plain-torch reference at sizes
where rows split, and the exp mode's refusal. The fused linear op's GPU cases are in test_gpu_linear.py.

Every call asks for `implementation="fused"`, which raises instead of falling back. Values are checked against
the float64 anchor of `logprob_reference` on the CPU, or, in the fuzz, against `implementation="torch"`.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from logprob_reference import assert_grad_close, assert_matches_anchor, expected_logprobs, make_case, upstream_grads

from megatron_grpo.ops import SamplingDistribution, VocabShard, fused_supports, vocab_parallel_logprobs

pytestmark = pytest.mark.gpu  # conftest skips it, with the reason, where there is no CUDA device

DEVICE = "cuda"  # every case runs here (a module constant, so that the helpers can be checked on the CPU too)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# The launch rules (csrc/launch_plan.h): rows of up to WARP_ROW_MAX_COLS columns go one warp per row when there are
# at least as many as the warp kernel keeps resident; other rows one block each, split while rows x splits fits one
# wave of the block kernel (splits = floor(wave / rows)), into shares of at least 4096 columns.
WARP_ROW_MAX_COLS = 8192
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def cuda_ops():
    """torch.ops.megatron_grpo after checking that its CUDA kernels are built (checking also loads _C)."""
    assert fused_supports(torch.device("cuda")), "megatron_grpo._C was built without its CUDA kernels"
    return torch.ops.megatron_grpo


def launch_plan(rows: int, valid_cols: int, dtype: torch.dtype = torch.bfloat16, *, cols: int | None = None,
                with_entropy: bool = True, filtered: bool = False, backward: bool = False) -> dict[str, int]:
    """The extension's own launch plan of a call on this device (`cuda_launch_plan`), so that tests aim at its
    boundaries: warp_rows (0/1), splits, split_cols, threads, blocks, and the waves (in blocks) of the warp-per-row
    and of the block-per-row kernel."""
    values = cuda_ops().cuda_launch_plan(rows, cols if cols is not None else valid_cols, valid_cols,
                                         DTYPE_NAMES[dtype], with_entropy, filtered, backward)
    return dict(zip(("warp_rows", "splits", "split_cols", "threads", "blocks", "warp_wave", "block_wave"), values))


def gpu_case(rows: int, vocab: int, true_vocab: int, dtype: torch.dtype, seed: int):
    """make_case's logits (padding columns huge) with rows 1, 5, 9, ... ignored, so that T = 1 has a live row."""
    logits, targets = make_case(rows, vocab, true_vocab, dtype, seed=seed, ignore_every=0)
    targets[1::4] = -1
    return logits, targets


def run_fused(logits, targets, g_lp, g_h, *, with_entropy=True, inplace_backward=False, **layout):
    """Forward and backward on the logits' CUDA device; returns (logprob, entropy or None, grad) on the CPU.

    `logits` is a CUDA tensor used as laid out (strides, alignment); with inplace_backward it is overwritten.
    """
    device = logits.device
    leaf = logits.detach().requires_grad_(True)
    out = vocab_parallel_logprobs(leaf, targets.to(device), with_entropy=with_entropy,
                                  inplace_backward=inplace_backward, implementation="fused", **layout)
    logprob, entropy = out if with_entropy else (out, None)
    objective = (logprob * g_lp.to(device)).sum() + ((entropy * g_h.to(device)).sum() if with_entropy else 0)
    objective.backward()
    return logprob.detach().cpu(), None if entropy is None else entropy.detach().cpu(), leaf.grad.cpu()



def test_cuda_kernels_are_built():
    assert cuda_ops().compiled_with_cuda()


# (rows, vocab, with_entropy); 1 and 7 rows of 50257 with entropy run as test_logprob_op's cuda cases.
SPLIT_ROW_CASES = [(257, 50257, False), (257, 50257, True), (3, 131072, False), (3, 131072, True),
                   (7, 50257, False), (1, 50257, False)]


@pytest.mark.parametrize("rows,vocab,with_entropy", SPLIT_ROW_CASES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_split_across_blocks_match_anchor(dtype, rows, vocab, with_entropy):
    """Few rows of many columns: forward splits each row across blocks and merges their partials."""
    assert launch_plan(rows, vocab, dtype, with_entropy=with_entropy)["splits"] > 1
    true_vocab = vocab - vocab // 7
    logits, targets = gpu_case(rows, vocab, true_vocab, dtype, seed=rows * 1000 + vocab)
    g_lp, g_h = upstream_grads(rows, seed=rows)
    logprob, entropy, grad = run_fused(logits.to(DEVICE), targets, g_lp, g_h, with_entropy=with_entropy,
                                       shard=VocabShard(true_vocab_size=true_vocab))
    assert_matches_anchor(logits, targets, true_vocab, g_lp, g_h if with_entropy else None, logprob, entropy, grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", [(7, 1000), (2, 131072)])
def test_padding_only_shard_partials(dtype, rows, cols):
    """valid_cols == 0: partials {-inf, 0, -inf, 0}, ignored rows {0, 1, -inf, 0}; the gradient is all 0."""
    ops = cuda_ops()
    logits, targets = make_case(rows, cols, cols, dtype, seed=31, ignore_every=0)
    logits, targets = logits.to(DEVICE), targets.to(DEVICE)
    targets[0] = -1
    partials = ops.logprob_partials(logits, targets, 50000, 0, True, None).cpu()
    inf = float("inf")
    expected = torch.tensor([[0.0, 1.0, -inf, 0.0]] + [[-inf, 0.0, -inf, 0.0]] * (rows - 1))
    assert torch.equal(partials, expected)
    grad = torch.full_like(logits, 7.0)
    zeros, ones = torch.zeros(rows, device=DEVICE), torch.ones(rows, device=DEVICE)
    ops.logprob_backward(logits, targets, 50000, 0, zeros, zeros, ones, ones, grad, None)
    assert bool((grad == 0).all())


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("rows,cols", [(257, 1000), (3, 131072), (1, 50257)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partials_match_float64(dtype, rows, cols, with_entropy):
    """The raw partials, also of rows split across blocks and merged: m and x_y exact, d and s to fp32 accuracy
    (s = sum exp(x - m) (x - m), see PartialsColumn)."""
    valid = cols - 5
    logits, targets = gpu_case(rows, cols, valid, dtype, seed=41)
    partials = cuda_ops().logprob_partials(logits.to(DEVICE), targets.to(DEVICE), 0, valid, with_entropy, None)
    partials = partials.cpu().double()
    x = logits[:, :valid].double()
    m = x.max(dim=-1).values
    e = torch.exp(x - m[:, None])
    live = targets >= 0
    assert torch.equal(partials[live, 0], m[live])
    torch.testing.assert_close(partials[live, 1], e.sum(-1)[live], rtol=1e-5, atol=0)
    assert torch.equal(partials[live, 2], x.gather(1, targets.clamp(min=0)[:, None])[live, 0])
    if with_entropy:
        torch.testing.assert_close(partials[live, 3], (e * (x - m[:, None])).sum(-1)[live], rtol=1e-5, atol=1e-4)
    ignored_row = torch.tensor([0.0, 1.0, float("-inf"), 0.0], dtype=torch.float64)[: partials.shape[1]]
    assert torch.equal(partials[~live], ignored_row.expand(int((~live).sum()), -1))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_or_inf_in_one_split_poisons_only_its_own_row(poison):
    rows, cols = 3, 131072
    logits, targets = make_case(rows, cols, cols, torch.float32, seed=61, ignore_every=0)
    bad = logits.clone()
    bad[1, cols // 2] = poison
    g_lp, g_h = upstream_grads(rows, seed=62)
    logprob, entropy, grad = run_fused(bad.to(DEVICE), targets, g_lp, g_h)
    clean, clean_entropy, clean_grad = run_fused(logits.to(DEVICE), targets, g_lp, g_h)
    assert bool(torch.isnan(logprob[1])) and bool(torch.isnan(entropy[1]))
    others = torch.arange(rows) != 1
    assert torch.equal(logprob[others], clean[others])
    assert torch.equal(entropy[others], clean_entropy[others])
    assert torch.equal(grad[others], clean_grad[others])


@functools.lru_cache(maxsize=2)
def production_case(dtype: torch.dtype):
    """2048 x 32771 logits (an odd width: rows alternate alignments) with a padded tail, and their anchor."""
    rows, cols, true_vocab = 2048, 32771, 32771 - 67
    logits, targets = gpu_case(rows, cols, true_vocab, dtype, seed=2048)
    g_lp, g_h = upstream_grads(rows, seed=2049)
    return logits, targets, true_vocab, g_lp, g_h, expected_logprobs(logits, targets, true_vocab, g_lp, g_h)


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_production_shape_2048_rows_of_32771(dtype, inplace_backward):
    """Enough rows that no row is split (below 256 SMs): the one-block-per-row, 256-thread path at a
    production size."""
    logits, targets, true_vocab, g_lp, g_h, expected = production_case(dtype)
    logprob, entropy, grad = run_fused(logits.to(DEVICE), targets, g_lp, g_h, inplace_backward=inplace_backward,
                                       shard=VocabShard(true_vocab_size=true_vocab))
    assert_matches_anchor(logits, targets, true_vocab, g_lp, g_h, logprob, entropy, grad, expected)


@pytest.mark.parametrize("inplace_backward", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_row_offsets_beyond_2_to_the_31_elements(dtype, inplace_backward):
    """Five rows `as_strided` from one buffer of more than 2^31 elements: the last row starts past 2^31, so any
    32-bit row offset in the kernels reads the wrong row. The odd stride also misaligns every row differently."""
    rows, cols, stride = 5, 4099, 2**29 + 13
    assert (rows - 1) * stride > 2**31
    logits, targets = gpu_case(rows, cols, cols, dtype, seed=97)
    g_lp, g_h = upstream_grads(rows, seed=98)
    buffer = torch.empty((rows - 1) * stride + cols, dtype=dtype, device=DEVICE)
    strided = buffer.as_strided((rows, cols), (stride, 1))
    strided.copy_(logits.to(DEVICE))
    logprob, entropy, grad = run_fused(strided, targets, g_lp, g_h, inplace_backward=inplace_backward)
    del buffer, strided
    assert_matches_anchor(logits, targets, cols, g_lp, g_h, logprob, entropy, grad)


def test_66000_contiguous_rows_of_32768_bf16():
    """4.3 GB of bf16 logits, rows 65536 and on start past 2^31 elements; rows around that boundary (and the
    first and last) are checked against the anchor, in place (one buffer of that size is enough)."""
    rows, cols = 66000, 32768
    gen = torch.Generator(DEVICE).manual_seed(5)
    logits = torch.randn(rows, cols, device=DEVICE, generator=gen).mul_(3).to(torch.bfloat16)
    targets = torch.randint(0, cols, (rows,), device=DEVICE, generator=gen)
    targets[1::4] = -1
    g_lp, g_h = torch.randn(rows, device=DEVICE, generator=gen), torch.randn(rows, device=DEVICE, generator=gen)
    checked = torch.tensor([0, 1, 65535, 65536, 65537, rows - 1], device=DEVICE)
    logits_checked = logits[checked].cpu()
    leaf = logits.requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(leaf, targets, with_entropy=True, inplace_backward=True,
                                               implementation="fused")
    ((logprob * g_lp).sum() + (entropy * g_h).sum()).backward()
    grad = leaf.grad[checked].cpu()
    results = logprob.detach()[checked].cpu(), entropy.detach()[checked].cpu(), grad
    del logits, leaf, logprob, entropy
    cpu = {name: t[checked].cpu() for name, t in {"targets": targets, "g_lp": g_lp, "g_h": g_h}.items()}
    assert_matches_anchor(logits_checked, cpu["targets"], cols, cpu["g_lp"], cpu["g_h"], *results)


def boundary_cases() -> list[tuple[int, int, int]]:
    """(rows, cols, valid_cols), bf16 with entropy: rows at the split boundary (half a wave of the block kernel -1, +0,
    +1: two splits at most half a wave), at the warp-per-row boundary (its resident warps -1, +0, +1, for 4097 and
    8192 columns), 8200 columns (never warp rows), and valid_cols at the split width (of the whole row) -1, +0, +1,
    and 0."""
    cases = []
    for cols in (4097, 8192, 8200):
        plan = launch_plan(1, cols)
        half_wave = plan["block_wave"] // 2
        resident_warps = plan["warp_wave"] * 8
        for rows in (half_wave - 1, half_wave, half_wave + 1, resident_warps - 1, resident_warps, resident_warps + 1):
            width = launch_plan(half_wave, cols)["split_cols"] or cols
            for valid in sorted({0, width - 1, width, width + 1}):
                if valid <= cols:
                    cases.append((rows, cols, valid))
    return cases


@pytest.mark.parametrize("rows,cols,valid", boundary_cases() if torch.cuda.is_available() else [pytest.param(
    0, 0, 0, marks=pytest.mark.skip(reason="needs a CUDA device: the cases come from its launch plan"))])
def test_launch_rule_boundaries(rows, cols, valid):
    """Values on both sides of the launch rules' boundaries (warp rows, block rows, split block rows), bf16 (16 bytes
    = one split alignment)."""
    dtype = torch.bfloat16
    logits, targets = gpu_case(rows, cols, max(valid, 1), dtype, seed=rows + cols + valid)
    g_lp, g_h = upstream_grads(rows, seed=valid)
    if valid == 0:  # a shard of padding only (TP): it contributes empty partials and a gradient of exactly 0
        ops, x, t = cuda_ops(), logits.to(DEVICE), targets.to(DEVICE)
        partials = ops.logprob_partials(x, t, cols, 0, True, None).cpu()
        live, inf = targets >= 0, float("inf")
        assert torch.equal(partials[live], torch.tensor([-inf, 0.0, -inf, 0.0]).expand(int(live.sum()), -1))
        assert torch.equal(partials[~live], torch.tensor([0.0, 1.0, -inf, 0.0]).expand(int((~live).sum()), -1))
        lse = torch.randn(rows, device=DEVICE)  # the softmax of the other ranks' columns
        grad = torch.full_like(x, 7.0)
        ops.logprob_backward(x, t, cols, 0, lse, lse, g_lp.to(DEVICE), g_h.to(DEVICE), grad, None)
        assert bool((grad == 0).all())
        return
    logprob, entropy, grad = run_fused(logits.to(DEVICE), targets, g_lp, g_h, shard=VocabShard(true_vocab_size=valid))
    assert_matches_anchor(logits, targets, valid, g_lp, g_h, logprob, entropy, grad)


@pytest.mark.parametrize("rows,cols", [(3, 131072), (2048, 4099)])
def test_forward_and_backward_on_a_side_stream_without_sync(rows, cols):
    """Everything on a side stream, the logits made there behind a ~50 ms sleep: a kernel (or the split-merge
    workspace) launched on another stream would run before the logits exist, and the values would be wrong."""
    logits, targets = gpu_case(rows, cols, cols - 3, torch.bfloat16, seed=rows)
    g_lp, g_h = upstream_grads(rows, seed=rows + 1)
    # Everything the side stream needs is copied first: a copy from pageable host memory waits for its stream.
    source, targets_d, g_lp_d, g_h_d = logits.to(DEVICE), targets.to(DEVICE), g_lp.to(DEVICE), g_h.to(DEVICE)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        made_here = source * 1  # written by the side stream, after the sleep
        leaf = made_here.detach().requires_grad_(True)
        # check_inputs=False: the target check's host sync would wait for the side stream and hide a race.
        logprob, entropy = vocab_parallel_logprobs(leaf, targets_d, shard=VocabShard(true_vocab_size=cols - 3),
                                                   with_entropy=True, check_inputs=False, implementation="fused")
        ((logprob * g_lp_d).sum() + (entropy * g_h_d).sum()).backward()
        results = logprob.detach().cpu(), entropy.detach().cpu(), leaf.grad.cpu()  # .cpu() waits for `side`
    assert_matches_anchor(logits, targets, cols - 3, g_lp, g_h, *results)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second CUDA device")
@pytest.mark.parametrize("rows,cols", [(7, 1000), (3, 131072)])
def test_a_second_device_while_device_0_is_current(rows, cols):
    """Tensors on cuda:1 with cuda:0 current: kernels, workspace and stream must follow the tensors."""
    assert torch.cuda.current_device() == 0
    logits, targets = gpu_case(rows, cols, cols - 1, torch.float32, seed=11)
    g_lp, g_h = upstream_grads(rows, seed=12)
    logprob, entropy, grad = run_fused(logits.to("cuda:1"), targets, g_lp, g_h,
                                       shard=VocabShard(true_vocab_size=cols - 1))
    assert torch.cuda.current_device() == 0
    assert_matches_anchor(logits, targets, cols - 1, g_lp, g_h, logprob, entropy, grad)


def random_layout_case(rng: random.Random):
    """A random shard layout: dtype, shape, storage offset 1-7, padded row stride, vocab offset and padding."""
    dtype = rng.choice(DTYPES)
    rows = rng.choice([1, 2, 7, rng.randint(1, 300), rng.randint(1000, 1200)])
    cols = rng.choice([1, 3, rng.randint(1, 9000), rng.randint(30000, 70000)])
    offset, stride = rng.randint(1, 7), cols + rng.choice([0, 1, 5, 8, rng.randint(0, 40)])
    vocab_start = rng.choice([0, 0, rng.randint(1, 3 * cols)])
    valid = rng.choice([cols, rng.randint(0, cols)])
    if vocab_start + valid == 0:  # true_vocab_size must be > 0: make it a shard of padding only
        vocab_start = cols
    return dict(dtype=dtype, rows=rows, cols=cols, offset=offset, stride=stride, vocab_start=vocab_start,
                true_vocab=vocab_start + valid, with_entropy=rng.random() < 0.7, inplace=rng.random() < 0.5)


def laid_out(case: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's logits on the GPU (padding columns 1e4, so that a leak shows) and its targets."""
    rows, cols, stride, offset = case["rows"], case["cols"], case["stride"], case["offset"]
    gen = torch.Generator(DEVICE).manual_seed(seed)
    storage = torch.randn(offset + rows * stride, device=DEVICE, generator=gen).mul_(3).to(case["dtype"])
    logits = storage.as_strided((rows, cols), (stride, 1), offset)
    logits[:, max(case["true_vocab"] - case["vocab_start"], 0):] = 1e4
    targets = torch.randint(0, case["true_vocab"], (rows,), device=DEVICE, generator=gen)
    targets[1::3] = -1
    return logits, targets


def run_on_layout(logits, targets, case, implementation):
    """Forward and backward on a copy of the case's buffer (same offset and strides); results on the CPU."""
    elements = logits.untyped_storage().nbytes() // logits.element_size()
    storage = logits.new_empty(elements)
    storage.copy_(logits.as_strided((elements,), (1,), 0))
    copy = storage.as_strided(logits.shape, logits.stride(), logits.storage_offset())
    leaf = copy.detach().requires_grad_(True)
    out = vocab_parallel_logprobs(leaf, targets,
                                  shard=VocabShard(start_index=case["vocab_start"], true_vocab_size=case["true_vocab"]),
                                  with_entropy=case["with_entropy"],
                                  inplace_backward=case["inplace"], implementation=implementation)
    logprob, entropy = out if case["with_entropy"] else (out, None)
    gen = torch.Generator().manual_seed(3)
    g_lp, g_h = (torch.randn(logprob.shape, generator=gen).to(DEVICE) for _ in range(2))
    finite = torch.isfinite(logprob)  # a target on another rank's columns: logprob -inf, a constant
    objective = torch.where(finite, logprob * g_lp, 0).sum()
    if entropy is not None:
        objective = objective + torch.where(torch.isfinite(entropy), entropy * g_h, 0).sum()
    objective.backward()
    return logprob.detach().cpu(), None if entropy is None else entropy.detach().cpu(), leaf.grad.cpu()


@pytest.mark.parametrize("seed", range(48))
def test_random_layouts_match_the_reference_on_the_gpu(seed):
    """Fused against implementation="torch" on the same GPU layout: offsets, strides, padding, shards."""
    case = random_layout_case(random.Random(seed))
    logits, targets = laid_out(case, seed)
    fused = run_on_layout(logits, targets, case, "fused")
    reference = run_on_layout(logits, targets, case, "torch")
    where = f"case {case}"
    assert torch.equal(torch.isfinite(fused[0]), torch.isfinite(reference[0])), where
    torch.testing.assert_close(fused[0], reference[0], atol=1e-5, rtol=1e-6, equal_nan=True, msg=where)
    if case["with_entropy"]:
        torch.testing.assert_close(fused[1], reference[1], atol=1e-4, rtol=1e-5, equal_nan=True, msg=where)
    valid = min(max(case["true_vocab"] - case["vocab_start"], 0), case["cols"])
    assert bool((fused[2][:, valid:] == 0).all()), f"padding columns must get exactly zero gradient: {where}"
    assert_grad_close(fused[2], reference[2].double(), case["dtype"], roundings=2)


@pytest.mark.parametrize("top_k,top_p", [(None, None), (9, 0.8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logit_scale_in_rows_split_across_blocks(dtype, top_k, top_p):
    """logit_scale inside the kernels' split merge (7 rows of 50257 columns, each split across many blocks)
    against softmax(scale * x) in float64; smaller shapes run as test_logprob_temperature's cuda cases."""
    from test_logprob_temperature import anchor, check

    rows, vocab = 7, 50257
    scale, true_vocab = 1 / 0.7, vocab - vocab // 7
    logits, targets = gpu_case(rows, vocab, true_vocab, dtype, seed=rows + vocab)
    g_lp, g_h = upstream_grads(rows, seed=rows)
    leaf = logits.to(DEVICE).requires_grad_(True)
    logprob, entropy = vocab_parallel_logprobs(leaf, targets.to(DEVICE), shard=VocabShard(true_vocab_size=true_vocab),
                                               with_entropy=True, implementation="fused",
                                               distribution=SamplingDistribution(logit_scale=scale, top_k=top_k,
                                                                                 top_p=top_p))
    finite = torch.isfinite(logprob)
    ((torch.where(finite, logprob, 0.0) * g_lp.to(DEVICE)).sum() + (entropy * g_h.to(DEVICE)).sum()).backward()
    expected = anchor(logits, targets, true_vocab, scale, top_k, top_p, g_lp, g_h)
    check(logprob.detach().cpu(), entropy.detach().cpu(), leaf.grad.cpu(), expected, targets, true_vocab, dtype)


def test_the_plans_cover_the_three_kernel_shapes():
    assert launch_plan(32768, 4096)["warp_rows"] == 1  # many short rows: one warp each, one wave of blocks
    assert launch_plan(32768, 4096)["blocks"] <= launch_plan(32768, 4096)["warp_wave"]
    assert launch_plan(8192, 32768)["splits"] == 1 and launch_plan(8192, 32768)["warp_rows"] == 0
    short_wide = launch_plan(256, 131072)
    assert short_wide["splits"] > 1 and short_wide["blocks"] <= short_wide["block_wave"]  # no second wave


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("rows,cols", [(2048, 4099), (3, 131072), (8192, 1000)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tp1_outputs_are_the_combine_of_the_partials(dtype, rows, cols, with_entropy):
    """The forward kernel's own outputs (TP 1) against the combine kernel on its partials: the same maths in another
    kernel (fma contraction may differ: a few fp32 ulps)."""
    ops = cuda_ops()
    logits, targets = gpu_case(rows, cols, cols - 3, dtype, seed=rows)
    x, t = logits.to(DEVICE), targets.to(DEVICE)
    direct = ops.logprob_forward(x, t, 0, cols - 3, with_entropy, None, 1.25)
    partials = ops.logprob_partials(x, t, 0, cols - 3, with_entropy, None, 1.25)
    combined = ops.logprob_combine(partials.unsqueeze(0).contiguous(), t, with_entropy)
    for got, want in zip(direct, combined):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
def test_the_combine_kernel_is_the_torch_combine(with_entropy):
    from test_op_registration import edge_partials

    from megatron_grpo.ops.core.partials import combine_partials

    gathered, targets = edge_partials(4, 5000, with_entropy, seed=4)
    fused = cuda_ops().logprob_combine(gathered.to(DEVICE), targets.to(DEVICE), with_entropy)
    for got, want in zip(fused, combine_partials(gathered, targets, with_entropy)):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("capacity", [None, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_top_p_fused_search_is_its_twin_on_cuda(dtype, capacity, monkeypatch):
    """The CUDA kernels (float64 atomics: another summation order) find the twin's threshold on random logits, also
    with rows whose candidates overflow the compact buffer."""
    from megatron_grpo.ops.core import filtering
    from megatron_grpo.ops.core.backends import FusedKernels, TorchKernels

    if capacity is not None:
        monkeypatch.setattr(filtering, "CANDIDATE_CAPACITY", capacity)
    gen = torch.Generator().manual_seed(21)
    logits = (torch.randn(300, 50257, generator=gen) * 3).to(dtype).to(DEVICE)
    distribution = SamplingDistribution.of_sampling(0.8, top_k=200, top_p=0.9)
    twin, fused = (filtering.kept_threshold(logits, distribution, true_vocab_size=50257, kernels=kernels)
                   for kernels in (TorchKernels(), FusedKernels()))
    assert torch.equal(twin, fused)


def test_the_op_captured_in_a_cuda_graph_replays_as_eager():
    """A split-row call (it needs the forward's workspace) captured into a CUDA graph: the capture takes a workspace
    of its own, and replays give the eager values."""
    rows, cols = 3, 131072
    logits, targets = gpu_case(rows, cols, cols, torch.bfloat16, seed=71)
    x, t = logits.to(DEVICE), targets.to(DEVICE)
    eager = vocab_parallel_logprobs(x, t, with_entropy=True, check_inputs=False, implementation="fused")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as torch.cuda.graph's documentation asks
        vocab_parallel_logprobs(x, t, with_entropy=True, check_inputs=False, implementation="fused")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = vocab_parallel_logprobs(x, t, with_entropy=True, check_inputs=False, implementation="fused")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


def test_exp_mode_is_refused_by_name_on_cuda():
    logits, targets = gpu_case(4, 100, 100, torch.float32, seed=0)
    with pytest.raises(NotImplementedError, match="inplace_backward='exp'"):
        vocab_parallel_logprobs(logits.to(DEVICE), targets.to(DEVICE), inplace_backward="exp", implementation="fused")
