"""One trace across the fleet: events of every chip, the controller and the client,
merged on one clock into files that Perfetto and TensorBoard/XProf open. Pure (no
Ray; JAX only to read a chip's own profile).

A ``Track`` is one process's timeline: a chip (``slice/rank``), the controller or
the client, each with named threads. Times are wall-clock nanoseconds on the
controller's clock (each chip's are shifted by its measured offset, see
``clock_offset``).

Two files come out of one list of tracks:

- ``plugins/profile/<run>/pathways.perfetto.json.gz``: Chrome's Trace Event
  Format, which ui.perfetto.dev, Perfetto's trace processor and chrome://tracing
  open; one process per track;
- ``pathways.xplane.pb`` beside it: an XSpace (the protobuf TensorBoard's
  profile plugin and XProf read), one ``/device:CUSTOM:<n>`` plane per track, so
  ``tensorboard --logdir <dir>`` or ``xprof <dir>`` shows it. Written with a
  minimal protobuf encoder here (the wire format of tsl's xplane.proto), so it
  needs no profiler package.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Event", "Track", "clock_offset", "read_xspace", "to_chrome", "to_xspace",
           "write"]


@dataclass(frozen=True)
class Event:
    thread: str  # the line of its track: "dispatch", an XLA thread, ...
    name: str
    start_ns: int  # wall clock, on the controller's clock
    duration_ns: int
    args: dict = field(default_factory=dict)


@dataclass
class Track:
    name: str  # "chip sim0/3 (host 0)", "controller", "client"
    events: list[Event]
    order: int = 0  # where it sits among the tracks


def clock_offset(samples: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
    """A remote clock's offset from ours and its uncertainty, from ``(sent, remote,
    received)`` samples (our ns, theirs, ours): the sample with the shortest round
    trip, remote minus its midpoint (NTP's estimate). Returns ``(offset_ns,
    uncertainty_ns)``, the uncertainty being half that round trip."""
    best = min(samples, key=lambda s: s[2] - s[0])
    sent, remote, received = best
    return remote - (sent + received) // 2, (received - sent + 1) // 2


def shift(events: list[Event], offset_ns: int) -> list[Event]:
    """Events of a clock that runs ``offset_ns`` ahead of ours, on ours."""
    if not offset_ns:
        return events
    return [Event(e.thread, e.name, e.start_ns - offset_ns, e.duration_ns, e.args)
            for e in events]


# Threads of a chip's own profile (XLA:CPU's host tracer) that are noise in a fleet view.
_SKIP_LINES = ("python",)
_SKIP_EVENTS = ("ThreadpoolListener::",)


def read_xspace(data: bytes, max_events: int = 200_000) -> list[Event]:
    """The events of a chip's own profile (``jax.profiler``'s XSpace), on its wall clock:
    JAX stores them relative to the profile's start, kept in the ``Task
    Environment`` plane. Zero-length markers are dropped."""
    from jax.profiler import ProfileData

    pd = ProfileData.from_serialized_xspace(data)
    start = 0
    for plane in pd.planes:
        if plane.name == "Task Environment":
            start = int(dict(plane.stats).get("profile_start_time", 0))
    out: list[Event] = []
    for plane in pd.planes:
        if not plane.name.startswith(("/host:", "/device:")):
            continue
        for line in plane.lines:
            if line.name in _SKIP_LINES:
                continue
            thread = line.name.split("/")[0]
            for ev in line.events:
                if ev.duration_ns <= 0 or ev.name.startswith(_SKIP_EVENTS):
                    continue
                args = {k: v for k, v in ev.stats if not k.startswith("_")}
                out.append(Event(thread, ev.name, start + int(ev.start_ns),
                                 int(ev.duration_ns), args))
                if len(out) >= max_events:
                    return out
    return out


# ---- Chrome's Trace Event Format (Perfetto, chrome://tracing) ------------------------
def to_chrome(tracks: Sequence[Track]) -> dict:
    """A trace with one process per track and one thread per line, in microseconds
    from the earliest event."""
    t0 = min((e.start_ns for t in tracks for e in t.events), default=0)
    events: list[dict] = []
    for pid, track in enumerate(tracks, start=1):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": track.name}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                       "args": {"sort_index": track.order}})
        tids: dict[str, int] = {}
        for e in track.events:
            tid = tids.get(e.thread)
            if tid is None:
                tid = tids[e.thread] = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": e.thread}})
            events.append({"ph": "X", "name": e.name, "pid": pid, "tid": tid,
                           "ts": (e.start_ns - t0) / 1e3, "dur": e.duration_ns / 1e3,
                           "args": {k: _jsonable(v) for k, v in e.args.items()}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock": "wall", "origin_unix_ns": t0}}


def _jsonable(v):
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


# ---- XSpace (tsl/profiler/protobuf/xplane.proto), encoded by hand -------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 negatives as two's complement, as protobuf does
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _int(num: int, value: int) -> bytes:
    return _varint(num << 3) + _varint(value) if value else b""


def _bytes(num: int, value: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(value)) + value


def _str(num: int, value: str) -> bytes:
    return _bytes(num, value.encode()) if value else b""


def _stat(metadata_id: int, value) -> bytes:
    """An XStat: metadata_id=1; double_value=2, int64_value=4, str_value=5."""
    body = _int(1, metadata_id)
    if isinstance(value, bool) or isinstance(value, int):
        body += _varint(4 << 3) + _varint(int(value))
    elif isinstance(value, float):
        body += _varint(2 << 3 | 1) + struct.pack("<d", value)
    else:
        body += _bytes(5, str(value).encode())
    return body


def to_xspace(tracks: Sequence[Track], hostname: str = "") -> bytes:
    """An XSpace with one ``/device:CUSTOM:<n>`` plane per track (lines are threads,
    events keep their names and stats; stats named in each plane's metadata)."""
    space = b""
    for n, track in enumerate(tracks):
        ev_meta: dict[str, int] = {}
        stat_meta: dict[str, int] = {"track": 1}
        lines: dict[str, list[Event]] = {}
        for e in track.events:
            lines.setdefault(e.thread, []).append(e)
        plane = _int(1, n) + _str(2, f"/device:CUSTOM:{track.name}")
        for line_id, (thread, evs) in enumerate(lines.items()):
            evs.sort(key=lambda e: e.start_ns)
            base = evs[0].start_ns
            body = b""
            for e in evs:
                mid = ev_meta.setdefault(e.name, len(ev_meta) + 1)
                stats = b"".join(_bytes(4, _stat(stat_meta.setdefault(k, len(stat_meta) + 1),
                                                 v)) for k, v in e.args.items())
                body += _bytes(4, _int(1, mid) + _int(2, (e.start_ns - base) * 1000)
                               + _int(3, e.duration_ns * 1000) + stats)
            plane += _bytes(3, _int(1, line_id) + _int(10, line_id) + _str(2, thread)
                            + _str(11, thread) + _int(3, base) + body)
        for name, mid in ev_meta.items():  # map<int64, XEventMetadata> event_metadata = 4
            plane += _bytes(4, _int(1, mid) + _bytes(2, _int(1, mid) + _str(2, name)))
        for name, sid in stat_meta.items():  # map<int64, XStatMetadata> stat_metadata = 5
            plane += _bytes(5, _int(1, sid) + _bytes(2, _int(1, sid) + _str(2, name)))
        plane += _bytes(6, _stat(1, track.name))  # the plane's own stat: which track
        space += _bytes(1, plane)
    if hostname:
        space += _str(4, hostname)
    return space


def write(tracks: Sequence[Track], log_dir: str | os.PathLike, run: str) -> dict[str, str]:
    """Write both files under ``log_dir``; returns their paths."""
    xdir = Path(log_dir) / "plugins" / "profile" / run
    xdir.mkdir(parents=True, exist_ok=True)
    chrome = xdir / "pathways.perfetto.json.gz"
    with gzip.open(chrome, "wt") as f:
        json.dump(to_chrome(tracks), f)
    xplane = xdir / "pathways.xplane.pb"
    xplane.write_bytes(to_xspace(tracks, hostname="pathways"))
    return {"perfetto": str(chrome), "xplane": str(xplane)}


def fleet_tracks(client: list[Event], got: dict) -> list[Track]:
    """The tracks of one profile: the client's spans, the controller's
    (``Controller.profile_stop``'s ``"controller"``) and every chip's events, shifted
    onto the controller's clock where its measured offset exceeds the measurement's
    own uncertainty (on one machine every clock is the same one: nothing moves)."""
    tracks = [Track("client", list(client), 0), Track("controller", list(got["controller"]), 1)]
    chips = sorted(got["chips"], key=lambda c: (c["slice"], c["rank"]))
    for k, c in enumerate(chips, start=2):
        offset = c["offset_ns"] if abs(c["offset_ns"]) > c["uncertainty_ns"] else 0
        tracks.append(Track(f"{c['slice']} chip {c['rank']} (host {c['host']})",
                            shift(list(c["events"]), offset), k))
    return tracks
