"""The tiers of a hybrid engine's state checkpoints, made beside the KV tiers of ``enable_offload``.

A checkpoint is one state slot's bytes (:meth:`~kvpool.storage.state.RecurrentStateCache.read_slots`), not
a KV block, so its tiers are the KV chain's kinds built for that row size, in the KV namespace with the
state's group (``layer_group`` = the number of KV cache groups) and a layout naming the rows: a host tier
becomes a :class:`~kvpool.tiers.host_rows.HostRowsTier` of as many rows as the host tier has blocks; a
disk or Redis tier given by URL is built again from its URL (:func:`~kvpool.tiers.from_url.build_tier`: a
disk folder keeps each namespace in its own subfolder, a Redis server its own keys). A disk or Redis tier
given as an object keeps only KV (its place is not known here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvpool.requests.state_checkpoints import RequestStates


def state_namespace(namespace: Any, states: RequestStates, row_bytes: int) -> Any:
    """``namespace`` with the state's group and a layout of ``row_bytes``-byte state rows."""
    return dataclasses.replace(namespace, layer_group=states.checkpoints.group,
                               layout=f"recurrent-state-rows:{row_bytes}")


def checkpoint_tiers(tiers: Sequence[Any], states: RequestStates, *, urls: Sequence[Any] | None = None,
                     namespace: Any = None, auth_key: Any = None) -> list[Any]:
    """The checkpoint tiers that mirror ``tiers`` (see the module docstring): the host tiers of ``tiers``
    and, when the chain came from ``urls`` (in ``namespace``, with ``auth_key``), its disk and Redis tiers.
    Empty when the states move no data (a bookkeeping-only run)."""
    from kvpool.tiers.from_url import build_tier, check_chain, resolve_auth_key
    from kvpool.tiers.host import HostTier
    from kvpool.tiers.host_rows import HostRowsTier

    mover = states.mover
    row = getattr(mover, "bytes_per_slot", 0)
    if not row:
        return []
    out: list[Any] = []
    if urls is not None:
        space = state_namespace(namespace, states, row)
        chain = check_chain(urls)
        key = resolve_auth_key(auth_key) if any(t.medium != "host" for t in chain) else None
        for t in chain:
            out.append(HostRowsTier(t.blocks, space, row) if t.medium == "host" else
                       build_tier(t, space, block_bytes=row, auth_key=key))
        return out
    for tier in tiers:
        if isinstance(tier, HostTier):
            out.append(HostRowsTier(tier.capacity_blocks, state_namespace(tier.namespace, states, row), row))
    return out
