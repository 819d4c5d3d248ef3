"""Model code: the config.json schemas and HF-format loader, the Llama target and the draft
models over the paged KV cache, each forward built from public pieces the graph runner reuses."""
