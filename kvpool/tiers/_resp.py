"""The RESP of a Redis tier's hot commands, packed and read here (the tier's wire, beneath
:class:`~kvpool.tiers.redis.RedisTier`, one server; a cluster goes through redis-py's cluster pipeline).

redis-py's pipeline packs each command through its generic packer and runs each reply through its command
machinery: ~20 us of Python per command, most of a small-value store's time (a tier replay's profile). The
hot commands are few and fixed, so they are packed here in one buffer (the same bytes on the wire as its
pipeline sends) and their replies read here too, within bounds, where the connection is redis-py's plain
one (else with redis-py's own parser).
"""

from __future__ import annotations

from typing import Any

import redis

try:  # redis-py's buffered reader: the integer replies are read by the tier only where it is the plain one
    from redis._parsers.socket import SocketBuffer
except ImportError:  # another redis-py layout: its own parser reads every reply
    SocketBuffer = None

#: Payload bytes up to which a value is sent as ``bytes`` (redis-py's own buffer cutoff: 6,000).
SMALL_VALUE = 6000
#: Bytes of one reply line the tier reads (``:<int>``, ``-<error>``, ``$<len>``, ``*<len>``) at most: Redis's
#: longest error messages are ~100 bytes.
LINE_BYTES = 1024
#: Replies in an array the tier reads at most (``HMGET`` answers 2; a few more are read, as a ``corrupt``
#: value, not a fault).
ARRAY_ITEMS = 8

_HSET = b"*6\r\n$4\r\nHSET\r\n$%d\r\n%b\r\n$1\r\nh\r\n$%d\r\n%b\r\n$1\r\np\r\n$%d\r\n"
_EXPIRE = b"*3\r\n$6\r\nEXPIRE\r\n$%d\r\n%b\r\n$%d\r\n%b\r\n"
_ONE_KEY = {"exists": b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%b\r\n",
            "hmget": b"*4\r\n$5\r\nHMGET\r\n$%d\r\n%b\r\n$1\r\nh\r\n$1\r\np\r\n",
            "delete": b"*2\r\n$3\r\nDEL\r\n$%d\r\n%b\r\n"}


def pack(command: str, names: list[bytes], values: list[tuple[bytes, Any]] | None, ttl: int | None
          ) -> list[Any]:
    """The RESP of ``command`` once per name (``hset``: of ``values``' header and payload fields, each
    followed by ``EXPIRE name ttl`` when ``ttl`` is given), as buffers to send in order: small pieces joined,
    a payload larger than ``SMALL_VALUE`` a buffer of its own (a view, not copied)."""
    if command != "hset":
        head = _ONE_KEY[command]
        return [b"".join([head % (len(name), name) for name in names])]
    out: list[Any] = []
    parts: list[bytes] = []
    expire = b"%d" % ttl if ttl is not None else None
    for name, (header, payload) in zip(names, values, strict=True):  # type: ignore[arg-type]
        size = len(payload) if isinstance(payload, bytes) else payload.nbytes
        parts.append(_HSET % (len(name), name, len(header), header, size))
        if isinstance(payload, bytes):
            parts.append(payload)
        else:
            out.append(b"".join(parts))
            out.append(payload)
            parts = []
        parts.append(b"\r\n")
        if expire is not None:
            parts.append(_EXPIRE % (len(name), name, len(expire), expire))
    out.append(b"".join(parts))
    return out


def send_packed(client: redis.Redis, buffers: list[Any], replies: int, field_bytes: int) -> list[Any]:
    """Send ``buffers`` on one of ``client``'s connections and read ``replies`` replies (an error reply
    as its ``ResponseError``): by :func:`read_replies` (fields of at most ``field_bytes``) where the
    connection is redis-py's plain one with nothing buffered, else by redis-py's parser. Any other exception
    drops that connection (its stream is out of step) and propagates."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(buffers)
        sock = _plain_socket(conn)
        if sock is not None:
            return read_replies(sock, replies, field_bytes)
        done: list[Any] = []
        while len(done) < replies:
            try:
                done.append(conn.read_response())
            except redis.ResponseError as exc:
                done.append(exc)
        return done
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _plain_socket(conn: Any) -> Any:
    """The socket of ``conn`` when redis-py's plain reader (a ``SocketBuffer``) holds nothing unread, so the
    tier may read the replies from it; None otherwise (another parser, such as hiredis, or another layout:
    redis-py's parser reads them)."""
    buffer = getattr(getattr(conn, "_parser", None), "_buffer", None)
    sock = getattr(conn, "_sock", None)
    if sock is None or SocketBuffer is None or not isinstance(buffer, SocketBuffer) or buffer.unread_bytes():
        return None
    return sock


def read_replies(sock: Any, n: int, field_bytes: int) -> list[Any]:
    """``n`` replies read from ``sock`` (RESP2 or RESP3: redis-py speaks RESP3 where the server does): an
    integer (``:``), an error (``-`` or ``!``, its ``ResponseError``), a simple string (``+``, bytes), a bulk
    string (``$``, bytes; None for ``$-1``), a null (``_``) or an array (``*``) of at most ``ARRAY_ITEMS`` of
    those (``HMGET``'s two fields; None for ``*-1``); the caller judges the shape. redis-py's parser costs
    ~5 us of Python per reply; this reads each reply's lines and fields from one buffer. Bounds, checked
    as the bytes come: a line of at most ``LINE_BYTES``, a bulk string of at most ``field_bytes``, an array
    of at most ``ARRAY_ITEMS``, so a server cannot make the tier buffer more than the call's replies can
    hold. Anything else (a longer line, field or array, another type, a nested array, a malformed number,
    bytes past the last reply, a closed connection) raises: a fault of the medium (the caller drops the
    connection)."""
    data, pos, out = bytearray(), 0, []
    while len(out) < n:
        got = _reply(data, pos, field_bytes) if data else None
        if got is None:  # incomplete: more bytes
            chunk = sock.recv(65536)
            if not chunk:
                raise redis.ConnectionError("the server closed the connection")
            data += chunk
            if not out and data.endswith(b"\r\n") and data.count(b"\r\n") == n:
                integers = _integer_lines(data, n)  # the common case of EXISTS, HSET, DEL, at once
                if integers is not None:
                    return integers
            continue
        value, pos = got
        out.append(value)
    if pos != len(data):
        raise redis.InvalidResponse("more bytes than replies")
    return out


def _integer_lines(data: bytearray, n: int) -> list[int] | None:
    """The ``n`` lines of ``data`` (exactly ``n``, each ended by CRLF) as non-negative integer replies
    (``:<1-19 digits>``) read at once; None when any line is another reply (:func:`_reply` reads them)."""
    out = []
    for line in bytes(data).split(b"\r\n", n)[:n]:
        digits = line[1:]
        if line[:1] != b":" or not (0 < len(digits) < 20 and digits.isdigit()):
            return None
        out.append(int(digits))
    return out


def _reply(data: bytearray, pos: int, field_bytes: int) -> tuple[Any, int] | None:
    """The reply at ``data[pos:]`` and where it ends, or None while it is incomplete (see
    :func:`read_replies`): a scalar, or an array of at most ``ARRAY_ITEMS`` scalars."""
    got = _line(data, pos)
    if got is None:
        return None
    kind, line, end = got
    if kind != b"*":
        return _scalar(data, kind, line, end, field_bytes)
    size = _number(line, nil=True)
    if size < 0:
        return None, end
    if size > ARRAY_ITEMS:
        raise redis.InvalidResponse(f"an array of {size} replies")
    items = []
    for _ in range(size):
        got = _line(data, end)
        item = None if got is None else _scalar(data, *got, field_bytes)
        if item is None:
            return None
        items.append(item[0])
        end = item[1]
    return items, end


def _scalar(data: bytearray, kind: bytes, line: bytes, end: int, field_bytes: int) -> tuple[Any, int] | None:
    """The reply of one line ``kind`` + ``line`` (its data from ``end``): an integer, an error, a simple
    string, a bulk string (bytes; None for nil) or a null; None while a bulk string is incomplete."""
    if kind == b":":
        return _number(line), end
    if kind == b"$":
        return _bulk(data, line, end, field_bytes)
    if kind == b"-":
        return redis.ResponseError(line.decode(errors="replace")), end
    if kind == b"+":
        return line, end
    if kind == b"_":
        return _null(line, end)
    if kind == b"!":  # RESP3's error as a bulk string
        got = _bulk(data, line, end, LINE_BYTES)
        return None if got is None else (redis.ResponseError(got[0].decode(errors="replace")), got[1])
    raise redis.InvalidResponse(f"not a reply the tier asked for: {kind + line[:32]!r}")


def _null(line: bytes, end: int) -> tuple[None, int]:
    """RESP3's null (``_``)."""
    if line:
        raise redis.InvalidResponse(f"not a RESP3 null: {line[:32]!r}")
    return None, end


def _line(data: bytearray, pos: int) -> tuple[bytes, bytes, int] | None:
    """The line at ``data[pos:]``: (its type byte, the rest, where the next begins); None while its CRLF
    has not come (InvalidResponse past ``LINE_BYTES``)."""
    end = data.find(b"\r\n", pos, pos + LINE_BYTES)
    if end < 0:
        if len(data) - pos >= LINE_BYTES:
            raise redis.InvalidResponse(f"a reply line longer than {LINE_BYTES} bytes")
        return None
    return bytes(data[pos:pos + 1]), bytes(data[pos + 1:end]), end + 2


def _bulk(data: bytearray, line: bytes, end: int, field_bytes: int) -> tuple[bytes | None, int] | None:
    """The bulk string whose ``$<len>`` line is ``line`` (its data from ``end``): (the bytes, where the
    next reply begins), (None, ...) for ``$-1``; None while it is incomplete."""
    size = _number(line, nil=True)
    if size < 0:
        return None, end
    if size > field_bytes:
        raise redis.InvalidResponse(f"a {size}-byte field, more than a value holds ({field_bytes})")
    if len(data) < end + size + 2:
        return None
    if data[end + size:end + size + 2] != b"\r\n":
        raise redis.InvalidResponse("a bulk string not ended by CRLF")
    return bytes(memoryview(data)[end:end + size]), end + size + 2  # (one copy)


def _number(line: bytes, *, nil: bool = False) -> int:
    """A RESP integer: an optional minus and 1-19 ASCII digits (``int()`` would also take ``+1``, ``1_0``,
    `` 1``). ``nil``: a length, at least -1 (nil)."""
    digits = line[1:] if line[:1] == b"-" else line
    if not (0 < len(digits) < 20 and digits.isdigit()) or (nil and line[:1] == b"-" and digits != b"1"):
        raise redis.InvalidResponse(f"not a RESP {'length' if nil else 'integer'}: {line[:32]!r}")
    return int(line)

