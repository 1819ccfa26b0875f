"""Hostile tier URLs: each is a ConfigError naming the URL (its password hidden), never a raw ValueError or
OSError."""

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers.auth import redact_url
from kvpool.tiers.from_url import parse_tier_url


@pytest.mark.parametrize("url", [
    "redis://[::1",                                  # urlsplit: "Invalid IPv6 URL" (ValueError)
    "file:///tmp/" + "a" * 5000 + "?bytes=1GiB",     # a name too long for the file system (OSError)
    "file:///tmp/kvpool%00x?bytes=1GiB",             # a NUL in the path (ValueError at first use)
])
def test_a_hostile_tier_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="bad tier URL|bad Redis URL"):
        parse_tier_url(url)


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://alice:s3cret-Pass@127.0.0.1:6379/0", "redis://alice:***@127.0.0.1:6379/0"),
    ("rediss://:s3cret-Pass@cache.internal:6380", "rediss://:***@cache.internal:6380"),
    ("redis://s3cret-Pass@127.0.0.1:6379", "redis://***@127.0.0.1:6379"),
    ("redis://u:p@ss:s3cret-Pass@127.0.0.1:6379", "redis://u:***@127.0.0.1:6379"),  # a raw @ in it
    ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
    ("file:///tmp/kv?bytes=1GiB", "file:///tmp/kv?bytes=1GiB"),
])
def test_redact_url_hides_the_password(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("url", [
    "redis://alice:s3cret-Pass@127.0.0.1:6379?socket_timeout=1",  # refused: a query string
    "redis://alice:s3cret-Pass@127.0.0.1:99999",                  # refused: the port
    "redis://:s3cret-Pass@127.0.0.1",                             # refused: no port
])
def test_a_refused_redis_url_does_not_show_its_password(url: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_url(url)
    assert "s3cret-Pass" not in str(info.value) and ":***@" in str(info.value)


# ---- a tier URL is read once per command (issue 31: 14 parses, and 14 probes of a file:// folder) ----------


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often a command parses a tier URL and probes a disk tier's folder (a folder created in it and
    removed again: :func:`kvpool.tiers.from_url.check_folder`)."""
    import tempfile

    from kvpool.tiers import from_url

    counts = {"parsed": 0, "probed": 0}
    parse, mkdtemp = from_url.parse_tier_url, tempfile.mkdtemp

    def parse_counted(url: str) -> object:
        counts["parsed"] += 1
        return parse(url)

    def mkdtemp_counted(*args: object, **kwargs: object) -> str:
        counts["probed"] += str(kwargs.get("prefix", "")).startswith(".kvpool-probe-")
        return mkdtemp(*args, **kwargs)

    monkeypatch.setattr(from_url, "parse_tier_url", parse_counted)
    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_counted)
    monkeypatch.setenv("KVPOOL_TIER_KEY", "kvpool tests: a tier key")
    return counts


@pytest.mark.parametrize("tiers", [
    ["--tier", "host://?blocks=4", "--tier", "file://{dir}?blocks=8"],
    ["--host-blocks", "4", "--disk-dir", "{dir}", "--disk-blocks", "8"],  # the older spellings
])
def test_a_replay_sweep_reads_its_tier_chain_once(tiers: list[str], counted: dict[str, int], tmp_path, capsys
                                                   ) -> None:
    """``kvpool replay`` over a host and a disk tier, two pool sizes by two policies (four runs, each with
    fresh tiers): each ``--tier`` URL is parsed once (the older options are read without a URL) and the disk
    tier's folder probed once, for the whole command."""
    from kvpool.cli import main

    folder = str(tmp_path / "disk")
    argv = ["replay", "--max-requests", "20", "--sweep", "8,16", "--policies", "lru,fifo", "--json",
            *(a.format(dir=folder) for a in tiers)]
    assert main(argv) == 0, capsys.readouterr().err
    assert counted == {"parsed": tiers.count("--tier"), "probed": 1}


def test_the_older_options_join_a_tier_chain_fastest_first(tmp_path) -> None:
    """``--tier file://...`` with ``--host-blocks``: the host tier goes first (it was refused as second);
    ``--tier`` URLs out of order are still refused."""
    from kvpool.cli import build_parser
    from kvpool.cli._tiers import tier_chain

    disk = f"file://{tmp_path}/d?blocks=8"
    args = build_parser().parse_args(["replay", "--tier", disk, "--host-blocks", "4"])
    assert [(t.medium, t.blocks) for t in tier_chain(args)] == [("host", 4), ("disk", 8)]
    args = build_parser().parse_args(["replay", "--tier", disk, "--tier", "host://?blocks=4"])
    with pytest.raises(ConfigError, match="comes first"):
        tier_chain(args)


def test_the_plug_ins_and_the_urls_make_a_tier_in_one_place(tmp_path) -> None:
    """``open_tier`` (the vLLM / SGLang plug-ins' configuration) and a tier URL describe the same disk
    tier: the same class, bound and folder; Redis options on a disk tier are refused; ``"public"`` opts
    out of the fleet secret in both."""
    pytest.importorskip("blake3")
    from kvpool.integrations.tier_jobs import open_tier
    from kvpool.tiers.backend import Namespace
    from kvpool.tiers.from_url import build_tier, disk_tier, tiers_from_urls

    ns = Namespace("m", "w", "layout")
    plug_in = open_tier("disk", ns, 64, directory=tmp_path / "a", capacity_bytes=1 << 20, auth_key="public")
    [url] = tiers_from_urls([f"file://{tmp_path}/b?bytes=1MiB"], ns, block_bytes=64, auth_key="public")
    assert type(plug_in) is type(url) and plug_in.capacity_bytes == url.capacity_bytes == 1 << 20
    with pytest.raises(ConfigError, match="for a Redis tier"):
        build_tier(disk_tier(str(tmp_path / "c"), blocks=4), ns, block_bytes=64, ttl_s=5)
