"""``kvpool generate --session-id``: the prompts as the turns of one session, against transformers' greedy
generate, with the cached-token accounting worked out by hand (byte tokenizer: one token per character)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from kvpool.cli import main  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIRST = "The cache keeps blocks of tokens for later."  # 43 characters: 43 byte tokens
SECOND = " And then some more."  # 20
NEW, BLOCK = 6, 4


def _generate(capsys: pytest.CaptureFixture[str], *extra: str) -> dict:
    argv = ["generate", "--model", "tiny-llama", "--prompt", FIRST, "--prompt", SECOND, "--num-blocks", "64",
            "--block-size", str(BLOCK), "--max-new-tokens", str(NEW), "--check", "--json", *extra]
    assert main(argv) == 0  # 0: every turn matches transformers' own greedy generate (--check)
    return json.loads(capsys.readouterr().out)


def test_turns_of_a_session_extend_each_other_and_read_the_last_one(capsys: pytest.CaptureFixture[str]
                                                                   ) -> None:
    out = _generate(capsys, "--session-id", "chat")
    first, second = out["requests"]
    assert first["prompt_tokens"] == 43 and second["prompt_tokens"] == 43 + NEW + 20  # prompt, answer, prompt
    assert all(r["matches_reference"] for r in out["requests"])
    # turn 1: 10 full blocks created (40 tokens), 3 uncached. Turn 2 reads turn 1's KV: its prompt and all
    # but the last sampled token (43 + 6 - 1 = 48 tokens: 12 full blocks); 69 - 48 = 21: 5 blocks, 1 token
    assert first["cache_usage"]["cache_read_tokens"] == 0
    assert (first["cache_usage"]["cache_creation_tokens"], first["cache_usage"]["uncached_tokens"]) == (40, 3)
    usage = second["cache_usage"]
    assert (usage["cache_read_tokens"], usage["cache_creation_tokens"], usage["uncached_tokens"]) == \
        (48, 20, 1)
    cache = out["stats"]["cache"]
    total = cache["usage"]
    assert total["cache_read_tokens"] + total["cache_creation_tokens"] + total["uncached_tokens"] == 43 + 69
    sessions = cache["sessions"]
    assert cache["session_policy"] == "session"
    assert (sessions["opened"], sessions["closed"], sessions["open"], sessions["turns_kept"]) == (1, 1, 0, 2)
    # turn 2 wrote 69 + 6 - 1 = 74 tokens: 18 full blocks kept, turn 1's 12 among them; none after the close
    assert sessions["kept_blocks"] == 0 and sessions["peak_kept_blocks"] == 18


def test_keep_no_turns_and_no_session(capsys: pytest.CaptureFixture[str]) -> None:
    kept = _generate(capsys, "--session-id", "chat", "--keep-turns", "0")["stats"]["cache"]
    assert kept["session_policy"] == "last=0" and kept["sessions"]["turns_kept"] == 0
    plain = _generate(capsys)  # no session: the prompts run side by side, unrelated
    assert [r["prompt_tokens"] for r in plain["requests"]] == [43, 20]
    assert "sessions" not in plain["stats"]["cache"] and plain["stats"]["cache"]["session_policy"] == ""


def test_human_report_prints_the_accounting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "tiny-llama", "--prompt", FIRST, "--prompt", SECOND, "--num-blocks",
                 "64", "--block-size", str(BLOCK), "--max-new-tokens", str(NEW), "--session-id", "chat"]) == 0
    out = capsys.readouterr().out
    assert "cache: 48 read (device 48), 20 created, 1 uncached" in out
    assert "sessions             session: 1 opened, 2 turns kept, peak 18 blocks kept" in out


def test_keep_turns_without_a_session_is_one_line_before_loading(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import kvpool.engine.models as models

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(models, "load_model", refuse)
    assert main(["generate", "--model", "tiny-llama", "--keep-turns", "2"]) == 2
    err = capsys.readouterr().err
    assert "--keep-turns" in err and "--session-id" in err and len(err.strip().splitlines()) == 1
