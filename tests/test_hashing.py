"""Chained block hashes: the byte format (rebuilt here with struct and hashlib), chaining, the root (seeded
from configuration, random per process, or public), extra keys (LoRA, salt, multimodal, prompt embeddings)
and their effect on BlockPool hits. Every expected digest is rebuilt here from the documented formula."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool import BlockPool, ConfigError, InvalidArgumentError, block_hashes, hash_block
from kvpool.allocators.hashing import (
    PUBLIC_ROOT,
    SEED_ENV,
    BlockHasher,
    LoRAIdentity,
    adapter_digest,
    block_extra_keys,
    default_hasher,
    embedding_digest,
)


def reference_hash(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """The documented format, built independently: parent || int64le count || int64le tokens || extra."""
    data = parent + struct.pack(f"<q{len(tokens)}q", len(tokens), *tokens) + extra
    return hashlib.blake2b(data, digest_size=16).digest()


def reference_root(seed: bytes) -> bytes:
    """The documented root of a seeded hasher: sha256(b"kvpool block-hash root v1\0" + seed)[:16]."""
    return hashlib.sha256(b"kvpool block-hash root v1\x00" + seed).digest()[:16]


TOKENS = [17, 4, 99_999, 0, 2**40, 5, 6, 7, 8, 9]
SEED = "fleet secret: 0123456789abcdef"


@pytest.fixture(autouse=True)
def no_seed_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the machine's environment says, each test starts with no configured seed."""
    monkeypatch.delenv(SEED_ENV, raising=False)


def public(algorithm: str = "blake2b") -> BlockHasher:
    return BlockHasher(algorithm, shared=True)  # no seed anywhere: the public root


def test_single_block_matches_the_documented_format() -> None:
    assert bytes(16) == PUBLIC_ROOT
    assert public().hash_block(None, [1, 2, 3]) == reference_hash(bytes(16), [1, 2, 3])
    parent = bytes(range(16))
    assert hash_block(parent, [7], hasher=public()) == reference_hash(parent, [7])


def test_block_hashes_chain_full_blocks_only() -> None:
    # 10 tokens, block 4: two full blocks, the 2-token tail gets none
    hashes = block_hashes(TOKENS, 4, hasher=public())
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


def hashes_in_a_subprocess(env: dict[str, str]) -> list[str]:
    """The default hasher's hashes of TOKENS (block size 2) computed by a fresh Python process."""
    code = ("import json; from kvpool import block_hashes; "
            f"print(json.dumps([h.hex() for h in block_hashes({TOKENS!r}, 2)]))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full_env = {k: v for k, v in os.environ.items() if k != SEED_ENV} | env
    out = subprocess.run([sys.executable, "-c", code], env=full_env, cwd=root, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


def test_processes_agree_exactly_when_they_share_a_seed() -> None:
    seeded = BlockHasher(seed=SEED)  # the default algorithm of a process-local hasher, as in the subprocess
    here = [h.hex() for h in seeded.block_hashes(TOKENS, 2)]
    # the same KVPOOL_HASH_SEED in another process (with its own PYTHONHASHSEED): the same hashes
    assert hashes_in_a_subprocess({SEED_ENV: SEED, "PYTHONHASHSEED": "1"}) == here
    # no seed: a random root per process, even with the same PYTHONHASHSEED (which vLLM would use as seed)
    a, b = (hashes_in_a_subprocess({"PYTHONHASHSEED": "0"}) for _ in range(2))
    assert a != b and here not in (a, b)
    assert [h.hex() for h in default_hasher().block_hashes(TOKENS, 2)] not in (a, b)


def test_a_seeded_root_follows_the_documented_formula() -> None:
    root = reference_root(SEED.encode())
    for algorithm, digest in [("sha256", lambda d: hashlib.sha256(d).digest()[:16]),
                              ("blake2b", lambda d: hashlib.blake2b(d, digest_size=16).digest())]:
        hasher = BlockHasher(algorithm, seed=SEED)
        first = digest(root + struct.pack("<q4q", 4, *TOKENS[:4]))
        assert hasher.block_hashes(TOKENS, 4) == [first, digest(first + struct.pack("<q4q", 4, *TOKENS[4:8]))]
        from_bytes = BlockHasher(algorithm, seed=SEED.encode())
        assert hasher.block_hashes(TOKENS, 4) == from_bytes.block_hashes(TOKENS, 4)
        assert (hasher.seeded, hasher.seed_source, hasher.cryptographic) == (True, "argument", True)


def test_the_environment_seed_is_the_argument_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SEED_ENV, SEED)
    from_env = BlockHasher("sha256", shared=True)
    assert from_env.block_hashes(TOKENS, 2) == BlockHasher("sha256", seed=SEED).block_hashes(TOKENS, 2)
    assert (from_env.seeded, from_env.seed_source) == (True, "KVPOOL_HASH_SEED")
    assert BlockHasher("sha256", seed="another secret, 16+ bytes").seed_source == "argument"  # argument wins


def test_an_unseeded_local_hasher_has_a_random_root_and_a_shared_one_the_public_root() -> None:
    a, b = BlockHasher("sha256"), BlockHasher("sha256")
    assert a.block_hashes(TOKENS, 2) != b.block_hashes(TOKENS, 2)
    assert (a.seeded, a.seed_source, a.shared) == (True, "random", False)
    shared = BlockHasher("sha256", shared=True)
    assert shared.hash_block(None, [1]) == hashlib.sha256(bytes(16) + struct.pack("<qq", 1, 1)).digest()[:16]
    assert (shared.seeded, shared.seed_source, shared.shared) == (False, "none", True)


def test_the_algorithm_auto_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = importlib.util.find_spec("xxhash") is not None
    assert BlockHasher().algorithm == ("xxh3_128" if installed else "sha256")
    assert BlockHasher(shared=True).algorithm == "sha256"  # hashes that leave the process: cryptographic
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xxhash" else
                        real_find_spec(name, *a))
    assert BlockHasher().algorithm == "sha256"


def test_xxh3_128_uses_the_same_bytes() -> None:
    xxhash = pytest.importorskip("xxhash")
    root = reference_root(SEED.encode())
    hasher = BlockHasher("xxh3_128", seed=SEED)
    data = root + struct.pack("<q4q", 4, *TOKENS[:4])
    assert hasher.hash_block(None, TOKENS[:4]) == xxhash.xxh3_128_digest(data)
    fast = hasher.block_hashes(TOKENS, 4)
    assert fast[1] == xxhash.xxh3_128_digest(fast[0] + struct.pack("<q4q", 4, *TOKENS[4:8]))
    assert fast != BlockHasher("blake2b", seed=SEED).block_hashes(TOKENS, 4)
    assert not hasher.cryptographic


def test_the_seed_and_root_never_show(tmp_path: Path) -> None:
    hasher = BlockHasher("sha256", seed=SEED, shared=True)
    shown = repr(hasher) + json.dumps(hasher.describe())
    root = reference_root(SEED.encode())
    assert SEED not in shown and root.hex() not in shown and str(root) not in shown
    assert hasher.describe() == {"algorithm": "sha256", "cryptographic": True, "seeded": True,
                                 "seed_source": "argument", "shared": True}
    copy = pickle.loads(pickle.dumps(hasher))  # a worker process gets the same hashes (and so the root)
    assert copy.block_hashes(TOKENS, 2) == hasher.block_hashes(TOKENS, 2) and repr(copy) == repr(hasher)


def test_an_attacker_without_the_root_cannot_aim_at_a_cached_block() -> None:
    # The attacker knows the format, the algorithm and the victim's likely prompt, and computes its block
    # hashes offline with the public root. Against an unseeded shared pool they match the pool's index
    # (a guessed prompt is confirmed, and with a weak hash a collision can be searched for offline);
    # against a seeded pool they match nothing.
    victim_prompt = list(range(1000, 1064))
    offline = public("sha256").block_hashes(victim_prompt, 16)
    for hasher, expected_hits in [(public("sha256"), 4), (BlockHasher("sha256", seed=SEED, shared=True), 0),
                                  (BlockHasher("sha256"), 0)]:
        pool = BlockPool(8)
        blocks = pool.allocate(4)
        pool.cache_blocks(blocks, hasher.block_hashes(victim_prompt, 16))
        assert len(pool.lookup(offline)) == expected_hits


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"seed": "short"}, "at least 16 bytes"), ({"seed": ""}, "at least 16 bytes"),
    ({"seed": 1234567890123456789}, "str or bytes"), ({"algorithm": "md5"}, "unknown hash algorithm"),
    ({"algorithm": "xxh3_128", "shared": True}, "need a secret seed"), ({"shared": 1}, "bool"),
])
def test_bad_hash_configuration_is_a_config_error(kwargs: dict, why: str) -> None:
    if kwargs.get("algorithm") == "xxh3_128":
        pytest.importorskip("xxhash")
    with pytest.raises(ConfigError, match=why):
        BlockHasher(**kwargs)


def test_a_short_environment_seed_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SEED_ENV, "")
    with pytest.raises(ConfigError, match="KVPOOL_HASH_SEED"):
        BlockHasher()
    monkeypatch.setenv(SEED_ENV, "0123456789abcdef")  # exactly 16 bytes: accepted, and shared xxh3 too
    assert BlockHasher(shared=True).seeded


def test_a_seed_that_is_not_utf8_is_its_own_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # $KVPOOL_HASH_SEED of random bytes (not UTF-8) reaches Python as surrogate escapes; encoding it as UTF-8
    # raised UnicodeEncodeError (a traceback from every command). The root is the bytes' formula's.
    secret = bytes(range(128, 160))  # 32 bytes, none valid UTF-8 on its own
    monkeypatch.setenv(SEED_ENV, secret.decode("utf-8", "surrogateescape"))
    from_env = BlockHasher("sha256", shared=True)
    root = reference_root(secret)
    assert from_env.block_hashes(TOKENS, 4)[0] == hashlib.sha256(root + struct.pack("<q4q", 4, *TOKENS[:4])
                                                                 ).digest()[:16]
    with pytest.raises(ConfigError, match="surrogate"):
        BlockHasher(seed="\ud800" * 16)


# ---- extra keys -----------------------------------------------------------------------------------------


def test_extra_keys_encoding_is_unambiguous() -> None:
    # Each pair has equal str()/concatenation but different structure: all hashes must differ.
    keys = [("a", "bc"), ("ab", "c"), (1,), ("1",), (True,), (b"1",), ((1, 2),), (1, 2), (), ("",)]
    hashes = {hash_block(None, [1], k) for k in keys} | {hash_block(None, [1])}
    assert len(hashes) == len(keys) + 1


def test_extra_keys_enter_the_hash_in_the_documented_form() -> None:
    # ("lora", 3, "ab"): tuple "(", str "s4:lora", int "i3;", str "s2:ab", ")".
    expected = reference_hash(bytes(16), [5], b"(s4:lorai3;s2:ab)")
    assert public().hash_block(None, [5], ("lora", 3, "ab")) == expected
    # a LoRA key shared by every block (encoded once) gives what encoding each block alone gives
    key = LoRAIdentity("sql", path="/a").key()
    assert public().block_hashes([1, 2, 3, 4], 2, extra_keys=[(key,), (key,)]) == \
        public().block_hashes([1, 2, 3, 4], 2, extra_keys=[(key,), (("lora", "sql", "/a", ""),)])
    # identity, never equality: (True,) and (1,) are equal tuples but different keys
    assert public().block_hashes([1, 2, 3, 4], 2, extra_keys=[(True,), (1,)])[1] != \
        public().block_hashes([1, 2, 3, 4], 2, extra_keys=[(True,), (True,)])[1]


def test_block_extra_keys_for_lora_salt_and_multimodal() -> None:
    # 40 tokens, block 16: full blocks cover positions 0-15 and 16-31 (the tail 32-39 gets no hash).
    # Image "img" spans tokens 10..21: block 0 starts 10 tokens before it (offset -10), block 1 6 after.
    # Item "late" (32..35) lies only in the partial tail; item "early" (0..3) only in block 0 (offset 0).
    keys = block_extra_keys(40, 16, lora=LoRAIdentity("sql", path="/adapters/sql"), cache_salt="tenant-a",
                            mm_items=[("img", 10, 12), ("late", 32, 4), ("early", 0, 4)])
    lora = ("lora", "sql", "/adapters/sql", "")
    assert keys == [
        (lora, ("salt", "tenant-a"), ("mm", "img", -10), ("mm", "early", 0)),
        (lora, ("mm", "img", 6)),
    ]
    assert block_extra_keys(32, 16, lora=LoRAIdentity("sql", digest="sha256:ab")) == [
        (("lora", "sql", "", "sha256:ab"),)] * 2
    assert block_extra_keys(40, 16) == [None, None]
    # a continuation from block 1 keeps absolute positions and no salt
    assert block_extra_keys(16, 16, cache_salt="s", mm_items=[("img", 10, 12)], start_block=1) == [
        (("mm", "img", 6),)]


@pytest.mark.parametrize("variant", [
    {"lora": LoRAIdentity("sql", path="/adapters/sql-v2")},  # the same name re-pointed at other weights
    {"lora": LoRAIdentity("chat", path="/adapters/sql")},
    {"lora": LoRAIdentity("sql", path="/adapters/sql", digest="sha256:01")},
    {"cache_salt": "tenant-b"}, {"mm_items": [("other-image", 4, 8)]}, {"mm_items": [("image", 5, 8)]},
    {"prompt_embeds": torch.zeros(20, 4)}, {},
])
def test_extra_keys_separate_pool_hits(variant: dict) -> None:
    tokens = list(range(64))  # 4 blocks of 16; placeholder tokens for the image are the same in every variant
    base = {"lora": LoRAIdentity("sql", path="/adapters/sql"), "cache_salt": "tenant-a",
            "mm_items": [("image", 4, 8)]}

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
    lambda: block_hashes([1, 2, 3], 1, extra_keys=[None, None]),
    lambda: block_hashes([1], 1, extra_keys=[(1.5,)]),
    lambda: hash_block(None, [1], ({"a": 1},)),
    lambda: block_extra_keys(16, 16, lora=(7, "sql")),  # an id and a name say nothing about the weights
    lambda: LoRAIdentity("sql"),
    lambda: LoRAIdentity("", path="/a"),
    lambda: LoRAIdentity("sql", path=""),
    lambda: LoRAIdentity("sql", digest=b"\x01"),
    lambda: block_extra_keys(16, 16, prompt_embeds=[[0.0]] * 16),
    lambda: embedding_digest([1.0, 2.0]),
    lambda: block_hashes([1, 2], 2**63),
    lambda: block_hashes([1, 2], True),
    lambda: block_hashes(torch.tensor([True, False]), 1),
    lambda: block_hashes(torch.tensor([1.0, 2.0]), 1),
], ids=["block0", "block-float", "token-float", "token-str", "token-overflow", "parent-short", "parent-str",
        "extra-length", "extra-float", "extra-dict", "lora-tuple", "lora-no-weights", "lora-no-name",
        "lora-empty-path", "lora-bytes-digest", "embeds-list", "digest-list", "block-past-int64",
        "block-bool", "token-bool-tensor", "token-float-tensor"])
def test_bad_input_raises_invalid_argument(call) -> None:
    with pytest.raises(InvalidArgumentError):
        call()


def test_extra_keys_may_cover_the_partial_tail_block() -> None:
    # 5 tokens, block 2: 2 full blocks, 3 blocks in all; both lengths are accepted, the tail entry ignored.
    assert block_hashes([1, 2, 3, 4, 5], 2, extra_keys=[None, ("x",), ("tail",)]) == \
        block_hashes([1, 2, 3, 4, 5], 2, extra_keys=[None, ("x",)])


# ---- LoRA identity and prompt embeddings ------------------------------------------------------------------


def test_adapter_digest_of_a_file_and_a_folder(tmp_path: Path) -> None:
    one = tmp_path / "a" / "adapter_model.safetensors"
    one.parent.mkdir()
    one.write_bytes(b"weights-v1")
    (tmp_path / "a" / "adapter_config.json").write_text('{"r": 8}')
    # a file: len(b"") = 0, the size 10, then the bytes; a folder: each file by relative path, in sorted order
    q = lambda n: struct.pack("<q", n)  # noqa: E731
    assert adapter_digest(one) == "sha256:" + hashlib.sha256(q(0) + q(10) + b"weights-v1").hexdigest()
    expected = hashlib.sha256(q(19) + b"adapter_config.json" + q(8) + b'{"r": 8}'
                              + q(25) + b"adapter_model.safetensors" + q(10) + b"weights-v1").hexdigest()
    assert adapter_digest(tmp_path / "a") == "sha256:" + expected
    copy = tmp_path / "b"
    copy.mkdir()
    for f in (tmp_path / "a").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert LoRAIdentity.from_files("sql", copy) == LoRAIdentity.from_files("sql", tmp_path / "a")
    (copy / "adapter_model.safetensors").write_bytes(b"weights-v2")  # rewritten in place
    assert LoRAIdentity.from_files("sql", copy) != LoRAIdentity.from_files("sql", tmp_path / "a")
    with pytest.raises(FileNotFoundError):
        adapter_digest(tmp_path / "missing")


def test_prompt_embedding_digests_per_block() -> None:
    embeds = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)  # 20 embedded prompt tokens
    # 40 tokens, block 16: block 0 covers embeddings 0..15, block 1 embeddings 16..19 (+ 12 generated tokens)
    keys = block_extra_keys(40, 16, prompt_embeds=embeds)

    def digest(rows: torch.Tensor) -> bytes:  # dtype, shape, then the raw float32 bytes (from numpy)
        header = f"torch.float32|{tuple(rows.shape)}|".encode()
        return hashlib.sha256(header + rows.numpy().tobytes()).digest()

    assert keys == [(("embeds", digest(embeds[:16])),), (("embeds", digest(embeds[16:20])),)]
    assert block_extra_keys(48, 16, prompt_embeds=embeds)[2] is None  # block 2 starts after the embeddings
    changed = embeds.clone()
    changed[17, 1] += 1.0
    new = block_extra_keys(40, 16, prompt_embeds=changed)
    assert new[0] == keys[0] and new[1] != keys[1]
    assert embedding_digest(embeds.t().contiguous().t()) == embedding_digest(embeds)  # layout does not matter
    assert embedding_digest(embeds.to(torch.bfloat16)) != embedding_digest(embeds.to(torch.float16))
    tokens = [0] * 40  # placeholder token ids: only the embeddings tell two such prompts apart
    assert block_hashes(tokens, 16, extra_keys=keys)[1] != block_hashes(tokens, 16, extra_keys=new)[1]


# ---- where the hashes go: one rule for the engine, the request path and the command line (issue 30) -----

def test_hasher_for_defaults_to_a_shared_hasher_only_where_hashes_leave() -> None:
    from kvpool.allocators.hashing import hasher_for, hashes_leave_process

    assert not hashes_leave_process() and not hashes_leave_process(media=["host"])
    assert hashes_leave_process(events=True) and hashes_leave_process(media=["host", "disk"])
    assert hasher_for(None) is default_hasher()  # nothing leaves: the process-local default
    assert hasher_for(None, media=["host"]) is default_hasher()
    assert hasher_for(None, events=True).shared and hasher_for(None, media=["remote"]).shared
    local, shared = BlockHasher(), BlockHasher(shared=True)
    assert hasher_for(local, media=["host"]) is local and hasher_for(shared, media=["disk"]) is shared
    with pytest.raises(ConfigError, match="KV events carry block hashes out of this process"):
        hasher_for(local, events=True)
    with pytest.raises(ConfigError, match="a disk tier, a remote tier carry"):
        hasher_for(local, media=["host", "remote", "disk"])


def test_the_request_path_refuses_a_process_local_hasher_whose_hashes_leave(tmp_path: Path) -> None:
    """KVCacheManager, which engines are built on, holds the rule the engine held alone: its events or a
    disk tier carry the hashes out of the process, where a random root matches no other process's."""
    from kvpool.events import KVEventSink, QueueEventPublisher
    from kvpool.requests.kv_manager import KVCacheManager
    from kvpool.spec import KVCacheGroup, LayerKind
    from kvpool.tiers.auth import TierKey
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.file import FileTier
    from kvpool.tiers.host import HostTier

    groups = (KVCacheGroup(0, LayerKind.FULL, None, (0,), 1, 4),)
    sink = KVEventSink(QueueEventPublisher(), block_size=4)
    with pytest.raises(ConfigError, match="shared hasher"):
        KVCacheManager(groups, 16, hasher=BlockHasher(), event_sink=sink)
    KVCacheManager(groups, 16, hasher=BlockHasher(shared=True), event_sink=sink)
    ns = Namespace("model", "none", "hash-only", hash_scheme="test")
    disk = FileTier(tmp_path, ns, capacity_bytes=10**6, block_bytes=0,
                    auth_key=TierKey("kvpool tests: a tier key of 16+ bytes"))
    kv = KVCacheManager(groups, 16, hasher=BlockHasher())
    with pytest.raises(ConfigError, match="a disk tier carry block hashes"):
        kv.attach_tiers([disk])
    assert kv.tiers is None  # nothing attached
    kv.attach_tiers([HostTier(8, ns)])  # host memory is this process's: any hasher
    disk.close()
