"""The target's sampling distribution, used identically by plain decoding and by tree acceptance.

Order as in llama.cpp's default chain: repetition penalty, top-k, top-p, min-p (the last three on the
untempered distribution), then temperature. temperature == 0 is greedy: the argmax, lowest id on ties.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from edge.errors import UserError

_TOP_P_PREFIX = 1024  # sort only this many candidates when they already hold top_p of the mass


MIN_PENALTY, MAX_PENALTY = 0.01, 100.0  # repetition penalties past these overflow float32 logits


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # the window the three penalties look at
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted from the logit of every token in the window (OpenAI's, llama.cpp's)
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the window

    def __post_init__(self) -> None:
        for name in ("top_k", "repeat_last_n", "seed"):
            value = getattr(self, name)
            if not (value is None and name == "seed") and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise UserError(f"{name} must be a whole number (got {value!r})", name)
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise UserError(f"{name} must be a number (got {value!r})", name)
        checks = [
            (0 <= self.temperature < float("inf"), "temperature",
             f"temperature must be >= 0 and finite (got {self.temperature})"),
            (self.seed is None or 0 <= self.seed < 1 << 63, "seed", f"seed must be 0 to 2^63 - 1 (got {self.seed})"),
            (self.top_k >= 0, "top_k", f"top_k must be >= 0, 0 turns it off (got {self.top_k})"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1] (got {self.top_p})"),
            (0 <= self.min_p < 1, "min_p", f"min_p must be in [0, 1) (got {self.min_p})"),
            # past these, dividing or multiplying logits overflows float32: the reply would be NaN, not text
            (MIN_PENALTY <= self.repeat_penalty <= MAX_PENALTY, "repeat_penalty",
             f"repeat_penalty must be {MIN_PENALTY:g} to {MAX_PENALTY:g}, 1 turns it off (got {self.repeat_penalty})"),
            (self.repeat_last_n >= 0, "repeat_last_n", f"repeat_last_n must be >= 0 (got {self.repeat_last_n})"),
            (abs(self.presence_penalty) <= MAX_PENALTY, "presence_penalty",
             f"presence_penalty must be finite, -{MAX_PENALTY:g} to {MAX_PENALTY:g} (got {self.presence_penalty})"),
            (abs(self.frequency_penalty) <= MAX_PENALTY, "frequency_penalty",
             f"frequency_penalty must be finite, -{MAX_PENALTY:g} to {MAX_PENALTY:g} (got {self.frequency_penalty})"),
        ]
        for ok, option, message in checks:
            if not ok:
                raise UserError(message, option)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def described(self) -> str:
        """The rules in force, as `chat`'s /show and its start line say them."""
        if self.greedy:
            rules = ["greedy (temperature 0)"]
        else:
            rules = [f"temperature {self.temperature:g}"]
            rules += [f"top-k {self.top_k}"] if self.top_k else []
            rules += [f"top-p {self.top_p:g}"] if self.top_p < 1 else []
            rules += [f"min-p {self.min_p:g}"] if self.min_p else []
        rules += [f"repeat penalty {self.repeat_penalty:g}"] if self.repeat_penalty != 1 else []
        rules += [f"presence penalty {self.presence_penalty:g}"] if self.presence_penalty else []
        rules += [f"frequency penalty {self.frequency_penalty:g}"] if self.frequency_penalty else []
        rules += [f"seed {self.seed}"] if self.seed is not None else []
        return ", ".join(rules)


# A pair's sampling where its model recommends none (general.sampling.* in its GGUF): llama.cpp's sampler defaults,
# what the library and the server (as llama-server) apply to what a caller leaves out.
LLAMA_DEFAULTS = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
# `edge-spec chat` adds ollama's repetition penalty (1.1 over the last 64 tokens) where the model recommends none.
# Greedy decoding of small chat models loops, and so does llama.cpp's set without the penalty: on the repo's 8 chat
# prompts x seeds 1-4, SmolLM2-135M ran 5 of 32 replies to 512 tokens without it and 1 of 32 with it
# (`python benchmarks/chat_lengths.py --seeds 1,2,3,4 [--set repeat_penalty=1.0]`).
CHAT_REPEAT_PENALTY = 1.1


def chat_defaults(sampling: SamplingConfig, recommended: Collection[str] = ()) -> SamplingConfig:
    """Chat's sampling: a pair's (`sampling`, with the field names its model `recommended`), and chat's repetition
    penalty unless the model recommends one."""
    if "repeat_penalty" in recommended:
        return sampling
    return dataclasses.replace(sampling, repeat_penalty=CHAT_REPEAT_PENALTY)


def penalized(logits: np.ndarray, config: SamplingConfig, history: Sequence[int],
              ids: np.ndarray | None = None) -> np.ndarray:
    """logits: [n_vocab] (or [m] for the tokens `ids`: a partial row) -> the same with the penalties applied to the
    last repeat_last_n tokens (a copy only when needed): llama.cpp's order, the repetition penalty's division first,
    then frequency and presence subtracted."""
    additive = config.presence_penalty != 0.0 or config.frequency_penalty != 0.0
    if (config.repeat_penalty == 1.0 and not additive) or config.repeat_last_n == 0 or not history:
        return logits
    recent, counts = np.unique(np.asarray(history[-config.repeat_last_n :], np.int64), return_counts=True)
    if ids is not None:  # a partial row: the recent tokens it holds, at their columns
        at = np.searchsorted(recent, ids)
        held = recent[np.minimum(at, len(recent) - 1)] == ids
        recent, counts = np.flatnonzero(held), counts[at[held]]
    out = np.array(logits, dtype=np.float32)
    if config.repeat_penalty != 1.0:
        values = out[recent]
        out[recent] = np.where(values > 0, values / config.repeat_penalty, values * config.repeat_penalty)
    if additive:
        out[recent] -= (counts * config.frequency_penalty + config.presence_penalty).astype(np.float32)
    return out


def distribution(logits: np.ndarray, config: SamplingConfig, history: Sequence[int], ids: np.ndarray | None = None,
                 log_mass: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The non-zero part of the sampling distribution: (token ids, probabilities summing to 1).

    A partial row (a drafter's top tokens, edge/residual.py) gives `ids`, the tokens its `logits` belong to, and
    `log_mass`, the log of the whole row's softmax normalizer: the same transforms then run on those tokens alone,
    top-p reading their true probabilities where no top-k renormalizes them first."""
    x = penalized(logits, config, history, ids)
    if config.greedy:  # (no id array of the vocabulary's size for one argmax: a token's worth of work saved)
        best = int(np.argmax(x))
        return np.array([best if ids is None else int(ids[best])]), np.ones(1)
    if ids is None:
        ids = np.arange(len(x))
    x = x.astype(np.float64)
    if 0 < config.top_k < len(x):
        keep = np.argpartition(-x, config.top_k - 1)[: config.top_k]
        ids, x = ids[keep], x[keep]
    values = x
    if log_mass is not None and not 0 < config.top_k <= len(values):
        probs = np.exp(values - log_mass)  # the row's true probabilities: they sum to less than 1
    else:
        probs = np.exp(values - values.max())
        probs /= probs.sum()
    if config.top_p < 1.0:
        ids, values, probs = _top_p(ids, values, probs, config.top_p)
    if config.min_p > 0:
        keep = probs >= config.min_p * probs.max()
        ids, values = ids[keep], values[keep]
    probs = np.exp((values - values.max()) / config.temperature)
    order = np.argsort(ids, kind="stable")  # a fixed order, so a uniform maps to the same token every time
    ids, probs = ids[order], probs[order]
    return ids, probs / probs.sum()


def _top_p(ids: np.ndarray, values: np.ndarray, probs: np.ndarray, top_p: float):
    """Keep the smallest best-first prefix holding top_p of the mass (at least one token)."""
    if len(probs) > _TOP_P_PREFIX:
        head = np.argpartition(-probs, _TOP_P_PREFIX - 1)[:_TOP_P_PREFIX]
        order = head if probs[head].sum() >= top_p else np.arange(len(probs))
    else:
        order = np.arange(len(probs))
    order = order[np.argsort(-probs[order], kind="stable")]
    cut = int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1
    order = order[:cut]
    return ids[order], values[order], probs[order]


def draw(logits: np.ndarray, config: SamplingConfig, history: Sequence[int], rng: np.random.Generator) -> int:
    """One token from the target's distribution; exactly one uniform per call when sampling."""
    ids, probs = distribution(logits, config, history)
    if config.greedy:
        return int(ids[0])
    index = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
    return int(ids[min(index, len(ids) - 1)])
