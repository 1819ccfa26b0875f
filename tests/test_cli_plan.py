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
                              "per token        65,536 B", "per block        1,048,576 B (16 tokens)",
                              "KV cache groups  1 group of 32 layer slots per block",
                              "  group 0        sliding_attention (window 4096), 32 layers "
                              "[0,1,2,3,4,5,...]"]),
    # Falcon-7B: multi-query, 71 query heads and 1 KV head, replicated on both ranks
    ("falcon-7b", "2", ["KV layout        MQA: 32 layers x 2 (K, V) x 1 KV head per rank x 64 x 2 B "
                        "(bfloat16), 71 query heads, tensor parallel 2 (replicated)"]),
    # Phi-3-mini: 32 and 32 heads (MHA), window 2047
    ("phi-3-mini-4k-instruct", "1", ["KV layout        MHA: 32 layers x 2 (K, V) x 32 KV heads x 96 x 2 B "
                                     "(bfloat16), 32 query heads", "per token        393,216 B",
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
    # Mistral-7B-v0.1: window 4096 needs 257 blocks of 2 MiB = 538968064 B; 512 MiB x 1.0 holds 256
    err = one_line_error(capsys, str(CONFIGS / "mistral-7b-v0.1.json"), "--gpu-memory", "512MiB",
                         "--gpu-memory-utilization", "1")
    assert "sliding window of 4096 tokens" in err and "(2.00 MiB missing)" in err
    assert "needs 514.00 MiB" in err and "257 blocks of 2.00 MiB" in err and "only 512.00 MiB" in err


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
