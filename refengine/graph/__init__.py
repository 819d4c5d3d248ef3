"""Graph runner for the target's decode and verify forwards and the draft loops: bucketed
static buffers with a padding policy (``staging``), executors that run a staged bucket
(``executors``), the whole draft step as one graph (``draft_loop``), and the runner that
stages, executes and slices (``runner``)."""

from refengine.graph.draft_loop import LOOP_FIELDS, DraftLoopGraph, LoopStaging
from refengine.graph.executors import CompiledExecutor, Executor, GraphKey, ReplayExecutor
from refengine.graph.runner import GraphBatch, GraphRunner
from refengine.graph.staging import (
    DUMMY_ROW,
    DUMMY_SLOT,
    PAD_POLICY,
    StagedViews,
    Staging,
    StepInputs,
    capture_sizes,
    kv_widths,
    pad_to_bucket,
    static_attention,
)

__all__ = [
    "DUMMY_ROW",
    "DUMMY_SLOT",
    "LOOP_FIELDS",
    "PAD_POLICY",
    "CompiledExecutor",
    "DraftLoopGraph",
    "Executor",
    "GraphBatch",
    "GraphKey",
    "GraphRunner",
    "LoopStaging",
    "ReplayExecutor",
    "StagedViews",
    "Staging",
    "StepInputs",
    "capture_sizes",
    "kv_widths",
    "pad_to_bucket",
    "static_attention",
]
