"""Grouping Ray nodes into TPU slices, from the dicts ray.nodes() returns."""

from __future__ import annotations

from pathways_ray.clusters.cluster import describe_capacity, slices_from_nodes


def node(node_id, slice_name, worker_id, *, alive=True, chips=4, pod="v6e-8", topo="2x4"):
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": "10.0.0.1",
        "Resources": {"CPU": 8.0, "TPU": float(chips), slice_name: 1.0},
        "Labels": {
            "ray.io/tpu-slice-name": slice_name,
            "ray.io/tpu-worker-id": str(worker_id),
            "ray.io/tpu-pod-type": pod,
            "ray.io/tpu-topology": topo,
        },
    }


HEAD = {"NodeID": "head", "Alive": True, "Resources": {"CPU": 2.0}, "Labels": {}}


def test_groups_hosts_by_slice_and_skips_the_head():
    """Hosts sharing ray.io/tpu-slice-name form one slice; the head is not a TPU host."""
    nodes = [HEAD, node("b1", "s1", 1), node("a0", "s0", 0), node("b0", "s1", 0),
             node("a1", "s0", 1)]
    slices = slices_from_nodes(nodes)
    assert [s.name for s in slices] == ["s0", "s1"]
    assert [h.worker_id for h in slices[1].hosts] == [0, 1]
    assert all(s.intact and s.idle and s.state == "free" for s in slices)
    assert slices[0].topology.num_hosts == 2 and slices[0].chips == 8


def test_free_chips_come_from_available_resources():
    """A node missing from the available map's TPU key has 0 free (Ray drops used-up keys)."""
    nodes = [node("a0", "s0", 0), node("a1", "s0", 1), node("b0", "s1", 0), node("b1", "s1", 1)]
    avail = {"a0": {"CPU": 4.0}, "a1": {"CPU": 4.0}, "b0": {"TPU": 4.0}, "b1": {"TPU": 1.0}}
    s0, s1 = slices_from_nodes(nodes, avail)
    assert (s0.state, s0.chips_free) == ("busy", 0)
    assert (s1.state, s1.chips_free) == ("partly busy", 5)
    text = describe_capacity([s0, s1])
    assert "s0 (v6e-8, 2x4): busy, 0/8 chips free" in text
    assert "s1 (v6e-8, 2x4): partly busy, 5/8 chips free" in text


def test_dead_host_degrades_its_slice():
    """A slice that lost a host is degraded, not intact, and says so."""
    nodes = [node("a0", "s0", 0), node("a1", "s0", 1, alive=False)]
    (s0,) = slices_from_nodes(nodes)
    assert not s0.intact and s0.state == "degraded"
    assert "1 host(s) down" in describe_capacity([s0])


def test_replaced_host_shows_the_live_node():
    """A host that died and came back has two node records; the live one wins."""
    nodes = [node("old", "s0", 1, alive=False), node("a0", "s0", 0), node("new", "s0", 1)]
    (s0,) = slices_from_nodes(nodes)
    assert [h.node_id for h in s0.hosts] == ["a0", "new"] and s0.intact


def test_single_host_and_3d_slices():
    """A single-host v6e 2x4 and a 2-host v5p 2x2x2 are recognized with their shapes."""
    nodes = [node("x", "one", 0, chips=8, pod="v6e-8", topo="2x4"),
             node("p0", "p", 0, pod="v5p-16", topo="2x2x2"),
             node("p1", "p", 1, pod="v5p-16", topo="2x2x2")]
    one, p = sorted(slices_from_nodes(nodes), key=lambda s: s.name)
    assert one.topology.is_single_host and one.intact
    assert p.topology.generation.name == "v5p" and p.intact


def test_no_tpu_nodes():
    """A cluster without TPU hosts says so."""
    assert slices_from_nodes([HEAD]) == []
    assert "no TPU slices" in describe_capacity([])


def test_hosts_answering_tells_a_dead_raylet_at_once():
    """A host whose raylet port refuses connections is not answering, though Ray still
    lists it alive (its health checks have not failed yet); a dead-marked one is skipped."""
    import socket
    import time

    from pathways_ray.clusters.cluster import HostView, hosts_answering

    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()

    def host(node_id, port, alive=True):
        return HostView(node_id, "127.0.0.1", "s0", 0, "v6e-4", "2x2", alive, 4, 4, port)

    try:
        t0 = time.monotonic()
        got = hosts_answering([host("up", listening.getsockname()[1]),
                               host("killed", closed_port),
                               host("dead", listening.getsockname()[1], alive=False)])
        assert got == {"up"}
        assert time.monotonic() - t0 < 1.0  # a refused connection needs no timeout
    finally:
        listening.close()
    nodes = [{**node("a0", "s0", 0), "NodeManagerPort": 4321}]
    assert slices_from_nodes(nodes)[0].hosts[0].port == 4321
