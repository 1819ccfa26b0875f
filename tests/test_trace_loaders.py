"""Trace loaders: the shipped traces against their READMEs and file text, malformed rows, hash expansion."""

import hashlib
import math
from pathlib import Path

import pytest

from kvpool.errors import ConfigError, TraceFormatError
from kvpool.trace.loaders import TraceRequest, detect_format, load_trace, shipped_trace_path

# From kvpool/trace/data/README.md (copied from the upstream commits named there).
MOONCAKE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
AZURE_SHA256 = "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6"
GOOD_MOONCAKE = '{"timestamp": 1500, "input_length": 600, "output_length": 7, "hash_ids": [4, 9]}\n'


def test_shipped_files_are_the_verbatim_copies_with_licenses() -> None:
    data = shipped_trace_path("mooncake").parent
    assert hashlib.sha256(shipped_trace_path("mooncake").read_bytes()).hexdigest() == MOONCAKE_SHA256
    assert hashlib.sha256(shipped_trace_path("azure").read_bytes()).hexdigest() == AZURE_SHA256
    assert "Apache License" in (data / "LICENSE-APACHE").read_text()
    assert "Attribution 4.0" in (data / "LICENSE-CC-BY-4.0").read_text()
    readme = (data / "README.md").read_text()
    assert "Mooncake" in readme and "Splitwise" in readme


def test_shipped_mooncake_matches_its_readme_and_first_row() -> None:
    trace = load_trace()  # no argument: the shipped Mooncake conversation trace
    assert trace.format == "mooncake" and trace.skipped == 0
    requests = trace.requests
    assert len(requests) == 12_031  # README: 12,031 rows
    # First line: {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, .., 13]}
    assert requests[0] == TraceRequest(0.0, 6758, 500, tuple(range(14)))
    # Upstream README table: average input 12,035 and output 343 tokens.
    assert round(sum(r.input_tokens for r in requests) / len(requests)) == 12_035
    assert round(sum(r.output_tokens for r in requests) / len(requests)) == 343
    assert all(len(r.hash_ids) == math.ceil(r.input_tokens / 512) for r in requests)


def test_shipped_azure_matches_its_readme_and_file_ends() -> None:
    trace = load_trace(fmt="azure")
    requests = trace.requests
    assert len(requests) == 8_819 and requests[0].hash_ids is None
    # Rows 1-2: 18:17:03.9799600,4808,10 and 18:17:04.0319600,3180,8; last: 19:14:19.9280160,549,173.
    assert (requests[0].arrival_s, requests[0].input_tokens, requests[0].output_tokens) == (0.0, 4808, 10)
    assert requests[1].arrival_s == pytest.approx(0.052, abs=1e-9)
    assert (requests[1].input_tokens, requests[1].output_tokens) == (3180, 8)
    assert requests[-1].arrival_s == pytest.approx(57 * 60 + 15.948056, abs=1e-6)
    assert (requests[-1].input_tokens, requests[-1].output_tokens) == (549, 173)


def test_max_requests_keeps_the_first_rows() -> None:
    full = load_trace().requests
    assert load_trace(max_requests=5).requests == full[:5]
    for bad in (0, -1, 2.5, True):  # -1 used to keep no row, 2.5 three rows
        with pytest.raises(ConfigError, match="max_requests"):
            load_trace(max_requests=bad)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BAD_MOONCAKE = [
    "not json at all",
    "[1, 2, 3]",
    '{"timestamp": 0, "input_length": 600, "output_length": 7}',
    '{"timestamp": 0, "input_length": 0, "output_length": 7, "hash_ids": []}',
    '{"timestamp": 0, "input_length": 600, "output_length": -1, "hash_ids": [1, 2]}',
    '{"timestamp": 0, "input_length": 600, "output_length": true, "hash_ids": [1, 2]}',
    '{"timestamp": 0, "input_length": 600.5, "output_length": 7, "hash_ids": [1, 2]}',
    '{"timestamp": -5, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}',
    '{"timestamp": "0", "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}',
    '{"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [1]}',
    '{"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [1, 2, 3]}',
    '{"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [1, "x"]}',
    '{"timestamp": 0, "input_length": 600, "output_length": 7, "hash_ids": [3, 3]}',
    '{"timestamp": Infinity, "input_length": 600, "output_length": 7, "hash_ids": [1, 2]}',
]


@pytest.mark.parametrize("bad", BAD_MOONCAKE)
def test_malformed_mooncake_row_names_file_and_line(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, "t.jsonl", GOOD_MOONCAKE + "\n" + bad + "\n" + GOOD_MOONCAKE)
    with pytest.raises(TraceFormatError, match=rf"{path}:3: "):  # line 2 is blank and is not a row
        load_trace(path)


def test_skip_malformed_counts_and_keeps_the_good_rows(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.jsonl", GOOD_MOONCAKE + "\n".join(BAD_MOONCAKE) + "\n" + GOOD_MOONCAKE)
    trace = load_trace(path, skip_malformed=True)
    assert trace.skipped == len(BAD_MOONCAKE)
    assert trace.requests == [TraceRequest(0.0, 600, 7, (4, 9))] * 2  # both at 1500 ms: 0 s after the first


def test_arrivals_are_relative_to_the_first_row(tmp_path: Path) -> None:
    later = GOOD_MOONCAKE.replace("1500", "4000")
    trace = load_trace(_write(tmp_path, "t.jsonl", GOOD_MOONCAKE + later))
    assert [r.arrival_s for r in trace.requests] == [0.0, 2.5]


AZURE_HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.5,100,10\n"


@pytest.mark.parametrize("bad", [
    "2023-11-16 18:17:04.0,abc,10", "2023-11-16 18:17:04.0,100", "yesterday,100,10",
    "2023-11-16 18:17:04.x,100,10", "2023-11-16 18:17:04.0,0,10", "2023-11-16 18:17:04.0,5,-1",
])
def test_malformed_azure_row_names_file_and_line(tmp_path: Path, bad: str) -> None:
    path = _write(tmp_path, "t.csv", AZURE_HEAD + bad + "\n")
    with pytest.raises(TraceFormatError, match=rf"{path}:3: "):
        load_trace(path)
    trace = load_trace(path, skip_malformed=True)
    assert trace.skipped == 1 and trace.requests == [TraceRequest(0.0, 100, 10)]


def test_azure_wrong_header_is_line_one_and_never_skipped(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.csv", "time,prompt,output\n2023-11-16 18:17:03.5,100,10\n")
    with pytest.raises(TraceFormatError, match=rf"{path}:1: "):
        load_trace(path, skip_malformed=True)


def test_azure_fractional_seconds(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.csv", AZURE_HEAD + "2023-11-16 18:17:05.25,7,0\n2023-11-16 18:18:00,8,1\n")
    assert [r.arrival_s for r in load_trace(path).requests] == [0.0, 1.75, 56.5]


def test_format_detection_and_unknown_formats(tmp_path: Path) -> None:
    assert detect_format("a/b.jsonl") == "mooncake" and detect_format("x.CSV") == "azure"
    with pytest.raises(ConfigError, match="format"):
        detect_format("trace.txt")
    with pytest.raises(ConfigError, match="format"):
        load_trace(fmt="parquet")
    path = _write(tmp_path, "trace.log", GOOD_MOONCAKE)
    assert load_trace(path, "mooncake").requests[0].input_tokens == 600


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        load_trace(tmp_path / "nope.jsonl")


# Block hash expansion, by hand: ids (7, 9), 700 prompt tokens; sub-block j of id h is h * k + j, k = 512 / B.
@pytest.mark.parametrize(("block_size", "expected"), [
    (512, [7]),                             # 700 // 512 = 1 full block
    (256, [14, 15]),                        # k = 2: 2 full blocks, both inside id 7
    (128, [28, 29, 30, 31, 36]),            # k = 4: 5 full blocks, the 5th is (9, 0) = 36
    (64, [56, 57, 58, 59, 60, 61, 62, 63, 72, 73]),  # k = 8: 10 full blocks
])
def test_block_hashes_expand_full_sub_blocks_only(block_size: int, expected: list[int]) -> None:
    assert TraceRequest(0.0, 700, 1, (7, 9)).block_hashes(block_size) == expected


def test_block_hashes_exact_multiple_and_no_ids() -> None:
    assert TraceRequest(0.0, 1024, 0, (3, 5)).block_hashes(256) == [6, 7, 10, 11]
    assert TraceRequest(0.0, 1024, 0).block_hashes(100) == []


@pytest.mark.parametrize("block_size", [100, 1024, 0])
def test_block_size_must_divide_512(block_size: int) -> None:
    with pytest.raises(ConfigError, match="divide 512"):
        TraceRequest(0.0, 1024, 0, (3, 5)).block_hashes(block_size)


def test_missing_field_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path, "t.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 7}\n')
    with pytest.raises(TraceFormatError, match=r"t.jsonl:1: missing field 'hash_ids'"):
        load_trace(path)


@pytest.mark.parametrize("name", ["t.jsonl", "t.csv"])
def test_a_file_that_is_not_utf8_is_a_trace_format_error(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        load_trace(path, skip_malformed=True)
