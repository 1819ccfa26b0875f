"""Next-token sampling: greedy by default; temperature, top-k and top-p with a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.errors import InvalidArgumentError
from kvpool.numeric import as_int, as_real, as_seed


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Args:
        max_new_tokens: tokens to generate at most (>= 1).
        temperature: 0 means greedy (argmax); > 0 divides the logits before sampling (any finite value:
            a tiny one samples the argmax tokens, see :func:`probabilities`).
        top_k: keep the k most likely tokens (0 keeps all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 keeps all).
        seed: seeds the request's own ``torch.Generator`` (an integer in ``[0, 2**64 - 1]``; None: a fixed
            default of 0), so a preempted and recomputed request draws the same tokens.
        ignore_eos: keep generating past an end-of-sequence token (a bool).

    Counts and seeds are integers, temperature and top_p numbers, by the rule of :mod:`kvpool.numeric`
    (numpy scalars are converted; bools, strings, None and floats for counts are not accepted).

    Raises:
        InvalidArgumentError: a value of the wrong type or out of its range.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checked = {
            "max_new_tokens": as_int(self.max_new_tokens, "max_new_tokens", minimum=1),
            "temperature": as_real(self.temperature, "temperature", minimum=0, finite=True),
            "top_k": as_int(self.top_k, "top_k", minimum=0),
            "top_p": as_real(self.top_p, "top_p", minimum=0, maximum=1, open_min=True),
            "seed": None if self.seed is None else as_seed(self.seed),
        }
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def make_generator(self) -> torch.Generator:
        """A CPU generator seeded with ``seed`` (0 when None)."""
        return torch.Generator().manual_seed(0 if self.seed is None else self.seed)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample` draws from for ``params`` (not greedy): ``softmax(logits / T)``
    ``[V]`` float64 on the CPU, after top-k and top-p.

    Computed as ``softmax((logits - max) / T)`` in float64, which is the same distribution and finite for
    every accepted temperature: the largest logit scores 0, the others at most 0, so no score overflows
    (``logits / 1e-30`` in float32 is inf, and softmax of inf is NaN), and a temperature too small for
    float32 (a denormal 1e-45, 1e-300) stays nonzero. As T -> 0 it is greedy: the argmax tokens share
    the probability, every other token gets 0 once its gap to the max exceeds ~745 T.
    """
    scores = logits.detach().to("cpu", torch.float64)
    scores = (scores - scores.max()) / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= params.top_p  # keeps the token that crosses top_p
        scores[order[drop]] = float("-inf")
    return scores.softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick one token id from ``logits`` ``[V]`` (any float dtype, any device): the argmax when greedy,
    else a draw from :func:`probabilities` with ``generator``."""
    if params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))
