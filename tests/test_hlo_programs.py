"""A chip's side of the programs JAX sends through the IFRT proxy (``chips/hlo.py``), on
this process's CPU devices as one world: the module JAX lowered, as its proxy client
serializes it, compiles with the client's options for the placement's devices and
gives what ``jax.jit`` gives, laid out as XLA chose (any device order). No Ray."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pathways_ray.chips.executor import Executor
from pathways_ray.chips.hlo import compile_hlo
from pathways_ray.programs.hlo_program import HloProgram, HloSignature
from pathways_ray.proxy.program_parser import module_signature


def _program(jitted, *avals, ranks=(0, 1, 2, 3)) -> HloProgram:
    """What the proxy builds from a client's CompileRequest: the portable artifact JAX's
    proxy client sends, and compile options naming devices of the client's."""
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc

    lowered = jitted.lower(*avals)
    module = xc._xla.mlir.serialize_portable_artifact(
        mlir.module_to_bytecode(lowered.compiler_ir("stablehlo")), "1.0.0")
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=max(len(ranks), 1),
        device_assignment=np.array([[100 + r for r in ranks] or [100]]))
    name, outs = module_signature(module)  # as the proxy reads it
    assert outs == [(tuple(a.shape), np.dtype(a.dtype).name)
                    for a in jax.tree.leaves(lowered.out_info)]
    return HloProgram(name, module, options.SerializeAsString(), tuple(ranks), tuple(outs))


def test_a_sharded_program_gives_what_jit_gives_laid_out_as_xla_chose():
    devices = jax.devices()[:4]
    mesh = Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
    w_s, x_s = NamedSharding(mesh, P(None, "y")), NamedSharding(mesh, P("x", None))

    def step(w, x):
        return jnp.tanh(x @ w).sum(), w * 2

    jitted = jax.jit(step, in_shardings=(w_s, x_s))
    w = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) / 64, w_s)
    x = jax.device_put(np.ones((4, 8), np.float32), x_s)
    program = _program(jitted, w, x)
    executor = Executor(0, pieces=lambda _: [])
    compiled = compile_hlo(program, 0, 4, executor.sharding)
    # The compiled signature travels as bytes, and the result layouts in it are the
    # shardings XLA chose: w * 2 keeps w's P(None, "y"), devices in (x, y) order.
    signature = HloSignature.from_bytes(compiled.signature.to_bytes())
    (_, loss_spec), (w_mesh, w_spec) = signature.out_layouts
    assert loss_spec == () and w_spec == ((), ("d1",)) and w_mesh.devices == (0, 2, 1, 3)
    loss, w2 = compiled(w, x)
    want_loss, want_w2 = jitted(w, x)
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(want_loss))
    np.testing.assert_array_equal(np.asarray(w2), np.asarray(want_w2))
    def held(a):  # device -> the block it holds
        return {s.device.id: s.index for s in a.addressable_shards}

    assert held(w2) == held(want_w2)


def test_a_one_device_program_runs_on_each_chip_s_own_copy():
    jitted = jax.jit(lambda a: a * 3 + 1)
    program = _program(jitted, jax.ShapeDtypeStruct((3,), jnp.float32), ranks=())
    executor = Executor(0, pieces=lambda _: [])
    compiled = compile_hlo(program, 0, 1, executor.sharding)
    x = jax.device_put(np.arange(3, dtype=np.float32), jax.devices()[0])
    (out,) = compiled(x)
    np.testing.assert_array_equal(np.asarray(out), [1, 4, 7])
