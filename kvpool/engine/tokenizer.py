"""The tiny random models' tokenizer: UTF-8 bytes as token ids 0..255, a transformers tokenizer.

:class:`ByteTokenizer` subclasses ``transformers.PreTrainedTokenizer`` (the documented base of a Python
tokenizer) and defines only the vocabulary, so everything a tokenizer passed to transformers is asked for is
transformers' own: ``tokenizer(texts, padding=True, return_tensors="pt")`` with an attention mask,
``pad_token_id``, ``batch_decode``, ``save_pretrained``.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizer

#: The padding token: byte 0 (NUL). The models' vocabulary is the 256 bytes, so there is no id outside
#: them to give it; a padded position is told apart by the attention mask, as in transformers' ``generate``.
PAD_TOKEN = "\x00"


class ByteTokenizer(PreTrainedTokenizer):
    """UTF-8 bytes as token ids 0..255 (one token per byte, no special token added to a text), padding on
    the left with byte 0 (:data:`PAD_TOKEN`, ``pad_token_id`` 0) as decoder-only generation pads. No
    end-of-sequence token (the tiny models have none) and no chat template. ``decode`` of ids that are not
    UTF-8 puts U+FFFD in their place; ``skip_special_tokens=True`` drops the padding bytes."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("pad_token", PAD_TOKEN)
        kwargs.setdefault("padding_side", "left")
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {chr(i): i for i in range(256)}

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [chr(b) for b in text.encode("utf-8")]

    def _convert_token_to_id(self, token: str) -> int:
        return ord(token)

    def _convert_id_to_token(self, index: int) -> str:
        return chr(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(ord(t) for t in tokens).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        return ()  # the vocabulary is the 256 bytes: no file
