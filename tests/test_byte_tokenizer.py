"""The tiny models' ``ByteTokenizer`` is a transformers tokenizer (issue 30, the new user's item 7: a
reference check with transformers crashed on its missing ``pad_token_id``).

transformers' own batched ``generate`` over a left-padded batch the tokenizer builds must give every prompt
the greedy tokens transformers gives it alone, unpadded (an attention model and a recurrent hybrid, whose
mixers mask the padding themselves); the ids are the prompts' UTF-8 bytes (Python's encoder).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvpool.engine.models import load_model, reference_greedy  # noqa: E402

TEXTS = ["KV blocks", "a longer prompt, with more bytes: \u00e9t\u00e9", "x"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-lfm2"])
def test_transformers_batched_generate_with_padding(name: str) -> None:
    loaded = load_model(name, seed=1)
    tok = loaded.tokenizer
    batch = tok(TEXTS, padding=True, return_tensors="pt")
    lengths = [9, 39, 1]  # 34 ASCII + "été" (2 + 1 + 2 bytes) in the second
    assert batch["input_ids"].shape == (3, 39)
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths  # pads on the left, masked
    assert batch["input_ids"][0, :30].eq(tok.pad_token_id).all() and tok.pad_token_id == 0
    with torch.inference_mode():
        out = loaded.model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    for row, text in zip(out, TEXTS, strict=True):
        alone = reference_greedy(loaded.model, list(text.encode("utf-8")), 8)[0]
        assert row[39:].tolist() == alone, (name, text)
    assert tok.batch_decode(out[:, :39], skip_special_tokens=True) == TEXTS


def test_the_ids_are_the_bytes_and_decode_inverts_them() -> None:
    loaded = load_model("tiny-llama")
    tok = loaded.tokenizer
    text = "h\u00e9llo\x00\u2028\U0001f600"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and loaded.encode(text) == ids  # what the engine encodes
    assert tok.decode(ids) == text
    assert tok.decode([104, 0, 105], skip_special_tokens=True) == "hi"  # the padding byte dropped
    assert tok.decode([0xFF]) == "\ufffd" and len(tok) == 256 and tok.eos_token_id is None
