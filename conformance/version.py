"""The installed specgate's version, as the certificate records it and ``--version`` prints it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def specgate_version() -> str:
    try:
        return version("specgate")
    except PackageNotFoundError:  # a checkout used without installing it
        return "unknown (not installed)"
