"""Sizing the memory of an attention / recurrent hybrid, both ways the serving engines do it (pure functions).

**One pool (vLLM).** Attention pages and state pages come from one block pool, so they must be the same
size. vLLM (``HybridAttentionMambaModelConfig.verify_and_update_config``) grows the attention block until a
page of one attention layer holds one layer's state, in multiples of the kernel alignment A (16 tokens; 64
for MLA backends)::

    block_size = A x cdiv(state_page, A x attn_page_per_token)       prefix caching off
    block_size = C x cdiv(cdiv(state_page, attn_page_per_token), C)   "align" mode, C = lcm(chunk, A)

and pads the state page up to the attention page (``mamba_page_size_padded``). Layers are then split into
KV cache groups of one size (the rule of :func:`kvpool.spec.kv_cache_groups`); a pool block holds one
group's layers. A request holds ``cdiv(tokens, block_size)`` blocks in each attention group and one state
block per recurrent group (two in "align" mode, plus one per speculative token: ``MambaSpec``); block 0 is
the null block.

**Two pools (SGLang).** A state pool of fixed slots beside the token KV pool, split by
``mamba_full_memory_ratio`` r (default 0.9): ``state_memory = memory x r / (1 + r)``, ``state_slots =
state_memory // state_bytes_per_request``, the rest to KV tokens of the attention layers; running requests
are capped at ``state_slots // 3`` with the radix cache (+2 with its extra buffer and the overlap scheduler,
+1 without overlap; 1 without a radix cache) and by SGLang's default ``min(max(tokens / context x 512,
2048), 4096)`` (``model_runner_kv_cache_mixin.py``). SGLang keeps SSM states in float32 by default: build
the spec with ``ssm_dtype="float32"`` to size it as SGLang would.

:func:`plan_state_memory` computes both for one model, memory budget and context length;
:meth:`StatePlan.lines` is what ``kvpool plan`` can print.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm
from typing import Any

from kvpool.errors import ConfigError, InsufficientMemoryError
from kvpool.numeric import as_int, as_real
from kvpool.spec.kv import AttentionKind, cdiv
from kvpool.spec.state import HybridSpec
from kvpool.units import human_bytes

#: vLLM's attention kernel alignment of the block size: FlashAttention / FlashInfer 16, MLA backends 64.
ALIGNMENT = {AttentionKind.MHA: 16, AttentionKind.MLA: 64}
#: SGLang's defaults: mamba_full_memory_ratio, running requests per state slot with a radix cache.
SGLANG_RATIO = 0.9
SGLANG_SLOTS_PER_REQUEST = 3


def group_size(counts: list[int]) -> int:
    """Layer slots of one KV cache group for kinds of ``counts`` layers: the fewest, or the most when that
    is under 1.5x the fewest (the rule of :func:`kvpool.spec.kv_cache_groups`, vLLM's uniform page)."""
    return max(counts) if max(counts) < 1.5 * min(counts) else min(counts)


@dataclass(frozen=True)
class SinglePoolPlan:
    """vLLM's one pool for a hybrid (see the module docstring). Bytes are per rank.

    Attributes:
        block_size: attention tokens per block (grown to hold a state page).
        attn_page_bytes: one attention layer's page, ``block_size x bytes per layer-token``.
        state_page_bytes: one recurrent layer's state of one request, unpadded.
        group_size: layer slots per block; attention_groups / state_groups: groups of each kind.
        block_bytes: ``group_size x attn_page_bytes``.
        num_blocks: blocks the memory holds (block 0 is the null block).
        state_blocks_per_request: blocks of state one request holds (pages per state x state groups).
    """

    block_size: int
    attn_page_bytes: int
    state_page_bytes: int
    group_size: int
    attention_groups: int
    state_groups: int
    block_bytes: int
    num_blocks: int
    state_blocks_per_request: int

    @property
    def padding_bytes(self) -> int:
        """Bytes of each state page that hold nothing: ``attn_page_bytes - state_page_bytes``."""
        return self.attn_page_bytes - self.state_page_bytes

    def blocks_per_request(self, tokens: int) -> int:
        """Blocks one request of ``tokens`` tokens holds: ``attention_groups x cdiv(tokens, block_size)``
        plus its state blocks."""
        return self.attention_groups * cdiv(tokens, self.block_size) + self.state_blocks_per_request

    def max_requests(self, tokens: int) -> int:
        """Requests of ``tokens`` tokens that fit at once: ``(num_blocks - 1) // blocks_per_request``."""
        return (self.num_blocks - 1) // self.blocks_per_request(tokens)


@dataclass(frozen=True)
class TwoPoolPlan:
    """SGLang's state pool beside a token KV pool (see the module docstring). Bytes are per rank.

    Attributes:
        ratio: ``mamba_full_memory_ratio``.
        state_slots: state slots (SGLang's ``max_mamba_cache_size``); state_bytes: their memory.
        kv_tokens: token slots of the attention KV; kv_bytes: their memory.
        max_running_requests: the cap from the state slots and SGLang's default.
    """

    ratio: float
    state_slots: int
    state_bytes: int
    kv_tokens: int
    kv_bytes: int
    max_running_requests: int

    def max_requests(self, tokens: int) -> int:
        """Requests of ``tokens`` tokens that run at once: ``min(max_running_requests, kv_tokens //
        tokens)``."""
        return min(self.max_running_requests, self.kv_tokens // tokens)


def plan_single_pool(spec: HybridSpec, memory_bytes: int, *, block_size: int | None = None,
                     prefix_caching: bool = False, chunk_size: int | None = None,
                     alignment: int | None = None, speculative_tokens: int = 0) -> SinglePoolPlan:
    """vLLM's single pool for ``spec`` in ``memory_bytes`` (see the module docstring).

    ``block_size``: the user's; kept when at least the grown one (vLLM overrides it otherwise).
    ``prefix_caching``: vLLM's "align" mode, which needs ``chunk_size`` (the Mamba kernel chunk, 256 for
    Mamba-2). ``alignment``: :data:`ALIGNMENT` of the attention kind unless given.

    Raises:
        ConfigError: a model without attention layers, prefix caching without a chunk size, bad numbers.
        InsufficientMemoryError: fewer than two blocks (the null block and one more) fit.
    """
    attention = _attention(spec)
    memory_bytes = as_int(memory_bytes, "memory_bytes", minimum=1, error=ConfigError)
    align = as_int(ALIGNMENT[attention.attention] if alignment is None else alignment, "alignment",
                   minimum=1, error=ConfigError)
    per_token, state_page = attention.bytes_per_layer_token, spec.state.bytes_per_layer
    if prefix_caching:
        if chunk_size is None:
            raise ConfigError("prefix caching ('align' mode) needs the recurrent kernel's chunk_size")
        chunk = lcm(as_int(chunk_size, "chunk_size", minimum=1, error=ConfigError), align)
        grown = chunk * cdiv(cdiv(state_page, per_token), chunk)
    else:
        grown = align * cdiv(state_page, align * per_token)
    if block_size is not None:
        grown = max(grown, as_int(block_size, "block_size", minimum=1, error=ConfigError))
    counts = [attention.num_layers, spec.state.num_layers]
    size = group_size(counts)
    page = grown * per_token
    block_bytes = size * page
    num_blocks = memory_bytes // block_bytes
    if num_blocks < 2:
        raise InsufficientMemoryError(f"{human_bytes(memory_bytes)} holds {num_blocks} block(s) of "
                                      f"{human_bytes(block_bytes)}; the null block and one more need "
                                      f"{human_bytes(2 * block_bytes)}")
    pages = (2 if prefix_caching else 1) + as_int(speculative_tokens, "speculative_tokens", minimum=0,
                                                 error=ConfigError)
    state_groups = cdiv(spec.state.num_layers, size)
    return SinglePoolPlan(grown, page, state_page, size, cdiv(attention.num_layers, size), state_groups,
                          block_bytes, num_blocks, pages * state_groups)


def plan_two_pools(spec: HybridSpec, memory_bytes: int, context_len: int, *, ratio: float = SGLANG_RATIO,
                   radix_cache: bool = True, extra_buffer: bool = False, overlap: bool = True
                   ) -> TwoPoolPlan:
    """SGLang's two pools for ``spec`` in ``memory_bytes`` (see the module docstring). ``context_len``
    enters SGLang's default cap on running requests.

    Raises:
        ConfigError: a model without attention layers, a ratio not > 0, bad numbers.
        InsufficientMemoryError: no state slot or no KV token fits.
    """
    attention = _attention(spec)
    memory_bytes = as_int(memory_bytes, "memory_bytes", minimum=1, error=ConfigError)
    context_len = as_int(context_len, "context_len", minimum=1, error=ConfigError)
    ratio = as_real(ratio, "ratio", minimum=0.0, open_min=True, finite=True, error=ConfigError)
    per_request = spec.state_bytes_per_request
    slots = int(memory_bytes * ratio / (1 + ratio) // per_request)
    kv_tokens = (memory_bytes - slots * per_request) // attention.bytes_per_token
    if slots < 1 or kv_tokens < 1:
        raise InsufficientMemoryError(f"{human_bytes(memory_bytes)} at ratio {ratio:g} holds {slots} state "
                                      f"slot(s) of {human_bytes(per_request)} and {kv_tokens} KV token(s)")
    per_slot = 1 if not radix_cache else SGLANG_SLOTS_PER_REQUEST + (0 if not extra_buffer else
                                                                     2 if overlap else 1)
    default = min(max(int(kv_tokens / context_len * 512), 2048), 4096)
    return TwoPoolPlan(ratio, slots, slots * per_request, kv_tokens, kv_tokens * attention.bytes_per_token,
                       min(default, slots // per_slot))


@dataclass(frozen=True)
class StatePlan:
    """Both sizings of one hybrid for one memory budget and context length (what ``kvpool plan`` shows)."""

    spec: HybridSpec
    memory_bytes: int
    context_len: int
    single: SinglePoolPlan
    two: TwoPoolPlan

    def lines(self) -> list[str]:
        """The plan for people: state per request and its KV-token equivalent, vLLM's block size and
        padding, SGLang's split, and the requests of ``context_len`` tokens each fits."""
        spec, single, two, n = self.spec, self.single, self.two, self.context_len
        state = spec.state
        shapes = (f"conv {list(state.conv_shape)} {state.conv_dtype_name}, "
                  f"ssm {list(state.ssm_shape)} {state.ssm_dtype_name}")
        padding = 100 * single.padding_bytes / single.state_page_bytes
        groups = (f"{single.attention_groups} attention + {single.state_groups} state groups of "
                  f"{single.group_size} layers")
        return [
            f"recurrent state: {state.num_layers} {state.kind.value} layers x "
            f"{human_bytes(state.bytes_per_layer)} ({shapes}) = {human_bytes(spec.state_bytes_per_request)} "
            f"per request",
            f"attention KV: {human_bytes(spec.kv_bytes_per_token)} per token; one state = "
            f"{spec.kv_token_equivalent:,.0f} tokens of KV",
            f"vLLM one pool: block size {single.block_size} tokens (a {human_bytes(single.attn_page_bytes)} "
            f"page per layer holds one state of {human_bytes(single.state_page_bytes)}, padded by "
            f"{human_bytes(single.padding_bytes)} = {padding:.2f}%); {groups}; {single.num_blocks:,} blocks "
            f"of {human_bytes(single.block_bytes)}; {single.max_requests(n):,} requests of {n:,} tokens",
            f"SGLang two pools (ratio {two.ratio:g}): {two.state_slots:,} state slots "
            f"({human_bytes(two.state_bytes)}) + {two.kv_tokens:,} KV tokens ({human_bytes(two.kv_bytes)}); "
            f"{two.max_requests(n):,} requests of {n:,} tokens (running cap {two.max_running_requests:,})",
        ]


def plan_state_memory(spec: HybridSpec, memory_bytes: int, context_len: int, *, block_size: int | None = None,
                      prefix_caching: bool = False, chunk_size: int | None = None,
                      ratio: float = SGLANG_RATIO) -> StatePlan:
    """Both sizings (:func:`plan_single_pool`, :func:`plan_two_pools`) of ``spec`` for a budget of
    ``memory_bytes`` (per rank, what is left for KV and state) and requests of ``context_len`` tokens.
    Raises as those two do."""
    context_len = as_int(context_len, "context_len", minimum=1, error=ConfigError)
    single = plan_single_pool(spec, memory_bytes, block_size=block_size, prefix_caching=prefix_caching,
                              chunk_size=chunk_size)
    return StatePlan(spec, memory_bytes, context_len, single, plan_two_pools(spec, memory_bytes, context_len,
                                                                             ratio=ratio))


def _attention(spec: HybridSpec):  # noqa: ANN202 - a KVCacheSpec
    if spec.attention is None:
        raise ConfigError(f"{spec.model_type} has no attention layers: its memory is state slots only "
                          f"({human_bytes(spec.state_bytes_per_request)} per request)")
    return spec.attention


def state_report(hybrid: HybridSpec, kv_bytes: int, max_model_len: int | None) -> dict[str, Any]:
    """A hybrid's recurrent state per request, and (with ``max_model_len``) :class:`StatePlan`'s lines for
    ``kv_bytes`` of memory: the ``recurrent_state`` object of ``--json``."""
    state = hybrid.state
    report: dict[str, Any] = {
        "kind": state.kind.value, "num_layers": state.num_layers, "layers": list(state.layers),
        "conv_shape": list(state.conv_shape), "ssm_shape": list(state.ssm_shape),
        "conv_dtype": state.conv_dtype_name, "ssm_dtype": state.ssm_dtype_name,
        "bytes_per_layer": state.bytes_per_layer, "bytes_per_request": hybrid.state_bytes_per_request,
        "kv_token_equivalent": hybrid.kv_token_equivalent,
        "attention_layers": list(hybrid.attention_layers),
    }
    if max_model_len is not None:
        report["sizing"] = plan_state_memory(hybrid, kv_bytes, max_model_len).lines()[2:]  # both ways
    return report
