"""``pathways-ray cache``: the persistent compilation cache."""

from __future__ import annotations

from pathways_ray.cli.common import console


def register(sub) -> dict:
    """Add this group's commands to ``sub``; returns their handlers."""
    cache = sub.add_parser(
        "cache", help="show or clear the persistent compilation cache",
        description="The XLA executables chip workers keep between runs: `status` shows "
        "entries, size, and the hits and misses the chip workers counted from JAX's own "
        "monitoring events; `clear` removes every entry, so the next run compiles.")
    cache.add_argument("action", choices=["status", "clear"])
    cache.add_argument("--dir", default=None,
                       help="cache directory (default $PATHWAYS_RAY_COMPILATION_CACHE_DIR, "
                       "else <PATHWAYS_RAY_DIR>/xla-cache)")

    return {"cache": cmd_cache}


def cmd_cache(args) -> int:
    from pathways_ray.config import default_compilation_cache_dir
    from pathways_ray.programs import compile_cache

    path = args.dir or default_compilation_cache_dir()
    if args.action == "clear":
        n = compile_cache.clear(path)
        console.print(f"removed {n} entries from {path}", highlight=False)
    else:
        console.print(compile_cache.summary(path).table(), highlight=False)
    return 0
