"""Programs are exported for the platform of the chips that run them (``export_program``),
and a Pallas kernel written for TPU exports for the emulated fleet's CPUs in Pallas'
interpret mode. Pure: JAX on this process's CPU devices, no Ray."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.experimental import pallas as pl

from pathways_ray.programs.program import export_program
from pathways_ray.programs.sharding import MeshShape


def _kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 3.0 + 1.0


def _with_pallas(x):
    blocks = pl.BlockSpec((8, 128), lambda i: (i, 0))
    return pl.pallas_call(_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // 8,), in_specs=[blocks], out_specs=blocks)(x)


def _export(platform):
    return export_program(_with_pallas, MeshShape(("data",), (1,)), [((), ())], None,
                          [((16, 128), np.float32)], ["args[0]"], platform=platform)


def test_a_pallas_kernel_exports_for_cpus_in_interpret_mode_and_runs():
    program, _ = _export("cpu")
    assert program.platform == "cpu"
    exp = export.deserialize(bytearray(program.blob))
    assert exp.platforms == ("cpu",)
    x = np.arange(16 * 128, dtype=np.float32).reshape(16, 128)
    (out,) = exp.call(jnp.asarray(x))  # the chips take results as a flat list
    np.testing.assert_array_equal(np.asarray(out), x * 3 + 1)


def test_for_tpu_the_kernel_stays_a_mosaic_kernel():
    program, _ = _export("tpu")
    exp = export.deserialize(bytearray(program.blob))
    assert program.platform == "tpu" and exp.platforms == ("tpu",)
    assert "tpu_custom_call" in exp.mlir_module()
    assert program.fingerprint != _export("cpu")[0].fingerprint


def test_an_unknown_platform_is_refused_by_name():
    with pytest.raises(ValueError, match="platform='gpu' must be 'cpu' or 'tpu'"):
        _export("gpu")


def test_results_in_named_tuples_export_flat_and_keep_their_structure():
    """jax.export cannot serialize a result tree holding a named tuple it does not know
    (an optax state); programs go to the chips with a flat result tree and the client
    keeps the structure, with each leaf's sharding from the prefix given."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    from pathways_ray.programs.program import export_program
    from pathways_ray.programs.sharding import MeshShape

    mesh = MeshShape(("d",), (2,))

    def step(x):
        return {"w": x * 2, "opt": optax.ScaleByAdamState(jax.numpy.int32(1), x, x + 1)}

    program, out_tree = export_program(step, mesh, [(("d",),)], {"w": P("d"), "opt": P()},
                                       [((4,), "float32")], ["x"])
    assert [s.spec for s in program.out_sigs] == [(), ((),), ((),), (("d",),)]
    assert jax.tree.structure(step(jax.numpy.ones(4))) == out_tree
