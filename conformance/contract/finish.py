"""refengine's finish semantics, for the bundled backends that run their own decoding loop (hf,
ctranslate2); the oracle's expected finish text uses the same stop-string rule.

Written here rather than imported from refengine, so a bug there cannot hide by being shared:
a backend built on these rules and compared token for token with refengine checks both.

* a token in ``stop_token_ids``, or EOS unless ``ignore_eos`` -> "stop";
* a stop string in the decoded output -> "stop" (the text is cut before the earliest one, the
  token that completed it stays in ``output_ids``);
* ``max_new_tokens``, or the prompt and output filling the model's context -> "length".

Checked after each token is appended, in that order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specwire import FinishReason, SamplingParams


def stop_string_index(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest of ``stops`` starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def eos_token_id(config_eos: int | list[int] | tuple[int, ...] | None,
                 tokenizer_eos: int | None = None) -> int:
    """The EOS id the way refengine reads it: config.json's (the first if a list), else 0.

    A config without one falls back to ``tokenizer_eos`` (if the backend's tokenizer knows one)
    before refengine's default of 0.
    """
    eos = config_eos
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    if eos is None:
        eos = tokenizer_eos
    return int(eos) if eos is not None else 0


@dataclass(frozen=True)
class FinishRule:
    """When one request stops, and the text it reports."""

    params: SamplingParams
    prompt_len: int
    eos_token_id: int
    max_context_len: int
    decode: Callable[[list[int]], str]  # raw decode: special tokens dropped, spaces untouched

    @property
    def max_output(self) -> int:
        """The most tokens the request can emit (``max_new_tokens`` or the context's room)."""
        return min(self.params.max_new_tokens, self.max_context_len - self.prompt_len)

    def reason(self, output_ids: Sequence[int]) -> FinishReason | None:
        """Why the request stops after ``output_ids[-1]`` (just appended), or None."""
        p = self.params
        token = output_ids[-1]
        if token in p.stop_token_ids or (token == self.eos_token_id and not p.ignore_eos):
            return "stop"
        if p.stop and stop_string_index(self.decode(list(output_ids)), p.stop) is not None:
            return "stop"
        if len(output_ids) >= self.max_output:
            return "length"
        return None

    def text(self, output_ids: Sequence[int], reason: FinishReason | None) -> str:
        """The reported text: the output decoded, cut before a stop string that ended it."""
        text = self.decode(list(output_ids))
        if reason == "stop" and self.params.stop:
            cut = stop_string_index(text, self.params.stop)
            text = text if cut is None else text[:cut]
        return text
