"""Model code: the HF-format loader and the Llama forward over the paged KV cache."""
