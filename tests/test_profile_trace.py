"""Merging a fleet's profile (pure: no Ray; JAX only reads the XSpace back)."""

from __future__ import annotations

import gzip
import json

from pathways_ray.observability.profile_trace import (
    Event,
    Track,
    clock_offset,
    fleet_tracks,
    to_chrome,
    to_xspace,
    write,
)


def test_clock_offset_takes_the_shortest_round_trip():
    # (sent, remote, received): the remote clock runs 5 ms ahead; the second sample
    # queued for 4 ms before the remote read its clock.
    samples = [(1_000, 5_001_500, 2_000), (10_000, 5_014_000, 15_000), (20_000, 5_020_200, 20_400)]
    offset, error = clock_offset(samples)
    assert offset == 5_000_000 and error == 200


def test_chips_move_onto_the_controllers_clock_only_past_the_measurements_error():
    ev = [Event("XLA", "fusion", 10_000_000, 1_000)]
    got = {"controller": [Event("dispatch", "submit s", 9_000_000, 500)],
           "chips": [{"slice": "s", "rank": 1, "host": 0, "events": ev, "offset_ns": 3_000_000,
                      "uncertainty_ns": 100_000},
                     {"slice": "s", "rank": 0, "host": 0, "events": ev, "offset_ns": 50_000,
                      "uncertainty_ns": 100_000}]}
    tracks = fleet_tracks([Event("calls", "step", 8_000_000, 100)], got)
    assert [t.name for t in tracks] == ["client", "controller", "s chip 0 (host 0)",
                                        "s chip 1 (host 0)"]
    assert tracks[2].events[0].start_ns == 10_000_000  # within the error: left alone
    assert tracks[3].events[0].start_ns == 7_000_000  # 3 ms ahead: moved back


def _tracks():
    return [Track("controller", [Event("dispatch", "submit s0", 1_000_000_000, 50_000,
                                       {"commands": 3, "bytes": 120})], 1),
            Track("s0 chip 0 (host 0)", [Event("XLA", "fusion", 1_000_020_000, 10_000,
                                               {"hlo_op": "fusion", "flops": 2.5}),
                                         Event("commands", "run abc", 1_000_010_000, 30_000)], 2)]


def test_the_xspace_reads_back_with_jaxs_own_reader():
    from jax.profiler import ProfileData

    pd = ProfileData.from_serialized_xspace(to_xspace(_tracks(), hostname="h"))
    planes = {p.name: p for p in pd.planes}
    assert set(planes) == {"/device:CUSTOM:controller", "/device:CUSTOM:s0 chip 0 (host 0)"}
    chip = planes["/device:CUSTOM:s0 chip 0 (host 0)"]
    got = {(line.name, e.name, e.start_ns, e.duration_ns, tuple(e.stats))
           for line in chip.lines for e in line.events}
    assert got == {("XLA", "fusion", 1_000_020_000, 10_000, (("hlo_op", "fusion"),
                                                              ("flops", 2.5))),
                   ("commands", "run abc", 1_000_010_000, 30_000, ())}
    assert dict(chip.stats) == {"track": "s0 chip 0 (host 0)"}


def test_the_chrome_trace_has_a_process_per_track_on_one_time_base(tmp_path):
    paths = write(_tracks(), tmp_path, "run1")
    with gzip.open(paths["perfetto"], "rt") as f:
        trace = json.load(f)
    assert trace == to_chrome(_tracks())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(names.values()) == ["controller", "s0 chip 0 (host 0)"]
    assert min(e["ts"] for e in spans) == 0.0
    fusion = next(e for e in spans if e["name"] == "fusion")
    assert fusion["ts"] == 20.0 and fusion["dur"] == 10.0 and names[fusion["pid"]].startswith("s0")
    assert paths["xplane"].endswith("plugins/profile/run1/pathways.xplane.pb")
