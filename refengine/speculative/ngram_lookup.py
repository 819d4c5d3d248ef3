"""Prompt lookup: the chain an n-gram drafter proposes, for a batch of contexts at once.

For each row's context (its tokens up to and including the root), for n from ``longest`` down
to ``shortest``: the latest earlier occurrence of the context's last n tokens (one that ends
before the root, so never the suffix itself; it may overlap it). The first n with a match
decides, and the proposal copies what followed that occurrence: token j is the context's token
at ``match_end + j``, and where that runs past the root the copy goes on over what it already
proposed (an LZ77 copy at distance ``d = context_len - match_end``), i.e. the text is continued
as if it repeats with the match's period. Without any match the root is repeated (a copy at
distance 1).

Every chain has ``steps`` tokens, so the verify block keeps its shape and the core is
unchanged; a filler costs no extra forward (the block is verified whole either way), and the
verify treats drafts as point masses, so whatever is proposed the output is lossless.

Tensor work only, with shapes fixed by the batch and the longest context: no host sync.
"""

from __future__ import annotations

import torch


def propose(tokens: torch.Tensor, lens: torch.Tensor, steps: int, shortest: int, longest: int
            ) -> torch.Tensor:
    """``tokens [b, W]`` int64 (row i's context is ``tokens[i, :lens[i]]``; what lies past it
    is never read), ``lens [b]`` int64 ``>= 1`` -> the proposed chains ``[b, steps]``."""
    b, width = tokens.shape
    device = tokens.device
    column = torch.arange(width, device=device)
    start = torch.full((b,), -1, dtype=torch.int64, device=device)  # -1: no match yet
    size = torch.zeros(b, dtype=torch.int64, device=device)
    for n in range(longest, shortest - 1, -1):
        if width < n + 1:
            continue  # no context here holds an earlier occurrence of n tokens
        offsets = torch.arange(n, device=device)
        suffix = tokens.gather(1, (lens[:, None] - n + offsets).clamp(min=0))       # [b, n]
        windows = tokens.unfold(1, n, 1)                                             # [b, W-n+1, n]
        starts = column[:width - n + 1]
        # An occurrence must end before the root: start + n <= len - 1.
        hit = (windows == suffix[:, None, :]).all(-1) & (starts < (lens - n)[:, None])
        latest = torch.where(hit, starts, -1).amax(1)
        take = (start < 0) & (latest >= 0)  # the longest n with a match decides
        start = torch.where(take, latest, start)
        size = torch.where(take, n, size)
    source = torch.where(start >= 0, start + size, lens - 1)  # no match: copy the root
    distance = lens - source
    index = source[:, None] + torch.arange(steps, device=device)[None, :] % distance[:, None]
    return tokens.gather(1, index)
