"""The reference engine against transformers' own greedy generate (tiny random models, std 0.3 weights).

Every expected token and logit comes from ``model.generate`` with the model's stock ``sdpa`` attention and
its own DynamicCache (no kvpool code), one prompt at a time; expected counts are worked out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from kvpool.engine.engine import LLMEngine, RequestStatus  # noqa: E402
from kvpool.engine.models import load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams, sample  # noqa: E402
from kvpool.errors import InvalidArgumentError, InvalidIdError, OutOfBlocksError  # noqa: E402

BLOCK = 4
NEW = 12
BASE = list(range(7, 47))  # a 40-token prompt (byte ids)
PROMPTS = [
    BASE,  # 10 full blocks
    BASE[:30] + [200, 201, 202, 203, 204],  # shares 30 tokens (7 full blocks) with BASE
    [99, 98, 97, 96, 95, 94, 93],  # short, unrelated
    BASE[:17],  # a prefix of BASE ending mid-block
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


FULL_ATTENTION_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gpt2")  # the windowed ones: test_engine_hybrid.py


@pytest.fixture(scope="module", params=FULL_ATTENTION_MODELS)
def tiny(request: pytest.FixtureRequest) -> tuple:
    """(model, [(reference tokens, reference logits [NEW, V]) per prompt])."""
    model = load_model(request.param, seed=1).model
    refs = [reference_greedy(model, p, NEW) for p in PROMPTS]
    return model, refs


def make_engine(model, num_blocks: int = 64, **kwargs) -> LLMEngine:
    return LLMEngine(model, num_blocks=num_blocks, block_size=BLOCK, keep_logits=True, **kwargs)


def run_all(engine: LLMEngine, prompts: list[list[int]], **params) -> list:
    """Generate, then check the pool is whole again: every block free, invariants intact."""
    params.setdefault("max_new_tokens", NEW)
    requests = engine.generate(prompts, SamplingParams(**params))
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_integrity()
    assert not engine.has_unfinished()
    return requests


def assert_matches(requests: list, refs: list) -> None:
    for req, (tokens, logits) in zip(requests, refs, strict=True):
        assert req.output_token_ids == tokens
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-4, rtol=0)


def test_reference_is_not_degenerate(tiny: tuple) -> None:
    # std 0.3 weights: greedy output varies, so token equality below is a real test
    _, refs = tiny
    assert all(len(set(tokens)) >= 4 and len(tokens) == NEW for tokens, _ in refs)


def test_one_prompt_at_a_time_matches(tiny: tuple) -> None:
    model, refs = tiny
    engine = make_engine(model)
    for prompt, ref in zip(PROMPTS, refs, strict=True):
        assert_matches(run_all(engine, [prompt]), [ref])
        reference_greedy(model, prompt, 2)  # switches the model back to sdpa: the engine must switch again


def test_batch_of_mixed_lengths_and_shared_prefixes_matches(tiny: tuple) -> None:
    model, refs = tiny
    engine = make_engine(model)
    assert_matches(run_all(engine, PROMPTS), refs)
    # all four join in step 1 (40+35+7+17 = 99 <= 256 tokens), before any block is published: no hits
    assert engine.stats.prefix_hit_tokens == 0
    assert engine.stats.generated_tokens == 4 * NEW


def test_chunked_prefill_matches(tiny: tuple) -> None:
    model, refs = tiny
    engine = make_engine(model, max_num_batched_tokens=6)  # 40-token prompt: 7 chunks, 6 sample nothing
    assert_matches(run_all(engine, PROMPTS), refs)


def test_preemption_by_recompute_matches(tiny: tuple) -> None:
    model, refs = tiny
    # 14 blocks: BASE alone needs ceil((40 + 12 - 1) / 4) = 13, so the four together cannot fit
    engine = make_engine(model, num_blocks=14)
    assert_matches(run_all(engine, PROMPTS), refs)
    assert engine.stats.preemptions > 0
    assert engine.stats.peak_blocks_used <= 14


def test_prefix_hits_after_publication(tiny: tuple) -> None:
    model, refs = tiny
    engine = make_engine(model)
    run_all(engine, [PROMPTS[0]])
    # BASE computed 40 + 11 tokens (the last sampled token is never written): 12 full blocks published.
    # PROMPTS[1] shares 30 tokens -> 7 full blocks = 28 tokens hit
    assert_matches(run_all(engine, [PROMPTS[1]]), [refs[1]])
    assert engine.stats.prefix_hit_tokens == 28
    # the same 40-token prompt again: its 10 blocks are cached, but lookup stops at (40 - 1) // 4 = 9 blocks
    # so that the last prompt token is recomputed for the first logits: 36 more hit tokens
    assert_matches(run_all(engine, [PROMPTS[0]]), [refs[0]])
    assert engine.stats.prefix_hit_tokens == 28 + 36


def test_the_engine_publishes_the_hashes_of_its_hasher(tiny: tuple) -> None:
    from kvpool.allocators.hashing import BlockHasher

    model, refs = tiny
    hasher = BlockHasher("blake2b", seed="engine test seed, 16+ bytes", shared=True)
    engine = make_engine(model, hasher=hasher)
    (req,) = run_all(engine, [PROMPTS[0]])
    assert req.output_token_ids == refs[0][0]
    expected = hasher.block_hashes(req.token_ids, BLOCK)
    assert req.block_hashes == expected and len(expected) == (40 + NEW) // BLOCK
    # 40 + 11 tokens were computed (the last sampled one is never written): 12 full blocks published
    assert len(engine.pool.lookup(expected)) == 12
    assert engine.pool.lookup(BlockHasher("blake2b").block_hashes(req.token_ids, BLOCK)) == []  # other root


def test_running_requests_share_published_prefix_blocks(tiny: tuple) -> None:
    model, refs = tiny
    engine = make_engine(model, max_num_batched_tokens=32)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in PROMPTS]
    engine.step()  # BASE alone: 32 of its 40 tokens; its first 8 blocks are published after the forward
    assert engine.stats.prefix_hit_tokens == 0 and engine.pool.num_cached_blocks == 8
    engine.step()
    # budget 32: BASE's last 8 tokens; PROMPTS[1] hits 7 blocks (28 tokens) and computes 7; PROMPTS[2]
    # computes 7; PROMPTS[3] (17 tokens) looks up (17 - 1) // 4 = 4 blocks, hits all 4 and computes 1
    assert engine.stats.prefix_hit_tokens == 28 + 16
    first_block = engine.kv.block_tables(ids[0])[0][0]
    assert engine.pool.ref_count(first_block) == 3  # BASE, PROMPTS[1] and PROMPTS[3] share it
    while engine.has_unfinished():
        engine.step()
    assert_matches([engine.requests[i] for i in ids], refs)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_integrity()


def test_prefix_caching_off_gives_same_tokens_and_no_hits(tiny: tuple) -> None:
    model, refs = tiny
    engine = make_engine(model, enable_prefix_caching=False)
    run_all(engine, [PROMPTS[0]])
    assert_matches(run_all(engine, PROMPTS), refs)
    assert engine.stats.prefix_hit_tokens == 0 and engine.pool.num_cached_blocks == 0


def test_eos_stops_like_transformers(tiny: tuple) -> None:
    model, refs = tiny
    tokens = refs[0][0]
    eos = tokens[5]
    stop = tokens.index(eos)  # first occurrence: transformers stops there too, EOS included
    engine = make_engine(model, eos_token_ids=[eos])
    (req,) = run_all(engine, [PROMPTS[0]])
    assert req.output_token_ids == tokens[:stop + 1]
    (req,) = run_all(engine, [PROMPTS[0]], ignore_eos=True)
    assert req.output_token_ids == tokens


def test_abort_frees_everything(tiny: tuple) -> None:
    model, refs = tiny
    engine = make_engine(model, max_num_seqs=2)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=NEW)) for p in PROMPTS]
    engine.step()
    engine.step()
    running, waiting = engine.requests[ids[0]], engine.requests[ids[3]]
    assert running.status is RequestStatus.RUNNING and engine.kv.num_blocks_held(running.request_id)
    assert waiting.status is RequestStatus.WAITING
    engine.abort(ids[0])
    engine.abort(ids[3])
    assert running.status is waiting.status is RequestStatus.ABORTED
    assert not engine.kv.num_blocks_held(running.request_id)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.pool.check_integrity()
    assert len(running.output_token_ids) < NEW and not waiting.output_token_ids
    for i in (1, 2):  # the others are untouched
        assert engine.requests[ids[i]].output_token_ids == refs[i][0]
    engine.abort(ids[1])  # finished: no-op
    assert engine.requests[ids[1]].status is RequestStatus.FINISHED
    with pytest.raises(InvalidIdError):
        engine.abort(12345)


def test_request_that_can_never_fit_is_refused(tiny: tuple) -> None:
    model, _ = tiny
    engine = make_engine(model, num_blocks=12)
    # 40 + 12 - 1 = 51 tokens need ceil(51 / 4) = 13 blocks > 12
    with pytest.raises(OutOfBlocksError, match="13 blocks"):
        engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=NEW))
    assert not engine.requests and not engine.has_unfinished()
    # 40 + 9 - 1 = 48 tokens = exactly 12 blocks: accepted and run alone
    (req,) = run_all(engine, [PROMPTS[0]], max_new_tokens=9)
    assert len(req.output_token_ids) == 9
    with pytest.raises(InvalidArgumentError):
        engine.add_request([])
    with pytest.raises(InvalidArgumentError, match="max_position_embeddings"):
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=4096))


def test_bad_prompts_are_refused_before_anything_is_queued(tiny: tuple) -> None:
    model, _ = tiny
    engine = make_engine(model)
    # the tiny models' vocabulary is the 256 byte values: 256 and -1 would index outside the embedding
    for bad in ([1, 256], [1, -1], [1, 2.5], ["a"]):
        with pytest.raises(InvalidArgumentError, match="token ids"):
            engine.generate([PROMPTS[2], bad], SamplingParams(max_new_tokens=NEW))
    with pytest.raises(InvalidArgumentError, match="2 prompts but 1"):
        engine.generate([PROMPTS[2], PROMPTS[3]], [SamplingParams()])
    with pytest.raises(InvalidArgumentError, match="empty prompt"):
        engine.generate([PROMPTS[2], []])
    # nothing was queued, no block is held, and the engine still runs
    assert not engine.requests and not engine.has_unfinished()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    (req,) = run_all(engine, [torch.tensor(PROMPTS[2])])  # a 1-D tensor of ids is a prompt too
    assert req.request_id == 0 and len(req.output_token_ids) == NEW


def test_seeded_sampling_is_reproducible_and_survives_preemption(tiny: tuple) -> None:
    model, _ = tiny
    params = dict(temperature=1.0, top_p=0.9, top_k=50, seed=3)
    first = [r.output_token_ids for r in run_all(make_engine(model), PROMPTS, **params)]
    small = make_engine(model, num_blocks=14)
    again = [r.output_token_ids for r in run_all(small, PROMPTS, **params)]
    assert small.stats.preemptions > 0
    assert first == again


def test_sample_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, SamplingParams(), gen) == 1  # greedy: argmax
    # top_k=1 keeps only the argmax; top_p=0.5: softmax = [.032, .644, .087, .237], token 1 alone reaches 0.5
    assert {sample(logits, SamplingParams(temperature=5.0, top_k=1), gen) for _ in range(20)} == {1}
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), gen) for _ in range(20)} == {1}
    # top_p=0.8 keeps tokens 1 and 3 (.644 + .237 = .881 >= .8), never 0 or 2
    assert {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), gen) for _ in range(200)} == {1, 3}
    with pytest.raises(InvalidArgumentError):
        SamplingParams(top_p=0.0)
    for bad in (-1.0, float("nan"), float("inf")):  # NaN would reach torch.multinomial as NaN weights
        with pytest.raises(InvalidArgumentError, match="temperature"):
            SamplingParams(temperature=bad)


def _brute_force_softmax(logits: torch.Tensor, temperature: float) -> list[float]:
    """softmax(logits / T) straight from its definition, exp(l_i / T) / sum_j exp(l_j / T), in 60-digit
    arithmetic with an unbounded exponent (mpmath): no float can overflow or underflow on the way."""
    import mpmath

    with mpmath.workdps(60):
        values = [float(v) for v in logits.double()]
        t = mpmath.mpf(temperature)
        terms = [mpmath.mpf(0) if v == float("-inf") else mpmath.exp(mpmath.mpf(v) / t) for v in values]
        total = mpmath.fsum(terms)
        return [float(term / total) for term in terms]


ULP3 = float(torch.nextafter(torch.tensor(3.0), torch.tensor(4.0)))  # 3 + 2**-22 in float32
SCORES = {
    "near tie": torch.tensor([0.0, 1.0, 3.0, ULP3, float("-inf")]),
    "tie": torch.tensor([2.0, 2.0, -1.0]),
    "large": torch.tensor([100.0, 99.0, 50.0, -80.0]),
    "float16": torch.tensor([1.0, 1.0009765625, -3.0], dtype=torch.float16),  # one fp16 ulp apart
    "bfloat16": torch.tensor([-2.0, 40.0, 39.75], dtype=torch.bfloat16),
}
# accepted temperatures: tiny (past float32's range: 1e-45 is its smallest denormal, 5e-324 float64's), plain
# and huge; logits / T overflowed float32 to inf for the small ones and softmax gave NaN (issue 20, item 8)
TEMPERATURES = [5e-324, 1e-300, 1e-45, 1e-38, 1e-30, 1e-8, 1e-3, 0.7, 1.0, 2.5, 1e10, 1e300, 1.7e308]


@pytest.mark.parametrize("name", sorted(SCORES))
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_sampling_is_the_brute_force_softmax_at_every_temperature(name, temperature) -> None:
    from kvpool.engine.sampling import probabilities

    logits = SCORES[name]
    params = SamplingParams(temperature=temperature, seed=7)
    expected = _brute_force_softmax(logits, temperature)
    got = probabilities(logits, params)
    assert torch.isfinite(got).all() and got.tolist() == pytest.approx(expected, abs=1e-12)
    token = sample(logits, params, params.make_generator())  # never raises, never an impossible token
    assert expected[token] > 0


def test_a_tiny_temperature_is_greedy_and_shares_ties() -> None:
    # T -> 0: softmax(l / T) puts everything on the argmax (shared equally by exact ties)
    gen = torch.Generator().manual_seed(0)
    for temperature in (1e-30, 1e-45, 5e-324):
        params = SamplingParams(temperature=temperature)
        assert {sample(SCORES["near tie"], params, gen) for _ in range(50)} == {3}  # 3 + ulp beats 3.0
        assert {sample(SCORES["tie"], params, gen) for _ in range(200)} == {0, 1}
        # with top-k and top-p as well
        filtered = SamplingParams(temperature=temperature, top_k=2, top_p=0.9)
        assert {sample(SCORES["large"], filtered, gen) for _ in range(50)} == {0}


@pytest.mark.parametrize("temperature", [1e-30, 1e-45])
def test_a_tiny_temperature_does_not_break_the_step(tiny: tuple, temperature: float) -> None:
    # one request's sampling parameters crashed engine.step() for every running request (torch.multinomial
    # on NaN); now it decodes greedily, beside a greedy request, both as transformers' greedy generate
    model, refs = tiny
    engine = make_engine(model)
    cold = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=NEW, temperature=temperature, seed=1))
    other = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=NEW))
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[cold].output_token_ids == refs[0][0]
    assert engine.requests[other].output_token_ids == refs[2][0]


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    from kvpool.cli import main

    code = main(["generate", "--model", "tiny-llama", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_check_json_and_kv_memory_plan(capsys: pytest.CaptureFixture) -> None:
    # tiny-llama keeps 2 layers x 2 KV heads x 16 dims x 4 bytes x 2 (K and V) = 512 B per token, 8 KiB per
    # 16-token block: 2 MiB of KV memory is 256 blocks
    code, out, _ = run_cli(capsys, "--max-new-tokens", "4", "--check", "--json", "--kv-memory", "2MiB")
    result = json.loads(out)
    assert code == 0
    assert result["stats"]["num_blocks"] == 256 and result["stats"]["pool_bytes"] == 2 * 2**20
    assert [r["matches_reference"] for r in result["requests"]] == [True] * 4
    assert all(len(r["output_token_ids"]) == 4 for r in result["requests"])
    # the first two built-in prompts share a ~1,400-byte document: the second hits the published blocks
    assert result["stats"]["prefix_hit_tokens"] > 0 and result["stats"]["prefix_hit_tokens"] % 16 == 0
    assert result["stats"]["generated_tokens"] == 16
    assert result["stats"]["hashing"]["seeded"] and not result["stats"]["hashing"]["shared"]


def test_cli_prompts_and_errors(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    code, out, _ = run_cli(capsys, "--prompt", "zero", "--prompts-file", str(prompts), "--max-new-tokens=2")
    assert code == 0 and out.count("] '") == 3 and "preemptions: 0" in out
    # 'zero' is 4 bytes: 4 + 30 - 1 = 33 tokens need ceil(33 / 16) = 3 blocks; the pool has 2
    code, _, err = run_cli(capsys, "--prompt", "ok", "--prompt", "zero", "--max-new-tokens", "30",
                           "--num-blocks", "2")
    # stderr is not a terminal here: no progress bar, only the one error line, naming prompt 1 and the fix
    assert (code, err) == (2, "kvpool generate: error: prompt 1 (4 tokens) + 30 new tokens need 3 blocks of "
                              "16 tokens, but the pool has 2 blocks ('zero'): pass --num-blocks 3 or more\n")
    code, _, err = run_cli(capsys, "--prompt", "x", "--max-new-tokens", "1", "--num-blocks", "1")
    assert code == 0  # 1 + 1 - 1 = 1 token: 1 block; and no "1 new tokens" anywhere
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    code, _, err = run_cli(capsys, "--prompts-file", str(bad))
    assert (code, err) == (2, f"kvpool generate: error: {bad} is not UTF-8 text (invalid continuation "
                              "byte at byte 3)\n")
    for seed in (str(2**70), "-1"):
        code, _, err = run_cli(capsys, "--seed", seed)
        assert code == 2 and err.count("\n") == 1 and "--seed" in err
    code, _, err = run_cli(capsys, "--seed", str(2**64 - 1), "--prompt", "a", "--prompt", "b")
    assert code == 2 and "seed must be an integer in [0, 18446744073709551615]" in err  # S + 1 is past it
    code, _, err = run_cli(capsys, "--check", "--temperature", "0.5")
    assert code == 2 and "--check" in err
    code, _, err = run_cli(capsys, "--model", str(tmp_path))  # a folder that is not a model
    assert code == 2 and err.count("\n") == 1 and "no config.json" in err
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a config, but no tokenizer or weights
    code, _, err = run_cli(capsys, "--model", str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and f"cannot load a model from {tmp_path}" in err


# ---- issue 9: the reference of --check, the GGUF bar, bad ids and counts, CLI messages ------------------


@torch.inference_mode()
def _argmax_loop(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by brute force: the whole sequence through the stock model each step, no cache,
    no mask, no generate (so no pad-token handling anywhere)."""
    model.set_attn_implementation("sdpa")
    tokens = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([tokens]), use_cache=False).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_reference_treats_token_zero_as_a_token(tiny: tuple) -> None:
    """Issue 9, item 3: generate() with pad_token_id=0 and no mask masked prompt tokens equal to 0, so a
    correct engine was reported as NO. Engine and reference both equal the brute-force argmax loop."""
    model, _ = tiny
    prompt = [97, 98, 0, 99, 100, 0, 0, 101]  # 'ab\0cd\0\0e'
    expected = _argmax_loop(model, prompt, 6)
    assert reference_greedy(model, prompt, 6)[0] == expected
    (req,) = run_all(make_engine(model), [prompt], max_new_tokens=6)
    assert req.output_token_ids == expected


def test_cli_check_of_a_prompt_with_a_nul_byte(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_bytes(b"ab\0cd\n")
    code, out, _ = run_cli(capsys, "--prompts-file", str(prompts), "--check", "--max-new-tokens", "4")
    assert code == 0 and "matches transformers generate: yes" in out


def test_gguf_progress_bar_is_off_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture) -> None:
    """Issue 9, item 14: the loader's own tqdm wrote carriage-return frames into logs."""
    gguf_loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    from kvpool.engine.models import _gguf_bar_only_at_a_terminal

    original = gguf_loader.tqdm
    list(gguf_loader.tqdm(range(3), desc="Converting"))
    assert "\r" in capsys.readouterr().err  # the loader's bar, as it is: frames even into a captured stream
    with _gguf_bar_only_at_a_terminal():
        list(gguf_loader.tqdm(range(3), desc="Converting"))
    assert capsys.readouterr().err == "" and gguf_loader.tqdm is original


@pytest.mark.parametrize("kwargs", [
    {"max_new_tokens": "5"}, {"max_new_tokens": None}, {"max_new_tokens": 2.5}, {"max_new_tokens": True},
    {"top_k": "1"}, {"top_k": True}, {"top_k": 1.0}, {"seed": "1"}, {"seed": 2.5}, {"seed": True},
    {"seed": -1}, {"seed": 2**64}, {"temperature": "x"}, {"temperature": None}, {"temperature": True},
    {"top_p": None}, {"top_p": "0.5"}, {"ignore_eos": 1},
])
def test_sampling_params_refuse_wrong_types(kwargs: dict) -> None:
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kwargs)


def test_sampling_params_take_numpy_scalars_as_their_values() -> None:
    import numpy as np

    params = SamplingParams(max_new_tokens=np.int64(4), top_k=np.int32(2), seed=np.uint64(2**64 - 1),
                            temperature=np.float32(0.5))
    assert params == SamplingParams(max_new_tokens=4, top_k=2, seed=2**64 - 1, temperature=0.5)
    assert type(params.max_new_tokens) is int and params.make_generator().initial_seed() == 2**64 - 1


def test_abort_of_a_bool_is_not_request_1(tiny: tuple) -> None:
    """Issue 9, item 10: abort(True) aborted request 1 (True == 1 as a dict key)."""
    model, _ = tiny
    engine = make_engine(model)
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=2)) for p in PROMPTS[:2]]
    for bad in (True, "1", 1.0, None):
        with pytest.raises(InvalidIdError):
            engine.abort(bad)
    assert all(engine.requests[i].status is RequestStatus.WAITING for i in ids)
    engine.abort(torch.tensor(1))  # a 0-d tensor is the id it holds
    assert engine.requests[1].status is RequestStatus.ABORTED
    engine.abort(0)
    assert not engine.has_unfinished()


def test_engine_refuses_bool_tokens_and_bad_counts(tiny: tuple) -> None:
    model, _ = tiny
    engine = make_engine(model)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        engine.add_request([1, True, 3])
    with pytest.raises(InvalidArgumentError, match="params must be SamplingParams"):
        engine.add_request([1, 2], {"max_new_tokens": 2})
    for kwargs in ({"max_num_batched_tokens": "8"}, {"max_num_seqs": 0}, {"max_num_seqs": True}):
        with pytest.raises(InvalidArgumentError):
            make_engine(model, **kwargs)
    assert not engine.requests
