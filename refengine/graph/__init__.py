"""Graph runner for the target's decode and verify forwards: bucketed static buffers with a
padding policy (``staging``), executors that run a staged bucket (``executors``), and the
runner that stages, executes and slices (``runner``)."""

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
    "PAD_POLICY",
    "CompiledExecutor",
    "Executor",
    "GraphBatch",
    "GraphKey",
    "GraphRunner",
    "ReplayExecutor",
    "StagedViews",
    "Staging",
    "StepInputs",
    "capture_sizes",
    "kv_widths",
    "pad_to_bucket",
    "static_attention",
]
