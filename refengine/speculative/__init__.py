"""Speculative decoding: phase inputs, the EAGLE V1 worker, tree sampling verify."""
