"""Colocated Python sidecars on a fleet of a 2-host v6e 2x4 slice and two v6e 2x2 slices.

One fleet and one client for the module. The training test runs on the two 2x2
slices; the multi-host slice shows that each host makes exactly its own block.
The last two kill and freeze a sidecar: each loses its slice.
"""

from __future__ import annotations

import os
import signal
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray import LocalFleet, RemoteError, SliceLost, Topology
from pathways_ray.client.connect import connect
from pathways_ray.demo.lm import LMConfig, init_params, loss_fn, param_specs
from pathways_ray.demo.text import TextBatches, write_corpus
from pathways_ray.elastic.data_parallel import DataParallelTrainer
from pathways_ray.elastic.feed import HostFeed
from pathways_ray.storage import host_checkpoint

pytestmark = pytest.mark.slow

MULTI = Topology.parse("v6e", "2x4", chips_per_host=4)  # 2 hosts x 4 chips


@pytest.fixture(scope="module")
def client():
    # A short step deadline, so that a frozen sidecar is found within seconds (the
    # controller takes the client's PATHWAYS_RAY_* settings when it starts).
    saved = os.environ.get("PATHWAYS_RAY_STEP_TIMEOUT_S")
    os.environ["PATHWAYS_RAY_STEP_TIMEOUT_S"] = "4"
    try:
        with LocalFleet(slices=[MULTI, "v6e-2x2", "v6e-2x2"], name="tsidecar"):
            c = connect()
            try:
                yield c
            finally:
                c.close()
    finally:
        if saved is None:
            os.environ.pop("PATHWAYS_RAY_STEP_TIMEOUT_S", None)
        else:
            os.environ["PATHWAYS_RAY_STEP_TIMEOUT_S"] = saved


@pytest.fixture(scope="module")
def multi(client):
    return next(s.name for s in client.slices if s.chips == 8)


@pytest.fixture(scope="module")
def small(client):
    return [s.name for s in client.slices if s.chips == 4]


def where_am_i(host):
    """What the sidecar knows of its host, and what the Ray node it runs on says."""
    return (host.worker_id, host.chips, host.num_hosts, os.environ.get("TPU_NAME"),
            int(os.environ.get("TPU_WORKER_ID", "-1")))


def rows_of(host, scale):
    """Each host returns its block of the global arange(16*6).reshape(16, 6) * scale, and
    its worker id in its block of a second array."""
    rows, cols = host.box
    full = np.arange(16 * 6, dtype=np.float32).reshape(16, 6) * scale
    return full[rows, cols], np.full([s.stop - s.start for s in host.boxes[1]],
                                     host.worker_id, np.int32)


def test_each_host_makes_its_own_block_and_the_client_sends_no_bytes(client, multi):
    """On a 2-host slice, a function's results become arrays whose shards each host made;
    the client put no array bytes anywhere. Without ``returning`` it gets each host's
    return value."""
    # Each runs on its own host's Ray node (the emulated host's TPU env), beside its chips.
    assert client.sidecar(where_am_i, slice=multi)().result(timeout_s=60) == [
        (0, (0, 1, 2, 3), 2, multi, 0), (1, (4, 5, 6, 7), 2, multi, 1)]
    mesh = client.mesh((8,), ("data",))
    out = (jax.ShapeDtypeStruct((16, 6), np.float32, sharding=NamedSharding(mesh, P("data"))),
           jax.ShapeDtypeStruct((8,), np.int32, sharding=NamedSharding(mesh, P("data"))))
    before = dict(client.counters)
    make = client.sidecar(rows_of, slice=multi).returning(out)
    values, hosts = make(2.0)
    np.testing.assert_array_equal(values.fetch(), np.arange(96, dtype=np.float32).reshape(16, 6)
                                  * 2.0)
    np.testing.assert_array_equal(hosts.fetch(), [0, 0, 0, 0, 1, 1, 1, 1])
    assert client.counters["put_bytes"] == before["put_bytes"]
    # Replicated: each host makes the whole array once, every chip gets it.
    rep = jax.ShapeDtypeStruct((4, 6), np.float32, sharding=NamedSharding(mesh, P()))
    whole = client.sidecar(lambda host: np.ones((4, 6), np.float32) * host.num_hosts,
                           slice=multi).returning(rep)()
    np.testing.assert_array_equal(whole.fetch(), np.full((4, 6), 2.0))


def test_a_wrong_block_names_the_expected_shape(client, multi):
    mesh = client.mesh((8,), ("data",))
    out = jax.ShapeDtypeStruct((16, 6), np.float32, sharding=NamedSharding(mesh, P("data")))
    bad = client.sidecar(lambda host: np.zeros((16, 6), np.float32), slice=multi).returning(out)()
    with pytest.raises(RemoteError, match=r"returned float32\[16, 6\] for output 0; this "
                                          r"host's block is float32\[8, 6\]"):
        bad.fetch()
    with pytest.raises(ValueError, match="must be a jax.ShapeDtypeStruct"):
        client.sidecar(where_am_i, slice=multi).returning(np.zeros(3))


class Counter:
    """A stateful sidecar: an iterator over rows, one position per host."""

    def __init__(self, host, start):
        self.pos = start

    def next(self, host):
        rows, _ = host.box
        block = np.arange(rows.start, rows.stop, dtype=np.int32)[:, None] + 100 * self.pos
        self.pos += 1
        return np.repeat(block, 2, axis=1)

    def boom(self, host, what):
        raise KeyError(f"no such shard {what!r}")

    def position(self, host):
        return self.pos


def test_a_class_keeps_its_position_and_an_error_keeps_the_slice(client, small):
    """Calls on one object run in order and keep its state; a method that raises comes
    back as RemoteError with the host's traceback, and the object and slice go on."""
    mesh = client.mesh((4,), ("data",))
    out = jax.ShapeDtypeStruct((8, 2), np.int32, sharding=NamedSharding(mesh, P("data")))
    it = client.sidecar(Counter, slice=small[0])(start=5)
    nxt = it.next.returning(out)
    batches = [nxt() for _ in range(3)]  # queued back to back: no waits between
    for i, b in enumerate(batches):
        np.testing.assert_array_equal(b.fetch()[:, 0], np.arange(8) + 100 * (5 + i))
    with pytest.raises(RemoteError, match=r"(?s)Counter.boom on host .*in boom.*KeyError.*"
                                          r"no such shard 'w'"):
        it.boom("w").result(timeout_s=60)
    np.testing.assert_array_equal(nxt().fetch()[:, 0], np.arange(8) + 100 * 8)
    assert it.position().result(timeout_s=60) == [9]
    x = client.device_put(np.ones(4, np.float32), NamedSharding(mesh, P("data")), slice=small[0])
    assert float(client.jit(lambda v: v.sum())(x).fetch()) == 4.0
    assert it.close(timeout_s=60) == [None]
    with pytest.raises(AttributeError, match="has no method 'nope'"):
        it.nope  # noqa: B018
    with pytest.raises(RemoteError, match="missing 1 required positional argument: .start."):
        client.sidecar(Counter, slice=small[0])()  # the constructor raises on the host


def test_host_checkpoint_round_trip(client, multi, small, tmp_path):
    """Each host writes its own shards (from its chips, through its node's store) and
    reads back what its chips need for another mesh: bit-exact."""
    mesh = client.mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    tree = {"w": rng.standard_normal((8, 6)).astype(np.float32),
            "b": {"bias": rng.standard_normal(6).astype(np.float32)},
            "step": np.int32(7)}
    sh = {"w": NamedSharding(mesh, P("data", "model")), "b": {"bias": NamedSharding(mesh, P())},
          "step": NamedSharding(mesh, P())}
    arrays = client.device_put(tree, sh, slice=multi)
    written = host_checkpoint.save(client, arrays, tmp_path / "ck", timeout_s=120)
    assert written == 8 * 6 * 4 + 2 * (6 * 4 + 4)  # w once; replicated ones once per host
    mesh4 = client.mesh((2, 2), ("data", "model"))
    like = {"w": NamedSharding(mesh4, P(None, "model")), "b": {"bias": NamedSharding(mesh4, P())},
            "step": NamedSharding(mesh4, P())}
    back = host_checkpoint.restore(client, tmp_path / "ck", like, slice=small[1])
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.fetch(), b), back, tree)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        host_checkpoint.restore(client, tmp_path / "nothing", like, slice=small[1])


REFERENCE: dict = {}  # the sidecar-fed run's losses, for the kill test that follows


def _trainer(client, cfg, slices, **kw):
    return DataParallelTrainer(client, lambda p, b: loss_fn(p, b, cfg), init_params(cfg),
                               param_specs(cfg), mesh_shape=(2, 2), lr=0.2, slices=slices,
                               snapshot_every=None, **kw)


def _feed(corpus: str, cfg: LMConfig, rows: int) -> HostFeed:
    return HostFeed(TextBatches, (rows, cfg.seq + 1), np.int32, args=(corpus, cfg.seq, rows))


def test_sidecar_fed_training_matches_client_fed_and_input_stays_on_hosts(client, small,
                                                                           tmp_path_factory):
    """The demo LM on the two 2x2 slices, data parallel: text read and tokenized on the
    hosts gives the same losses as the same batches fed by the client, and the client
    sends no input bytes (its own counter)."""
    cfg = LMConfig()
    corpus = str(write_corpus(tmp_path_factory.mktemp("text") / "corpus.txt"))
    rows, steps = 8, 8  # per micro-batch; 2 micro-batches
    read = TextBatches.on_client(corpus, cfg.seq, rows)

    fed = _trainer(client, cfg, small)
    before = client.counters["put_bytes"]
    client_losses = [fed.step(np.concatenate([read(i, 0), read(i, 1)])).mean_loss()
                     for i in range(steps)]
    batch_bytes = 2 * rows * (cfg.seq + 1) * 4
    assert client.counters["put_bytes"] - before == steps * batch_bytes

    hosts = _trainer(client, cfg, small, feed=_feed(corpus, cfg, rows))
    before = client.counters["put_bytes"]
    host_losses = [hosts.step().mean_loss() for _ in range(steps)]
    assert client.counters["put_bytes"] == before, "input bytes went through the client"
    np.testing.assert_allclose(host_losses, client_losses, rtol=1e-5)
    assert host_losses[-1] < host_losses[0] - 0.3, host_losses
    with pytest.raises(ValueError, match="takes a batch, or none when the trainer has a feed"):
        hosts.step(np.zeros((16, cfg.seq + 1), np.int32))
    REFERENCE.update(losses=host_losses, corpus=corpus, rows=rows)


def test_sidecar_fed_micro_batches_match_client_fed(client, small):
    """With 2 micro-batches per slice each host reads its block of both (micro-batches
    2g and 2g+1 of slice g, stacked) and the accumulated step gives the client-fed
    losses of the same 4 micro-batches."""
    if not REFERENCE:
        pytest.skip("needs the sidecar-fed run above")
    cfg, rows, steps = LMConfig(), 4, 4
    read = TextBatches.on_client(REFERENCE["corpus"], cfg.seq, rows)
    fed = _trainer(client, cfg, small, microbatches=2)
    want = [fed.step(np.concatenate([read(i, m) for m in range(4)])).mean_loss()
            for i in range(steps)]
    hosts = _trainer(client, cfg, small, microbatches=2,
                     feed=_feed(REFERENCE["corpus"], cfg, rows))
    before = client.counters["put_bytes"]
    got = [hosts.step().mean_loss() for _ in range(steps)]
    assert client.counters["put_bytes"] == before
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_killed_sidecar_loses_its_slice_and_training_goes_on(client, small):
    """SIGKILL one slice's sidecar mid-run: that slice is lost, as with a lost host, and
    the trainer carries on with the survivor reading both micro-batches: the losses are
    those of the uninterrupted run. The user then gets SliceLost naming the host. The
    slice's hosts are fine, so a replacement is reserved there (its sidecars started
    with it), compiled ahead and added, and reads its own input again.
    Runs last but one: it loses a 2x2 slice."""
    if not REFERENCE:
        pytest.skip("needs the sidecar-fed run above")
    cfg = LMConfig()
    trainer = _trainer(client, cfg, small, feed=_feed(REFERENCE["corpus"], cfg,
                                                       REFERENCE["rows"]),
                       grow=True, grow_check_s=0.5)
    losses = []
    for i in range(len(REFERENCE["losses"])):
        if i == 3:
            pids = client.sidecar(lambda host: os.getpid(), slice=small[1])().result(60)
            os.kill(pids[0], signal.SIGKILL)
        losses.append(trainer.step().mean_loss())
    lost = [e for e in trainer.events if e.kind == "slice_lost"]
    assert len(lost) == 1 and lost[0].slice == small[1] and lost[0].step == 3, trainer.events
    assert "sidecar" in lost[0].reason, lost[0].reason
    np.testing.assert_allclose(losses, REFERENCE["losses"], rtol=1e-5)
    deadline = time.monotonic() + 30
    with pytest.raises(SliceLost, match=rf"slice {small[1]} was lost \(host {small[1]}/0\)"):
        while time.monotonic() < deadline:  # the monitor marks it within a second or two
            client.sidecar(where_am_i, slice=small[1])().result(60)
            time.sleep(0.5)
    deadline = time.monotonic() + 120
    while len(trainer.slices) < 2 and time.monotonic() < deadline:
        losses.append(trainer.step().mean_loss())
    assert len(trainer.slices) == 2, trainer.events
    new = trainer.slices[1]
    assert new.startswith(small[1] + "."), new  # the same hosts, a new slice
    before = client.counters["put_bytes"]
    losses += [trainer.step().mean_loss() for _ in range(2)]  # micro-batch 1 read there
    assert client.counters["put_bytes"] == before and np.isfinite(losses).all()


def test_a_frozen_sidecar_loses_its_slice_at_the_step_deadline(client, multi):
    """SIGSTOP one host's sidecar: it stops answering the controller's pings, and at the
    step deadline (4 s here) its slice is lost naming that host; a call waiting on it
    ends with that SliceLost, never a hang. Runs last: it loses the 2x4 slice."""
    pids = client.sidecar(lambda host: os.getpid(), slice=multi)().result(60)
    mesh = client.mesh((8,), ("data",))
    out = jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("data")))
    os.kill(pids[1], signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        pending = client.sidecar(lambda host: np.zeros(4, np.float32), slice=multi
                                 ).returning(out)()
        with pytest.raises(SliceLost, match=rf"slice {multi} was lost \(host {multi}/1\): "
                                            r"the sidecar on host .* did not answer"):
            pending.fetch(timeout_s=60)
        assert time.monotonic() - t0 < 30
    finally:
        try:
            os.kill(pids[1], signal.SIGCONT)  # killed with its slice by now, or let it go
        except ProcessLookupError:
            pass
