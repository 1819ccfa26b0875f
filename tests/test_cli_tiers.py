"""``kvpool generate`` and ``kvpool replay`` with tiers: tokens identical to transformers with a device pool
too small for the shared prefix, two processes sharing one Redis, the replay identity (an unbounded lower
tier hits what an unbounded pool hits), a sweep's plot, and one clear line (exit 2) for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.cli import main

pytest.importorskip("redis")

ROOT = Path(__file__).resolve().parents[1]
SHARED = "A KV cache keeps keys and values of tokens seen."  # 48 bytes = 12 blocks of 4 byte-tokens
PROMPTS = [SHARED + " first?", "z" * 52, SHARED + " second one?"]
TINY = ["--model", "tiny-llama", "--block-size", "4", "--num-blocks", "17", "--max-new-tokens", "6",
        "--threads", "1"]


#: One fleet secret: the hash root's seed, and the tier key derived from it.
FLEET = {"KVPOOL_HASH_SEED": "kvpool tests: the fleet's secret"}


def kvpool(*args: str, timeout: float = 300, env: dict[str, str] = FLEET) -> subprocess.CompletedProcess:
    """The CLI in a process of its own (this checkout's code), as a user runs it, with ``env`` added."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run([sys.executable, "-m", "kvpool", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


# ---- generate -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_generate_hits_the_host_and_disk_tiers_and_matches_transformers(prompts_file: Path, tmp_path: Path
                                                                         ) -> None:
    done = kvpool("generate", *TINY, "--prompts-file", str(prompts_file), "--host-blocks", "4",
                  "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "1MiB", "--check", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert all(r["matches_reference"] for r in out["requests"])
    hits = out["stats"]["tier_hits"]
    # the third prompt's 12 shared blocks: the 52-byte prompt pushed them off the 17-block device
    assert hits["host"] > 0 and hits["disk"] > 0 and hits["device"] + hits["host"] + hits["disk"] == 12
    assert out["stats"]["hashing"]["shared"] is True  # a disk tier keeps hashes beyond the process


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiers_under_tensor_parallelism_hit_as_one_process(prompts_file: Path, tmp_path: Path) -> None:
    """Two ranks, each with its own host and disk tiers (namespaces name the rank): the same tier hits as
    one process, and transformers' tokens."""
    options = ("--prompts-file", str(prompts_file), "--host-blocks", "4", "--check", "--json")
    one = kvpool("generate", *TINY, *options, "--disk-dir", str(tmp_path / "d1"), "--disk-bytes", "1MiB")
    two = kvpool("generate", *TINY, *options, "--disk-dir", str(tmp_path / "d2"), "--disk-bytes", "1MiB",
                 "--tp-size", "2")
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    a, b = json.loads(one.stdout), json.loads(two.stdout)
    assert all(r["matches_reference"] for r in b["requests"])
    assert [r["output_token_ids"] for r in b["requests"]] == [r["output_token_ids"] for r in a["requests"]]
    assert b["stats"]["tier_hits"] == a["stats"]["tier_hits"] and b["stats"]["tier_hits"]["host"] > 0
    assert b["stats"]["tp_size"] == 2 and len(list((tmp_path / "d2").iterdir())) == 2  # a folder per rank


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_gemma3_270m_finds_its_windows_in_the_host_tier(tmp_path: Path) -> None:
    """Gemma 3 270M (5 sliding groups of window 512, 1 full) on a device that holds one ~1,200-token
    prompt: an unrelated prompt of that length pushes the document out, and the third prompt restores its
    prefix from the host tier, the sliding groups only their window: tokens as transformers'."""
    from kvpool.engine.models import _DOCUMENT, gemma3_folder

    gemma3_folder()
    document = " ".join([_DOCUMENT] * 5)
    other = " ".join(reversed(document.split()))
    prompts = tmp_path / "p.txt"
    prompts.write_text(f"{document} Why are KV blocks shared?\n{other}\n{document} What is a block table?\n")
    done = kvpool("generate", "--model", "gemma3-270m", "--prompts-file", str(prompts), "--max-new-tokens",
                  "8", "--max-batched-tokens", "64", "--num-blocks", "300", "--host-blocks", "600", "--check",
                  "--json", timeout=1100)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [r["matches_reference"] for r in out["requests"]] == [True] * 3
    assert out["stats"]["tier_hits"]["host"] > 0


@pytest.mark.slow
def test_two_processes_share_one_redis(prompts_file: Path, tmp_path: Path) -> None:
    from redis_servers import redis_server

    with redis_server(tmp_path / "redis") as server:
        first = kvpool("generate", *TINY, "--prompts-file", str(prompts_file), "--remote", server.url,
                       "--write-through", "--json")
        assert first.returncode == 0, first.stderr
        second = kvpool("generate", *TINY, "--prompts-file", str(prompts_file), "--remote", server.url,
                        "--check", "--json")
        assert second.returncode == 0, second.stderr
        # the same hashes (the same seed) but another tier key: a process that is not of this fleet (or a
        # forger) finds the fleet's keys, but no value verifies: it hits only what it stored itself, as the
        # first process did (prompt 3's 12 shared blocks)
        stranger = kvpool("generate", *TINY, "--prompts-file", str(prompts_file), "--remote", server.url,
                          "--check", "--json", env={**FLEET, "KVPOOL_TIER_KEY": "another fleet's tier key"})
        assert stranger.returncode == 0, stranger.stderr
    c = json.loads(stranger.stdout)
    assert all(r["matches_reference"] for r in c["requests"])
    assert sum(c["stats"]["tier_hits"].values()) == 12
    assert c["stats"]["tiers"]["remote"]["unauthenticated"] > 0
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert [r["output_token_ids"] for r in a["requests"]] == [r["output_token_ids"] for r in b["requests"]]
    assert all(r["matches_reference"] for r in b["requests"])
    # the first finds only prompt 3's 12 shared blocks (device or its own remote writes); the second finds
    # the first's blocks of every prompt: 13 + 12 + 14 full blocks of the first 54, 51, 59 tokens
    assert sum(a["stats"]["tier_hits"].values()) == 12
    assert sum(b["stats"]["tier_hits"].values()) == 13 + 12 + 14 and b["stats"]["tier_hits"]["remote"] >= 13
    assert b["stats"]["tiers"]["remote"]["misses"] == 0


@pytest.mark.parametrize("options, message", [
    (["--remote", "http://localhost:1"], "bad Redis URL"),
    (["--remote", "redis://localhost"], "give the port"),
    (["--disk-dir", "/proc/version/sub", "--disk-bytes", "1MiB"], "--disk-dir"),
    (["--disk-dir", "x"], "a disk tier needs --disk-dir and one size: --disk-bytes or --disk-blocks"),
    (["--write-through"], "need a tier"),
    (["--tier-admission", "2"], "need a tier"),
])
def test_generate_refuses_bad_tier_options_in_one_line(options: list[str], message: str, capsys) -> None:
    assert main(["generate", *TINY, "--prompt", "hi", *options]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("command", [["generate", *TINY, "--prompt", "hi"], ["replay", "--num-blocks", "64"]])
@pytest.mark.parametrize("tier", [["--disk-dir", "{tmp}/d", "--disk-{size}", "1024"],
                                  ["--remote", "redis://127.0.0.1:1"]])
def test_tiers_that_leave_the_process_need_a_tier_secret(command: list[str], tier: list[str], tmp_path: Path,
                                                         monkeypatch, capsys) -> None:
    # Without a secret a disk or Redis tier's values could be forged by whoever can write the medium: the
    # run is refused in one line (before a model or a trace loads), naming the variables to set.
    monkeypatch.delenv("KVPOOL_TIER_KEY", raising=False)
    monkeypatch.delenv("KVPOOL_HASH_SEED", raising=False)
    size = "bytes" if command[0] == "generate" else "blocks"
    argv = [*command, *(a.format(tmp=tmp_path, size=size) for a in tier)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "$KVPOOL_TIER_KEY (or $KVPOOL_HASH_SEED)" in err and "16 bytes" in err
    assert not (tmp_path / "d").exists()  # nothing was made
    monkeypatch.setenv("KVPOOL_TIER_KEY", "too short")
    assert main(argv) == 2 and "$KVPOOL_TIER_KEY must be at least 16 bytes" in capsys.readouterr().err


HINT = "hint: block hashes leave this process"


@pytest.mark.parametrize(("options", "env", "hinted"), [
    (["--kv-events", "{port}"], {}, "--kv-events"),
    (["--disk-dir", "{tmp}/d", "--disk-bytes", "1MiB"], {"KVPOOL_TIER_KEY": "kvpool tests: a tier key"},
     "--disk-dir"),
    (["--kv-events", "{port}"], {"KVPOOL_HASH_SEED": "kvpool tests: the fleet's seed"}, None),
    (["--host-blocks", "4"], {}, None),  # the host tier never leaves the process
], ids=["events", "disk", "seeded", "host only"])
def test_generate_hints_at_the_hash_seed_when_hashes_leave_with_the_public_root(
        options: list[str], env: dict[str, str], hinted: str | None, tmp_path: Path, monkeypatch, capsys
) -> None:
    # With no $KVPOOL_HASH_SEED a shared hasher starts from the public root: whoever sees the hashes (a
    # disk folder's file names, Redis key names, the event stream) can confirm a guessed prompt. That was
    # silent; now one line on stderr says what to set, and the run goes on.
    from _ports import free_port, tcp

    for name in ("KVPOOL_HASH_SEED", "KVPOOL_TIER_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = [a.format(port=tcp(free_port()), tmp=tmp_path) for a in options]
    assert main(["generate", *TINY, "--prompt", "hi", "--max-new-tokens", "1", *argv]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if HINT in line]
    if hinted is None:
        assert lines == []
    else:
        assert len(lines) == 1 and lines[0].startswith(f"kvpool generate: {HINT} ({hinted}) from the public")
        assert "set $KVPOOL_HASH_SEED to a secret of at least 16 bytes" in lines[0]


def test_replay_gives_no_hash_seed_hint_its_hashes_are_the_traces(tmp_path: Path, monkeypatch, capsys
                                                                   ) -> None:
    # A replay's block hashes are the trace's own ids, not a hasher's: $KVPOOL_HASH_SEED would change
    # nothing, so no hint names it.
    from _ports import free_port, tcp

    monkeypatch.delenv("KVPOOL_HASH_SEED", raising=False)
    monkeypatch.setenv("KVPOOL_TIER_KEY", "kvpool tests: a tier key")
    assert main(["replay", "--max-requests", "20", "--num-blocks", "64", "--kv-events", tcp(free_port()),
                 "--disk-dir", str(tmp_path / "d"), "--disk-blocks", "8", "--json"]) == 0
    assert HINT not in capsys.readouterr().err


# ---- replay -------------------------------------------------------------------------------------------

def replay_json(*args: str, capsys) -> dict:
    assert main(["replay", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_replay_unbounded_host_tier_equals_the_unbounded_pool(capsys) -> None:
    base = ["--max-requests", "400", "--block-size", "512"]
    oracle = replay_json(*base, capsys=capsys)
    for device in ("240", "400"):  # the largest of the first 400 requests holds 239 blocks of 512 tokens
        tiered = replay_json(*base, "--num-blocks", device, "--host-blocks", str(oracle["num_blocks"]),
                             capsys=capsys)
        alone = replay_json(*base, "--num-blocks", device, capsys=capsys)
        assert tiered["requests_rejected"] == 0 and tiered["hit_blocks"] == oracle["hit_blocks"]
        assert tiered["tier_hits"]["host"] > 0 and alone["hit_blocks"] < oracle["hit_blocks"]
        assert sum(tiered["tier_hits"].values()) == tiered["hit_blocks"]


#: Conversations (2 blocks of 512 tokens each) revisited at short and long distances.
ORDER = [6, 3, 6, 3, 0, 2, 4, 3, 3, 6, 6, 2, 3, 2, 4, 1, 0, 5, 6, 0, 1, 2]


def test_replay_through_disk_and_redis_loses_nothing(tmp_path: Path, redis_single, monkeypatch, capsys
                                                     ) -> None:
    monkeypatch.setenv("KVPOOL_TIER_KEY", "kvpool tests: a tier key")
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": [c * 10, c * 10 + 1]}
            for i, c in enumerate(ORDER)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    oracle = replay_json(str(trace), "--block-size", "512", capsys=capsys)
    out = replay_json(str(trace), "--block-size", "512", "--num-blocks", "3", "--host-blocks", "2",
                      "--disk-dir", str(tmp_path / "disk"), "--disk-blocks", "4",
                      "--remote", redis_single.url, capsys=capsys)
    hits = out["tier_hits"]
    assert all(hits[p] for p in ("device", "host", "disk", "remote")), hits
    assert out["hit_blocks"] == sum(hits.values()) == oracle["hit_blocks"]  # the remote tier is unbounded
    assert out["tiers"]["disk"]["blocks"] <= 4
    assert not list((tmp_path / "disk").glob("*/*/*"))  # emptied after the run (only the lock file stays)


@pytest.mark.parametrize(("k", "host_hits", "refused"), [(1, 8, 0), (2, 4, 6), (3, 0, 8)])
def test_replay_tier_admission_stores_a_block_at_its_kth_eviction(k: int, host_hits: int, refused: int,
                                                                   tmp_path: Path, capsys) -> None:
    # Requests 1-6 are A B A B A B, each 1,025 prompt tokens (2 full blocks, both hit when cached: the last
    # prompt token, always computed, lies in the 3rd block) and 1 output token (KV of 1,025 tokens: 3
    # blocks), on a device of 3 blocks: each request evicts the one before it, so A is offered when
    # requests 1, 3, 5 are evicted, B when 2 and 4 are (6 never is).
    # k=1 stores every offer: requests 3-6 hit the host, 8 blocks. k=2 admits the second offers (3 and 4):
    # requests 5 and 6 hit, 4 blocks; refused 1, 2 and 5 (A's count started over): 6 blocks. k=3 admits
    # only A's third offer (5), which no request follows: no hit; refused 1, 2, 3, 4: 8 blocks.
    trace = tmp_path / "abab.jsonl"
    rows = [{"timestamp": i, "input_length": 1025, "output_length": 1,
             "hash_ids": [c * 10, c * 10 + 1, c * 10 + 2]} for i, c in enumerate([0, 1, 0, 1, 0, 1])]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = replay_json(str(trace), "--block-size", "512", "--num-blocks", "3", "--host-blocks", "8",
                      "--tier-admission", str(k), capsys=capsys)
    assert out["tier_hits"] == {"device": 0, "host": host_hits}
    assert out["tiers"]["not_admitted"] == refused


def test_replay_tier_admission_remembers_as_far_as_the_tiers_reach(tmp_path: Path, capsys) -> None:
    # 10 conversations of 2 full blocks, in order, three times, on a device of 3 blocks (each request evicts
    # the one before it): a block's second offer comes 18 other offers after its first. The filter
    # tracked 4 x the device's 3 blocks = 12 hashes, so it forgot every first offer and admitted nothing
    # (as it admitted nothing over 1,500 Mooncake requests); it now tracks 4 x (3 + the host's 24) = 108:
    # the second pass's offers are admitted, and every request of the third pass finds its 2 blocks on the
    # host: 20 host hits. Refused: the first pass's 20 offers, and the third pass's 18 (an admitted hash is
    # counted anew).
    trace = tmp_path / "rounds.jsonl"
    rows = [{"timestamp": i, "input_length": 1025, "output_length": 1,
             "hash_ids": [c * 10, c * 10 + 1, c * 10 + 2]} for i, c in enumerate(list(range(10)) * 3)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = replay_json(str(trace), "--block-size", "512", "--num-blocks", "3", "--host-blocks", "24",
                      "--tier-admission", "2", capsys=capsys)
    assert out["tier_hits"] == {"device": 0, "host": 20}
    assert out["tiers"]["not_admitted"] == 38


def test_replay_refuses_tier_admission_without_a_tier_or_below_1(capsys) -> None:
    assert main(["replay", "--tier-admission", "2"]) == 2
    assert main(["replay", "--host-blocks", "4", "--tier-admission", "0"]) == 2
    err = capsys.readouterr().err
    assert "--tier-admission need a tier" in err and "must be an integer >= 1" in err and err.count("\n") == 2


def test_replay_sweep_plots_hit_ratio_by_tier(tmp_path: Path, capsys) -> None:
    png = tmp_path / "sweep.png"
    out = replay_json("--max-requests", "300", "--block-size", "512", "--sweep", "60,120", "--host-blocks",
                      "200", "--plot", str(png), capsys=capsys)
    # one run per size and policy: the default lru, and the offline bound a sweep adds (--no-bound drops it)
    assert [(run["num_blocks"], run["policy"]) for run in out["runs"]] == [
        (60, "lru"), (60, "belady"), (120, "lru"), (120, "belady")]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["replay", "--max-requests", "50", "--sweep", "60", "--num-blocks", "5"]) == 2
