"""Extra keys of block hashes: what separates blocks whose tokens are equal but whose KV differs.

A LoRA adapter (:class:`LoRAIdentity`), a cache salt (tenant isolation), multimodal items (content hash +
offset), prompt embeddings (a digest of each block's embedding rows). :func:`block_extra_keys` builds them
per block, for :func:`kvpool.allocators.hashing.block_hashes`. An extra key is None, a bool, int, str or
bytes, or a tuple of those (nested). :mod:`kvpool.allocators.hashing` re-exports every public name.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.errors import InvalidArgumentError

#: A block's extra keys: a tuple of keys, or None for a block with none.
ExtraKeys = tuple | None
#: A multimodal item: (content hash, start token, length in tokens).
MMItem = tuple[object, int, int]


@dataclass(frozen=True)
class LoRAIdentity:
    """The LoRA adapter a request runs with, as it enters its blocks' hashes: ``("lora", name, path,
    digest)`` (an absent field as ``""``). The name alone is a label: re-pointing it at other weights must
    never reuse KV, so ``path`` (where the weights were loaded from) or ``digest`` (of their content) is
    required. A path identifies the weights only on one machine and only while the files there do not
    change; for a shared tier or adapters rewritten in place, use :meth:`from_files` (a content digest).
    vLLM keys a LoRA on its name.

    Raises:
        InvalidArgumentError: an empty or non-str name, or neither a path nor a digest.
    """

    name: str
    path: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name:
            raise InvalidArgumentError(f"LoRA name must be a non-empty str, got {self.name!r}")
        given = [f for f in (self.path, self.digest) if f is not None]
        if not given or any(type(f) is not str or not f for f in given):
            raise InvalidArgumentError(
                f"LoRA {self.name!r} needs a path or a content digest (a non-empty str) for its weights")

    @classmethod
    def from_files(cls, name: str, path: str | os.PathLike[str]) -> LoRAIdentity:
        """The identity of the adapter in file or folder ``path`` by content (:func:`adapter_digest`), so
        the same weights match wherever they lie. Raises OSError when ``path`` cannot be read."""
        return cls(name, digest=adapter_digest(path))

    def key(self) -> tuple[str, str, str, str]:
        """The extra key every block of the request carries."""
        return ("lora", self.name, self.path or "", self.digest or "")


def adapter_digest(path: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` of a file, or of a folder's regular files (recursively: each one's relative path,
    size and bytes, in sorted order). Raises OSError (FileNotFoundError, ...) when ``path`` cannot be read."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"no adapter at {os.fspath(path)!r}")
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for file in files:
        rel = b"" if file == root else file.relative_to(root).as_posix().encode("utf-8")
        h.update(struct.pack("<q", len(rel)) + rel + struct.pack("<q", file.stat().st_size))
        with file.open("rb") as f:
            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                h.update(chunk)
    return "sha256:" + h.hexdigest()


def embedding_digest(embeds: Any) -> bytes:
    """SHA-256 (32 bytes) of a tensor of prompt embeddings: its dtype, shape and raw bytes (moved to the CPU
    and made contiguous first), so equal values in another dtype or shape digest apart."""
    import torch  # the allocators otherwise need no torch here

    if not isinstance(embeds, torch.Tensor):
        raise InvalidArgumentError(f"prompt embeddings must be a torch.Tensor, got {type(embeds).__name__}")
    t = embeds.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy
    return h.digest()


def block_extra_keys(num_tokens: int, block_size: int, *, lora: LoRAIdentity | None = None,
                     cache_salt: str | bytes | None = None, mm_items: Sequence[MMItem] = (),
                     prompt_embeds: Any = None, start_block: int = 0) -> list[ExtraKeys]:
    """Extra keys for each full block of a ``num_tokens``-token sequence, for :func:`block_hashes`.

    ``lora`` (:class:`LoRAIdentity`) goes into every block; ``cache_salt`` into block 0 only (the chain
    carries it on); each multimodal item ``(content_hash, start, length)`` (token positions) adds
    ``("mm", content_hash, block_start - start)`` to every block its span overlaps, the offset saying which
    part of the item the block holds. ``prompt_embeds``: a tensor ``[P, hidden]`` standing for tokens
    ``0..P-1`` (a prompt given as embeddings, whose token ids are placeholders): every block that overlaps
    it adds ``("embeds", embedding_digest(prompt_embeds[block_start:min(block_end, P)]))``, as vLLM does.
    ``start_block``: index of the first block when hashing a continuation (token positions stay absolute).
    Blocks with no key get None. Key order in a block: lora, salt, mm items, embeds.

    Raises:
        InvalidArgumentError: ``lora`` that is not a LoRAIdentity, or prompt embeddings that are not a
            tensor with at least one dimension.
    """
    if lora is not None and not isinstance(lora, LoRAIdentity):
        raise InvalidArgumentError(f"lora must be a LoRAIdentity (name plus path or digest), got {lora!r}")
    num_embeds = _num_embeds(prompt_embeds)
    lora_key = lora.key() if lora is not None else None
    lora_only = (lora_key,)  # one object for every block that holds only the LoRA key: encoded once
    out: list[ExtraKeys] = []
    for i in range(start_block, start_block + num_tokens // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        keys: list[object] = []
        if cache_salt is not None and i == 0:
            keys.append(("salt", cache_salt))
        keys += [("mm", h, lo - start) for h, start, length in mm_items if start < hi and lo < start + length]
        if lo < num_embeds:
            keys.append(("embeds", embedding_digest(prompt_embeds[lo:min(hi, num_embeds)])))
        if lora_key is None:
            out.append(tuple(keys) if keys else None)
        else:
            out.append((lora_key, *keys) if keys else lora_only)
    return out


def _num_embeds(prompt_embeds: Any) -> int:
    if prompt_embeds is None:
        return 0
    shape = getattr(prompt_embeds, "shape", None)
    if shape is None or len(shape) < 1:
        raise InvalidArgumentError("prompt_embeds must be a tensor [num_tokens, hidden_size]")
    return int(shape[0])
