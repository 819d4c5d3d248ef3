"""What a request and a speculative configuration say: ``SamplingParams`` and ``SpecConfig``.

Every bad value raises ``ValueError`` whose message starts with the offending field's name, so
a caller can print it as one line and tell which knob to fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# SpecConfig.algorithm's values
SPEC_ALGORITHMS = ("eagle", "eagle3", "frozen_kv_mtp", "draft_model", "ngram")
# The n-gram window: an ``ngram`` config looks up the context's last n tokens for n from
# NGRAM_MAX down to NGRAM_MIN (vLLM's prompt_lookup_max/min). Fixed by the wire rather than
# SpecConfig fields, so every other config serialises as before (golden traces and repro files
# store ``asdict(SpecConfig)``).
NGRAM_MIN = 1
NGRAM_MAX = 3


def require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    # bool is an int subclass; True as a temperature is a caller bug, not 1.0.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def as_tuple(value: object, name: str) -> tuple[object, ...]:
    """Accept any iterable from callers but store a tuple (hashable, immutable). A non-iterable
    (None, a bare int) is a bad value of ``name``, reported as ValueError, not a TypeError."""
    try:
        return tuple(value)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"{name}: must be a sequence, got {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. ``temperature == 0`` means greedy."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = -1  # -1 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # None: derived from the engine seed and the request id
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the emitted text is cut before the match
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples, so params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids",
                           as_tuple(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str)
                           else as_tuple(self.stop, "stop"))
        require(is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                 "max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        require(is_number(self.temperature) and math.isfinite(self.temperature)
                 and self.temperature >= 0, "temperature",
                 f"must be a finite number >= 0, got {self.temperature!r}")
        require(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
                 f"must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"must be in (0, 1], got {self.top_p!r}")
        require(self.seed is None or (is_int(self.seed) and self.seed >= 0), "seed",
                 f"must be None or an integer >= 0, got {self.seed!r}")
        require(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 f"must be non-negative integers, got {self.stop_token_ids!r}")
        require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 f"must be non-empty strings, got {self.stop!r}")
        require(isinstance(self.ignore_eos, bool), "ignore_eos",
                 f"must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings (sglang's names).

    ``num_draft_tokens`` counts the tree's nodes including the root (the last verified token);
    a chain (``topk == 1``) therefore needs ``num_draft_tokens == num_steps + 1``.
    ``algorithm="draft_model"`` (a standalone draft LM, e.g. ``tiny-code-draft``) drafts such a
    chain of ``num_steps`` tokens and runs sequentially (no overlap scheduling).
    ``algorithm="eagle3"`` drafts as EAGLE does (chains and trees, either scheduling) with an
    EAGLE-3 head (e.g. ``tiny-code-eagle3``), which reads several of the target's layers.
    ``algorithm="ngram"`` (prompt lookup: the tokens that followed the latest earlier occurrence
    of the context's last ``NGRAM_MAX``..``NGRAM_MIN`` tokens) drafts a chain with no model:
    ``draft_model`` is ignored and stored as ``""``.
    """

    algorithm: Literal["eagle", "eagle3", "frozen_kv_mtp", "draft_model", "ngram"] = "eagle"
    draft_model: str = "tiny-code-eagle"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4
    overlap: bool = False

    def __post_init__(self) -> None:
        require(self.algorithm in SPEC_ALGORITHMS, "algorithm",
                 f"must be one of {', '.join(SPEC_ALGORITHMS)}, got {self.algorithm!r}")
        if not self.needs_draft_model:  # frozen dataclass: normalise once, here
            object.__setattr__(self, "draft_model", "")
        require(isinstance(self.draft_model, str)
                 and (bool(self.draft_model) or not self.needs_draft_model), "draft_model",
                 f"must be a fixture name or a directory, got {self.draft_model!r}")
        require(is_int(self.num_steps) and self.num_steps >= 1, "num_steps",
                 f"must be an integer >= 1, got {self.num_steps!r}")
        require(is_int(self.topk) and self.topk >= 1, "topk",
                 f"must be an integer >= 1, got {self.topk!r}")
        require(is_int(self.num_draft_tokens) and self.num_draft_tokens >= 2,
                 "num_draft_tokens", f"must be an integer >= 2, got {self.num_draft_tokens!r}")
        if self.topk == 1:
            require(self.num_draft_tokens == self.num_steps + 1, "num_draft_tokens",
                     f"a chain (topk=1) needs num_steps + 1 = {self.num_steps + 1}, "
                     f"got {self.num_draft_tokens}")
        else:
            most = 1 + self.topk * self.num_steps
            require(self.num_draft_tokens <= most, "num_draft_tokens",
                     f"at most 1 + topk * num_steps = {most} for this tree, "
                     f"got {self.num_draft_tokens}")
        require(isinstance(self.overlap, bool), "overlap",
                 f"must be a bool, got {self.overlap!r}")
        if self.algorithm in ("draft_model", "ngram"):
            require(self.topk == 1, "topk",
                     f"{self.algorithm} speculation drafts a chain (topk=1), got {self.topk}")
        if self.algorithm == "draft_model":
            require(not self.overlap, "overlap",
                     "draft_model speculation runs sequentially; overlap scheduling is "
                     "not supported")

    @property
    def needs_draft_model(self) -> bool:
        """Whether the algorithm loads ``draft_model`` (n-gram lookup has no model)."""
        return self.algorithm != "ngram"
