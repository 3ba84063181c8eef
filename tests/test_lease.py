"""The shared service's book of slices, leases and queue (pure, no Ray)."""

from __future__ import annotations

import pytest

from pathways_ray.clusters.topology import Topology
from pathways_ray.service.lease import LeaseBook, parse_request, render_status

V6E_2X2 = Topology.parse("v6e", "2x2")
V6E_2X4 = Topology.parse("v6e", "2x4")
ALICE, BOB, CAROL = ({"user": u, "host": "h", "pid": i} for i, u in enumerate(
    ["alice", "bob", "carol"]))


def _book(*topos) -> LeaseBook:
    book = LeaseBook()
    for i, t in enumerate(topos):
        book.add_slice(f"s{i}", t)
    return book


@pytest.mark.parametrize("slices, want", [
    ({"v6e-2x2": 1}, (("v6e-2x2", 1),)),
    ({"tpuv6e:2x2": 2}, (("v6e-2x2", 2),)),  # pathwaysutils' spelling
    (["v6e-2x2", "v6e-2x4", "v6e-2x2"], (("v6e-2x2", 2), ("v6e-2x4", 1))),
    ("v6e-8", (("v6e-2x4", 1),)),
    ({V6E_2X2: 1, "tpuv6e:2x2": 1}, (("v6e-2x2", 2),)),
])
def test_requests_parse_both_spellings(slices, want):
    assert parse_request(slices) == want


@pytest.mark.parametrize("slices, match", [
    ({"v6e-3x3": 1}, r"'v6e-3x3' is not a slice shape .*write it as 'v6e-2x2' or 'tpuv6e:2x2'"),
    ({"tpuv9:2x2": 1}, r"'tpuv9:2x2' is not a slice shape"),
    ({"v6e-2x2": 0}, r"the count of 'v6e-2x2' is 0; give a positive number"),
    ({"v6e-2x2": True}, r"the count of 'v6e-2x2' is True"),
    ({}, r"asks for nothing"),
])
def test_malformed_requests_are_named(slices, match):
    with pytest.raises(ValueError, match=match):
        parse_request(slices)


def test_a_request_for_more_than_the_pool_has_fails_at_once():
    book = _book(V6E_2X2)
    with pytest.raises(ValueError, match=r"2 x v6e-2x2 asked, but this service's pool has "
                                          r"1 x v6e-2x2"):
        book.request(ALICE, (("v6e-2x2", 2),), 0.0)
    assert not book.queue


def test_grants_in_order_a_third_waits_and_gets_the_slice_given_back():
    book = _book(V6E_2X2, V6E_2X2)
    for who in (ALICE, BOB, CAROL):
        book.request(who, (("v6e-2x2", 1),), 0.0)
    granted = book.schedule(1.0)
    assert [r.owner["user"] for r, _ in granted] == ["alice", "bob"]
    a, b = (lease for _, lease in granted)
    assert set(a.slices) | set(b.slices) == {"s0", "s1"} and not set(a.slices) & set(b.slices)
    assert book.position("r3") == 1 and book.schedule(2.0) == []
    n = book.numbers(3.0)
    assert (n["active_users"], n["leases"], n["chips_in_use"], n["chips_total"],
            n["queue_length"], n["longest_wait_s"]) == (2, 2, 8, 8, 1, 3.0)
    book.end(a.id)
    assert book.state(a.slices[0]) == "returning" and book.schedule(4.0) == []
    book.returned(a.slices[0], healthy=True)
    (req, c), = book.schedule(5.0)
    assert req.owner["user"] == "carol" and c.slices == a.slices and c.waited_s == 5.0


def test_a_later_request_passes_only_when_it_wants_other_shapes():
    book = _book(V6E_2X2, V6E_2X4)
    book.request(ALICE, (("v6e-2x2", 1),), 0.0)
    book.schedule(0.0)
    book.request(BOB, (("v6e-2x2", 1), ("v6e-2x4", 1)), 1.0)  # waits for alice's 2x2
    book.request(CAROL, (("v6e-2x4", 1),), 2.0)  # the 2x4 is free, but bob wants it first
    assert book.schedule(3.0) == []
    book.cancel("r2")
    (req, lease), = book.schedule(4.0)
    assert req.owner["user"] == "carol" and lease.slices == ("s1",)


def test_tokens_heartbeats_and_reclaim():
    book = _book(V6E_2X2)
    book.request(ALICE, (("v6e-2x2", 1),), 0.0)
    (_, lease), = book.schedule(0.0)
    with pytest.raises(ValueError, match="not lease-1's"):
        book.check(lease.id, "forged")
    assert book.beat(lease.id, lease.token, 10.0)
    book.request(BOB, (("v6e-2x2", 1),), 10.0)
    assert book.expired(39.0, 30.0) == ([], [])
    assert book.expired(41.0, 30.0) == ([lease.id], ["r2"])
    book.touch("r2", 41.0)
    assert book.expired(41.0, 30.0) == ([lease.id], [])
    assert book.end(lease.id, reclaimed=True) is lease and book.end(lease.id) is None
    assert not book.beat(lease.id, lease.token, 42.0)  # the client learns it is over
    assert book.numbers(42.0)["reclaimed_total"] == 1


def test_a_broken_slice_stays_counted_until_its_replacement_joins():
    book = _book(V6E_2X2)
    book.request(ALICE, (("v6e-2x2", 1),), 0.0)
    (_, lease), = book.schedule(0.0)
    book.end(lease.id)
    book.returned("s0", healthy=False)
    assert book.slices("broken") == ["s0"] and book.numbers(1.0)["chips_total"] == 0
    book.request(BOB, (("v6e-2x2", 1),), 1.0)  # still a shape the pool has: queued
    assert book.schedule(1.0) == []
    book.replace_slice("s0", "s0", V6E_2X2)  # the hosts name their slice: maybe the same
    (req, lease), = book.schedule(2.0)
    assert req.owner["user"] == "bob" and lease.slices == ("s0",)
    assert book.numbers(2.0)["replaced_total"] == 1


def test_status_renders():
    from rich.console import Console

    book = _book(V6E_2X2, V6E_2X2)
    for who in (ALICE, BOB, CAROL):
        book.request(who, (("v6e-2x2", 1),), 0.0)
    book.schedule(0.0)
    console = Console(width=120, record=True)
    console.print(render_status("team", book.snapshot(5.0)))
    text = console.export_text()
    for part in ("service team: 2 users, 2 leases, 8/8 chips in use (100%), 1 waiting",
                 "alice@h", "bob@h", "carol@h", "1 x v6e-2x2", "leased"):
        assert part in text, text
