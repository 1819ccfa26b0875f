"""Hostile tier URLs: each is a ConfigError naming the URL, never a raw ValueError or OSError."""

import pytest

from kvpool.errors import ConfigError
from kvpool.tiers.from_url import parse_tier_url


@pytest.mark.parametrize("url", [
    "redis://[::1",                                  # urlsplit: "Invalid IPv6 URL" (ValueError)
    "file:///tmp/" + "a" * 5000 + "?bytes=1GiB",     # a name too long for the file system (OSError)
    "file:///tmp/kvpool%00x?bytes=1GiB",             # a NUL in the path (ValueError at first use)
])
def test_a_hostile_tier_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="bad tier URL|bad Redis URL"):
        parse_tier_url(url)
