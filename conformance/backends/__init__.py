"""Bundled backends: the reference engine, HF transformers, and the bug zoo (mutants)."""
