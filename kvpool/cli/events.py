"""``kvpool events ENDPOINT``: subscribe to a KV event stream (kvpool's or vLLM's), one line per event.

Lines come in sequence order; with ``--kv-events-replay`` missed batches are fetched from the publisher's
replay socket (a request unanswered for 2 s is given up and its gap counted missed; on exit the batches
waiting behind a gap are printed, and one line on stderr says what was missed, or that no batch came).
``--json`` prints one JSON object per event: ``seq``, ``ts``, ``data_parallel_rank``, ``type`` and
the event's fields (hashes as lowercase hex strings when they are bytes, integers otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvpool.cli._args import add_deprecated_alias, add_json_argument, positive_float, positive_int
from kvpool.units import plural


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("events", help="print the KV cache events a publisher sends",
                                   description="Subscribe to a KV event stream (kvpool's or vLLM's), "
                                               "one line per event.")
    parser.add_argument("endpoint", metavar="ENDPOINT",
                        help="the publisher's PUB address, e.g. tcp://127.0.0.1:5557")
    replay = parser.add_argument("--kv-events-replay", dest="replay", metavar="ENDPOINT",
                                 help="its replay (ROUTER) address: fetch missed batches from it")
    add_deprecated_alias(parser, "--replay", replay)
    parser.add_argument("--topic", default="", metavar="NAME", help="topic to subscribe to (default: all)")
    parser.add_argument("--max-events", type=positive_int, metavar="N", help="exit after N events")
    parser.add_argument("--timeout", type=positive_float, metavar="S",
                        help="exit after S seconds without a batch (default: run until interrupted)")
    add_json_argument(parser, per_event=True)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvpool.events.subscriber import KVEventSubscriber

    with KVEventSubscriber(args.endpoint, replay_endpoint=args.replay, topic=args.topic) as sub:
        printed = 0
        try:
            while args.max_events is None or printed < args.max_events:
                got = sub.recv(timeout=args.timeout)
                if got is None:  # silent for --timeout: print what waits behind a gap, then stop
                    for seq, batch in sub.drain():
                        printed = _print_batch(args, seq, batch, printed)
                    break
                printed = _print_batch(args, *got, printed)
        except KeyboardInterrupt:
            pass
        _report(args, sub.stats)
    return 0


def _print_batch(args: argparse.Namespace, seq: int, batch: Any, printed: int) -> int:
    """Print the batch's events (up to --max-events in all); returns how many are printed now."""
    for event in batch.events:
        if args.max_events is not None and printed >= args.max_events:
            break
        row = event_dict(seq, batch.ts, batch.data_parallel_rank, event)
        print(json.dumps(row) if args.json else event_line(row), flush=True)
        printed += 1
    return printed


def _report(args: argparse.Namespace, stats: Any) -> None:
    """One line on stderr when something went amiss: no batch at all, or batches missed or unreadable."""
    if stats.delivered == 0 and stats.missed == 0 and args.timeout is not None:
        print(f"kvpool events: no batch from {args.endpoint} in {args.timeout:g} s", file=sys.stderr)
    elif stats.missed or stats.malformed or stats.restarts:
        why = []
        if stats.replay_timeouts:
            why.append(f"{args.replay} did not answer {plural(stats.replay_timeouts, 'replay request')}")
        elif stats.missed and args.replay is None:
            why.append("no --replay to fetch them from")
        if stats.restarts:
            why.append(f"the publisher restarted {plural(stats.restarts, 'time')}")
        tail = f" ({'; '.join(why)})" if why else ""
        print(f"kvpool events: {plural(stats.missed, 'message')} missed, {stats.malformed} "
              f"malformed{tail}", file=sys.stderr)


def event_dict(seq: int, ts: float, rank: int | None, event: Any) -> dict[str, Any]:
    """One event as JSON-ready fields (bytes as hex)."""
    import msgspec

    fields = {name: _plain(value) for name, value in msgspec.structs.asdict(event).items()}
    return {"seq": seq, "ts": _plain(ts), "data_parallel_rank": rank, "type": type(event).__name__, **fields}


def _plain(value: Any) -> Any:
    """JSON-ready: bytes as hex, a NaN or infinite number (which no JSON parser reads) as None."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def event_line(row: dict[str, Any]) -> str:
    """The human line: sequence number, type, and what changed."""
    head = f"#{row['seq']} {row['type']}"
    if row["type"] == "AllBlocksCleared":
        return head
    where = f"group {row['group_idx']} {row['medium']}"
    hashes = " ".join(_short(h) for h in row["block_hashes"])
    if row["type"] == "BlockRemoved":
        return f"{head} {where}: {plural(len(row['block_hashes']), 'block')} [{hashes}]"
    lora = f" lora {row['lora_name']}" if row["lora_name"] is not None else ""
    parent = "-" if row["parent_block_hash"] is None else _short(row["parent_block_hash"])
    return (f"{head} {where}: {plural(len(row['block_hashes']), 'block')} x {row['block_size']} tokens "
            f"({plural(len(row['token_ids']), 'token id')}){lora} parent {parent} [{hashes}]")


def _short(h: str | int) -> str:
    return h[:12] if isinstance(h, str) else str(h)
