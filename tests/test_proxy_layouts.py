"""Where the IFRT proxy puts JAX's arrays (pure): XLA's shardings as layouts over a
slice's chips, sharding protos, host buffers and compiled signatures. No Ray."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from pathways_ray.clusters.topology import Topology
from pathways_ray.programs.hlo_program import HloProgram, HloSignature, is_hlo_blob
from pathways_ray.programs.hlo_sharding import layout_of
from pathways_ray.programs.sharding import MeshShape, shard_slices
from pathways_ray.proxy.devices import plan_devices
from pathways_ray.proxy.errors import InvalidArgument
from pathways_ray.proxy.host_buffers import HostBuffers
from pathways_ray.proxy.protos import xla_xla_data_pb2 as xla_data_pb2
from pathways_ray.proxy.types import (
    ProxySharding,
    dtype_of,
    dtype_proto,
    hlo_sharding_proto,
    parse_sharding,
    place,
)


def _tiled(dims, *, reshape=(), perm=(), devices=(), replicate_last=False):
    return xla_data_pb2.OpSharding(
        type=xla_data_pb2.OpSharding.OTHER, tile_assignment_dimensions=dims,
        iota_reshape_dims=reshape, iota_transpose_perm=perm, tile_assignment_devices=devices,
        replicate_on_last_tile_dim=replicate_last)


def test_a_mesh_in_another_order_than_the_ranks_places_each_block_by_rank():
    mesh = MeshShape(("x",), (4,), devices=(2, 0, 3, 1))  # position 0 is rank 2
    blocks = shard_slices((8,), mesh, (("x",),))
    assert [(b[0].start, b[0].stop) for b in blocks] == [(2, 4), (6, 8), (0, 2), (4, 6)]
    with pytest.raises(ValueError, match="order the ranks 0..3"):
        MeshShape(("x",), (4,), devices=(0, 0, 1, 2))


def test_xla_tile_assignments_become_layouts_that_hold_the_same_blocks():
    # P(None, "y") on a 2x2 ("x", "y") mesh, as JAX lowers it: iota [2,2] transposed.
    op = _tiled([1, 2, 2], reshape=[2, 2], perm=[1, 0], replicate_last=True)
    mesh, spec = layout_of(op, [0, 1, 2, 3], 2, 4)
    assert spec == ((), ("d1",)) and mesh.devices == (0, 2, 1, 3)
    blocks = shard_slices((8, 8), mesh, spec)
    # Devices 0 and 2 (y = 0) hold columns 0..4; 1 and 3 hold 4..8.
    assert [b[1].start for b in blocks] == [0, 4, 0, 4]
    # A plain split in rank order needs no device order.
    mesh, spec = layout_of(_tiled([4], reshape=[4], perm=[0]), [0, 1, 2, 3], 1, 4)
    assert mesh.devices is None and spec == (("d0",),)
    # Devices listed in another order than the ranks (the client's device list).
    mesh, _ = layout_of(_tiled([4], devices=[0, 1, 2, 3]), [3, 2, 1, 0], 1, 4)
    assert mesh.devices == (3, 2, 1, 0)
    replicated = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.REPLICATED)
    assert layout_of(replicated, [0, 1, 2, 3], 2, 4) == (MeshShape(("chips",), (4,)),
                                                         ((), ()))


def test_what_is_not_a_layout_over_a_whole_slice_is_refused_by_name():
    with pytest.raises(ValueError, match=r"chips \[0, 1\] of a slice of 4"):
        layout_of(_tiled([2], devices=[0, 1]), [0, 1], 1, 4)
    manual = xla_data_pb2.OpSharding(type=xla_data_pb2.OpSharding.MANUAL)
    with pytest.raises(ValueError, match="type MANUAL"):
        layout_of(manual, [0, 1, 2, 3], 1, 4)


def _devices():
    topo = Topology.of("v6e-2x2")
    return plan_devices([{"name": f"s{i}", "topology": topo, "platform": "cpu",
                          "workers": [(r, 0, r) for r in range(4)]} for i in range(2)])


def test_a_sharding_is_placed_on_one_slice_or_refused_naming_why():
    devices = _devices()
    op = _tiled([4], reshape=[4], perm=[0])
    placed = place(ProxySharding((4, 5, 6, 7), op), 1, devices, [4, 4])
    assert placed.slices == (1,) and placed.device is None and placed.spec == (("d0",),)
    one = place(ProxySharding((6,)), 2, devices, [4, 4])
    assert one.slices == (1,) and one.device == 6 and one.spec == ((), ())
    # Across both slices of one JAX world: one layout over their 8 chips.
    across = place(ProxySharding(tuple(range(8)), _tiled([8], reshape=[8], perm=[0])), 1,
                   devices, [4, 4])
    assert across.slices == (0, 1) and across.device is None and across.mesh.size == 8
    with pytest.raises(InvalidArgument, match=r"spans devices of slices .* separate JAX"):
        place(ProxySharding((2, 3, 4, 5), op), 1, devices, [4, 4], joint=False)
    with pytest.raises(InvalidArgument, match=r"not a layout|replicates over"):
        place(ProxySharding((2, 3, 4, 5), op), 1, devices, [4, 4])  # half of each slice
    with pytest.raises(InvalidArgument, match="device 9 is not one of this session's 8 devices"):
        place(ProxySharding((9,)), 1, devices, [4, 4])


def test_sharding_and_dtype_protos_round_trip():
    op = _tiled([2, 1], reshape=[2], perm=[0])
    parsed = parse_sharding(hlo_sharding_proto([4, 5], op.SerializeToString(), "device"))
    assert parsed.device_ids == (4, 5) and parsed.memory_kind == "device"
    assert list(parsed.op.tile_assignment_dimensions) == [2, 1]
    import ml_dtypes

    for dtype in map(np.dtype, ("float32", ml_dtypes.bfloat16, "int8", "bool", "uint32")):
        assert dtype_of(dtype_proto(dtype)) == dtype


def test_a_lookup_waits_for_its_buffer_and_times_out_by_name():
    buffers = HostBuffers(timeout_s=5)
    threading.Timer(0.2, lambda: buffers.store(7, b"abc")).start()
    t0 = time.monotonic()
    assert buffers.take(7) == b"abc" and time.monotonic() - t0 < 4
    assert not buffers.delete(7)
    with pytest.raises(TimeoutError, match="host buffer 8 did not arrive within 0 s"):
        buffers.lookup(8, timeout_s=0.1)
    buffers.close("the session closed")
    with pytest.raises(RuntimeError, match="host buffer 9: the session closed"):
        buffers.lookup(9)


def test_hlo_programs_and_signatures_travel_as_bytes():
    program = HloProgram("jit_step", b"module", b"options", (0, 2, 1, 3), (((4,), "float32"),))
    assert is_hlo_blob(program.blob) and not is_hlo_blob(b"\x00exported")
    assert HloProgram.from_blob(program.blob) == program
    assert program.fingerprint != HloProgram("jit_step", b"module", b"options", (),
                                             (((4,), "float32"),)).fingerprint
    sig = HloSignature(((MeshShape(("d0", "r0"), (2, 2), (0, 2, 1, 3)), (("d0",),)),),
                       (b"\x08\x03",), (b"",))
    assert HloSignature.from_bytes(sig.to_bytes()) == sig


def test_a_clients_debug_options_naming_host_paths_are_dropped_and_the_rest_kept():
    from pathways_ray.proxy.programs import _confine
    from pathways_ray.proxy.protos import xla_python_pjrt_ifrt_xla_compiler_pb2 as pb

    options = pb.XlaCompileOptionsProto().compile_options
    debug = options.executable_build_options.debug_options
    debug.xla_dump_to = "/tmp/x"
    debug.xla_gpu_kernel_cache_file = "/etc/passwd"
    debug.xla_dump_hlo_pass_re = ".*"  # a pattern, not a path: kept (it dumps nowhere now)
    debug.xla_cpu_enable_fast_math = True
    options.env_option_overrides["xla_dump_to"].string_field = "/tmp/y"
    options.env_option_overrides["xla_cpu_enable_fast_math"].bool_field = True
    _confine(options)
    assert debug.xla_dump_to == "" and debug.xla_gpu_kernel_cache_file == ""
    assert debug.xla_dump_hlo_pass_re == ".*" and debug.xla_cpu_enable_fast_math
    assert sorted(options.env_option_overrides) == ["xla_cpu_enable_fast_math"]
