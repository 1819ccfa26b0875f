"""LLMEngine runs the tiny attention / recurrent hybrids with their state in the state pool, against
transformers' own greedy ``generate``.

Per family of ``TINY_HYBRID_MODELS`` (random weights std 0.3, float32, block size 4), one engine run of four
requests at ``max_num_seqs`` 3 under a 16-token step budget: prompts of 40, 29, 17 and 30 tokens, the
second sharing the first's first 20 tokens and the fourth its first 24, so prefills run in chunks beside
decodes, the pool of 30 blocks runs short (preemptions: a preempted request frees its state slot and is
recomputed), and with ``interval=2`` saves into 32 checkpoint slots (never all used) the second and fourth
requests start from a state checkpoint (at 16 and 24 tokens: the last even block boundary that their cached
KV reaches). Every request's 32 greedy
tokens must equal transformers' and its logits agree within 1e-3.

Restores are exact: a prompt's state saved at 24 tokens, restored into a fresh slot for a second prompt
that continues it by 10 tokens, gives transformers' full-recompute logits (1e-3). Negative controls: a
request whose state slot is zeroed mid-decode, and a restore that zeroes instead of copying (2 tokens before
the first sampled logits), must move the logits by more than 1.0 (so the passes above prove the state is
carried and restored).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvpool.engine.engine import LLMEngine  # noqa: E402
from kvpool.engine.models import TINY_HYBRID_MODELS, load_model, reference_greedy  # noqa: E402
from kvpool.engine.sampling import SamplingParams  # noqa: E402
from kvpool.errors import ConfigError  # noqa: E402

NEW = 32
P0 = [(7 * i + 3) % 251 for i in range(40)]
PROMPTS = [P0, P0[:20] + [(5 * i + 1) % 256 for i in range(9)], [(11 * i + 9) % 256 for i in range(17)],
           P0[:24] + [(13 * i + 2) % 256 for i in range(6)]]
CONTINUED = P0[:24] + [(3 * i + 5) % 256 for i in range(10)]
SHORT = CONTINUED[:26]  # 2 tokens past the restore: a short convolution's whole state (LFM2's: 2 inputs)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model: object, **kwargs: object) -> LLMEngine:
    options = dict(num_blocks=30, block_size=4, max_num_batched_tokens=16, max_num_seqs=3, keep_logits=True,
                   state_save="interval=2", state_checkpoints=32)
    return LLMEngine(model, **{**options, **kwargs})


@pytest.fixture(scope="module", params=TINY_HYBRID_MODELS)
def family(request: pytest.FixtureRequest) -> tuple[str, object, list]:
    model = load_model(request.param, seed=1).model
    refs = [reference_greedy(model, p, NEW) for p in PROMPTS]
    return request.param, model, refs


def test_tokens_and_logits_match_transformers(family: tuple) -> None:
    name, model, refs = family
    engine = _engine(model)
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    for req, (tokens, logits) in zip(done, refs, strict=True):
        assert req.output_token_ids == tokens, name
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-3, rtol=0)
    stats = engine.states.stats
    assert engine.stats.preemptions > 0 and stats.restored >= 2 and stats.evicted == 0, name
    # the KV of 20 shared tokens reaches block 5: the second request restores at block 4 and recomputes 4
    assert [r.num_cached_tokens for r in done] == [0, 16, 0, 24] and stats.kv_only_tokens == 4
    assert stats.peak_request_slots == 3 and engine.states.num_request_slots == 0
    assert engine.states.pool.num_used_slots == len(engine.states.checkpoints) == stats.saved
    engine.kv_manager.check_integrity()


def _continued(model: object, engine: LLMEngine, prompt: list[int] = CONTINUED) -> tuple[list, list]:
    """P0 alone (saved at 8, 16, 24, 32, 40 tokens), then ``prompt``, which restores the 24-token state."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    engine.generate([P0], SamplingParams(max_new_tokens=1, ignore_eos=True))
    (req,) = engine.generate([prompt], params)
    assert req.num_cached_tokens == 24
    return req.output_token_ids, torch.stack(req.logits)


def test_a_restored_state_is_a_full_recompute(family: tuple) -> None:
    name, model, _ = family
    tokens, logits = _continued(model, _engine(model))
    ref_tokens, ref_logits = reference_greedy(model, CONTINUED, 4)
    assert tokens == ref_tokens, name
    torch.testing.assert_close(logits, ref_logits, atol=1e-3, rtol=0)


class _ZeroingMover:
    """A restore that forgets to copy: the destination slot is zeroed instead."""

    def __init__(self, cache: object) -> None:
        self.cache = cache

    def zero_slots(self, slots: list[int]) -> None:
        self.cache.zero_slots(slots)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        self.cache.zero_slots([dst for _, dst in pairs])


def test_negative_controls_diverge(family: tuple) -> None:
    name, model, refs = family
    engine = _engine(model)
    engine.states.mover = _ZeroingMover(engine.runner.recurrent.cache)
    _, logits = _continued(model, engine, SHORT)
    gap = (logits - reference_greedy(model, SHORT, 4)[1]).abs().max().item()
    assert gap > 1.0, f"{name}: a restore that zeroed the state moved the logits by {gap:.3f} only"

    engine = _engine(model)
    rid = engine.add_request(P0, SamplingParams(max_new_tokens=16, ignore_eos=True))
    req = engine.requests[rid]
    while len(req.output_token_ids) < 12:
        engine.step()
    engine.runner.recurrent.cache.zero_slots([engine.states.slot(req)])
    while engine.has_unfinished():
        engine.step()
    logits = torch.stack(req.logits)
    torch.testing.assert_close(logits[:12], refs[0][1][:12], atol=1e-3, rtol=0)
    gap = (logits[12:] - refs[0][1][12:16]).abs().max().item()
    assert gap > 1.0, f"{name}: zeroing the state slot moved the logits by {gap:.3f} only"


def test_without_prefix_caching_every_state_starts_from_zero() -> None:
    model = load_model("tiny-lfm2", seed=1).model
    engine = _engine(model, enable_prefix_caching=False)
    done = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [r.output_token_ids for r in done] == [reference_greedy(model, p, 8)[0] for p in PROMPTS[:2]]
    assert engine.states.stats.saved == 0 and len(engine.states.checkpoints) == 0
    assert [r.num_cached_tokens for r in done] == [0, 0]


def test_bad_state_options() -> None:
    model = load_model("tiny-lfm2", seed=1).model
    with pytest.raises(ConfigError, match="state_save interval"):
        _engine(model, state_save="interval=0")
    with pytest.raises(ConfigError, match="state_checkpoints must be"):
        _engine(model, state_checkpoints=-1)
    with pytest.raises(ConfigError, match="one rank"):  # KDA: its state is not sharded under TP
        _engine(load_model("tiny-kimi-linear", seed=1).model, tp_size=2)
    # the KV pool's policy orders the checkpoints too: a fresh one of its name
    engine = _engine(model, policy="fifo")
    assert engine.states.checkpoints.policy.name == "fifo" and engine.states.checkpoints.policy is not \
        engine.pool.policy


def test_cli_generate_runs_a_hybrid(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvpool.cli import main

    doc = "A state pool keeps one slot per request beside the paged KV."
    argv = ["generate", "--model", "tiny-lfm2", "--max-new-tokens", "6", "--block-size", "4",
            "--max-batched-tokens", "16", "--state-save", "dense", "--check", "--json",
            "--prompt", f"{doc} Why?", "--prompt", f"{doc} How?"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    state = out["stats"]["recurrent_state"]
    assert all(r["matches_reference"] for r in out["requests"])
    assert state["state_save"] == "dense" and state["state_slots_used"] == 0
    assert state["checkpoints_saved"] > 0 and out["stats"]["prefix_hit_tokens"] > 0
    assert main(["generate", "--model", "tiny-lfm2", "--state-save", "interval=0"]) == 2
    assert "--state-save interval must be" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["tail+junction", "interval=2"])
def test_the_replay_makes_the_engines_pool_calls(policy: str) -> None:
    """The engine and a replay of its requests (the clock gives back the engine's tokens) with the same
    save policy and checkpoint slots make the same block pool calls and the same hits: the replay's state
    counts are the engine's."""
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.engine.distributed import RecordingPool
    from kvpool.requests import Request
    from kvpool.trace.replayer import ReplayConfig, Replayer

    model = load_model("tiny-lfm2", seed=1).model
    hasher = BlockHasher("sha256", shared=True)
    engine = _engine(model, hasher=hasher, state_save=policy, state_checkpoints=6)
    engine_log = engine.kv_manager.wrap_pool(lambda pool: RecordingPool(pool, on_check=lambda: None))
    done = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    outputs = {r.request_id: r.output_token_ids for r in done}
    config = ReplayConfig(block_size=4, num_blocks=30, timing="trace", max_batched_tokens=16, max_running=3,
                          state_save=policy, state_checkpoints=6)
    replayer = Replayer([Request(i, p, NEW) for i, p in enumerate(PROMPTS)], config, hasher=hasher,
                        next_token=lambda req: outputs[req.request_id][req.num_output_tokens])
    replay_log = replayer.kv.wrap_pool(lambda pool: RecordingPool(pool, on_check=lambda: None))
    result = replayer.run(0.0)
    assert engine.stats.preemptions > 0 and replay_log.log == engine_log.log
    assert result.hit_blocks * 4 == sum(r.num_cached_tokens for r in done) > 0
    assert result.checkpoints_saved == engine.states.stats.saved
    assert result.checkpoint_hits == engine.states.stats.restored
    assert result.kv_only_tokens == engine.states.stats.kv_only_tokens


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-qwen3-next"])
@pytest.mark.parametrize(("checkpoints", "state_tiers", "hit", "from_tier"),
                         [(16, True, 40, 0), (4, True, 40, 1), (4, False, 0, 0)])
def test_kv_from_a_tier_is_reused_only_with_its_state(name: str, checkpoints: int, state_tiers: bool,
                                                      hit: int, from_tier: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt at a time on a 14-block device pool over a host tier: X (40 shared tokens + 3) saves its
    state every 2 blocks (8 .. 40 tokens), U (51 unrelated tokens) evicts X's KV to the host tier and saves
    6 states of its own; Y (the 40 shared tokens + 5) finds their KV in the host tier. With 16 checkpoint
    slots X's 40-token state is still held: Y restores KV from the host and the state from the device, 40
    tokens. With 4, U's saves evicted X's states from the device into the checkpoints' host tier: Y restores
    the 40-token state from there, 40 tokens. The control skips the checkpoints' tier (the state chain made
    empty): the KV in the tier is no hit without its state (0 tokens, 40 counted as KV only), never a wrong
    restore. Every way the tokens are transformers' (LFM2: conv states only; Qwen3-Next: conv and float32
    delta-rule states, both in the rows)."""
    from kvpool.allocators.hashing import BlockHasher
    from kvpool.engine import state_tiers as made
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.host import HostTier

    if not state_tiers:
        monkeypatch.setattr(made, "checkpoint_tiers", lambda *args, **kwargs: [])
    model = load_model(name, seed=1).model
    shared = list(range(30, 70))
    x, u, y = shared + [1, 2, 3], [200 - i for i in range(51)], shared + [9, 8, 7, 6, 5]
    engine = _engine(model, num_blocks=14, hasher=BlockHasher("sha256", shared=True),
                     state_checkpoints=checkpoints)
    namespace = Namespace.for_cache(engine.cache, model=name)
    engine.enable_offload([HostTier(64, namespace, like=engine.cache)])
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    done = [engine.generate([p], params)[0] for p in (x, u, y)]
    assert [r.output_token_ids for r in done] == [reference_greedy(model, p, 6)[0] for p in (x, u, y)]
    assert done[2].num_cached_tokens == hit
    assert engine.kv_manager.hits_by_place()["host"] == hit // 4
    assert engine.states.stats.kv_only_tokens == 40 - hit
    assert engine.states.stats.tier_restored == from_tier
    engine.offload.close()
    engine.kv_manager.check_integrity()


def _raise_in_conv1d_init(*args: object, **kwargs: object) -> None:
    raise RuntimeError("no\nmemory")  # a two-line message: the report keeps one line


@pytest.mark.parametrize("where", ["forward", "load"])
def test_cli_reports_an_error_inside_transformers_in_one_line(where: str, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29: transformers 5.25's mixers called a cache method kvpool's cache lacked, and ``kvpool
    generate`` died with a traceback. An exception raised in transformers' code, in the forward (a method the
    mixers call taken off transformers' Cache) or while the model is built (a torch layer failing in its
    constructor), is one line naming the model and the transformers version, exit status 1."""
    import transformers
    from transformers.cache_utils import Cache

    from kvpool.cli import main

    if where == "forward":
        monkeypatch.delattr(Cache, "update_conv_state")
        why = "AttributeError: 'SlotStateCache' object has no attribute 'update_conv_state'"
    else:
        monkeypatch.setattr(torch.nn.Conv1d, "__init__", _raise_in_conv1d_init)
        why = "RuntimeError: no memory"
    code = main(["generate", "--model", "tiny-lfm2", "--max-new-tokens", "2", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"kvpool generate: error: tiny-lfm2 failed inside transformers "
                                    f"{transformers.__version__}: {why}")


def test_an_error_of_kvpool_inside_the_forward_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only transformers' own errors are reported as the model's: one raised by kvpool's code that
    transformers calls (here the mixer's per-span cache) is a kvpool bug and propagates as it is."""
    from kvpool.cli import main
    from kvpool.engine import recurrent

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a kvpool bug")

    monkeypatch.setattr(recurrent.SlotStateCache, "__init__", broken)
    with pytest.raises(RuntimeError, match="a kvpool bug"):
        main(["generate", "--model", "tiny-lfm2", "--max-new-tokens", "2", "--prompt", "hi"])
