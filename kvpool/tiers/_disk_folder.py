"""The folder of a disk tier (:class:`~kvpool.tiers.file.FileTier`): which file names hold a value
(:func:`key_of`), and the one tier per namespace folder (:func:`claim_folder`: an exclusive ``flock`` on its
``.lock``, and a set of the folders this process's tiers hold, released by :func:`release_folder`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import threading
from pathlib import Path

from kvpool.errors import ConfigError

#: A value file's name: exactly what ``FileTier._file`` writes (``bytes.fromhex`` would also take upper
#: case and spaces, and the file could sit in any subfolder: its value indexed but read elsewhere).
_VALUE_NAME = re.compile(r"[0-9a-f]{32}")


def key_of(path: Path) -> bytes | None:
    """The block key a value file at ``path`` holds (``<2 hex digits>/<32 hex digits>``, the subfolder the
    name's first two), or None: no value file."""
    name = path.name
    if not _VALUE_NAME.fullmatch(name) or path.parent.name != name[:2]:
        return None
    return bytes.fromhex(name)


#: The namespace folders (real paths) the open FileTiers of this process hold. The ``flock`` cannot tell a
#: second tier of this process from another process's (a second open of ``.lock`` is refused either way),
#: so this says which it is.
_HELD: set[str] = set()
_HELD_LOCK = threading.Lock()


def claim_folder(folder: Path) -> tuple[int, str]:
    """Create ``folder`` and take an exclusive lock on its ``.lock`` file: one FileTier per namespace folder
    (two would each index and evict the same files on their own). Returns the lock's descriptor and the
    folder's real path (held until :func:`release_folder`, from
    :meth:`~kvpool.tiers.file.FileTier.close`).

    Raises:
        ConfigError: the folder cannot be made or written, or another FileTier holds it: one of this
            process (close it first) or another process.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot use {folder.parent} as a disk tier: {exc.strerror or exc}") from None
    held = os.path.realpath(folder)
    with _HELD_LOCK:
        try:
            if held in _HELD:
                raise ConfigError(f"cannot use {folder} as a disk tier: another FileTier of this process "
                                  "holds it (close() that one first, or give each its own folder)")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                busy = exc.errno in (errno.EAGAIN, errno.EACCES)
                why = "another process holds it (one process per folder)" if busy else exc.strerror
                raise ConfigError(f"cannot use {folder} as a disk tier: {why}") from None
            if not os.access(folder, os.W_OK):
                raise ConfigError(f"cannot use {folder.parent} as a disk tier: not writable")
        except ConfigError:
            os.close(fd)
            raise
        _HELD.add(held)
    return fd, held


def release_folder(fd: int, held: str) -> None:
    """Give up a folder :func:`claim_folder` took: close its lock's descriptor ``fd`` (the ``flock`` goes with
    it) and forget ``held`` (its real path)."""
    os.close(fd)
    with _HELD_LOCK:
        _HELD.discard(held)
