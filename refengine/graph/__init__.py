"""Graph runner for the target's decode and verify forwards and the draft loops: bucketed
static buffers with a padding policy (``staging``, ``loop_staging``), the executors that run a
staged key (the registry ``executors``; ``replay``, ``compiled``, ``cuda_graph``, ``aot``),
the static forwards they run (``program``: the target's in ``target``, the draft loops' in
``loops``), the whole draft step as one graph (``draft_loop``), and the runner that stages,
executes and slices (``runner``).

Nothing is imported here: the registry (``refengine.graph.executors``) stays importable without
torch."""
