"""``specgate cache info|prune|clear``: the persistent compiled keys of the reference engine's
"aot" executor (``refengine/graph/aot_store.py``): what is there and how big against the budget,
delete what the current code can never load, or delete everything."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refengine.graph.aot_index import CacheInfo


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["info", "prune", "clear"],
                        help="info: where they are, each one's size, the total against the "
                        "budget ($SPECGATE_CACHE_MAX_GB), leftovers of killed builds and "
                        "loading markers; prune: delete what this code and torch can never "
                        "load; clear: delete everything")


def cmd_cache(args: argparse.Namespace) -> int:
    """Imports torch and the engine's package cache, as only this command needs them."""
    import torch

    from refengine.graph.aot import sources_digest
    from refengine.graph.aot_format import CacheConfigError, gigabytes
    from refengine.graph.aot_store import PackageCache

    try:
        cache = PackageCache()
    except CacheConfigError as err:
        print(f"specgate cache: {err}", file=sys.stderr)
        return 2
    if args.action == "clear":
        print(f"removed {cache.clear()} package(s) from {cache.root}")
        return 0
    if args.action == "prune":
        pruned = cache.prune(sources_digest(), torch.__version__)
        print(f"removed {len(pruned.packages)} package(s) of other code or torch, or that "
              f"crashed a process, from {cache.root}: {gigabytes(pruned.bytes)} freed")
        for name in pruned.packages:
            print(f"  {name}")
        return 0
    print_info(cache.info())
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def print_info(info: CacheInfo) -> None:
    from refengine.graph.aot_format import BUDGET_ENV, CACHE_ENV, gigabytes

    code = sum(e.size for e in info.packages)
    free = f", {gigabytes(info.free)} free on its disk" if info.free is not None else ""
    print(f"{info.root} (${CACHE_ENV} moves it): {len(info.packages)} package(s), "
          f"{_mib(code)}, and {info.blobs} shared weight blob(s), {_mib(info.blob_bytes)}: "
          f"{gigabytes(info.total)} of a {gigabytes(info.budget)} budget "
          f"(${BUDGET_ENV}){free}")
    for e in info.packages:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        note = "" if e.sidecar is not None else "  (no sidecar: rebuilt on use; prune removes it)"
        print(f"  {e.path.name}  {_mib(e.size)}  last used {used}{note}")
    if info.temporaries:
        print(f"temporary files of builds: {len(info.temporaries)}, "
              f"{_mib(sum(t.size for t in info.temporaries))} (prune removes those of "
              f"ended processes)")
        for t in info.temporaries:
            state = "its build is running" if t.alive else "left by a killed build"
            print(f"  {t.path.relative_to(info.root)}  {_mib(t.size)}  {state}")
    if info.markers:
        print(f"loading markers: {len(info.markers)}")
        for m in info.markers:
            state = ("loading" if m.alive
                     else "dead: its package crashed it, and is rebuilt on next use")
            print(f"  {m.path.name}  pid {m.pid}, {state}")
