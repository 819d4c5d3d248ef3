"""Graph-runner mutants: padded rows that keep an earlier replay's values, draft-loop
buffers staged only at capture, key widths chosen for the cached prefix alone or for the
first request, a verify graph whose greedy walk takes its bonus from the wrong node, a
one-graph step whose root token buffer is staged only at capture."""

from __future__ import annotations

import bisect
from typing import Any

import torch

from refengine import Engine
from refengine.graph.draft_loop import DraftLoopGraph
from refengine.graph.loop_staging import LoopStaging
from refengine.graph.runner import GraphBatch, GraphRunner
from refengine.graph.staging import DUMMY_SLOT, StagedViews, Staging, StepInputs
from refengine.graph.step_graph import StepGraph
from refengine.graph.target import GraphKey, TargetForward
from refengine.model.llama import ForwardBatch

# --- graph runner -------------------------------------------------------------------------------

class _StalePaddedRowsStaging(Staging):
    def stage(self, step: StepInputs | None, bucket: int) -> StagedViews:
        raw = 0 if step is None else step.batch_size
        rows = self.buffers["rows"]
        left = rows[raw:bucket].clone()
        views = super().stage(step, bucket)
        rows[raw:bucket] = left  # BUG: the padded rows keep whatever an earlier batch left
        return views


class _StalePaddedRowsGraphRunner(GraphRunner):
    staging_class = _StalePaddedRowsStaging


class StalePaddedRows(Engine):
    """Stale padded rows: graph staging rewrites every field of the padded rows but their
    request rows (req_pool_indices), so after a bigger batch a padded row keeps a real
    request's row and its attention gathers that request's KV. The outputs are sliced to the
    real rows and the padded rows still write the dummy slot: only the padding itself shows.
    """

    graph_runner_class = _StalePaddedRowsGraphRunner


def _on_width_for(runner: GraphRunner, key: GraphKey, length: int) -> GraphKey:
    """``key`` on the smallest of ``runner``'s key widths that holds ``length`` columns."""
    return key._replace(max_kv=runner.kv_sizes[bisect.bisect_left(runner.kv_sizes, length)])


class _PrefixWidthGraphRunner(GraphRunner):
    def graph_key(self, batch: ForwardBatch) -> GraphKey | None:
        key = super().graph_key(batch)  # a key only for a GraphBatch with its lengths
        if key is None:
            return None
        assert isinstance(batch, GraphBatch) and batch.host_seq_lens is not None
        # BUG: the width must hold the forward's new tokens too, not just the cached prefix
        return _on_width_for(self, key, max(batch.host_seq_lens) - self.kinds[key.kind])


class KeyWidthIgnoresNewTokens(Engine):
    """Key width ignores the new tokens: a graph runner picks each replay's key width (the
    key columns every request's attention gathers) by the longest cached prefix, without the
    forward's own new tokens (the decode token, the verify block), so a step whose prefix fits
    a width but whose new tokens cross it replays one width too narrow and drops the newest
    keys. Below the first width, and everywhere without the graph runner, it is exact: only a
    context that crosses a width boundary while decoding shows it (lengths 257, 513, ...).
    """

    graph_runner_class = _PrefixWidthGraphRunner


class _FirstRequestWidthGraphRunner(GraphRunner):
    def graph_key(self, batch: ForwardBatch) -> GraphKey | None:
        key = super().graph_key(batch)
        if key is None:
            return None
        assert isinstance(batch, GraphBatch) and batch.host_seq_lens is not None
        return _on_width_for(self, key, batch.host_seq_lens[0])  # BUG: not the longest's


class KeyWidthFromFirstRequest(Engine):
    """Key width from the first request: a graph runner picks each replay's key width by the
    batch's first request, as if batches came sorted longest first, so a longer request later
    in the batch attends over a width too narrow for it and loses every key past it. While
    every context fits the smallest width, and everywhere without the graph runner, it is
    exact: only a batch mixing requests either side of a width shows it.
    """

    graph_runner_class = _FirstRequestWidthGraphRunner


class _CaptureTimeOnly(LoopStaging):
    """Restages every buffer but ``stale`` (a field name), which only the first staging of a
    bucket (its capture) writes."""

    stale = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._captured: set[int] = set()
        self._replaying = False

    def stage(self, inputs: dict[str, torch.Tensor] | None, bucket: int
              ) -> dict[str, torch.Tensor]:
        self._replaying = bucket in self._captured
        self._captured.add(bucket)
        return super().stage(inputs, bucket)

    def restage(self, name: str, buf: torch.Tensor, value: torch.Tensor | None, raw: int,
                bucket: int) -> None:
        if name == self.stale and self._replaying:
            return  # BUG: the replay reads the capture-time step's values of this buffer
        super().restage(name, buf, value, raw, bucket)


class _CaptureTimeBonusTokens(_CaptureTimeOnly):
    stale = "bonus_tokens"


class _CaptureTimeRoots(_CaptureTimeOnly):
    stale = "verified_id"


def loop_staging_runner(staging: type[LoopStaging]) -> type[GraphRunner]:
    """A graph runner whose draft loops and extend graph stage through ``staging``."""
    loop = type(f"{staging.__name__}Loop", (DraftLoopGraph,), {"staging_class": staging})
    return type(f"{staging.__name__}GraphRunner", (GraphRunner,), {"draft_loop_class": loop})


class BonusTokensNotRestaged(Engine):
    """Bonus tokens not restaged: the graph-captured Frozen-KV MTP draft loop folds the seed
    iteration in, but its ``bonus_tokens`` buffer is written only when a bucket is captured,
    so every later replay seeds the draft with an earlier step's tokens. Verify still decides
    every token (output stays lossless); only acceptance drops."""

    graph_runner_class = loop_staging_runner(_CaptureTimeBonusTokens)


class _RealColumnsOnly(LoopStaging):
    """Stages a draft-extend's slots column by column for the accepted tokens only: the front
    padding inside a real request's row keeps whatever an earlier replay staged there."""

    def restage(self, name: str, buf: torch.Tensor, value: torch.Tensor | None, raw: int,
                bucket: int) -> None:
        if name == "slots" and value is not None:
            real = value != DUMMY_SLOT
            buf[:raw][real] = value[real]  # BUG: padded columns keep a stale request's slots
            buf[raw:bucket] = self.fields[name].fill
            return
        super().restage(name, buf, value, raw, bucket)


class ExtendPaddingNotRestaged(Engine):
    """Draft-extend padding not restaged: a graphed EAGLE draft-extend pads each request's
    accepted tokens to a fixed width, and the padded columns' KV slots are left as an earlier
    replay staged them, so the head writes junk KV into slots that now belong to live
    positions. Verify still decides every token (output stays lossless); the drafts that read
    that KV get worse."""

    graph_runner_class = loop_staging_runner(_RealColumnsOnly)


class StepRootNotRestaged(Engine):
    """Step root not restaged: a greedy EAGLE chain step runs as one graph (draft, verify,
    walk, draft-extend), but its ``verified_id`` buffer (each request's root token, the first
    token verify reads) is written only when a bucket is captured, so every later replay
    verifies after an earlier step's root. The target's KV at the root and every logit after
    it are then wrong: greedy output changes, and only where the graph runner runs steps."""

    graph_runner_class = type("_CaptureTimeRootsGraphRunner", (GraphRunner,), {
        "step_graph_class": type("_CaptureTimeRootsStep", (StepGraph,),
                                 {"staging_class": _CaptureTimeRoots})})


class _BonusAfterRootForward(TargetForward):
    def run(self, key: GraphKey, views: StagedViews) -> Any:
        out = super().run(key, views)
        if out.walk is not None:
            # BUG: the bonus is the target's token after the root, not after the last
            # accepted node
            out.walk[:, -1] = out.logits.argmax(-1).view(views.bucket, views.q)[:, 0]
        return out


class _BonusAfterRootGraphRunner(GraphRunner):
    target_forward_class = _BonusAfterRootForward


class GraphWalkBonusAfterRoot(Engine):
    """Graph walk bonus after the root: the verify graph walks each tree on the device
    (greedy accept inside the graph), but emits as the bonus the target's token after the
    root instead of after the last accepted draft. A step that accepts nothing is right; every
    step that accepts a draft emits a token the target did not choose there (greedy output
    changes), and only where the graph runner verifies."""

    graph_runner_class = _BonusAfterRootGraphRunner

