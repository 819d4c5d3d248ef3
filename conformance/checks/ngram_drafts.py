"""Prompt-lookup verify steps whose drafts every correct n-gram drafter agrees on, and what a
correct greedy verify emits at them: a per-step acceptance rule that needs no reference trace.

A greedy request's verify step i has its root at output index ``c_i - 1``, with
``c_i = 1 + sum(accept_lens[:i])``; its context is ``prompt + output[:c_i]`` and it emitted
``output[c_i : c_i + accept_lens[i]]``.

**Which drafts are known.** A correct drafter looks up the context's last n tokens for n from
``longest`` down to ``shortest``; the first n with an earlier occurrence (one ending before
the root: never the suffix itself, overlapping it allowed) decides, and it copies what followed
one of that n's occurrences. Drafters differ in which occurrence they take (refengine the
latest, vLLM the earliest) and in what they copy past the context's end (refengine goes on with
the match's period, vLLM stops), so the tokens all of them propose first are ``P``: the
common prefix of what follows each occurrence inside the context, cut to S. The step is
*determined* when ``P`` is not empty and some occurrence ends at or before the suffix begins
(else a drafter that skips overlapping occurrences would fall to a shorter n).

**What a correct verify emits.** It accepts drafts while they equal the target's tokens, then
emits the target's. With ``L`` the common prefix of ``P`` and ``output[c_i:]``: where the output
goes on past ``L`` and ``P`` has a token there (which differs from the output's), the step
emits exactly ``1 + L``; otherwise (``P`` all accepted, or the output ended) at least
``min(1 + L, remaining)``. The correction token and the acceptance come from one verify pass,
so no near-tie is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specwire.params import NGRAM_MAX, NGRAM_MIN


@dataclass(frozen=True)
class DeterminedStep:
    """What a determined verify step must emit."""

    step: int                   # index into accept_lens
    start: int                  # c_i: the output index of the step's first emitted token
    proposal: tuple[int, ...]   # P: the first tokens every correct drafter proposes
    emits: int                  # tokens the step must emit: exactly, or at least
    exact: bool

    def allows(self, emitted: int) -> bool:
        return emitted == self.emits if self.exact else emitted >= self.emits


@dataclass(frozen=True)
class Violation:
    rule: DeterminedStep
    got: int

    def describe(self) -> str:
        r = self.rule
        want = f"{r.emits}" if r.exact else f"at least {r.emits}"
        return (f"verify step {r.step} (output index {r.start}) emitted {self.got} tokens, "
                f"expected {want}: every prompt-lookup drafter proposes {list(r.proposal)}")


def _agreeing(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def common_proposal(context: Sequence[int], steps: int, longest: int = NGRAM_MAX,
                    shortest: int = NGRAM_MIN) -> tuple[int, ...] | None:
    """``P``: the tokens every correct drafter proposes first for ``context`` (its tokens up to
    and including the root); None where the step is not determined."""
    size = len(context)
    for n in range(longest, shortest - 1, -1):
        suffix = list(context[size - n:])
        starts = [s for s in range(size - n) if list(context[s:s + n]) == suffix]
        if not starts:
            continue
        if starts[0] + n > size - n:
            return None  # every occurrence overlaps the suffix
        agreed = list(context[starts[0] + n:][:steps])
        for s in starts[1:]:
            agreed = agreed[:_agreeing(agreed, context[s + n:])]
        return tuple(agreed) or None
    return None


def determined_steps(prompt: Sequence[int], output: Sequence[int], accept_lens: Sequence[int],
                     steps: int, longest: int = NGRAM_MAX, shortest: int = NGRAM_MIN
                     ) -> list[DeterminedStep]:
    """Every determined verify step of one greedy request, with what it must emit.
    ``accept_lens`` must account for the output: ``1 + sum(accept_lens) == len(output)``."""
    if 1 + sum(accept_lens) != len(output):
        raise ValueError(f"accept_lens {list(accept_lens)} sum to {sum(accept_lens)}: they do "
                         f"not account for {len(output)} output tokens (one from the prefill)")
    rules = []
    start = 1
    for i, emitted in enumerate(accept_lens):
        proposal = common_proposal([*prompt, *output[:start]], steps, longest, shortest)
        if proposal is not None:
            remaining = len(output) - start
            agree = _agreeing(proposal, output[start:])
            exact = agree < len(proposal) and agree < remaining
            rules.append(DeterminedStep(i, start, proposal, min(1 + agree, remaining), exact))
        start += emitted
    return rules


def violations(rules: Sequence[DeterminedStep], accept_lens: Sequence[int]) -> list[Violation]:
    """The determined steps that emitted what no correct verify of a correct prompt-lookup
    draft could."""
    return [Violation(r, accept_lens[r.step]) for r in rules if not r.allows(accept_lens[r.step])]
