"""KV memory: request rows, the paged slot allocator, KV tensors and the accounting view."""
