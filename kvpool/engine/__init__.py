"""The reference engine: Hugging Face models with their KV in kvpool (see :mod:`kvpool.engine.engine`)."""

from kvpool.engine.engine import EngineStats, LLMEngine, Request, RequestStatus
from kvpool.engine.sampling import SamplingParams

__all__ = ["EngineStats", "LLMEngine", "Request", "RequestStatus", "SamplingParams"]
