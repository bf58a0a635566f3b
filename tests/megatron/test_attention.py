"""`TorchDotProductAttention`, the core attention without Transformer Engine (`megatron/attention.py`), in float64
against independent references, on one rank (its context parallelism: tests/megatron/test_context_parallel.py).

- Core level: packed (THD) sequences against a plain per-sequence softmax attention, outputs and dQ / dK / dV, with
  grouped-query heads (4 query heads on 4, 2 and 1 key heads) and a given or default scale; padded rows, causal and
  under a given mask, against Megatron's own `DotProductAttention`.
- Through the tiny GPTModel: the spec `torch_attention_layer_spec()` against Megatron's local spec on padded rows
  (the same weights: logits and every parameter gradient), and packed rows (THD) against the local spec's dense
  reference, one `[T, T]` attention under a block-diagonal causal mask, and against each sequence alone, with learned
  absolute positions and RoPE (whose THD path restarts in every sequence).
- Bad input: each a ValueError naming what is wrong.
- torch's `varlen_attn` under its three signatures (2.10, 2.11, 2.13), through stubs that compute with SDPA; the real
  kernel on a GPU (`gpu`), and Transformer Engine's THD attention against ours where TE is importable (`gpu`).

Float64 throughout on the CPU: the two sides compute the same sums in other orders, so they agree to a few ulps of
the largest element (1e-12 relative leaves three orders of magnitude).
"""

from __future__ import annotations

import types

import pytest
import torch
from _dist import run_on_ranks

RTOL64 = 1e-12  # float64, the same maths in another order: a few ulps (2.2e-16) of the largest element
LENGTHS = [3, 1, 3, 11]  # packed sequences: odd lengths, two alike (one flash call on the CPU), a single token
HEADS, HEAD_DIM = 4, 8


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int],
                        scale: float) -> torch.Tensor:
    """Causal softmax attention within each sequence of `[t, hq, d]` queries on `[t, hkv, d]` keys and values,
    query head h reading key head h // (hq / hkv) (Megatron's grouping): plain einsums, the scores materialised."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    pieces = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        future = torch.ones(len(qs), len(ks), dtype=torch.bool).triu(1)
        pieces.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(future, -torch.inf).softmax(-1), vs))
    return torch.cat(pieces)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


class _OneRank:
    """A process group of one rank (what the attention asks a TP or CP group without context parallelism)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def core_attention(query_groups: int, *, softmax_scale: float | None = None, megatron_groups: bool = False,
                   cp: int = 1, cp_comm_type: str | None = None, **config):
    """A TorchDotProductAttention of HEADS heads of HEAD_DIM in `query_groups` groups, as a GPT layer builds it: on
    Megatron's groups (`megatron_groups`, parallel_state initialised) or on groups of one rank."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_grpo.megatron import TorchDotProductAttention

    options = dict(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                   num_query_groups=query_groups, attention_dropout=0.0, context_parallel_size=cp)
    pg_collection = None if megatron_groups else types.SimpleNamespace(tp=_OneRank(), cp=_OneRank())
    return TorchDotProductAttention(config=TransformerConfig(**{**options, **config}), layer_number=1,
                                    attn_mask_type=AttnMaskType.causal, attention_type="self",
                                    softmax_scale=softmax_scale, cp_comm_type=cp_comm_type,
                                    pg_collection=pg_collection)


def thd_params(cu_seqlens: torch.Tensor, **overrides):
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    fields = dict(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=int(lengths.max()),
                  max_seqlen_kv=int(lengths.max()))
    return PackedSeqParams(**{**fields, **overrides})


def cu_seqlens_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _qkv(tokens: int, query_groups: int, seed: int, dtype=torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(tokens, HEADS, HEAD_DIM), (tokens, query_groups, HEAD_DIM), (tokens, query_groups, HEAD_DIM)]
    return [(2 * torch.randn(shape, generator=gen, dtype=dtype)).requires_grad_() for shape in shapes]


def _packed_against_reference() -> dict:
    """THD outputs and gradients against `reference_attention`, per number of key heads and scale, through the CPU's
    flash kernels into one output; and (`"sdpa"`) through the fallback of one SDPA per sequence (dropout, or CUDA
    in fp32)."""
    from megatron_grpo.megatron import attention

    errors = {}
    cu_seqlens = cu_seqlens_of(LENGTHS)
    flash = attention._CPU_FLASH
    for groups, scale, path in [(g, s, "flash") for g in (4, 2, 1) for s in (None, 0.3)] + [(2, 0.3, "sdpa")]:
        attention._CPU_FLASH = flash if path == "flash" else None
        try:
            q, k, v = _qkv(sum(LENGTHS), groups, seed=groups)
            out = core_attention(groups, softmax_scale=scale)(q, k, v, None, packed_seq_params=thd_params(cu_seqlens))
            upstream = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), upstream)
        finally:
            attention._CPU_FLASH = flash
        q_ref, k_ref, v_ref = (t.detach().clone().requires_grad_() for t in (q, k, v))
        expected = reference_attention(q_ref, k_ref, v_ref, LENGTHS, scale or HEAD_DIM ** -0.5)
        expected_grads = torch.autograd.grad(expected, (q_ref, k_ref, v_ref), upstream.view_as(expected))
        errors[groups, scale, path] = [relative_error(out.view_as(expected), expected)] + [
            relative_error(g, e) for g, e in zip(grads, expected_grads)]
    return errors


def _padded_against_megatron() -> dict:
    """sbhd `[s, b, h, d]`: causal (no mask) and under a given mask, against Megatron's DotProductAttention."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    seq, batch, groups = 7, 3, 2
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(seq, batch, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(seq, batch, groups, HEAD_DIM, generator=gen) for _ in range(2))
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=groups, attention_dropout=0.0)
    megatron = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    given = causal | (torch.rand(batch, 1, seq, seq, generator=gen) < 0.3)  # True = masked out
    given[..., torch.arange(seq), torch.arange(seq)] = False  # every query keeps one key
    ours = core_attention(groups)
    return {"causal": relative_error(ours(q, k, v, None), megatron(q, k, v, causal)),
            "mask": relative_error(ours(q, k, v, given), megatron(q, k, v, given))}


def _tiny_gpt(spec, position_embedding_type: str, state: dict | None = None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=2, ffn_hidden_size=48, init_method_std=0.2, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float64)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=32,
                     position_embedding_type=position_embedding_type)
    if state is not None:
        model.load_state_dict(state)
    return model


def _logits_and_grads(model, forward, weights: torch.Tensor) -> tuple:
    """`forward()`'s logits, and every parameter of `model`'s gradient of sum(logits · weights)."""
    model.zero_grad()
    logits = forward()
    (logits * weights).sum().backward()
    return logits.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


def _worst_grad(grads: dict, expected: dict) -> float:
    return max(relative_error(grads[name], expected[name]) for name in expected)


def _through_gpt_model() -> dict:
    """The tiny GPTModel (float64, GQA): the torch spec against the local spec on padded rows; its packed row
    (`model_forward`, THD) against the local spec's block-diagonal reference and against each sequence alone."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_grpo.megatron import model_forward, torch_attention_layer_spec

    errors = {}
    gen = torch.Generator().manual_seed(9)
    cu_seqlens = cu_seqlens_of(LENGTHS)
    tokens = sum(LENGTHS)
    input_ids = torch.randint(0, 64, (1, tokens), generator=gen)
    weights = torch.randn(1, tokens, 64, generator=gen, dtype=torch.float64)
    sequence = torch.arange(len(LENGTHS)).repeat_interleave(torch.tensor(LENGTHS))
    positions = torch.cat([torch.arange(length) for length in LENGTHS])[None]
    block_diagonal = torch.ones(tokens, tokens, dtype=torch.bool).triu(1) | (sequence[:, None] != sequence[None, :])
    causal = torch.ones(9, 9, dtype=torch.bool).triu(1)[None, None]
    for kind in ("learned_absolute", "rope"):
        torch.manual_seed(3)
        local = _tiny_gpt(get_gpt_layer_local_spec(), kind)
        ours = _tiny_gpt(torch_attention_layer_spec(), kind, local.state_dict())
        row, row_weights, row_positions = input_ids[:, :9], weights[:, :9], torch.arange(9)[None]
        padded = _logits_and_grads(ours, lambda: ours(row, row_positions, attention_mask=None), row_weights)
        reference = _logits_and_grads(local, lambda: local(row, row_positions, attention_mask=causal), row_weights)
        errors[kind, "spec"] = (relative_error(padded[0], reference[0]), _worst_grad(padded[1], reference[1]))
        packed = _logits_and_grads(ours, lambda: model_forward(ours, input_ids, cu_seqlens=cu_seqlens), weights)
        if kind == "learned_absolute":  # the dense reference reads the positions (RoPE there would not restart)
            mask = block_diagonal[None, None]
            dense = _logits_and_grads(local, lambda: local(input_ids, positions, attention_mask=mask), weights)
            errors[kind, "dense"] = (relative_error(packed[0], dense[0]), _worst_grad(packed[1], dense[1]))
        bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        alone = _logits_and_grads(ours, lambda: torch.cat([model_forward(ours, input_ids[:, start:end])
                                                           for start, end in bounds], dim=1), weights)
        errors[kind, "alone"] = (relative_error(packed[0], alone[0]), _worst_grad(packed[1], alone[1]))
    return errors


def _bad_input() -> dict[str, str]:
    """The ValueError of each input the attention cannot take, by name."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_grpo.megatron import model_forward, torch_attention_layer_spec

    q, k, v = (t.detach() for t in _qkv(18, 2, seed=1))
    cu_seqlens = cu_seqlens_of(LENGTHS)
    attention = core_attention(2)
    attempts = {
        "not_from_zero": lambda: attention(q, k, v, None, packed_seq_params=thd_params(cu_seqlens + 1)),
        "short": lambda: attention(q, k, v, None, packed_seq_params=thd_params(cu_seqlens_of([5, 1, 9]))),
        "empty_sequence": lambda: attention(q, k, v, None, packed_seq_params=thd_params(
            torch.tensor([0, 5, 5, 18], dtype=torch.int32))),
        "float": lambda: attention(q, k, v, None, packed_seq_params=thd_params(cu_seqlens.double())),
        "keys_differ": lambda: attention(q, k, v, None, packed_seq_params=thd_params(
            cu_seqlens, cu_seqlens_kv=cu_seqlens_of([6, 9, 3]))),
        "mask_with_thd": lambda: attention(q, k, v, torch.zeros(1, 1, 18, 18, dtype=torch.bool),
                                           packed_seq_params=thd_params(cu_seqlens)),
        "bshd": lambda: attention(q, k, v, None, packed_seq_params=thd_params(cu_seqlens, qkv_format="bshd")),
        "bias": lambda: attention(q[:, None], k[:, None], v[:, None], None, attention_bias=torch.zeros(1)),
        "float_mask": lambda: attention(q[:, None], k[:, None], v[:, None], torch.zeros(1, 1, 18, 18)),
        "window": lambda: core_attention(2, window_size=(4, 0)),
        "p2p": lambda: core_attention(2, cp_comm_type="p2p"),
        "mla": lambda: torch_attention_layer_spec(multi_latent_attention=True),
        "local_spec_packed": lambda: model_forward(_tiny_gpt(get_gpt_layer_local_spec(), "learned_absolute"),
                                                   torch.zeros(1, 18, dtype=torch.long), cu_seqlens=cu_seqlens),
    }
    return value_error_messages(attempts)


def value_error_messages(attempts: dict) -> dict[str, str]:
    """Each attempt's ValueError message, by name (each must raise one)."""
    messages = {}
    for name, attempt in attempts.items():
        with pytest.raises(ValueError) as error:
            attempt()
        messages[name] = str(error.value)
    return messages


def _single_rank_checks(rank: int, world_size: int) -> dict:
    from megatron_grpo.megatron import ParallelParams, init_parallel

    init_parallel(ParallelParams())
    torch.set_default_dtype(torch.float64)
    return {"packed": _packed_against_reference(), "padded": _padded_against_megatron(),
            "gpt": _through_gpt_model(), "bad_input": _bad_input()}


@pytest.fixture(scope="module")
def single() -> dict:
    return run_on_ranks(1, _single_rank_checks)[0]


def test_packed_sequences_equal_a_plain_attention_of_each_sequence(single):
    """Outputs and dQ, dK, dV of the THD path (on the CPU, its flash kernels per length of sequence) against the
    float64 reference, with 4, 2 and 1 key heads for 4 query heads, at the default and a given softmax scale; and
    of the fallback, one SDPA per sequence."""
    assert set(single["packed"]) == {(groups, scale, "flash") for groups in (4, 2, 1) for scale in (None, 0.3)} | {
        (2, 0.3, "sdpa")}
    for case, errors in single["packed"].items():
        assert max(errors) <= RTOL64, (case, errors)


def test_padded_rows_equal_megatrons_dot_product_attention(single):
    for case, error in single["padded"].items():
        assert error <= RTOL64, (case, error)


def test_torch_attention_spec_equals_the_local_spec_and_packs_exactly(single):
    """Through the GPTModel: the spec against Megatron's local spec on padded rows, and a packed row against the
    local spec's dense block-diagonal reference and against each sequence alone; logits and every gradient."""
    assert set(single["gpt"]) == {("learned_absolute", "spec"), ("learned_absolute", "dense"),
                                  ("learned_absolute", "alone"), ("rope", "spec"), ("rope", "alone")}
    for case, (logits, grads) in single["gpt"].items():
        assert logits <= RTOL64 and grads <= RTOL64, (case, logits, grads)


def test_bad_input_is_a_value_error_naming_it(single):
    messages = single["bad_input"]
    expected_starts = {
        "not_from_zero": "packed_seq_params.cu_seqlens_q: must rise strictly from 0 to the 18 tokens",
        "short": "packed_seq_params.cu_seqlens_q: must rise strictly from 0 to the 18 tokens",
        "empty_sequence": "packed_seq_params.cu_seqlens_q: must rise strictly",
        "float": "packed_seq_params.cu_seqlens_q: expected an int32 tensor [N + 1]",
        "keys_differ": "packed_seq_params.cu_seqlens_kv: self-attention needs the keys' boundaries equal",
        "mask_with_thd": "attention_mask: packed sequences and context-parallel shares take no mask",
        "bshd": "packed_seq_params.qkv_format: TorchDotProductAttention packs 'thd', got 'bshd'",
        "bias": "attention_bias: TorchDotProductAttention takes none",
        "float_mask": "attention_mask: expected a bool mask",
        "window": "TorchDotProductAttention: window_size: no sliding-window attention",
        "p2p": "TorchDotProductAttention: cp_comm_type: context parallelism all-gathers K and V here",
        "mla": "multi_latent_attention: ",
        "local_spec_packed": "cu_seqlens: this model's core attention (DotProductAttention) takes no packed (THD) "
                             "sequences; build its layers with megatron_grpo.megatron.torch_attention_layer_spec()",
    }
    assert messages.keys() == expected_starts.keys()
    for name, start in expected_starts.items():
        assert messages[name].startswith(start), (name, messages[name])


# ---- torch's varlen_attn, under each of its signatures ----

def _stub_reference(query, key, value, cu_seq_q, causal: bool, scale: float | None, gqa: bool) -> torch.Tensor:
    if not causal:  # varlen_attn's default: the test must see that the adapter asks for causal attention
        return torch.zeros_like(query)
    if not gqa:
        assert query.shape[1] == key.shape[1], "grouped heads given to a varlen_attn without enable_gqa"
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    return reference_attention(query, key, value, lengths, query.shape[-1] ** -0.5 if scale is None else scale)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _stub_reference(query, key, value, cu_seq_q, is_causal, None, gqa=False)


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):
    return _stub_reference(query, key, value, cu_seq_q, window_size == (-1, 0), scale, gqa=False)


def varlen_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    return _stub_reference(query, key, value, cu_seq_q, window_size == (-1, 0), scale, gqa=enable_gqa)


@pytest.mark.parametrize("fn", [varlen_2_10, varlen_2_11, varlen_2_13], ids=["2.10", "2.11", "2.13"])
@pytest.mark.parametrize("groups", [4, 2])
def test_varlen_adapter_asks_each_signature_for_causal_attention_at_the_scale(fn, groups):
    """The stubs compute what each signature's keywords ask for (non-causal by default, as varlen_attn): the adapter
    must make it causal, pass or fold the scale, and repeat grouped heads where enable_gqa is missing."""
    from megatron_grpo.megatron.attention import varlen_causal

    q, k, v = (t.detach() for t in _qkv(sum(LENGTHS), groups, seed=5))
    for scale in (HEAD_DIM ** -0.5, 0.3):
        got = varlen_causal(q, k, v, cu_seqlens_of(LENGTHS), max(LENGTHS), scale=scale, fn=fn)
        assert relative_error(got, reference_attention(q, k, v, LENGTHS, scale)) <= RTOL64


def test_varlen_signature_of_this_torch():
    """This torch's varlen_attn (2.10+) is read as one of the known signatures; on the CPU the attention never
    calls it (it has no CPU kernel): per-sequence SDPA instead."""
    from megatron_grpo.megatron.attention import VARLEN, VarlenSignature

    if VARLEN is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10+)")
    signature = VarlenSignature.of(VARLEN)
    assert signature.causal in ({"window_size": (-1, 0)}, {"is_causal": True})
    assert not core_attention(2)._varlen_usable(torch.zeros(1, HEADS, HEAD_DIM, dtype=torch.bfloat16))


# ---- on a GPU ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_attn_on_cuda_equals_per_sequence_sdpa(dtype, monkeypatch):
    """On CUDA in half precision the THD path is torch's varlen_attn (counted); its outputs and gradients equal the
    float32 per-sequence path's within half precision: each output is a convex mix of values of at most |v| = 8
    (2·randn, 4 sigma), rounded once per operation in bf16 (u = 2^-8) or fp16 (2^-11); 8 ulps of 8 at bf16 is
    0.25, 0.03 at fp16."""
    pytest.importorskip("megatron.core", reason="megatron-core is not importable (gpu_check.sh: the wheels step)")
    from megatron_grpo.megatron import attention as module

    calls = []
    real = module.varlen_causal
    monkeypatch.setattr(module, "varlen_causal", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    lengths = [37, 1, 128, 64, 250]
    cu_seqlens = cu_seqlens_of(lengths).cuda()
    attention = core_attention(2).cuda()
    q, k, v = (t.detach().cuda() for t in _qkv(sum(lengths), 2, seed=7, dtype=torch.float32))
    half = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attention(*half, None, packed_seq_params=thd_params(cu_seqlens))
    expected = attention(*full, None, packed_seq_params=thd_params(cu_seqlens))
    assert len(calls) == 1  # the half-precision call only
    upstream = torch.randn_like(expected)
    grads = torch.autograd.grad(out, half, upstream.to(dtype))
    expected_grads = torch.autograd.grad(expected, full, upstream)
    atol = 0.25 if dtype == torch.bfloat16 else 0.03
    torch.testing.assert_close(out.float(), expected, rtol=0, atol=atol)
    for got, want in zip(grads, expected_grads):
        scale = want.abs().max().item()
        torch.testing.assert_close(got.float(), want, rtol=0, atol=atol / 8 * scale)


@pytest.mark.gpu
def test_transformer_engine_thd_attention_equals_ours():
    """Where Transformer Engine is importable: its THD attention (Megatron's TEDotProductAttention) and ours on the
    same packed bf16 batch, outputs within bf16 rounding (as above)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not importable (gpu_check.sh: the wheels step)")
    from megatron_grpo.megatron.transformer_engine import transformer_engine_usable

    if not transformer_engine_usable():
        pytest.skip("Transformer Engine is not importable here")
    run_on_ranks(1, _transformer_engine_comparison)


def _transformer_engine_comparison(rank: int, world_size: int) -> None:
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_grpo.megatron import ParallelParams, init_parallel

    init_parallel(ParallelParams())
    lengths = [37, 1, 128, 64, 250]
    cu_seqlens = cu_seqlens_of(lengths).cuda()
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=2, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16)
    theirs = TEDotProductAttention(config, 1, AttnMaskType.causal, "self")
    q, k, v = (t.detach().cuda().to(torch.bfloat16) for t in _qkv(sum(lengths), 2, seed=8, dtype=torch.float32))
    params = thd_params(cu_seqlens, cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens)
    expected = theirs(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=params)
    got = core_attention(2).cuda()(q, k, v, None, packed_seq_params=params)
    torch.testing.assert_close(got.float().view_as(expected), expected.float(), rtol=0, atol=0.25)
