"""``specgate cache info|clear``: the persistent compiled keys of the reference engine's "aot"
executor (``refengine/graph/aot.py``): where they are, how many and how big, or delete them."""

from __future__ import annotations

import argparse

from refengine.graph.aot import CACHE_ENV, PackageCache


def cmd_cache(args: argparse.Namespace) -> int:
    cache = PackageCache()
    if args.action == "clear":
        print(f"removed {cache.clear()} package(s) from {cache.root}")
        return 0
    entries = cache.entries()
    size = sum(p.stat().st_size for p in entries)
    print(f"{cache.root} (${CACHE_ENV} moves it): {len(entries)} package(s), "
          f"{size / 2**20:.1f} MiB")
    for p in entries:
        print(f"  {p.name}  {p.stat().st_size / 2**20:.1f} MiB")
    return 0
