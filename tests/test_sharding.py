"""The client's shard map equals JAX's own devices_indices_map for the same mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray.programs.sharding import MeshShape, normalize_spec, shard_slices, unique_shards

CASES = [
    ((2, 4), ("data", "model"), (8, 16), P("data", "model")),
    ((2, 4), ("data", "model"), (8, 16), P(None, "model")),
    ((2, 4), ("data", "model"), (8, 16), P("model", "data")),
    ((2, 4), ("data", "model"), (16, 4), P(("data", "model"))),
    ((2, 4), ("data", "model"), (16, 4), P(("model", "data"))),
    ((2, 4), ("data", "model"), (3, 5), P()),
    ((8,), ("chips",), (8, 2), P("chips")),
    ((2, 2, 2), ("x", "y", "z"), (4, 4, 2), P("x", ("y",), "z")),
]


@pytest.mark.parametrize("mesh_shape,names,shape,spec", CASES)
def test_matches_jax(mesh_shape, names, shape, spec):
    """Every device's index agrees with jax.sharding.NamedSharding on a real mesh."""
    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), names)
    want = NamedSharding(mesh, spec).devices_indices_map(shape)
    ms = MeshShape(names, mesh_shape)
    got = shard_slices(shape, ms, normalize_spec(spec, len(shape), ms))
    for rank, device in enumerate(mesh.devices.flat):
        norm = tuple(slice(s.start or 0, n if s.stop is None else s.stop)
                     for s, n in zip(want[device], shape, strict=True))
        assert got[rank] == norm, (rank, got[rank], norm)


def test_replicas_and_errors():
    """Replicated shards point at their first holder; bad specs name the problem."""
    ms = MeshShape(("data", "model"), (2, 2))
    idx = shard_slices((4, 4), ms, normalize_spec(P("data"), 2, ms))
    assert unique_shards(idx) == [0, 0, 2, 2]
    with pytest.raises(ValueError, match="axis 'batch'"):
        normalize_spec(P("batch"), 2, ms)
    with pytest.raises(ValueError, match="twice"):
        normalize_spec(P("data", "data"), 2, ms)
    with pytest.raises(ValueError, match="does not split evenly"):
        shard_slices((3, 4), ms, normalize_spec(P("data"), 2, ms))


def test_a_transfer_packs_one_object_per_source_chip_and_destination_host():
    from pathways_ray.programs.sharding import pack_transfer

    dm, mp = MeshShape(("data", "model"), (2, 2)), MeshShape(("model",), (4,))
    # 3 arrays on a 2x2 (data x model) slice, replicated over "data", to a 1x4 slice
    # on two hosts (ranks 0-1 on host a, 2-3 on host b): host a needs the first model
    # half (held by chips 0 and 2), host b the second (chips 1 and 3).
    arrays = [((8, 16), 4, dm, ((), ("model",)), mp, ((), ("model",)))] * 3
    plan = pack_transfer(arrays, ["a", "a", "b", "b"])
    # One object per (chip, host), all four chips sending: the replicas share the work.
    assert plan.sends == {0: [[0, 2]], 1: [[0, 2]], 2: [[1]], 3: [[1]]}
    for i, per_dst in enumerate(plan.pieces):
        for d, mine in enumerate(per_dst):
            (rank, packet, pos, block), = mine  # each destination block lies in one half
            assert plan.sends[rank][packet][pos] == i
            assert rank in ((0, 2) if d < 2 else (1, 3))
            assert block == (slice(0, 8), slice(8 * (d // 2), 8 * (d // 2) + 8))
        # Both destination chips of a host read the same object.
        assert per_dst[0][0][:2] == per_dst[1][0][:2] and per_dst[2][0][:2] == per_dst[3][0][:2]


def test_a_pull_transfer_moves_only_what_each_destination_chip_keeps():
    from pathways_ray.programs.sharding import pull_transfer

    dm, mp = MeshShape(("data", "model"), (2, 2)), MeshShape(("model",), (4,))
    # The weight sync of the RL loop: 2x2 (data x model, replicated over "data") to a
    # 1x4 model-parallel slice. Each destination chip keeps a quarter, which lies in
    # one source half, held by two chips.
    arrays = [((8, 16), 4, dm, ((), ("model",)), mp, ((), ("model",)))] * 3
    plan = pull_transfer(tuple(arrays))
    pulled = {}
    for i, per_dst in enumerate(plan.pieces):
        for d, mine in enumerate(per_dst):
            (rank, k, part), = mine
            assert part == (slice(0, 8), slice(4 * d, 4 * d + 4))  # just its quarter
            assert rank in ((0, 2) if d < 2 else (1, 3))  # a holder of that half
            pos, whole, rel = plan.sends[rank][d][k]
            assert (pos, whole) == (i, part)
            assert rel == (slice(0, 8), slice(4 * (d % 2), 4 * (d % 2) + 4))  # in its shard
            pulled[rank] = pulled.get(rank, 0) + 8 * 4 * 4
    # The replicas share the work: every source chip sends a quarter of the bytes.
    assert sorted(pulled.values()) == [3 * 128] * 4


def test_a_pull_of_the_same_sharding_moves_whole_shards_and_spreads_replicas():
    from pathways_ray.programs.sharding import pull_transfer

    m = MeshShape(("data", "model"), (2, 2))
    replicated = ((8, 16), 4, m, ((), ()), m, ((), ()))
    same = ((8, 16), 2, m, (("data",), ("model",)), m, (("data",), ("model",)))
    plan = pull_transfer((same, replicated))
    for d, mine in enumerate(plan.pieces[0]):
        (rank, k, part), = mine
        assert rank == d and plan.sends[rank][d][k][2] is None  # a whole shard, as is
    # A replicated array: every destination chip needs all of it, held by all four
    # source chips; the four pulls come from four different chips.
    senders = [mine[0][0] for mine in plan.pieces[1]]
    assert sorted(senders) == [0, 1, 2, 3]
    assert all(plan.sends[r][d][-1][2] is None for d, r in enumerate(senders))
