"""``kvpool plan``: the JSON keys and numbers (worked out by hand), human output, and one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool.cli import main

CONFIGS = Path(__file__).parent / "configs"
LLAMA_8B = str(CONFIGS / "llama-3.1-8b.json")
GiB = 2**30
REQUIRED = ("num_layers", "num_kv_heads_per_rank", "head_dim", "kv_dtype_bytes", "bytes_per_token",
            "bytes_per_block", "available_kv_bytes", "num_blocks", "max_num_tokens")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["plan", *argv])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert (code, err) == (0, "")
    return json.loads(out)  # exactly one JSON document, nothing else on stdout


def test_json_llama_8b_on_80_gib(capsys):
    data = run_json(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--non-kv-memory", "16GiB")
    # 2 x 32 x 8 x 128 x 2 B = 131072 B per token, x 16 = 2097152 per block;
    # floor(80 GiB x 0.9) = 77309411328; - 16 GiB = 60129542144 B = 56 GiB; / 2 MiB = 28672 blocks
    expected = {"num_layers": 32, "num_kv_heads_per_rank": 8, "head_dim": 128, "kv_dtype_bytes": 2,
                "bytes_per_token": 131072, "bytes_per_block": 2097152, "available_kv_bytes": 60129542144,
                "num_blocks": 28672, "max_num_tokens": 28672 * 16}
    assert {key: data[key] for key in REQUIRED} == expected
    assert all(type(data[key]) is int for key in REQUIRED)
    assert "max_concurrency" not in data


def test_json_max_model_len_tp_fp8(capsys):
    config = str(CONFIGS / "llama-3.1-70b.json")
    data = run_json(capsys, config, "--gpu-memory", "80GiB", "--non-kv-memory", "20GiB", "--tp-size", "8",
                    "--kv-cache-dtype", "fp8", "--block-size", "32", "--gpu-memory-utilization", "0.95",
                    "--max-model-len", "131072")
    # per rank: 80 layers x 2 x (8 / 8 = 1) head x 128 x 1 B = 20480 B per token, x 32 = 655360 per block;
    # floor(80 GiB x 0.95) = 81604378624; - 20 GiB = 60129542144; // 655360 = 91750 blocks (2936000 tokens)
    assert (data["num_kv_heads_per_rank"], data["kv_dtype_bytes"], data["bytes_per_token"]) == (1, 1, 20480)
    assert (data["bytes_per_block"], data["available_kv_bytes"], data["num_blocks"]) == (655360, 60129542144,
                                                                                       91750)
    assert data["max_concurrency"] == pytest.approx(91750 * 32 / 131072)  # 22.399...


def test_mla_and_directory_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "deepseek-v2-lite.json").read_text())
    data = run_json(capsys, str(tmp_path), "--gpu-memory", "24GiB", "--non-kv-memory", "16000MiB",
                    "--gpu-memory-utilization", "1")
    # MLA: 27 x (512 + 64) x 2 B = 31104 B per token, x 16 = 497664 per block, one latent "head" of 576;
    # 24576 MiB - 16000 MiB = 8576 MiB = 8992587776 B; 497664 x 18069 = 8992290816 <= it < 497664 x 18070
    assert (data["bytes_per_token"], data["num_kv_heads_per_rank"], data["head_dim"]) == (31104, 1, 576)
    assert (data["available_kv_bytes"], data["num_blocks"]) == (8992587776, 18069)


def test_human_output(capsys):
    code, out, err = run(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--non-kv-memory", "16GiB",
                         "--max-model-len", "8192")
    assert (code, err) == (0, "")
    for text in ("131,072 B", "2,097,152 B", "60,129,542,144 B", "28,672", "458,752", "56.00 requests"):
        assert text in out
    # Llama-3.1-8B's config: 32 layers, 32 query heads, 8 KV heads of 128: GQA, no window
    assert out.splitlines()[0] == ("KV layout        GQA: 32 layers x 2 (K, V) x 8 KV heads x 128 x 2 B "
                                   "(bfloat16), 32 query heads")
    assert "sliding" not in out


@pytest.mark.parametrize(("config", "tp", "first_lines"), [
    # Mistral-7B-v0.1: 32 query / 8 KV heads, window 4096; tp 2 splits the KV heads 4 per rank
    ("mistral-7b-v0.1", "2", ["KV layout        GQA: 32 layers x 2 (K, V) x 4 KV heads per rank x 128 x 2 B "
                              "(bfloat16), 32 query heads, tensor parallel 2 (of 8 KV heads)",
                              "KV dtype         bfloat16 (auto: the config's bfloat16)",
                              "per token        65,536 B", "per block        1,048,576 B (16 tokens)",
                              "KV cache groups  1 group of 32 layer slots per block",
                              "  group 0        sliding_attention (window 4096), 32 layers "
                              "[0,1,2,3,4,5,...]"]),
    # Falcon-7B: multi-query, 71 query heads and 1 KV head, replicated on both ranks
    ("falcon-7b", "2", ["KV layout        MQA: 32 layers x 2 (K, V) x 1 KV head per rank x 64 x 2 B "
                        "(bfloat16), 71 query heads, tensor parallel 2 (replicated)"]),
    # Phi-3-mini: 32 and 32 heads (MHA), window 2047
    ("phi-3-mini-4k-instruct", "1", ["KV layout        MHA: 32 layers x 2 (K, V) x 32 KV heads x 96 x 2 B "
                                     "(bfloat16), 32 query heads",
                                     "KV dtype         bfloat16 (auto: the config's bfloat16)",
                                     "per token        393,216 B",
                                     "per block        6,291,456 B (16 tokens)",
                                     "KV cache groups  1 group of 32 layer slots per block",
                                     "  group 0        sliding_attention (window 2047), 32 layers "
                                     "[0,1,2,3,4,5,...]"]),
    ("deepseek-v3", "2", ["KV layout        MLA: 61 layers x 1 latent x 576 x 2 B (bfloat16), not split by "
                          "tensor parallelism"]),
])
def test_human_layout_names_the_attention_and_the_window(capsys, config, tp, first_lines):
    code, out, _ = run(capsys, str(CONFIGS / f"{config}.json"), "--gpu-memory", "80GiB", "--tp-size", tp)
    assert code == 0 and out.splitlines()[:len(first_lines)] == first_lines


def one_line_error(capsys, *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.mark.parametrize(("bad", "why"), [("80GB", "byte count"), ("lots", "byte count"),
                                         ("-1GiB", "byte count"), ("1.5B", "whole number")])
def test_bad_bytes(capsys, bad, why):
    err = one_line_error(capsys, LLAMA_8B, f"--gpu-memory={bad}")
    assert "--gpu-memory" in err and why in err


def test_tp_that_cannot_split_names_both_numbers(capsys):
    err = one_line_error(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--tp-size", "3")
    assert "tp_size 3" in err and "num_kv_heads 8" in err


def test_unknown_kv_dtype_lists_accepted(capsys):
    err = one_line_error(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--kv-cache-dtype", "int4")
    assert "'int4'" in err and "fp8_e5m2" in err and "bfloat16" in err


def test_missing_config(capsys, tmp_path):
    err = one_line_error(capsys, str(tmp_path), "--gpu-memory", "80GiB")
    assert "no config file" in err


def test_missing_field(capsys, tmp_path):
    # a model type transformers does not know either, so nothing can fill the field
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 64}))
    err = one_line_error(capsys, str(tmp_path), "--gpu-memory", "80GiB")
    assert "num_hidden_layers" in err


def test_too_little_memory(capsys):
    err = one_line_error(capsys, LLAMA_8B, "--gpu-memory", "16GiB", "--non-kv-memory", "16GiB")
    # floor(16 GiB x 0.9) = 15461882265 B (14.40 GiB) - 16 GiB = 1717986919 B (1.60 GiB) over the budget;
    # one 2 MiB block more: 1720084071 B = 1.60 GiB missing
    assert "exceeds the budget 14.40 GiB (total x gpu_memory_utilization) by 1.60 GiB" in err
    assert "(1.60 GiB missing)" in err and "available" not in err


def test_sliding_window_too_big(capsys):
    # Mistral-7B-v0.1, window 4096, 256 tokens per step: cdiv(4096 - 2 + 256, 16) + 1 = 273 blocks of 2 MiB
    # and the null block: 274 = 548 MiB; 512 MiB x 1.0 holds 256
    mistral = str(CONFIGS / "mistral-7b-v0.1.json")
    err = one_line_error(capsys, mistral, "--gpu-memory", "512MiB", "--gpu-memory-utilization", "1")
    assert "sliding window of 4096 tokens at 256 tokens per step and the null block" in err
    assert "needs 548.00 MiB" in err and "274 blocks of 2.00 MiB" in err and "(36.00 MiB missing)" in err
    # one token per step: cdiv(4095, 16) + 1 = 257 + the null block = 258 blocks = 516 MiB
    err = one_line_error(capsys, mistral, "--gpu-memory", "512MiB", "--gpu-memory-utilization", "1",
                         "--max-num-batched-tokens", "1")
    assert "needs 516.00 MiB" in err and "258 blocks of 2.00 MiB" in err and "(4.00 MiB missing)" in err


@pytest.mark.parametrize("argv", [("--gpu-memory-utilization", "1.5"), ("--gpu-memory-utilization", "x"),
                                  ("--block-size", "0"), ("--tp-size", "two"), ("--max-model-len", "-4")])
def test_bad_numbers(capsys, argv):
    one_line_error(capsys, LLAMA_8B, "--gpu-memory", "80GiB", *argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_no_gpu_memory_without_cuda(capsys):
    err = one_line_error(capsys, LLAMA_8B)
    assert "--gpu-memory" in err and "no CUDA device" in err


def test_module_entry_point():
    ok = subprocess.run([sys.executable, "-m", "kvpool", "plan", LLAMA_8B, "--gpu-memory", "80GiB",
                         "--non-kv-memory", "16GiB", "--json"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and json.loads(ok.stdout)["num_blocks"] == 28672
    bad = subprocess.run([sys.executable, "-m", "kvpool", "plan", LLAMA_8B, "--gpu-memory", "80GB"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_json_and_human_output_report_the_block_hasher_never_the_seed(capsys, monkeypatch):
    seed = "fleet secret that must not leak"
    monkeypatch.setenv("KVPOOL_HASH_SEED", seed)
    data = run_json(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--hash-shared")
    assert data["hashing"] == {"algorithm": "sha256", "cryptographic": True, "seeded": True,
                               "seed_source": "KVPOOL_HASH_SEED", "shared": True}
    code, out, _ = run(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--hash-algorithm", "blake2b")
    assert code == 0 and "block hashes     blake2b, root seeded (KVPOOL_HASH_SEED), process-local" in out
    assert seed not in out
    monkeypatch.delenv("KVPOOL_HASH_SEED")
    data = run_json(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--hash-shared", "--hash-algorithm", "blake2b")
    assert (data["hashing"]["seeded"], data["hashing"]["seed_source"]) == (False, "none")
    data = run_json(capsys, LLAMA_8B, "--gpu-memory", "80GiB")  # process-local: a random root
    assert (data["hashing"]["seeded"], data["hashing"]["seed_source"], data["hashing"]["shared"]) == (
        True, "random", False)


def test_bad_hash_seed_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setenv("KVPOOL_HASH_SEED", "too short")
    err = one_line_error(capsys, LLAMA_8B, "--gpu-memory", "80GiB")
    assert "KVPOOL_HASH_SEED" in err and "16 bytes" in err and "too short" not in err


def test_max_num_batched_tokens_sets_the_windows_blocks(capsys):
    mistral = str(CONFIGS / "mistral-7b-v0.1.json")
    argv = (mistral, "--gpu-memory", "80GiB", "--non-kv-memory", "15GiB", "--max-model-len", "32768")
    # 57 GiB = 29184 blocks of 2 MiB, one the null block; per 32K request at T tokens per step
    # cdiv(4096 - 2 + T, 16) + 1: T 256 (default) 273, T 2048 (--max-batched-tokens, the other commands'
    # name) cdiv(6142, 16) + 1 = 385: 29183 / 385 = 75.80 (vLLM: 29184 / 385 = 75.80)
    default = run_json(capsys, *argv)
    assert (default["max_num_batched_tokens"], default["blocks_per_request"]) == (256, 273)
    assert default["max_concurrency"] == pytest.approx(29183 / 273)
    for option in ("--max-num-batched-tokens", "--max-batched-tokens"):
        data = run_json(capsys, *argv, option, "2048")
        assert (data["max_num_batched_tokens"], data["blocks_per_request"]) == (2048, 385)
        assert round(data["max_concurrency"], 2) == 75.80 and data["context_tokens"] == 29183 * 32768 // 385
        assert not any("tokens per step assumed" in note for note in data["notes"])
    assert any("256 tokens per step assumed" in note for note in default["notes"])
    one_line_error(capsys, *argv, "--max-num-batched-tokens", "0")


def test_hybrid_headline_says_what_it_counts(capsys):
    # issue 23, item 3: Gemma-3-27B with 54 GiB non-KV: 14745 blocks over 7 KV cache groups
    argv = ("gemma-3-27b", "--gpu-memory", "80GiB", "--non-kv-memory", "54GiB", "--max-model-len", "131072")
    data = run_json(capsys, *argv)
    # token slots 14745 x 16 = 235920; per group 14745 // 7 = 2106 blocks x 16 = 33696 tokens (vLLM 0.19's
    # "GPU KV cache size"); context: floor(14744 / 8678 x 131072) = 222692 (vLLM 0.33's)
    assert (data["num_groups"], data["max_num_tokens"], data["tokens_per_group"]) == (7, 235920, 33696)
    assert (data["num_null_blocks"], data["context_tokens"]) == (1, 222692)
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "per block        1,310,720 B (16 tokens x 10 layer slots: one KV cache group's block)" in out
    assert "token slots      235,920 (14,745 blocks x 16, over 7 KV cache groups" in out
    assert "tokens           33,696 per group" in out and "222,692 tokens" in out
    assert "block 0 the null block" in out
    # a uniform model: one group, tokens are token slots, no null block and no context line
    code, out, _ = run(capsys, LLAMA_8B, "--gpu-memory", "80GiB", "--non-kv-memory", "16GiB",
                       "--max-model-len", "8192")
    assert "tokens           458,752\n" in out and "token slots" not in out and "null block" not in out
    assert "context" not in out


@pytest.mark.parametrize(("config", "rule", "noted"), [
    ("llama-3.1-8b", "auto: the config's bfloat16", False),
    ("gpt-oss-20b", "auto: the config names no dtype: vLLM takes it as float32 and casts it down to bfloat16",
     True),
])
def test_kv_dtype_rule_and_its_note(capsys, config, rule, noted):
    data = run_json(capsys, config, "--gpu-memory", "80GiB", "--non-kv-memory", "16GiB")
    assert (data["kv_dtype"], data["kv_dtype_rule"]) == ("bfloat16", rule)
    assert any(note.startswith("KV dtype bfloat16 assumed") for note in data["notes"]) is noted
    data = run_json(capsys, config, "--gpu-memory", "80GiB", "--kv-cache-dtype", "fp8")
    assert (data["kv_dtype"], data["kv_dtype_rule"]) == ("float8_e4m3fn", "--kv-cache-dtype fp8")


def test_gemma2_in_float32_plans_what_vllm_runs(capsys, tmp_path):
    # issue 20, item 15: google/gemma-2-9b names float32; vLLM casts it down to bfloat16. 2 groups of 21
    # layers: a block is 21 x (2 x 8 x 256 x 2 B) x 16 = 2752512 B; 20 GiB // 2752512 = 7801 blocks
    # (float32 would give 3900)
    config = json.loads((CONFIGS / "gemma-2-9b-it.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))
    data = run_json(capsys, str(tmp_path), "--gpu-memory", "80GiB", "--non-kv-memory", "52GiB")
    assert (data["kv_dtype"], data["bytes_per_block"], data["num_blocks"]) == ("bfloat16", 2752512, 7801)
    assert data["kv_dtype_rule"] == "auto: the config's float32, cast down to bfloat16 as vLLM does"


def test_notes_name_every_assumption(capsys):
    data = run_json(capsys, "gpt-oss-20b", "--gpu-memory", "80GiB")
    notes = data["notes"]
    assert len(notes) == 3
    assert notes[0].startswith("KV dtype bfloat16 assumed (the config names no dtype")
    assert notes[1].startswith("non-KV memory 0 B: the model's weights") and "72.00 GiB budget" in notes[1]
    assert notes[2].startswith("256 tokens per step assumed")
    code, out, _ = run(capsys, "gpt-oss-20b", "--gpu-memory", "80GiB")
    assert [line for line in out.splitlines() if line.startswith("note: ")] == [f"note: {n}" for n in notes]
    # every assumption given: no note
    data = run_json(capsys, "gpt-oss-20b", "--gpu-memory", "80GiB", "--non-kv-memory", "14GiB",
                    "--kv-cache-dtype", "bfloat16", "--max-num-batched-tokens", "2048")
    assert data["notes"] == []


@pytest.mark.parametrize("option", ["--gpu-memory", "--non-kv-memory"])
@pytest.mark.parametrize("bare", ["80", "1", "1048575"])
def test_a_memory_size_without_a_unit_below_any_gpu_is_refused(capsys, option, bare):
    # issue 23, item 4: --gpu-memory 80 was 80 bytes; a bare number under 1 MiB names no real memory
    argv = ["--gpu-memory", "80GiB"] if option == "--non-kv-memory" else []
    err = one_line_error(capsys, LLAMA_8B, *argv, option, bare)
    assert f"'{bare}' has no unit" in err and f"{bare}GiB" in err


def test_memory_sizes_with_a_unit_or_in_full_are_taken(capsys):
    data = run_json(capsys, LLAMA_8B, "--gpu-memory", "85899345920", "--non-kv-memory", "0")
    assert (data["total_bytes"], data["non_kv_bytes"]) == (80 * GiB, 0)
    err = one_line_error(capsys, LLAMA_8B, "--gpu-memory", "80B")  # bytes said outright: too little memory
    assert "has no unit" not in err and "needs 2.00 MiB for one block" in err


@pytest.mark.parametrize("name", ["gemma-3-27b", "llama-3.1-8b", "qwen2.5-0.5b", "mistral-7b-v0.1",
                                  "gpt-oss-20b", "gemma-3-4b"])
def test_built_in_configs_by_name(capsys, name):
    # each built-in is the published config (tests/configs holds the same files): the same plan
    source = {"gemma-3-27b": "gemma-3-27b-it", "gemma-3-4b": "gemma-3-4b-it"}.get(name, name)
    by_name = run_json(capsys, name, "--gpu-memory", "80GiB", "--non-kv-memory", "16GiB")
    by_file = run_json(capsys, str(CONFIGS / f"{source}.json"), "--gpu-memory", "80GiB", "--non-kv-memory",
                       "16GiB")
    assert by_name == by_file


def test_unknown_config_name_lists_the_built_ins(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(capsys, "mistral-7b", "--gpu-memory", "80GiB")
    assert "no config file at mistral-7b" in err and "gemma-3-27b" in err and "mistral-7b-v0.1" in err
    # a folder of that name wins over the built-in
    (tmp_path / "llama-3.1-8b").mkdir()
    (tmp_path / "llama-3.1-8b" / "config.json").write_text((CONFIGS / "qwen2.5-0.5b.json").read_text())
    assert run_json(capsys, "llama-3.1-8b", "--gpu-memory", "80GiB")["num_layers"] == 24


def test_help_lists_the_built_in_configs(capsys):
    from kvpool.spec.hf_config import BUILTIN_CONFIGS

    assert main(["plan", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in BUILTIN_CONFIGS) and "--max-num-batched-tokens" in text


def _limited_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (6 * GiB, 6 * GiB))  # a per-layer list of 2**31 would need 16 GiB


def _deep_config(tmp_path: Path, config: str, layers: int) -> str:
    data = json.loads((CONFIGS / f"{config}.json").read_text())
    text = data.get("text_config") or data
    text["num_hidden_layers"] = layers
    text.pop("layer_types", None)  # the file's own list would have the wrong length, caught anyway
    (tmp_path / "config.json").write_text(json.dumps(data))
    return str(tmp_path)


@pytest.mark.parametrize("value", [2**16 + 1, 2**20])
@pytest.mark.parametrize("config", ["qwen2.5-0.5b", "gemma-3-27b-it", "gemma-3-4b-it", "gpt-oss-20b",
                                    "llama-4-scout-17b-16e"])
def test_a_config_asking_for_more_layers_than_exist_is_one_line(capsys, tmp_path, config, value):
    # issue 20, item 9: a layer count past any model is refused before anything is built per layer,
    # whichever per-layer rule the model type has (gemma-3-4b's sparse config also goes to transformers,
    # whose config class would build its own list); 2**31 - 1 in a subprocess below
    err = one_line_error(capsys, _deep_config(tmp_path, config, value), "--gpu-memory", "80GiB")
    assert f"is {value:,}: more layers than any model has (at most 65,536" in err


def test_the_largest_layer_count_is_refused_in_seconds_and_little_memory(tmp_path):
    # 2**31 - 1 layers built a per-layer list of 2**31 (16 GiB, minutes, MemoryError or the OOM killer)
    done = subprocess.run([sys.executable, "-m", "kvpool", "plan", _deep_config(tmp_path, "gemma-3-27b-it",
                                                                                 2**31 - 1),
                           "--gpu-memory", "80GiB"], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limited_memory)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.count("\n") == 1 and "2,147,483,647: more layers than any model has" in done.stderr


def test_the_largest_layer_count_plans():
    from kvpool.spec import KVCacheSpec
    from kvpool.spec.hf_config import MAX_LAYERS
    from kvpool.spec.planner import MemoryReadings, plan_pool

    # 65536 layers, Gemma 3's pattern (every 6th full): 10922 full, 54614 sliding; 1 KV head of 8, fp8:
    # 2 x 1 x 8 x 1 B = 16 B per layer-token
    spec = KVCacheSpec(num_layers=MAX_LAYERS, num_kv_heads=1, head_dim=8, dtype="fp8", sliding_window=16,
                       layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention"
                                    for i in range(MAX_LAYERS)])
    assert sum(len(g.layers) for g in spec.groups) == MAX_LAYERS
    assert plan_pool(spec, MemoryReadings(80 * GiB, 0)).num_blocks > 0
    with pytest.raises(Exception, match="65,537: more layers than any model has"):
        KVCacheSpec(num_layers=MAX_LAYERS + 1, num_kv_heads=1, head_dim=8)


def test_the_local_device_reading_says_the_model_is_not_counted(capsys, monkeypatch):
    from kvpool.cli import plan as plan_cli
    from kvpool.spec.planner import MemoryReadings

    # a device of 80 GiB with 2 GiB in use (CUDA context, other processes) and 78 GiB free
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plan_cli, "profile_cuda_memory", lambda: MemoryReadings(80 * GiB, 2 * GiB, 78 * GiB))
    code, out, _ = run(capsys, "llama-3.1-8b")
    lines = out.splitlines()
    assert code == 0 and lines.index("  free now       83,751,862,272 B") + 1 == [
        i for i, line in enumerate(lines) if line.startswith("= KV memory")][0]
    assert lines[-1] == ("note: non-KV memory is what the device uses now (2.00 GiB); the model is not "
                         "loaded by this command: add its weights and activations with --non-kv-memory")
    data = run_json(capsys, "llama-3.1-8b", "--non-kv-memory", "16GiB")
    assert (data["non_kv_bytes"], data["notes"]) == (18 * GiB, [])  # 2 GiB in use + 16 GiB given
