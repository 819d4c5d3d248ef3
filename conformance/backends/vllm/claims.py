"""What the vLLM backend does not claim, and why: one line per capability, shown on the
certificate, and the reasons its config mapping refuses the same things with."""

from __future__ import annotations

NAME = "vllm"

TREE = ("vLLM's CPU build runs speculative chains only (tree drafts need its tree-attention "
        "backend, not available on CPU); topk > 1 is refused")
UNCLAIMED_REASONS = {
    "algorithm:frozen_kv_mtp": "specgate's frozen-KV MTP head has no vLLM counterpart "
                               "(vLLM's MTP methods load model-specific heads)",
    "tree": TREE,
    "overlap": "vLLM's CPU platform forces async_scheduling off (platforms/cpu.py), so "
               "SpecConfig(overlap=True) is refused",
    "in_flight": "async scheduling is off on CPU: every step is resolved before step() returns",
    "sessions": "vLLM keeps no per-conversation KV the adapter can address (prefix caching "
                "is automatic and evictable, not a session)",
    "forced_retract": "vLLM has no hook to preempt a chosen request every N steps",
    "chunked_prefill": "not yet verified against the lifecycle tier: vLLM's token budget "
                       "(max_num_batched_tokens) counts decode tokens too and must be at "
                       "least max_num_seqs",
    "worker_hooks": "vLLM exposes no phase traces or forced verify outcomes",
    "graph_runner": "run with enforce_eager on CPU: no graph runner to probe",
    "kernels": "vLLM's CPU build has no tree kernels to hand the kernel tier",
}

NGRAM_LOOKUP = ("vLLM's prompt lookup takes the earliest match, stops copying at the "
                "context's end and proposes nothing without a match; refengine's takes the "
                "latest, copies on and pads, so the drafts differ by design")
