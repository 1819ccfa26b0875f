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
