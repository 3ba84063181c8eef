"""The persistent compilation cache as a thing a team inspects and clears.

JAX keeps one file per compiled program in the cache directory
(``<module>-<key>-cache``, plus ``-atime`` beside it when its LRU eviction is
on). Every chip worker counts what JAX's own monitoring events say about its
lookups (``/jax/compilation_cache/compile_requests_use_cache`` and
``.../cache_hits``; a request that is not a hit compiled) and keeps its counts
in a small file of its own under ``<cache>/.counters/``, so ``pathways-ray
cache status`` can show hits and misses without a running client.

Pure file logic (no Ray, no JAX) except ``count_events``, which a chip worker
calls once after importing JAX.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CacheCounts", "CacheSummary", "clear", "count_events", "summary"]

ENTRY_SUFFIX = "-cache"
ATIME_SUFFIX = "-atime"
COUNTERS = ".counters"
REQUESTS_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
HITS_EVENT = "/jax/compilation_cache/cache_hits"
SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"


@dataclass
class CacheCounts:
    """Lookups of one process (or a sum of them): every request is a hit or a miss."""

    requests: int = 0
    hits: int = 0
    saved_s: float = 0.0  # compile time the hits saved, as JAX reports it

    @property
    def misses(self) -> int:
        return self.requests - self.hits

    def __add__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(self.requests + other.requests, self.hits + other.hits,
                           self.saved_s + other.saved_s)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "hits": self.hits, "misses": self.misses,
                "saved_s": round(self.saved_s, 3)}


@dataclass
class CacheSummary:
    path: str
    entries: int = 0
    bytes: int = 0
    programs: dict[str, int] = field(default_factory=dict)  # module name -> entries
    counts: CacheCounts = field(default_factory=CacheCounts)
    processes: int = 0  # processes whose counts are summed

    def table(self) -> str:
        c = self.counts
        lines = [f"compilation cache {self.path}",
                 f"  entries {self.entries}, {_size(self.bytes)}",
                 f"  lookups {c.requests} from {self.processes} chip worker process(es): "
                 f"{c.hits} hits, {c.misses} misses, {c.saved_s:.1f} s of compiling saved"]
        for name, n in sorted(self.programs.items(), key=lambda kv: (-kv[1], kv[0]))[:10]:
            lines.append(f"    {n:4d}  {name}")
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _local(path: str | os.PathLike, what: str) -> Path:
    text = os.fspath(path)
    if "://" in text:
        raise ValueError(f"{what}: path={text!r} is a bucket URL; inspect it with the bucket's "
                         f"own tools (gcloud storage ls/du/rm), this command reads local or "
                         f"mounted directories")
    return Path(text)


def summary(path: str | os.PathLike) -> CacheSummary:
    """Entries, bytes and the chip workers' lookup counts of the cache at ``path`` (an
    empty summary when nothing was cached there yet)."""
    root = _local(path, "cache status")
    out = CacheSummary(str(root))
    if not root.exists():
        return out
    if not root.is_dir():
        raise ValueError(f"cache status: path={str(root)!r} is a file, not a cache directory")
    for p in root.iterdir():
        if p.name.endswith(ENTRY_SUFFIX) and p.is_file():
            out.entries += 1
            out.bytes += p.stat().st_size
            module = p.name[:-len(ENTRY_SUFFIX)].rsplit("-", 1)[0]
            out.programs[module] = out.programs.get(module, 0) + 1
        elif p.name.endswith(ATIME_SUFFIX) and p.is_file():
            out.bytes += p.stat().st_size
    counters = root / COUNTERS
    if counters.is_dir():
        for p in counters.glob("*.json"):
            try:
                d = json.loads(p.read_text())
                out.counts = out.counts + CacheCounts(int(d["requests"]), int(d["hits"]),
                                                      float(d.get("saved_s", 0.0)))
                out.processes += 1
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written, or not ours
    return out


def clear(path: str | os.PathLike) -> int:
    """Remove every entry (and the lookup counts) at ``path``; returns the entries
    removed. Files that are not JAX's entries are left alone."""
    root = _local(path, "cache clear")
    if not root.exists():
        return 0
    if not root.is_dir():
        raise ValueError(f"cache clear: path={str(root)!r} is a file, not a cache directory")
    removed = 0
    for p in root.iterdir():
        if p.is_file() and (p.name.endswith(ENTRY_SUFFIX) or p.name.endswith(ATIME_SUFFIX)):
            p.unlink(missing_ok=True)
            removed += p.name.endswith(ENTRY_SUFFIX)
    counters = root / COUNTERS
    if counters.is_dir():
        for p in counters.glob("*.json"):
            p.unlink(missing_ok=True)
    return removed


class _Counter:
    """This process's counts, fed by JAX's monitoring listeners."""

    def __init__(self, file: Path | None):
        self.counts = CacheCounts()  # since the process started
        self._kept = CacheCounts()  # since its file was last (re)created: clear() resets
        self._file = file
        self._lock = threading.Lock()

    def event(self, name: str, **_kw) -> None:
        if name not in (REQUESTS_EVENT, HITS_EVENT):
            return
        hit = name == HITS_EVENT
        self._add(CacheCounts(requests=int(not hit), hits=int(hit)))

    def duration(self, name: str, secs: float, **_kw) -> None:
        if name == SAVED_EVENT:
            self._add(CacheCounts(saved_s=max(0.0, secs)))

    def _add(self, delta: CacheCounts) -> None:
        with self._lock:
            self.counts = self.counts + delta
            if self._file is None:
                return
            if self._kept != CacheCounts() and not self._file.exists():
                self._kept = CacheCounts()  # cleared meanwhile: count from here
            self._kept = self._kept + delta
            try:
                self._file.parent.mkdir(parents=True, exist_ok=True)
                tmp = self._file.with_suffix(".tmp")
                tmp.write_text(json.dumps(self._kept.as_dict()))
                tmp.replace(self._file)
            except OSError:
                pass  # counts are for people; a read-only cache still works


_counter: _Counter | None = None


def count_events(cache_dir: str | None, name: str) -> _Counter:
    """Count this process's cache lookups from JAX's monitoring events (once per
    process); with a local ``cache_dir`` they are also kept in
    ``<cache_dir>/.counters/<name>.json``. Its ``counts`` are the live totals."""
    global _counter
    if _counter is None:
        from jax import monitoring

        file = None
        if cache_dir and "://" not in cache_dir:
            file = Path(cache_dir) / COUNTERS / f"{name}.json"
        _counter = _Counter(file)
        monitoring.register_event_listener(_counter.event)
        monitoring.register_event_duration_secs_listener(_counter.duration)
    return _counter
