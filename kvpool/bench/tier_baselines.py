"""The raw baselines ``kvpool bench tiers`` times each byte tier against (:mod:`kvpool.bench.tiers`): the
same payloads written and read as plain files (:class:`FileBaseline`) or through a bare redis-py pipeline
(:class:`RedisBaseline`), each optionally with the tiers' integrity check (:class:`MacCheck`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class MacCheck:
    """The integrity check of a raw baseline (``mac=True``): the tiers' keyed BLAKE3 over each payload,
    the tags kept in memory (computed on store, compared on load)."""

    def __init__(self, key: Any, n: int) -> None:
        self.key, self.tags = key, [b""] * n

    def sign(self, i: int, payload: Any) -> None:
        self.tags[i] = self.key.tag(b"", payload)

    def check(self, i: int, payload: Any) -> None:
        if not self.key.verifies(self.tags[i], b"", payload):
            raise AssertionError("a raw baseline read back other bytes than it wrote")


class FileBaseline:
    """One plain file per payload in ``folder``: ``write`` and ``readinto``, nothing else (with
    ``mac=True``: plus the MAC of each payload)."""

    def __init__(self, folder: Path, rows: torch.Tensor, key: Any) -> None:
        self.folder, self.rows = folder, rows
        folder.mkdir(parents=True, exist_ok=True)
        self.paths = [folder / f"{i:032x}" for i in range(rows.shape[0])]
        self.out = torch.zeros_like(rows)
        self.mac = MacCheck(key, rows.shape[0])

    def what(self, op: str) -> str:
        return "file write" if op == "store" else "file read"

    def store(self, mac: bool = False) -> None:
        for i, (path, row) in enumerate(zip(self.paths, self.rows, strict=True)):
            payload = memoryview(row.numpy())
            if mac:
                self.mac.sign(i, payload)
            with open(path, "wb", buffering=0) as f:
                f.write(payload)

    def load(self, mac: bool = False) -> None:
        for i, (path, row) in enumerate(zip(self.paths, self.out, strict=True)):
            payload = memoryview(row.numpy())
            with open(path, "rb", buffering=0) as f:
                f.readinto(payload)
            if mac:
                self.mac.check(i, payload)

    def clear(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)


class RedisBaseline:
    """A raw redis-py pipeline of ``SET`` / ``GET`` of the payloads (as ``bytes``, built once)."""

    def __init__(self, url: str, rows: torch.Tensor, key: Any) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self.values = [row.numpy().tobytes() for row in rows]
        self.names = [f"bench-raw:{i}".encode() for i in range(len(self.values))]
        self.mac = MacCheck(key, len(self.values))

    def what(self, op: str) -> str:
        return "redis SET" if op == "store" else "redis GET"

    def store(self, mac: bool = False) -> None:
        pipe = self.client.pipeline(transaction=False)
        for i, (name, value) in enumerate(zip(self.names, self.values, strict=True)):
            if mac:
                self.mac.sign(i, value)
            pipe.set(name, value)
        pipe.execute()

    def load(self, mac: bool = False) -> None:
        pipe = self.client.pipeline(transaction=False)
        for name in self.names:
            pipe.get(name)
        values = pipe.execute()
        assert all(v is not None for v in values)
        if mac:
            for i, value in enumerate(values):
                self.mac.check(i, value)

    def clear(self) -> None:
        self.client.delete(*self.names)
