"""Recurrent hybrids through the runner with their state in pool slots, against transformers' own generate.

The test plays the scheduler by hand over one tiny model per family (kvpool.engine.models
TINY_HYBRID_MODELS, random weights std 0.3, float32): three requests of 40, 29 and 17 tokens prefill in
chunks (16 + 16 + 8, 11 + 18, 17), the third step mixes the last chunk of one request with the decode of the
other two, then every request decodes; the second request is preempted after 6 tokens (its state slot and
blocks freed), decodes no longer while the others go on, and is resumed by recomputing its prompt and the
tokens it already had from scratch, in two chunks, in a fresh state slot. Each request's 32 greedy tokens
must equal transformers' ``generate`` and its logits agree within 1e-3. A negative control zeroes a
request's state slot mid-decode: its logits must then move by more than 1.0 (so the pass above proves the
state is carried in the slot). Four families run by default (Gated DeltaNet, Mamba-2, short conv, Mamba-1);
the other six (KDA with MLA attention among them) are marked slow. The state shapes the spec gives are
checked against transformers' own DynamicCache after a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("transformers")

from kvpool.allocators.block_pool import BlockPool  # noqa: E402
from kvpool.allocators.state_pool import StatePool  # noqa: E402
from kvpool.engine.models import kv_spec, load_model, reference_greedy  # noqa: E402
from kvpool.engine.recurrent import execution_kv_spec, hybrid_spec  # noqa: E402
from kvpool.engine.runner import ModelRunner, StepBatch  # noqa: E402
from kvpool.engine.state_cache import TESTED_TRANSFORMERS, SlotStateCache, SlotStateLayer  # noqa: E402
from kvpool.errors import ConfigError, InvalidArgumentError  # noqa: E402
from kvpool.spec import cdiv  # noqa: E402

BLOCK, NEW = 4, 32
PROMPTS = [[(7 * i + 3) % 251 for i in range(40)], [(5 * i + 1) % 256 for i in range(29)],
           [(11 * i + 9) % 256 for i in range(17)]]
FAST = ("tiny-qwen3-next", "tiny-nemotron-h", "tiny-lfm2", "tiny-jamba")
SLOW = ("tiny-kimi-linear", "tiny-qwen3.5", "tiny-granite-4.0-h", "tiny-bamba", "tiny-olmo-hybrid",
        "tiny-falcon-h1")
FAMILIES = [*FAST, *(pytest.param(name, marks=pytest.mark.slow) for name in SLOW)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Req:
    prompt: list[int]
    out: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    computed: int = 0
    table: list[int] = field(default_factory=list)
    slot: int = -1

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


class Scheduler:
    """The decisions an engine makes, by hand: blocks from a BlockPool, state slots from a StatePool,
    zeroed when taken (a fresh request's state), freed on preemption and finish."""

    def __init__(self, name: str) -> None:
        self.model = load_model(name, seed=1).model
        self.hybrid = hybrid_spec(self.model, block_size=BLOCK)
        spec = execution_kv_spec(self.hybrid, self.model)
        self.runner = ModelRunner(self.model, spec, 64, hybrid=self.hybrid, num_state_slots=4)
        self.blocks = BlockPool(64, enable_caching=False)
        self.slots = StatePool(4, padding_slot=True)

    def admit(self, req: Req) -> None:
        req.slot = self.slots.alloc(1)[0]
        self.runner.recurrent.cache.zero_slots([req.slot])

    def preempt(self, req: Req) -> None:
        self.slots.free([req.slot])
        self.blocks.free(req.table)
        req.slot, req.table, req.computed = -1, [], 0

    def step(self, work: list[tuple[Req, int]]) -> None:
        ids, positions, rows, spans = [], [], [], []
        for req, n in work:
            start, end = req.computed, req.computed + n
            assert end <= len(req.tokens)
            req.table += self.blocks.allocate(cdiv(end, BLOCK) - len(req.table))
            ids += req.tokens[start:end]
            positions += list(range(start, end))
            if end == len(req.tokens):
                rows.append(len(ids) - 1)
            spans.append(((req.table,), start, end))
        logits = self.runner.execute(StepBatch(ids, positions, rows, spans, [r.slot for r, _ in work]))
        sampled = iter(logits)
        for req, n in work:
            req.computed += n
            if req.computed == len(req.tokens):
                row = next(sampled)
                req.out.append(int(row.argmax()))
                req.logits.append(row.float())
        self.slots.check_integrity()

    def decode(self, reqs: list[Req]) -> None:
        live = [r for r in reqs if len(r.out) < NEW]
        if live:
            self.step([(r, 1) for r in live])


def play(sched: Scheduler) -> list[Req]:
    """The scenario of the module docstring."""
    a, b, c = (Req(p) for p in PROMPTS)
    for req in (a, b, c):
        sched.admit(req)
    sched.step([(a, 16), (b, 11)])
    sched.step([(a, 16), (b, 18), (c, 17)])
    sched.step([(a, 8), (b, 1), (c, 1)])  # a's last prefill chunk beside two decodes
    while len(b.out) < 6:
        sched.decode([a, b, c])
    sched.preempt(b)
    for _ in range(3):
        sched.decode([a, c])
    sched.admit(b)  # resumed: recompute prompt + the 6 tokens it had, from scratch, in a fresh slot
    sched.step([(b, 20), (a, 1)])
    sched.step([(b, len(b.tokens) - 20), (a, 1), (c, 1)])
    while any(len(r.out) < NEW for r in (a, b, c)):
        sched.decode([a, b, c])
    for req in (a, b, c):
        sched.slots.free([req.slot])
        sched.blocks.free(req.table)
    assert sched.slots.num_used_slots == 0 and sched.blocks.num_free_blocks == 64
    return [a, b, c]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> tuple[str, Scheduler, list]:
    sched = Scheduler(request.param)
    refs = [reference_greedy(sched.model, p, NEW) for p in PROMPTS]
    return request.param, sched, refs


def test_tokens_and_logits_match_transformers(family: tuple) -> None:
    name, sched, refs = family
    for req, (tokens, logits) in zip(play(sched), refs, strict=True):
        assert req.out == tokens, name
        torch.testing.assert_close(torch.stack(req.logits), logits, atol=1e-3, rtol=0)


def test_zeroed_state_diverges(family: tuple) -> None:
    """The first prompt alone, in two prefill chunks, decoding 12 tokens; then its state slot is zeroed
    and it decodes 4 more: those logits must move by more than 1.0 from transformers', the first 12 not."""
    name, sched, refs = family
    a = Req(PROMPTS[0])
    sched.admit(a)
    sched.step([(a, 24)])
    sched.step([(a, 16)])
    while len(a.out) < 12:
        sched.decode([a])
    sched.runner.recurrent.cache.zero_slots([a.slot])
    while len(a.out) < 16:
        sched.decode([a])
    sched.slots.free([a.slot])
    sched.blocks.free(a.table)
    logits = torch.stack(a.logits)
    torch.testing.assert_close(logits[:12], refs[0][1][:12], atol=1e-3, rtol=0)
    gap = (logits[12:] - refs[0][1][12:16]).abs().max().item()
    assert gap > 1.0, f"{name}: zeroing the state moved the logits by {gap:.3f} only"


def test_spec_shapes_are_transformers_states(family: tuple) -> None:
    from transformers import DynamicCache

    name, sched, _ = family
    cache = DynamicCache(config=sched.model.config)
    sched.model.set_attn_implementation("eager")
    with torch.no_grad():
        sched.model(input_ids=torch.tensor([PROMPTS[2]]), cache=cache, use_cache=True)
    state = sched.hybrid.state
    for layer in state.layers:
        conv, ssm = cache.layers[layer].conv_states[0], cache.layers[layer].recurrent_states[0]
        assert conv.shape[1:] == (state.conv_shape[0], state.conv_kernel), name  # K columns there
        assert (() if ssm is None else tuple(ssm.shape[1:])) == state.ssm_shape, name


def test_the_slot_holds_transformers_own_states(family: tuple) -> None:
    """The third prompt through the runner in two prefill chunks (11 + 6 tokens) leaves in its slot the
    states transformers' own DynamicCache holds after one forward of it (a second model with the same
    weights): the conv state's last K - 1 inputs (the pool keeps K - 1, transformers K) and the SSM state."""
    from transformers import DynamicCache

    name, sched, _ = family
    req = Req(PROMPTS[2])
    sched.admit(req)
    sched.step([(req, 11)])
    sched.step([(req, 6)])
    reference = load_model(name, seed=1).model
    cache = DynamicCache(config=reference.config)
    with torch.no_grad():
        reference(input_ids=torch.tensor([PROMPTS[2]]), cache=cache, use_cache=True)
    pool = sched.runner.recurrent.cache
    for layer in sched.hybrid.state.layers:
        theirs = cache.layers[layer]
        conv = pool.conv_view(layer, req.slot)
        torch.testing.assert_close(conv, theirs.conv_states[0][..., -conv.shape[-1]:], atol=1e-4, rtol=0)
        if pool.ssm is not None:
            torch.testing.assert_close(pool.ssm_view(layer, req.slot), theirs.recurrent_states[0], atol=1e-4,
                                       rtol=0)
    sched.slots.free([req.slot])
    sched.blocks.free(req.table)


def test_the_cache_and_its_layers_are_transformers_own() -> None:
    """Issue 29: transformers 5.25's mixers call ``increase_count`` and ``get_recurrent_states_to_keep``,
    which kvpool's copy of the cache protocol lacked. SlotStateCache is a transformers ``Cache`` and its
    layers ``LinearAttentionLayer``s that define nothing but ``__init__``, so every method of the protocol, of
    this release or a later one, is transformers' own (the two above among them)."""
    from transformers.cache_utils import Cache, LinearAttentionLayer

    sched = Scheduler("tiny-qwen3-next")
    cache = SlotStateCache(sched.runner.recurrent.cache, 1, True)
    assert isinstance(cache, Cache) and issubclass(SlotStateLayer, LinearAttentionLayer)
    for cls in (SlotStateCache, SlotStateLayer):
        assert [k for k, v in vars(cls).items() if callable(v) or isinstance(v, property)] == ["__init__"]
    layer, pool = sched.hybrid.state.layers[0], sched.runner.recurrent.cache
    assert cache.get_conv_state(layer).data_ptr() == pool.conv_view(layer, 1).data_ptr()
    assert not cache.is_recording_past(layer) and cache.has_previous_state(layer)
    if hasattr(Cache, "get_recurrent_states_to_keep"):  # 5.25 and later
        assert cache.get_recurrent_states_to_keep(layer) == 0


def test_the_installed_transformers_is_a_tested_release() -> None:
    """SlotStateLayer fills LinearAttentionLayer's state attributes, which transformers does not document:
    a release not in TESTED_TRANSFORMERS is trusted only once this file passes on it and its name is added
    (a check of the newest releases sees it fail here first)."""
    import transformers

    version = transformers.__version__
    assert version in TESTED_TRANSFORMERS, f"untested transformers {version}"


def test_a_layer_that_keeps_its_states_elsewhere_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release whose layer renamed ``conv_states`` would keep its own zeros and update them, not the pool's
    slot (the engine would run without state): SlotStateLayer refuses it, naming the release."""
    import transformers
    from transformers.cache_utils import LinearAttentionLayer

    original = LinearAttentionLayer.__init__

    def renamed(self: LinearAttentionLayer, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        self._conv_states = self.__dict__.pop("conv_states")

    states = Scheduler("tiny-lfm2").runner.recurrent.cache
    monkeypatch.setattr(LinearAttentionLayer, "__init__", renamed)
    why = rf"transformers {transformers.__version__}'s LinearAttentionLayer has no conv_states: "
    with pytest.raises(ConfigError, match=why + r".* transformers 5.24.0 and 5.25.0"):
        SlotStateCache(states, 1, False)


def test_mamba1_resumes_multi_token_spans_token_by_token() -> None:
    """Jamba: transformers' full-sequence scan ignores a saved state, so a resumed multi-token span run as one
    call would silently restart the state; the runner runs it token by token instead (checked above), and
    this shows the one-call path would indeed differ."""
    sched = Scheduler("tiny-jamba")
    assert not sched.hybrid.state.resumes_multi_token
    states = sched.runner.recurrent
    ids = torch.tensor([PROMPTS[0][:24]])
    mixer = sched.model.model.layers[0].mamba
    hidden = sched.model.model.embed_tokens(ids)
    with torch.no_grad():
        whole = mixer(hidden, cache=SlotStateCache(states.cache, 1, False))
        mixer(hidden[:, :16], cache=SlotStateCache(states.cache, 2, False))
        one_call = mixer(hidden[:, 16:], cache=SlotStateCache(states.cache, 2, True))
    assert (one_call - whole[:, 16:]).abs().max() > 1e-2


def test_runner_refuses_bad_state_batches() -> None:
    sched = Scheduler("tiny-lfm2")
    req = Req(PROMPTS[2])
    sched.admit(req)
    req.table = sched.blocks.allocate(cdiv(17, BLOCK))
    batch = StepBatch(req.prompt, list(range(17)), [16], [((req.table,), 0, 17)])
    with pytest.raises(InvalidArgumentError, match="state slot"):
        sched.runner.execute(batch)
    with pytest.raises(InvalidArgumentError, match="spans"):
        sched.runner.execute(StepBatch(req.prompt, list(range(17)), [16], [((req.table,), 0, 17)], [1, 2]))


@pytest.mark.parametrize("name", ["tiny-jamba", "tiny-bamba", "tiny-falcon-h1", "tiny-lfm2"])
def test_the_engine_refuses_recurrent_models(name: str) -> None:
    """Read as a plain KV spec, Jamba's, Bamba's and Falcon-H1's configs pass as all-attention models (their
    layer types are properties, absent from the dict), and the engine would run their recurrent layers
    with no state at all: kv_spec, which the engine builds its cache from, refuses them."""
    with pytest.raises(ConfigError, match="recurrent state"):
        kv_spec(load_model(name).model, block_size=BLOCK)
