"""conformance: specgate's suite, adapter protocol, pytest plugin and CLI."""

__version__ = "0.1.0"
