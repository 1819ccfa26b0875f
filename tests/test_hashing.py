"""Chained block hashes: the byte format (rebuilt here with struct and hashlib), chaining, determinism across
processes, extra keys (LoRA, salt, multimodal) and their effect on BlockPool hits."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from kvpool import BlockPool, InvalidArgumentError, block_hashes, hash_block
from kvpool.allocators.hashing import ROOT_HASH, _digest_fn, block_extra_keys, resolved_algorithm


def reference_hash(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """The documented format, built independently: parent || int64le count || int64le tokens || extra."""
    data = parent + struct.pack(f"<q{len(tokens)}q", len(tokens), *tokens) + extra
    return hashlib.blake2b(data, digest_size=16).digest()


TOKENS = [17, 4, 99_999, 0, 2**40, 5, 6, 7, 8, 9]


def test_single_block_matches_the_documented_format() -> None:
    assert bytes(16) == ROOT_HASH
    assert hash_block(None, [1, 2, 3], algorithm="blake2b") == reference_hash(bytes(16), [1, 2, 3])
    parent = bytes(range(16))
    assert hash_block(parent, [7], algorithm="blake2b") == reference_hash(parent, [7])


def test_block_hashes_chain_full_blocks_only() -> None:
    # 10 tokens, block 4: two full blocks, the 2-token tail gets none
    hashes = block_hashes(TOKENS, 4, algorithm="blake2b")
    first = reference_hash(bytes(16), TOKENS[0:4])
    assert hashes == [first, reference_hash(first, TOKENS[4:8])]
    assert block_hashes(TOKENS[:3], 4) == []


def test_changing_a_token_changes_its_block_and_every_later_one() -> None:
    base = block_hashes(TOKENS[:8] + [1, 2, 3, 4], 4)
    changed = block_hashes(TOKENS[:5] + [123] + TOKENS[6:8] + [1, 2, 3, 4], 4)  # token 5 lies in block 1
    assert changed[0] == base[0]
    assert changed[1] != base[1] and changed[2] != base[2]


def test_continuation_with_parent_equals_one_pass() -> None:
    tokens = list(range(100, 124))
    head = block_hashes(tokens[:8], 4)
    assert head + block_hashes(tokens[8:], 4, parent=head[-1]) == block_hashes(tokens, 4)


def test_tensor_and_list_inputs_hash_alike() -> None:
    assert block_hashes(torch.tensor(TOKENS), 4) == block_hashes(TOKENS, 4)


def test_hashes_are_the_same_in_another_process_with_another_hash_seed() -> None:
    code = ("import json; from kvpool import block_hashes; hs = block_hashes("
            f"{TOKENS!r}, 2, extra_keys=[('lora', 1, 'x')] * 5); print(json.dumps([h.hex() for h in hs]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         check=True)
    here = [h.hex() for h in block_hashes(TOKENS, 2, extra_keys=[("lora", 1, "x")] * 5)]
    assert json.loads(out.stdout) == here


def test_xxh3_128_uses_the_same_bytes() -> None:
    xxhash = pytest.importorskip("xxhash")
    data = bytes(16) + struct.pack("<q4q", 4, *TOKENS[:4])
    assert hash_block(None, TOKENS[:4], algorithm="xxh3_128") == xxhash.xxh3_128_digest(data)
    fast = block_hashes(TOKENS, 4, algorithm="xxh3_128")
    assert fast[1] == xxhash.xxh3_128_digest(fast[0] + struct.pack("<q4q", 4, *TOKENS[4:8]))
    assert fast != block_hashes(TOKENS, 4, algorithm="blake2b")


def test_auto_is_xxh3_when_installed_else_blake2b(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = importlib.util.find_spec("xxhash") is not None
    assert resolved_algorithm() == ("xxh3_128" if installed else "blake2b")
    assert block_hashes(TOKENS, 4) == block_hashes(TOKENS, 4, algorithm=resolved_algorithm())
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xxhash" else
                        real_find_spec(name, *a))
    _digest_fn.cache_clear()
    try:
        assert resolved_algorithm() == "blake2b"
        assert block_hashes(TOKENS, 4) == block_hashes(TOKENS, 4, algorithm="blake2b")
    finally:
        monkeypatch.undo()
        _digest_fn.cache_clear()
    assert resolved_algorithm() == ("xxh3_128" if installed else "blake2b")


# ---- extra keys -----------------------------------------------------------------------------------------


def test_extra_keys_encoding_is_unambiguous() -> None:
    # Each pair has equal str()/concatenation but different structure: all hashes must differ.
    keys = [("a", "bc"), ("ab", "c"), (1,), ("1",), (True,), (b"1",), ((1, 2),), (1, 2), (), ("",)]
    hashes = {hash_block(None, [1], k) for k in keys} | {hash_block(None, [1])}
    assert len(hashes) == len(keys) + 1


def test_extra_keys_enter_the_hash_in_the_documented_form() -> None:
    # ("lora", 3, "ab"): tuple "(", str "s4:lora", int "i3;", str "s2:ab", ")".
    expected = reference_hash(bytes(16), [5], b"(s4:lorai3;s2:ab)")
    assert hash_block(None, [5], ("lora", 3, "ab"), algorithm="blake2b") == expected


def test_block_extra_keys_for_lora_salt_and_multimodal() -> None:
    # 40 tokens, block 16: full blocks cover positions 0-15 and 16-31 (the tail 32-39 gets no hash).
    # Image "img" spans tokens 10..21: block 0 starts 10 tokens before it (offset -10), block 1 6 after.
    # Item "late" (32..35) lies only in the partial tail; item "early" (0..3) only in block 0 (offset 0).
    keys = block_extra_keys(40, 16, lora=(7, "sql"), cache_salt="tenant-a",
                            mm_items=[("img", 10, 12), ("late", 32, 4), ("early", 0, 4)])
    assert keys == [
        (("lora", 7, "sql"), ("salt", "tenant-a"), ("mm", "img", -10), ("mm", "early", 0)),
        (("lora", 7, "sql"), ("mm", "img", 6)),
    ]
    assert block_extra_keys(40, 16) == [None, None]
    # a continuation from block 1 keeps absolute positions and no salt
    assert block_extra_keys(16, 16, cache_salt="s", mm_items=[("img", 10, 12)], start_block=1) == [
        (("mm", "img", 6),)]


@pytest.mark.parametrize("variant", [
    {"lora": (2, "sql")}, {"lora": (1, "chat")}, {"cache_salt": "tenant-b"},
    {"mm_items": [("other-image", 4, 8)]}, {"mm_items": [("image", 5, 8)]}, {},
])
def test_extra_keys_separate_pool_hits(variant: dict) -> None:
    tokens = list(range(64))  # 4 blocks of 16; placeholder tokens for the image are the same in every variant
    base = {"lora": (1, "sql"), "cache_salt": "tenant-a", "mm_items": [("image", 4, 8)]}

    def hashes(**kw: object) -> list[bytes]:
        return block_hashes(tokens, 16, extra_keys=block_extra_keys(len(tokens), 16, **kw))

    pool = BlockPool(8)
    blocks = pool.allocate(4)
    pool.cache_blocks(blocks, hashes(**base))
    assert pool.lookup(hashes(**base)) == blocks
    assert pool.lookup(hashes(**{**base, **variant})) == ([] if variant else blocks)


def test_salt_in_block_zero_separates_every_block_through_the_chain() -> None:
    tokens = list(range(48))
    a = block_hashes(tokens, 16, extra_keys=block_extra_keys(48, 16, cache_salt="a"))
    b = block_hashes(tokens, 16, extra_keys=block_extra_keys(48, 16, cache_salt="b"))
    assert all(x != y for x, y in zip(a, b, strict=True))


# ---- errors ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call", [
    lambda: block_hashes([1, 2], 0),
    lambda: block_hashes([1, 2], 1.5),
    lambda: block_hashes([1, 2.5], 1),
    lambda: block_hashes(["1"], 1),
    lambda: block_hashes([2**63], 1),
    lambda: block_hashes([1, 2], 1, parent=b"short"),
    lambda: block_hashes([1, 2], 1, parent="0" * 16),
    lambda: block_hashes([1, 2], 1, algorithm="md5"),
    lambda: block_hashes([1, 2, 3], 1, extra_keys=[None, None]),
    lambda: block_hashes([1], 1, extra_keys=[(1.5,)]),
    lambda: hash_block(None, [1], ({"a": 1},)),
], ids=["block0", "block-float", "token-float", "token-str", "token-overflow", "parent-short", "parent-str",
        "algorithm", "extra-length", "extra-float", "extra-dict"])
def test_bad_input_raises_invalid_argument(call) -> None:
    with pytest.raises(InvalidArgumentError):
        call()


def test_extra_keys_may_cover_the_partial_tail_block() -> None:
    # 5 tokens, block 2: 2 full blocks, 3 blocks in all; both lengths are accepted, the tail entry ignored.
    assert block_hashes([1, 2, 3, 4, 5], 2, extra_keys=[None, ("x",), ("tail",)]) == \
        block_hashes([1, 2, 3, 4, 5], 2, extra_keys=[None, ("x",)])
