"""Elastic data parallel training inside one controller, on 3 emulated v6e 2x2 slices,
with what real models train with: AdamW on a warm-up/cosine schedule after global-norm
clipping, 2 micro-batches per slice accumulated each step.

A host is really killed mid-run (``LocalFleet.remove_host``): the run goes on on 2
slices with no exception and the losses of a single-process optax run on the same
global batches, then grows back to 3 when the host returns. A frozen host (SIGSTOP)
is caught by the step deadline and costs the same. An error in the user's program
costs nothing.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pathways_ray import LocalFleet, RemoteError, connect
from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn, param_specs
from pathways_ray.elastic.data_parallel import DataParallelTrainer
from pathways_ray.elastic.elastic_policy import NotEnoughSlices
from pathways_ray.elastic.optim import adamw_warmup_cosine, single_process

pytestmark = pytest.mark.slow

STEPS, KILL_AT, RESTORE_AT, BATCH = 40, 12, 14, 24


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(num_slices=3, accelerator="v6e", topology="2x2", name="telastic",
                    log_to_driver=False) as f:
        yield f


CFG = LMConfig()
SCHEDULE_STEPS = 60  # warm-up over 6, cosine decay to step 60, then flat


def _optimizer():
    return adamw_warmup_cosine(3e-2, SCHEDULE_STEPS, clip_norm=1.0)


def _trainer(client, cfg=CFG, loss=loss_fn, **kw):
    kw.setdefault("microbatches", 2)
    return DataParallelTrainer(client, lambda p, b: loss(p, b, cfg), init_params(cfg),
                               param_specs(cfg), mesh_shape=(2, 2), optimizer=_optimizer(),
                               **kw)


def _batches(cfg, n):
    rng, text = np.random.default_rng(0), MarkovText(cfg.vocab)
    return [text.batch(rng, BATCH, cfg.seq + 1) for _ in range(n)]


@pytest.fixture(scope="module")
def expected():
    """The losses of plain optax in this process, one step per global batch (no fleet,
    no micro-batches)."""
    losses, _, _ = single_process(lambda p, b: loss_fn(p, b, CFG), init_params(CFG),
                                  _optimizer(), _batches(CFG, STEPS + 100))
    return losses


@pytest.mark.timeout(900)
def test_losing_a_slice_mid_run_keeps_training_and_grows_back(fleet, expected):
    """40 steps on 3 slices; before step 12 slice 1's host is killed. Every step
    completes without an exception in the loop, at most one step is recomputed, and
    the losses equal single-process optax's on the same global batches (rtol 1e-5).
    The host comes back two steps later and the run returns to 3 slices by itself;
    the new slice gets the parameters and the optimizer state, and the steps after it
    joined still give optax's losses, with the optimizer's own step count right."""
    cfg = CFG
    batches = _batches(cfg, STEPS + 100)
    events, t_lost, losses = [], None, []
    client = connect()
    try:
        trainer = _trainer(client, min_slices=2, grow=True,
                           on_elastic_event=events.append)
        start = list(trainer.live)
        victim = start[1]
        deadline = None
        for i, batch in enumerate(batches):
            if i == KILL_AT:
                fleet.remove_host(victim, 0)
                t_lost = time.monotonic()
            if i == RESTORE_AT:
                fleet.restore_host(victim, 0)
            losses.append(trainer.step(batch).mean_loss())
            if i == KILL_AT:
                recovered_s = time.monotonic() - t_lost
            if i == STEPS - 1:
                deadline = time.monotonic() + 300  # the new slice imports JAX on a busy machine
            if deadline:
                if len(trainer.live) == 3 or time.monotonic() > deadline:
                    break
                time.sleep(2)  # leave the 2 cores to the replacement's start, step now and then
        assert len(trainer.live) == 3, f"did not grow back: {events}"
        for batch in batches[len(losses):len(losses) + 3]:  # on the grown-back fleet
            losses.append(trainer.step(batch).mean_loss())
        assert [trainer.optimizer_step(s) for s in trainer.live] == [trainer.steps_done] * 3
    finally:
        client.close()
        if t_lost is not None and RESTORE_AT >= len(losses):  # failed before the restore
            fleet.restore_host(victim, 0)

    kinds = [e.kind for e in events]
    assert kinds[:2] == ["slice_lost", "step_retried"], kinds
    assert events[0].slice == victim and events[0].step == KILL_AT
    assert kinds.count("step_retried") == 1  # at most one step recomputed
    assert "slice_joining" in kinds and kinds[-1] == "slice_added"
    assert trainer.live[:2] == [s for s in start if s != victim]
    assert trainer.live[2] != victim, "a slice back under an old name is a new slice"
    np.testing.assert_allclose(losses, expected[:len(losses)], rtol=1e-5)
    assert recovered_s < 30, recovered_s


@pytest.mark.timeout(600)
def test_a_frozen_host_mid_run_is_caught_by_the_step_deadline(fleet, expected, monkeypatch):
    """The same run with slice 1's host frozen (SIGSTOP: its sockets stay open, gloo
    would wait ~100 s for JAX's heartbeat) before step 12. The controller's step
    deadline (3 s here) condemns the slice; the step runs again on 2 slices, no
    exception reaches the loop and the losses are optax's."""
    monkeypatch.setenv("PATHWAYS_RAY_STEP_TIMEOUT_S", "3")  # the controller inherits it
    events, losses = [], []
    client = connect()
    victim = client.slices[1].name
    try:
        trainer = _trainer(client, min_slices=2, on_elastic_event=events.append)
        for i, batch in enumerate(_batches(CFG, STEPS)):
            if i == KILL_AT:
                fleet.freeze_host(victim, 0)
                t_frozen = time.monotonic()
            losses.append(trainer.step(batch).mean_loss())
            if i == KILL_AT:
                recovered_s = time.monotonic() - t_frozen
    finally:
        client.close()
        fleet.freeze_host(victim, 0, frozen=False)
        try:
            fleet.remove_host(victim, 0)
        except Exception:  # noqa: BLE001 - its raylet may have exited by itself on waking
            pass
        fleet.restore_host(victim, 0)
    kinds = [e.kind for e in events]
    assert kinds == ["slice_lost", "step_retried"], kinds
    assert events[0].slice == victim and events[0].step == KILL_AT
    assert "silent" in events[0].reason and "frozen" in events[0].reason, events[0].reason
    np.testing.assert_allclose(losses, expected[:STEPS], rtol=1e-5)
    assert recovered_s < 20, f"{recovered_s:.1f} s: not the 3 s step deadline"


def _oom_loss(params, batch, cfg):
    """The user's loss, plus a temporary far larger than any chip's memory: XLA fails
    the step at run time on the chips (RESOURCE_EXHAUSTED)."""
    import jax.numpy as jnp

    big = jnp.sort(jnp.arange(1 << 36, dtype=jnp.float32) * batch[0, 0].astype(jnp.float32))
    return loss_fn(params, batch, cfg) + 0.0 * big[0]


def test_an_error_in_the_users_step_costs_no_slice(fleet):
    """A step that fails inside the user's program on the chips raises RemoteError with
    the remote traceback in the loop; no slice is dropped, every slice stays healthy,
    and the same client trains on with every slice."""
    import ray

    events = []
    with connect() as client:
        batches = _batches(CFG, 2)
        bad = _trainer(client, loss=_oom_loss, on_elastic_event=events.append)
        with pytest.raises(RemoteError, match="RESOURCE_EXHAUSTED") as err:
            bad.step(batches[0]).mean_loss()
        assert "Traceback" in str(err.value)
        assert events == [] and len(bad.live) == 3
        assert set(ray.get(client._controller.health.remote()).values()) == {"ok"}
        good = _trainer(client)
        assert np.isfinite(good.step(batches[1]).mean_loss()) and len(good.live) == 3


def test_below_min_slices_ends_the_run_with_a_clear_error(fleet):
    """Losing a slice when only min_slices are left raises NotEnoughSlices naming what
    was lost and the setting; nothing hangs."""
    batches = _batches(CFG, 4)
    client = connect()
    victim = client.slices[0].name
    try:
        trainer = _trainer(client, min_slices=len(client.slices))
        trainer.step(batches[0]).mean_loss()
        fleet.remove_host(victim, 0)
        t0 = time.monotonic()
        with pytest.raises(NotEnoughSlices, match=rf"{victim}.*min_slices=3"):
            trainer.step(batches[1])
        assert time.monotonic() - t0 < 30
    finally:
        client.close()
        fleet.restore_host(victim, 0)


def test_closing_while_a_replacement_is_reserved_releases_it(fleet):
    """close() while the controller is reserving a replacement slice (its host just came
    back) leaves every slice free: placement groups outlive the controller actor that
    made them, so an in-flight reservation must be released before it is killed."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pathways_ray.clusters.cluster import cluster_slices
    from pathways_ray.errors import SliceLost

    client = connect()
    victim = client.slices[2].name
    try:
        x = client.device_put(np.ones((4, 4), np.float32),
                              NamedSharding(client.mesh((4,), ("chips",)), P()), slice=victim)
        fleet.remove_host(victim, 0)
        with pytest.raises(SliceLost):
            x.fetch()
        client.request_slices(1)
        fleet.restore_host(victim, 0)
        deadline = time.monotonic() + 60
        while all(v.idle for v in cluster_slices() if v.name == victim):
            assert time.monotonic() < deadline, "the controller never began the reservation"
            time.sleep(0.1)
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while not all(v.idle for v in cluster_slices()):
        assert time.monotonic() < deadline, [(v.name, v.state) for v in cluster_slices()]
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_losing_every_replica_resumes_from_the_host_memory_snapshot(fleet):
    """A run on one slice snapshots every 3 steps; its host is killed before step 5, so
    no replica is left. With wait_for_slices_s the trainer waits for a replacement
    (the fleet's free slice), restores the snapshot of step 3 (parameters and AdamW's
    state) onto it from host memory, runs steps 3 and 4 again from the batches it kept
    and goes on: no exception, the losses of an uninterrupted one-slice run on another
    slice (rtol 1e-6), and the optimizer's step count is the run's."""
    from pathways_ray.elastic import snapshot

    batches = _batches(CFG, 8)
    client = connect(slices=["v6e-2x2", "v6e-2x2"])  # the third slice stays free
    victim, other = (s.name for s in client.slices)
    try:
        ref = _trainer(client, slices=[other], snapshot_every=None)
        want = [ref.step(b).mean_loss() for b in batches]
        events = []
        trainer = _trainer(client, slices=[victim], snapshot_every=3, wait_for_slices_s=120,
                           on_elastic_event=events.append)
        got = []
        for i, b in enumerate(batches):
            if i == 5:
                deadline = time.monotonic() + 60
                while snapshot.latest_step(client) != 3:
                    assert time.monotonic() < deadline, "the snapshot of step 3 never completed"
                    time.sleep(0.1)
                fleet.remove_host(victim, 0)
            got.append(trainer.step(b).mean_loss())
        np.testing.assert_allclose(got, want, rtol=1e-6)
        kinds = [e.kind for e in events]
        assert kinds[:2] == ["slice_lost", "waiting_for_slices"], kinds
        assert "snapshot_restored" in kinds and kinds[-1] == "step_retried", kinds
        restored = next(e for e in events if e.kind == "snapshot_restored")
        assert restored.step == 3 and "running the 2 step(s)" in restored.reason
        assert len(trainer.live) == 1 and trainer.live[0] not in (victim, other)
        assert trainer.steps_done == 8 and trainer.optimizer_step() == 8
    finally:
        client.close()
        fleet.restore_host(victim, 0)


def test_no_replica_and_no_snapshot_ends_the_run_with_a_clear_error(fleet):
    """With snapshots off, losing the only replica cannot be recovered by waiting: the
    error says so and names the setting, at once."""
    batches = _batches(CFG, 2)
    client = connect(slices=["v6e-2x2"])
    victim = client.slices[0].name
    try:
        trainer = _trainer(client, snapshot_every=None, wait_for_slices_s=120)
        trainer.step(batches[0]).mean_loss()
        fleet.remove_host(victim, 0)
        t0 = time.monotonic()
        with pytest.raises(NotEnoughSlices, match=r"snapshot_every=None"):
            trainer.step(batches[1])
        assert time.monotonic() - t0 < 30
    finally:
        client.close()
        fleet.restore_host(victim, 0)


def test_closing_with_a_frozen_slice_releases_the_others_in_time(fleet):
    """close() while one slice's host is frozen (its workers never answer the request
    to leave their JAX world) still releases every other slice, within the client's
    wait. Seen in the chaos loop: slices left one by one, 30 s each, outlasted it and a
    slice stayed held until the driver exited."""
    from pathways_ray.clusters.cluster import cluster_slices

    client = connect()
    victim = client.slices[0].name
    fleet.freeze_host(victim, 0)
    try:
        t0 = time.monotonic()
        client.close()
        took = time.monotonic() - t0
        deadline = time.monotonic() + 30
        while not all(v.idle for v in cluster_slices() if v.name != victim):
            assert time.monotonic() < deadline, [(v.name, v.state) for v in cluster_slices()]
            time.sleep(0.5)
    finally:
        fleet.freeze_host(victim, 0, frozen=False)
        try:
            fleet.remove_host(victim, 0)
        except Exception:  # noqa: BLE001 - its raylet may have exited by itself on waking
            pass
        fleet.restore_host(victim, 0)
    assert took < 25, f"close() took {took:.1f} s"
