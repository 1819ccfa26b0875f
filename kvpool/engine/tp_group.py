"""A tensor-parallel group across processes (torch.distributed): :class:`TPGroup` (this process's rank, its
device and the collectives kvpool uses, each failure a :class:`~kvpool.errors.CollectiveError`) and
:class:`Channel` (rank 0's messages to the other ranks, broadcast in frames of :data:`FRAME_BYTES` on the
gloo control group). :mod:`kvpool.engine.distributed` runs the engine over them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvpool.errors import CollectiveError, IntegrityError, KVPoolError

FRAME_BYTES = 16384  # a step's message is ~0.2-3 KB for a few requests: one broadcast nearly always
DEFAULT_TIMEOUT_S = 300.0  # a collective waiting longer than this raises (a rank hung)


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, its ``device``, the model's
    collective ``backend`` (``gloo`` or ``nccl``) and ``control``, the gloo group that carries messages."""

    rank: int
    size: int
    device: torch.device
    backend: str
    control: Any

    @classmethod
    def init(cls, rank: int, size: int, init_method: str = "env://", *, backend: str | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
        """Join the group (``torch.distributed.init_process_group``). ``backend`` None: NCCL when CUDA is
        available (device ``cuda:LOCAL_RANK``, or ``cuda:rank``), else gloo on the CPU."""
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        device = torch.device("cpu")
        if backend == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        return cls(rank, size, device, backend, control)

    @classmethod
    def from_env(cls, **kwargs: Any) -> TPGroup:
        """Join the group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``)."""
        return cls.init(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", **kwargs)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (the row-parallel layers' reduction)."""
        self._collective(dist.all_reduce, tensor)

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank passes (``all_reduce`` MIN)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self._collective(dist.all_reduce, tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (the same length on every rank), in rank order."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self._collective(dist.all_gather, out, mine, group=self.control)
        return [t.numpy().tobytes() for t in out]

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` (CPU) into every rank's."""
        self._collective(dist.broadcast, tensor, src=0, group=self.control)

    def close(self) -> None:
        """Leave the group: a barrier first, so no rank tears its connections down while another still
        uses them, then ``destroy_process_group``."""
        if dist.is_initialized():
            self._collective(dist.barrier, group=self.control)
            dist.destroy_process_group()

    def _collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except RuntimeError as exc:  # DistBackendError: a peer closed its connections, or a timeout
            why = " ".join(str(exc).split())[:300]
            raise CollectiveError(f"rank {self.rank}: {fn.__name__} failed (another rank stopped?): "
                                  f"{why}") from exc


class Channel:
    """Rank 0 sends bytes, every other rank receives them (broadcast frames on the control group)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self._view = self._frame.numpy()

    def send(self, data: bytes) -> None:
        head = len(data).to_bytes(8, "little") + data
        inline = min(len(head), FRAME_BYTES)
        self._view[:inline] = memoryview(head)[:inline]
        self.tp.broadcast(self._frame)
        if len(head) > FRAME_BYTES:
            self.tp.broadcast(torch.frombuffer(bytearray(head[FRAME_BYTES:]), dtype=torch.uint8))

    def recv(self) -> bytes:
        self.tp.broadcast(self._frame)
        size = int.from_bytes(self._view[:8].tobytes(), "little")
        data = self._view[8:8 + size].tobytes()
        if 8 + size > FRAME_BYTES:
            rest = torch.empty(8 + size - FRAME_BYTES, dtype=torch.uint8)
            self.tp.broadcast(rest)
            data += rest.numpy().tobytes()
        return data


def follow_call(call: Callable[..., Any], name: str, args: tuple, kwargs: dict[str, Any], expected: Any,
                rank: int, what: str) -> None:
    """A follower's side of one of rank 0's logged calls: run ``call(*args, **kwargs)`` here and compare its
    result with rank 0's ``expected``. ``name`` names the call and ``what`` the state that diverged (for the
    messages).

    Raises:
        IntegrityError: the call raised a KVPoolError here, or returned something else than on rank 0.
    """
    try:
        result = call(*args, **kwargs)
    except KVPoolError as exc:
        raise IntegrityError(f"rank {rank}: rank 0's {name} raised here ({exc}): the {what} diverged") \
            from exc
    if result != expected:
        raise IntegrityError(f"rank {rank}: {name} returned {result!r} where rank 0's returned {expected!r}: "
                             f"the {what} diverged")
