"""A mesh across slices: 2 emulated v6e 2x2 slices joined in one JAX world
(``connect(multislice=True)``), one SPMD program over all 8 chips, beside each
slice's own programs.

The reference runs are in this test process on 8 fake CPU devices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray import LocalFleet, SliceLost
from pathways_ray.client.connect import connect, reshard
from tests.test_controller import _mlp_data, _mlp_loss, _sgd
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name="tms") as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    c = connect(multislice=True)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def both(client):
    return [s.name for s in client.slices]


@pytest.fixture(scope="module")
def gmesh(client, both):
    return client.mesh((2, 2, 2), ("slice", "data", "model"), slices=both)


X = np.arange(64, dtype=np.float32).reshape(8, 8)


def test_one_program_over_the_chips_of_both_slices(client, both, gmesh):
    xg = client.device_put(X, NamedSharding(gmesh, P(("slice", "data"), "model")), slice=both)
    assert xg.slice == "+".join(both)
    centred = client.jit(lambda v: v - v.mean())(xg)  # a mean over all 8 chips
    np.testing.assert_allclose(centred.fetch(), X - X.mean())
    w = client.device_put(np.eye(8, dtype=np.float32) * 0.3, NamedSharding(gmesh, P()),
                          slice=both)
    out = client.jit(lambda v, w: jnp.tanh(v @ w).sum(axis=0))(xg, w)
    np.testing.assert_allclose(out.fetch(), np.tanh(X @ (np.eye(8) * 0.3)).sum(0), rtol=1e-5)
    # Every chip of both slices holds a shard of the group's arrays.
    workers = client.stats()["+".join(both)]["workers"]
    assert len(workers) == 8 and all(w["buffers"] >= 2 for w in workers)


def test_each_slice_still_runs_its_own_programs_interleaved_with_the_group(client, both,
                                                                          gmesh):
    m = client.mesh((2, 2), ("data", "model"))
    xs = [client.device_put(X * (i + 1), NamedSharding(m, P("data", "model")), slice=s)
          for i, s in enumerate(both)]
    xg = client.device_put(X, NamedSharding(gmesh, P("slice")), slice=both)
    f = client.jit(lambda v: v * 0.5 + 1.0)
    g = client.jit(lambda v: v - v.mean())
    for _ in range(10):  # slice, group and slice commands share workers: order must hold
        xs[0], xg, xs[1] = f(xs[0]), g(xg), f(xs[1])
    ref = [X * (i + 1) for i in range(2)]
    refg = X.copy()
    for _ in range(10):
        ref = [r * 0.5 + 1.0 for r in ref]
        refg = refg - refg.mean()
    for got, want in zip(xs, ref, strict=True):
        np.testing.assert_allclose(got.fetch(), want, rtol=1e-6)
    np.testing.assert_allclose(xg.fetch(), refg, atol=1e-4)


def test_reshard_between_one_slice_and_both(client, both, gmesh):
    m = client.mesh((4,), ("chips",))
    on_b = client.device_put(X, NamedSharding(m, P("chips")), slice=both[1])
    spread = reshard(on_b, NamedSharding(gmesh, P(("slice", "data", "model"))), slice=both)
    np.testing.assert_allclose(spread.fetch(), X)
    back = reshard(client.jit(lambda v: v * 2)(spread), NamedSharding(m, P()), slice=both[0])
    np.testing.assert_allclose(back.fetch(), X * 2)


def test_mlp_parity_one_spmd_program_across_slices(client, both):
    """20 steps, the batch over (slice, data) and the gradient all-reduce inside one
    program across both slices, match one process on 8 fake CPU devices."""
    params, x, y = _mlp_data()
    steps = 20

    def step(p, xb, yb):
        loss, g = jax.value_and_grad(_mlp_loss)(p, xb, yb)
        return loss, _sgd(p, g)

    ref_mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("slice", "data"))
    rep, dat = NamedSharding(ref_mesh, P()), NamedSharding(ref_mesh, P(("slice", "data")))
    ref_step = jax.jit(step, out_shardings=(rep, rep))
    p_ref, xr, yr = jax.device_put(params, rep), jax.device_put(x, dat), jax.device_put(y, dat)
    ref_losses = []
    for _ in range(steps):
        loss, p_ref = ref_step(p_ref, xr, yr)
        ref_losses.append(float(loss))

    gm = client.mesh((2, 4), ("slice", "data"), slices=both)
    grep, gdat = NamedSharding(gm, P()), NamedSharding(gm, P(("slice", "data")))
    remote_step = client.jit(step, out_shardings=(grep, grep))
    p = client.device_put(params, grep, slice=both)
    xb, yb = client.device_put(x, gdat, slice=both), client.device_put(y, gdat, slice=both)
    losses = []
    for _ in range(steps):
        loss, p = remote_step(p, xb, yb)
        losses.append(loss)
    got = [float(v.fetch()) for v in losses]
    np.testing.assert_allclose(got, ref_losses, rtol=1e-5)
    assert got[-1] < got[0]


def test_a_group_mesh_must_fit_and_may_take_its_slices_in_any_order(client, both):
    """A group's slices need not be side by side in the world (the survivors of a lost
    slice are not): reversed, each chip is named by its world device id, and a program
    over the group gives the values of local JAX."""
    with pytest.raises(ValueError, match=r"make 4 devices; slices .* have 8 chips"):
        client.mesh((2, 2), ("slice", "data"), slices=both)
    rev = list(reversed(both))
    gm = client.mesh((2, 4), ("slice", "data"), slices=rev)
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    a = client.device_put(x, NamedSharding(gm, P(("slice", "data"))), slice=rev)
    out = client.jit(lambda v: v * 2 + jnp.sum(v), out_shardings=NamedSharding(gm, P()))(a)
    np.testing.assert_allclose(out.fetch(), x * 2 + x.sum())
    with pytest.raises(ValueError, match=r"two or more different slices"):
        client.mesh((2, 4), ("slice", "data"), slices=[both[0], both[0]])


def test_a_lost_slice_leaves_the_other_running_and_its_replacement_rejoins_one_world(
        fleet, client, both):
    """Last in this module: slice 1's host is killed. A program over both slices is
    ``SliceLost``; slice 0 keeps running and keeps its arrays. The host comes back, a
    replacement is reserved (``request_slices``), and the first group of slice 0 and
    the replacement re-forms one JAX world over them: slice 0's arrays made before
    are still there, and a program over all 8 chips gives local JAX's values."""
    s0, s1 = both
    one = client.mesh((4,), ("chips",))
    a = client.device_put(X, NamedSharding(one, P("chips")), slice=s0)
    xg = client.device_put(X, NamedSharding(client.mesh((2, 4), ("slice", "data"),
                                                        slices=both), P("data")), slice=both)
    fleet.remove_host(s1, 0)
    with pytest.raises(SliceLost, match=s1):
        client.jit(lambda v: v - v.mean())(xg).fetch()
    step = client.jit(lambda v: jnp.tanh(v) + v.mean())
    np.testing.assert_allclose(step(a).fetch(), np.tanh(X) + X.mean(), rtol=1e-6)
    fleet.restore_host(s1, 0)
    client.request_slices(1)
    added: list[str] = []
    wait_until(lambda: added.extend(client.refresh_slices()) or added, 240,
               "no replacement slice joined after the host came back")
    gm = client.mesh((2, 4), ("slice", "data"), slices=[s0, added[0]])  # re-forms
    np.testing.assert_array_equal(a.fetch(), X)  # carried into the new world
    np.testing.assert_allclose(step(a).fetch(), np.tanh(X) + X.mean(), rtol=1e-6)
    yg = client.device_put(X, NamedSharding(gm, P(("slice", "data"))), slice=[s0, added[0]])
    centred = client.jit(lambda v: v - v.mean())(yg)  # a mean over all 8 chips
    np.testing.assert_allclose(centred.fetch(), X - X.mean(), rtol=1e-6)
