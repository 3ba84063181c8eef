"""Checkpoints to storage (``pathways_ray.storage.checkpoint``): Orbax checkpoints of RemoteArray
pytrees, written by the chip workers, resumed by a new client on a fresh fleet."""

from __future__ import annotations

import numpy as np
import pytest

from pathways_ray import LocalFleet, connect
from pathways_ray.demo.lm import LMConfig, MarkovText, init_params, loss_fn, param_specs
from pathways_ray.elastic.data_parallel import DataParallelTrainer

pytestmark = pytest.mark.slow

STEPS, SAVE_AT, BATCH = 8, 4, 16


def _trainer(client, cfg):
    """AdamW on a warm-up/cosine schedule: its moments (twice the parameters) and step
    counts are state the checkpoint must carry."""
    from pathways_ray.elastic.optim import adamw_warmup_cosine

    return DataParallelTrainer(client, lambda p, b: loss_fn(p, b, cfg), init_params(cfg),
                               param_specs(cfg), mesh_shape=(2, 2),
                               optimizer=adamw_warmup_cosine(3e-2, STEPS, warmup_steps=2))


def _read_plain(path) -> dict:
    """The checkpoint read by plain Orbax in this process (one CPU device, numpy out)."""
    import jax
    import orbax.checkpoint as ocp

    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with ocp.StandardCheckpointer() as ckpt:
        meta = ckpt.metadata(path).item_metadata.tree
        like = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here),
                            meta, is_leaf=lambda m: hasattr(m, "shape"))
        return jax.tree.map(np.asarray, ckpt.restore(path, like))


def _by_path(tree) -> dict:
    """Leaves by their path as Orbax writes it ("opt/1/0/mu/embed"): the optimizer's
    tuples and named tuples come back from a plain read as dicts."""
    import jax

    from pathways_ray.storage.checkpoint import _key

    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key(k) for k in path): np.asarray(v) for path, v in flat}


def _assert_same(a, b) -> None:
    a, b = _by_path(a), _by_path(b)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _fleet(name):
    return LocalFleet(num_slices=2, accelerator="v6e", topology="2x2", name=name,
                      log_to_driver=False)


@pytest.mark.timeout(900)
def test_checkpoint_resumes_on_a_fresh_fleet_with_the_same_losses(tmp_path):
    """Fleet A trains 8 steps with AdamW and saves after step 4 (the run goes on
    undisturbed). The checkpoint is plain Orbax (read here without pathways_ray):
    parameters, optimizer state and step. Fleet B, started after A is gone, restores
    it with a new client and trains steps 5-8: the losses are A's (rtol 1e-6), the
    optimizer's step count and schedule going on from 4. Then a host of the slice
    that writes is killed and B saves again: the save drops the lost slice and the
    survivor writes the same state."""
    import jax

    cfg = LMConfig(lr=0.2)
    rng, text = np.random.default_rng(0), MarkovText(cfg.vocab)
    batches = [text.batch(rng, BATCH, cfg.seq + 1) for _ in range(STEPS)]
    path = tmp_path / "step_4"

    with _fleet("tckpt-a"), connect() as client:
        trainer = _trainer(client, cfg)
        expected = []
        for i, batch in enumerate(batches):
            expected.append(trainer.step(batch).mean_loss())
            if i + 1 == SAVE_AT:
                nbytes = trainer.save(path)
                saved = trainer.fetch_state()
        with pytest.raises(ValueError, match="step_4.*exists"):
            trainer.save(path)

    plain = _read_plain(path)
    assert int(plain["step"]) == SAVE_AT
    assert nbytes == sum(v.nbytes for v in jax.tree.leaves(saved)) + 4
    _assert_same({k: plain[k] for k in ("params", "opt")}, saved)

    with _fleet("tckpt-b") as fleet, connect() as client:
        trainer = _trainer(client, cfg)
        assert trainer.restore(path) == SAVE_AT
        assert trainer.optimizer_step() == SAVE_AT
        losses = [trainer.step(b).mean_loss() for b in batches[SAVE_AT:]]
        np.testing.assert_allclose(losses, expected[SAVE_AT:], rtol=1e-6)

        writer, survivor = trainer.live
        final = trainer.fetch_state(survivor)
        fleet.remove_host(writer, 0)
        trainer.save(tmp_path / "step_8")
        assert trainer.live == [survivor]
        assert [e.kind for e in trainer.events] == ["slice_lost", "save_retried"]
    again = _read_plain(tmp_path / "step_8")
    assert int(again["step"]) == STEPS
    _assert_same({k: again[k] for k in ("params", "opt")}, final)


def test_restore_names_a_missing_checkpoint(tmp_path):
    """A path with no checkpoint is named before anything is sent to a slice."""
    from pathways_ray.storage import checkpoint

    with pytest.raises(FileNotFoundError, match="nowhere.*no checkpoint"):
        checkpoint.restore(None, tmp_path / "nowhere", None)
    with pytest.raises(TypeError, match="pytree of RemoteArrays"):
        checkpoint.save(tmp_path / "x", {"w": np.zeros(3)})


def test_restore_names_arrays_that_do_not_match(tmp_path):
    """Shardings for other arrays than the checkpoint holds are named, both ways, before
    anything is sent to a slice."""
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pathways_ray.storage import checkpoint

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "c", {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)})
    sh = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("chips",)), P())
    with pytest.raises(ValueError, match=r"not in it \['v'\], missing \['b', 'w'\]"):
        checkpoint.restore(None, tmp_path / "c", {"v": sh})
