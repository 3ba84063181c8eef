"""Host-side pieces of sidecars, without Ray: prefetching, cutting blocks, host layout."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pathways_ray.chips.sidecar_host import Host, _cut, _Out
from pathways_ray.elastic.feed import HostFeed, Prefetcher
from pathways_ray.programs.sharding import MeshShape, host_blocks, normalize_spec


class Slow:
    """Batches that take 50 ms each; records what it read."""

    def __init__(self, host, scale):
        self.scale, self.read = scale, []
        self.lock = threading.Lock()

    def batch(self, host, step, micro):
        time.sleep(0.05)
        with self.lock:
            self.read.append((step, micro))
        return np.full((2, 3), step * 10 + micro) * self.scale


HOST = Host("s", 0, 1, (0,), ((slice(0, 2), slice(0, 3)),))


def test_prefetcher_reads_ahead_and_answers_from_what_it_read():
    p = Prefetcher(HOST, Slow, (1,), {}, ahead=2)
    np.testing.assert_array_equal(p.get(HOST, 0, 1), np.full((2, 3), 1))
    time.sleep(0.3)  # steps 1 and 2 are read meanwhile
    assert {(1, 1), (2, 1)} <= set(p.inner.read)
    np.testing.assert_array_equal(p.get(HOST, 1, 1), np.full((2, 3), 11))
    assert (p.hits, p.misses) == (1, 1), "step 1 was read ahead: answered from it"
    # Asked out of order (a survivor taking a lost slice's micro-batch): read on demand.
    np.testing.assert_array_equal(p.get(HOST, 5, 0), np.full((2, 3), 50))
    assert p.close() == {"hits": 1, "misses": 2}


def test_host_feed_checks_its_class_and_prefetch():
    with pytest.raises(TypeError, match=r"needs a method batch\(self, host, step, micro\)"):
        HostFeed(dict, (2, 3), np.int32)
    with pytest.raises(ValueError, match="prefetch=-1 must be"):
        HostFeed(Slow, (2, 3), np.int32, prefetch=-1)


def test_host_blocks_boxes_pieces_and_chips():
    """Two hosts of 4 chips, mesh (data=4, model=2): each host holds half the rows, in
    two row blocks each split in two column blocks."""
    mesh = MeshShape(("data", "model"), (4, 2))
    spec = normalize_spec(("data", "model"), 2, mesh)
    h0, h1 = host_blocks((8, 6), mesh, spec, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert h0.box == (slice(0, 4), slice(0, 6)) and h1.box == (slice(4, 8), slice(0, 6))
    assert h0.pieces[:2] == ((slice(0, 2), slice(0, 3)), (slice(0, 2), slice(3, 6)))
    assert h1.chip_piece == {4: 0, 5: 1, 6: 2, 7: 3}
    rep = host_blocks((8, 6), mesh, normalize_spec((), 2, mesh), [[0, 1, 2, 3]])[0]
    assert len(rep.pieces) == 1 and set(rep.chip_piece.values()) == {0}


def test_cut_gives_each_chip_its_block_and_names_a_wrong_one():
    out = _Out((8, 2), "int32", (slice(4, 8), slice(0, 2)),
               ((slice(4, 6), slice(0, 2)), (slice(6, 8), slice(0, 2))))
    block = np.arange(8, dtype=np.int32).reshape(4, 2)
    a, b = _cut(block, [out], "f")
    np.testing.assert_array_equal(a, block[:2])
    np.testing.assert_array_equal(b, block[2:])
    assert len(_cut((block,), [out], "f")) == 2  # a 1-tuple is the array
    with pytest.raises(ValueError, match=r"returned int32\[2, 2\] for output 0; this host's "
                                         r"block is int32\[4, 2\] \(host.boxes\[0\] = \[4:8, "
                                         r"0:2\] of \[8, 2\]\)"):
        _cut(block[:2], [out], "f")
    with pytest.raises(ValueError, match="must return 2 arrays"):
        _cut(block, [out, out], "f")
