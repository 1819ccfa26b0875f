"""The in-place paged attention kernel (``attention="paged"``) against a brute-force float64 softmax over
gathered contexts, against the gather path over random block tables, and the engine with it on against
transformers' own greedy generate (every expected token and logit from ``model.generate``, no kvpool code).

Tolerances: float32 outputs within 1e-5 of the float64 brute force and of the gather path's SDPA (both
sum ~100 products of O(1) values in float32); bfloat16 within 2e-2 (8 bits of mantissa); engine logits
within 1e-4, as tests/test_engine.py holds the gather path to.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.attention import build_step_metadata, gather_attention
from kvpool.engine.paged_attention import PagedBatch, new_token_slots, paged_attention, paged_batch
from kvpool.errors import ConfigError, InvalidArgumentError, InvalidIdError
from kvpool.spec import KVCacheGroup, KVCacheSpec, LayerKind
from kvpool.storage.paged import PagedKVCache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

B, HQ, HKV, D = 4, 6, 2, 8


def _brute_force(q, k_cache, v_cache, tables, spans, kind=LayerKind.FULL, window=None, softcap=None,
                 sinks=None, scale=None):
    """Per query: its request's keys by slot, masked by hand (t <= p; sliding t > p - W; chunked t >= C *
    (p // C)), scores in float64, softcap, softmax with the sink logit appended and dropped."""
    out, row = [], 0
    hq, hkv = q.shape[1], k_cache.shape[2]
    kf = k_cache.reshape(-1, hkv, k_cache.shape[-1]).double()
    vf = v_cache.reshape(-1, hkv, v_cache.shape[-1]).double()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    for table, (start, end) in zip(tables, spans, strict=True):
        for p in range(start, end):
            keys = [t for t in range(p + 1) if (kind is not LayerKind.SLIDING or t > p - window)
                    and (kind is not LayerKind.CHUNKED or t >= window * (p // window))]
            slots = torch.tensor([table[t // B] * B + t % B for t in keys])
            heads = []
            for h in range(hq):
                g = h // (hq // hkv)
                s = (kf[slots, g] @ q[row, h].double()) * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                if sinks is not None:
                    s = torch.cat([s, sinks[h:h + 1].double()])
                w = torch.softmax(s, 0)[:len(keys)]
                heads.append(w @ vf[slots, g])
            out.append(torch.stack(heads))
            row += 1
    return torch.stack(out)


def _random_case(spans, num_blocks=64, dv=D, dtype=torch.float32, seed=0, hq=HQ, hkv=HKV, d=D):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, B, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, B, hkv, dv, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for _, end in spans:
        n = -(-end // B)
        tables.append(perm[used:used + n])
        used += n
    q = torch.randn(sum(e - s for s, e in spans), hq, d, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables


def _group(kind=LayerKind.FULL, window=None):
    return KVCacheGroup(index=0, kind=kind, window=window, layers=(0,), slots=1, block_size=B)


MIXED = [(40, 41), (0, 23), (10, 17), (63, 64)]  # decode, a whole prefill, a chunk, decode at a block edge


@pytest.mark.parametrize(("kind", "window"), [(LayerKind.FULL, None), (LayerKind.SLIDING, 5),
                                              (LayerKind.CHUNKED, 8)])
@pytest.mark.parametrize("extra", [{}, {"softcap": 2.0}, {"sinks": True}, {"scale": 0.3}])
def test_kernel_is_the_brute_force_softmax(kind, window, extra) -> None:
    _assert_brute_force(MIXED, 64, kind, window, extra)


def _assert_brute_force(spans: list, num_blocks: int, kind: LayerKind, window: int | None,
                        extra: dict) -> None:
    """The kernel over a random case of ``spans`` equals :func:`_brute_force` (``extra["sinks"]``: random
    sinks)."""
    q, kc, vc, tables = _random_case(spans, num_blocks=num_blocks)
    if extra.get("sinks"):
        extra = {"sinks": torch.randn(HQ, generator=torch.Generator().manual_seed(3))}
    batch = paged_batch(_group(kind, window), [((t,), s, e) for t, (s, e) in zip(tables, spans, strict=True)],
                        num_blocks, B)
    got = paged_attention(q, kc, vc, batch, **extra)
    expected = _brute_force(q, kc, vc, tables, spans, kind, window, **extra)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)


LONG = [(200, 1240), (1500, 1501)]  # 1,040 queries after 200 tokens (the kernel's tile path), a decode


@pytest.mark.parametrize(("kind", "window"), [(LayerKind.FULL, None), (LayerKind.SLIDING, 37),
                                              (LayerKind.CHUNKED, 64)])
@pytest.mark.parametrize("extra", [{}, {"softcap": 2.0}, {"sinks": True}])
def test_long_runs_are_the_brute_force_softmax(kind, window, extra) -> None:
    # runs of 512 queries or more take GEMM tiles instead of the per-token loop: the same function
    _assert_brute_force(LONG, 700, kind, window, extra)


@pytest.mark.parametrize(("spans", "blocks"), [(MIXED, 64), (LONG, 700)])
def test_values_narrower_than_keys_and_bfloat16(spans, blocks) -> None:
    q, kc, vc, tables = _random_case(spans, num_blocks=blocks, dv=4)
    batch = paged_batch(_group(), [((t,), s, e) for t, (s, e) in zip(tables, spans, strict=True)], blocks, B)
    torch.testing.assert_close(paged_attention(q, kc, vc, batch).double(),
                               _brute_force(q, kc, vc, tables, spans), atol=1e-5, rtol=0)
    got = paged_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), batch)
    assert got.dtype == torch.bfloat16
    expected = _brute_force(q.bfloat16().float(), kc.bfloat16().float(), vc.bfloat16().float(), tables, spans)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=0)


@pytest.mark.parametrize(("spans", "blocks"), [(MIXED, 64), (LONG, 700)])
def test_hnd_views_and_a_strided_query(spans, blocks) -> None:
    # the HND layout's views ([N, H, B, D] storage seen as [N, B, H, D]) and a query whose heads are not
    # packed: the kernel reads every stride it is given
    q, kc, vc, tables = _random_case(spans, num_blocks=blocks)
    k_hnd = kc.transpose(1, 2).contiguous().transpose(1, 2)
    v_hnd = vc.transpose(1, 2).contiguous().transpose(1, 2)
    q_wide = torch.zeros(q.shape[0], HQ, 2 * D)[:, :, :D]
    q_wide.copy_(q)
    batch = paged_batch(_group(), [((t,), s, e) for t, (s, e) in zip(tables, spans, strict=True)], blocks, B)
    torch.testing.assert_close(paged_attention(q_wide, k_hnd, v_hnd, batch).double(),
                               _brute_force(q, kc, vc, tables, spans), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(10, 1, 8), (4, 4, 12), (9, 3, 5), (9, 3, 64)])
def test_head_groups_past_8_plain_mha_and_odd_head_dims(hq, hkv, head_dim) -> None:
    # G = 10 query heads per KV head (past the 8 the vector loop holds), MHA, and head dims that are not
    # a multiple of 8 (the loop's scalar tail)
    q, kc, vc, tables = _random_case(MIXED, hq=hq, hkv=hkv, d=head_dim, dv=head_dim)
    batch = paged_batch(_group(), [((t,), s, e) for t, (s, e) in zip(tables, MIXED, strict=True)], 64, B)
    torch.testing.assert_close(paged_attention(q, kc, vc, batch).double(),
                               _brute_force(q, kc, vc, tables, MIXED), atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("spans", [[(c - 1, c) for c in (5, 33, 64, 17)], [(0, 30)], [(12, 27), (3, 4)]])
def test_kernel_equals_the_gather_path_over_random_tables(seed, spans) -> None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, dtype=torch.float32, block_size=B)
    cache = PagedKVCache(spec, 64)
    gen = torch.Generator().manual_seed(seed)
    cache.k_cache(0).copy_(torch.randn(cache.k_cache(0).shape, generator=gen))
    cache.v_cache(0).copy_(torch.randn(cache.v_cache(0).shape, generator=gen))
    _, _, _, tables = _random_case(spans, seed=seed)
    full = [((t,), s, e) for t, (s, e) in zip(tables, spans, strict=True)]
    meta = build_step_metadata(cache, spec.groups, full, "cpu")
    q = torch.randn(sum(e - s for s, e in spans), HQ, D, generator=gen)
    reference = gather_attention(q.transpose(0, 1).unsqueeze(0), cache, 0, meta.groups[0], meta.query_starts)
    paged = build_step_metadata(cache, spec.groups, full, "cpu", attention="paged").groups[0]
    torch.testing.assert_close(paged.slot_mapping, meta.groups[0].slot_mapping)  # the same new slots
    got = paged_attention(q, cache.k_cache(0), cache.v_cache(0), paged.paged)
    torch.testing.assert_close(got, reference[0], atol=1e-5, rtol=0)


def test_bad_input_is_a_typed_error() -> None:
    q, kc, vc, tables = _random_case([(0, 8)])
    group = _group()
    with pytest.raises(InvalidIdError):
        paged_batch(group, [(([64, 1],), 0, 8)], 64, B)  # block 64 of a 64-block pool
    with pytest.raises(InvalidArgumentError):
        paged_batch(group, [(([1],), 0, 8)], 64, B)  # 8 tokens need 2 blocks
    with pytest.raises(InvalidArgumentError):
        paged_batch(group, [], 64, B)
    batch = paged_batch(group, [((tables[0],), 0, 8)], 64, B)
    with pytest.raises(InvalidArgumentError):
        paged_attention(q[:5], kc, vc, batch)  # 5 queries for 8 tokens
    with pytest.raises(InvalidArgumentError):
        paged_attention(q[:, :5], kc, vc, batch)  # 5 heads over 2 KV heads
    with pytest.raises(InvalidIdError):
        paged_attention(q, kc[:1], vc[:1], batch)  # the tables name blocks past a 1-block cache
    with pytest.raises(ConfigError):
        paged_attention(q.double(), kc.double(), vc.double(), batch)  # float64
    with pytest.raises(ConfigError):
        paged_attention(q, kc.half(), vc.half(), batch)  # KV not in the query's dtype
    assert isinstance(batch, PagedBatch)


@pytest.mark.parametrize("spans, extra", [
    ([(0, 9), (5, 6)], {"mul": 3e3}),  # scores ~ +-1e4: the exp polynomial's range, decode and a short run
    ([(0, 9)], {"mul": 1e4, "softcap": 30.0}),  # tanh saturates at +-softcap
    ([(0, 5), (9, 10)], {"sinks": torch.tensor([1e4, -1e4, 50.0, -50.0, 0.0, 88.0])}),
    ([(0, 512)], {"sinks": torch.full((HQ,), 1e4)}),  # a GEMM tile whose sink outweighs every key
])
def test_extreme_scores_and_sinks_stay_finite_and_match_float64(spans, extra) -> None:
    blocks = sum(-(-end // B) for _, end in spans) + 1
    q, kc, vc, tables = _random_case(spans, num_blocks=max(64, blocks))
    q = q * extra.get("mul", 1.0)
    batch = paged_batch(_group(), [((t,), s, e) for t, (s, e) in zip(tables, spans, strict=True)],
                        kc.shape[0], B)
    got = paged_attention(q, kc, vc, batch, softcap=extra.get("softcap"), sinks=extra.get("sinks"))
    reference = _brute_force(q, kc, vc, tables, spans, softcap=extra.get("softcap"), sinks=extra.get("sinks"))
    assert torch.isfinite(got).all()
    # float32 scores of ~1e4 carry ~1e-3 absolute error (SDPA in float32 has the same order)
    torch.testing.assert_close(got.double(), reference, atol=2e-3 if "mul" in extra else 1e-5, rtol=0)


def _hand_batches(batch: PagedBatch) -> list[tuple[str, PagedBatch, type]]:
    """A user-built PagedBatch the kernel would read out of bounds (or misread) without the checks."""
    t, st, pos = batch.tables, batch.starts, batch.positions
    return [
        ("negative block id", PagedBatch(t - 100, st, pos), InvalidIdError),
        ("int64 tables", PagedBatch(t.long(), st, pos), InvalidArgumentError),
        ("transposed tables", PagedBatch(t.repeat(2, 1).t(), torch.tensor([0, 4, 8], dtype=torch.int32),
                                         torch.tensor([0, 0], dtype=torch.int32)), InvalidArgumentError),
        ("positions past the table", PagedBatch(t, st, pos + 1), InvalidArgumentError),
        ("negative position", PagedBatch(t, st, pos - 1), InvalidArgumentError),
        ("starts not from 0", PagedBatch(t, st + 1, pos), InvalidArgumentError),
        ("starts of the wrong length", PagedBatch(t, st[1:], pos), InvalidArgumentError),
        ("negative window", PagedBatch(t, st, pos, window=-3), InvalidArgumentError),
    ]


@pytest.mark.parametrize("case", range(8))
def test_a_hand_built_batch_that_reads_out_of_bounds_is_refused(case) -> None:
    q, kc, vc, tables = _random_case([(0, 8)])
    name, bad, error = _hand_batches(paged_batch(_group(), [((tables[0],), 0, 8)], 64, B))[case]
    if name == "transposed tables":
        q = torch.cat([q, q])
    with pytest.raises(error):
        paged_attention(q, kc, vc, bad)


def test_mismatched_kv_dtypes_and_zero_kv_heads_are_typed_errors() -> None:
    q, kc, vc, tables = _random_case([(0, 8)])
    batch = paged_batch(_group(), [((tables[0],), 0, 8)], 64, B)
    with pytest.raises(InvalidArgumentError):
        paged_attention(q, kc, vc.half(), batch)  # K float32, V float16
    with pytest.raises(InvalidArgumentError):
        paged_attention(q, kc[:, :, :0], vc[:, :, :0], batch)  # Hq % 0


def _bad_arguments(q, kc, vc, batch) -> dict[str, tuple]:
    """What reached the kernel (or Python's arithmetic before it) and failed there with an untyped error:
    ZeroDivisionError for a head dim of 0, TypeError for a window of 1.5 or 2**64, ValueError for a str
    scale; the rest the kernel took silently."""
    t, st, pos = batch.tables, batch.starts, batch.positions
    return {
        "head dim 0": (q[..., :0], kc[..., :0], vc[..., :0], batch, {}),
        "V head dim 0": (q, kc, vc[..., :0], batch, {}),
        "window 1.5": (q, kc, vc, PagedBatch(t, st, pos, window=1.5), {}),
        "window 2**64": (q, kc, vc, PagedBatch(t, st, pos, window=2**64), {}),
        "window True": (q, kc, vc, PagedBatch(t, st, pos, window=True), {}),
        "chunk '8'": (q, kc, vc, PagedBatch(t, st, pos, chunk="8"), {}),
        "str scale": (q, kc, vc, batch, {"scale": "0.5"}),
        "NaN scale": (q, kc, vc, batch, {"scale": float("nan")}),
        "str softcap": (q, kc, vc, batch, {"softcap": "30"}),
        "infinite softcap": (q, kc, vc, batch, {"softcap": float("inf")}),
        "sinks as a list": (q, kc, vc, batch, {"sinks": [0.0] * HQ}),
        "query as a list": (q.tolist(), kc, vc, batch, {}),
        "tables as a list": (q, kc, vc, PagedBatch(t.tolist(), st, pos), {}),
    }


BAD_ARGUMENTS = ("head dim 0", "V head dim 0", "window 1.5", "window 2**64", "window True", "chunk '8'",
                 "str scale", "NaN scale", "str softcap", "infinite softcap", "sinks as a list",
                 "query as a list", "tables as a list")


@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_arguments_are_typed_errors_before_the_kernel(case: str) -> None:
    q, kc, vc, tables = _random_case([(0, 8)])
    batch = paged_batch(_group(), [((tables[0],), 0, 8)], 64, B)
    cases = _bad_arguments(q, kc, vc, batch)
    assert tuple(cases) == BAD_ARGUMENTS
    query, k, v, bad, kwargs = cases[case]
    with pytest.raises(InvalidArgumentError):
        paged_attention(query, k, v, bad, **kwargs)


def test_paged_batch_refuses_what_a_cast_would_pass_as_another_value() -> None:
    """Each of these failed in Python's arithmetic (a block size of 0: ZeroDivisionError) or, worse, was
    cast by torch.tensor(..., dtype=int32) into another batch: a start of 0.5 became 0, a block id of 1.5
    block 1."""
    group, table = _group(), [1, 2]
    with pytest.raises(InvalidArgumentError, match="block_size"):
        paged_batch(group, [((table,), 0, 8)], 64, 0)
    with pytest.raises(InvalidArgumentError, match="num_blocks"):
        paged_batch(group, [((table,), 0, 8)], "64", B)
    with pytest.raises(InvalidArgumentError, match="start"):
        paged_batch(group, [((table,), 0.5, 8)], 64, B)
    with pytest.raises(InvalidIdError):
        paged_batch(group, [(([1.5, 2],), 0, 8)], 64, B)
    with pytest.raises(InvalidIdError):
        paged_batch(group, [(([2**70, 2],), 0, 8)], 64, B)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        new_token_slots(paged_batch(group, [((table,), 0, 8)], 64, B), 0)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, dtype="float32", block_size=B)
    cache = PagedKVCache(spec, 64)
    step = build_step_metadata(cache, spec.groups, [((table,), 0, 8)], "cpu").groups[0]
    with pytest.raises(InvalidArgumentError, match="scaling"):
        gather_attention(torch.zeros(1, HQ, 8, D), cache, 0, step, [0, 8], scaling="0.5")


@pytest.mark.parametrize("softcap", [0.0, -0.0, -30.0, 0])
def test_a_softcap_of_zero_or_below_is_refused_on_both_paths(softcap) -> None:
    """transformers' eager attention computes tanh(s / c) * c (NaN at c = 0, |c|'s values at c < 0) and
    FlashAttention reads 0 as off: a softcap <= 0 has no one meaning, so both engine paths refuse it (the
    kernel used to skip it while the gather path applied it: 1.94 apart). None is off on both."""
    spec = KVCacheSpec(num_layers=1, num_kv_heads=HKV, head_dim=D, dtype="float32", block_size=B)
    cache = PagedKVCache(spec, 64)
    gen = torch.Generator().manual_seed(5)
    cache.k_cache(0).copy_(torch.randn(cache.k_cache(0).shape, generator=gen))
    cache.v_cache(0).copy_(torch.randn(cache.v_cache(0).shape, generator=gen))
    full = [(([1, 2],), 0, 8)]
    q = torch.randn(8, HQ, D, generator=gen)
    gather = build_step_metadata(cache, spec.groups, full, "cpu").groups[0]
    paged = build_step_metadata(cache, spec.groups, full, "cpu", attention="paged").groups[0].paged
    with pytest.raises(InvalidArgumentError, match="softcap"):
        paged_attention(q, cache.k_cache(0), cache.v_cache(0), paged, softcap=softcap)
    with pytest.raises(InvalidArgumentError, match="softcap"):
        gather_attention(q.transpose(0, 1).unsqueeze(0), cache, 0, gather, [0, 8], softcap=softcap)
    for cap in (None, 0.5):  # what is allowed, the two paths compute alike (scores ~3: 0.5 caps them)
        torch.testing.assert_close(
            paged_attention(q, cache.k_cache(0), cache.v_cache(0), paged, softcap=cap),
            gather_attention(q.transpose(0, 1).unsqueeze(0), cache, 0, gather, [0, 8], softcap=cap)[0],
            atol=1e-5, rtol=0)


# ---- the engine with attention="paged" against transformers -------------------------------------------

transformers = pytest.importorskip("transformers")

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402

NEW = 10
DOC = [(7 * i + 3) % 251 for i in range(60)]
PROMPTS = [DOC + [10, 11, 12], DOC[:45] + list(range(150, 170)), [(5 * i + 1) % 256 for i in range(23)]]
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-mistral", "tiny-gemma2", "tiny-gemma3",
          "tiny-gpt-oss", "tiny-gemma4", "tiny-mimo", "tiny-llama4")


@pytest.fixture(scope="module", params=MODELS)
def tiny(request: pytest.FixtureRequest) -> tuple:
    model = load_model(request.param, seed=1).model
    return model, [reference_greedy(model, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("batched_tokens", [256, 8])  # whole prefills; chunks of 8 mixed with decodes
def test_engine_with_paged_attention_matches_transformers(tiny, batched_tokens) -> None:
    model, refs = tiny
    engine = LLMEngine(model, num_blocks=200, block_size=B, keep_logits=True, attention="paged",
                       max_num_batched_tokens=batched_tokens)
    requests = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))
    for req, (tokens, logits) in zip(requests, refs, strict=True):
        assert req.output_token_ids == tokens
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)
    assert engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("attention", ["gather", "paged"])
def test_the_engine_refuses_a_model_s_softcap_of_zero_on_both_paths(attention: str) -> None:
    model = load_model("tiny-gemma2", seed=1).model
    for layer in model.model.layers:  # what transformers' Gemma 2 attention passes as softcap
        layer.self_attn.attn_logit_softcapping = 0.0
    engine = LLMEngine(model, num_blocks=64, block_size=B, attention=attention)
    with pytest.raises(InvalidArgumentError, match="softcap must be a finite number > 0, got 0.0"):
        engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=2))


def test_engine_refuses_an_unknown_attention() -> None:
    model = load_model("tiny-llama", seed=1).model
    with pytest.raises(ConfigError, match="attention must be one of gather, paged"):
        LLMEngine(model, num_blocks=8, block_size=B, attention="flash")
    with pytest.raises(ConfigError, match="float32, float16 or bfloat16"):
        LLMEngine(model, num_blocks=8, block_size=B, attention="paged", kv_dtype=torch.float16)
