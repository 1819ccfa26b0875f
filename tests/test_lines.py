"""Every reader of lines from a user's file ends a line at ``\\n`` (or ``\\r\\n``) only (issue 20, item 10).

``str.splitlines()`` also breaks at ``\\v``, ``\\f``, ``\\x1c``-``\\x1e``, ``\\x85``, U+2028 and U+2029, and
text-mode files at a lone ``\\r``: a prompt holding a form feed silently became two prompts, and a trace row
holding a lone ``\\r`` became two malformed rows (and shifted every later line number). The expected values
are the files' lines as written, split by hand at their ``\\n``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvpool.cli.generate import read_prompts
from kvpool.errors import TraceFormatError
from kvpool.trace.loaders import TraceRequest, load_trace

# every character str.splitlines() breaks at, besides \n, \r\n and a lone \r
OTHER_BREAKS = ["\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def _prompts(path: Path) -> list[str]:
    return read_prompts(argparse.Namespace(prompt=None, prompts_file=path))


@pytest.mark.parametrize("char", [*OTHER_BREAKS, "\r"])
def test_a_prompt_keeps_every_character_but_the_newline(tmp_path: Path, char: str) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(f"first{char}half\nsecond\n".encode())
    assert _prompts(path) == [f"first{char}half", "second"]


def test_prompts_file_line_endings_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    # \r\n ends a line like \n; blank and whitespace-only lines (a lone form feed too) are no prompt
    path.write_bytes("one\r\ntwo\n\n   \n\f\nthree\u2028four".encode())
    assert _prompts(path) == ["one", "two", "three\u2028four"]


MOONCAKE = '{"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [4, 9]}'


def test_a_mooncake_row_with_a_lone_carriage_return_is_one_row(tmp_path: Path) -> None:
    # a lone \r is JSON whitespace: the row is valid and stays one row
    row = MOONCAKE.replace(', "output_length"', ',\r"output_length"')
    path = tmp_path / "t.jsonl"
    path.write_bytes(f"{MOONCAKE}\n{row}\n".encode())
    assert load_trace(path).requests == [TraceRequest(0.0, 600, 7, (4, 9))] * 2
    # and the line numbers count \n: the bad row after it is line 3
    path.write_bytes(f"{MOONCAKE}\n{row}\nnot json\n".encode())
    with pytest.raises(TraceFormatError, match=rf"{path}:3: not a JSON object"):
        load_trace(path)
    path.write_bytes(f"{MOONCAKE}\r\n{MOONCAKE}\r\n".encode())  # \r\n files load as before
    assert len(load_trace(path).requests) == 2


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.5,100,10\n"


def test_an_azure_row_with_a_lone_carriage_return_is_one_malformed_row(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(f"{AZURE_HEAD}2023-11-16 18:17:04.0,1\r00,10\nnot a row\n2023-11-16 18:17:05.0,8,1\n"
                     .encode())
    with pytest.raises(TraceFormatError, match=rf"{path}:3: not a CSV row"):
        load_trace(path)
    # line 3 (the \r) and line 4 are malformed: two rows skipped, not three
    trace = load_trace(path, skip_malformed=True)
    assert trace.skipped == 2 and trace.requests == [TraceRequest(0.0, 100, 10), TraceRequest(1.5, 8, 1)]
    path.write_bytes(AZURE_HEAD.replace("\n", "\r\n").encode())  # \r\n files load as before
    assert load_trace(path).requests == [TraceRequest(0.0, 100, 10)]
