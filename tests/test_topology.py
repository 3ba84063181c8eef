"""Topology math against the tables GKE publishes, and the errors for bad input."""

from __future__ import annotations

import pytest

from pathways_ray.clusters.topology import GENERATIONS, Topology, generation, parse_shape

# (accelerator, topology, chips, hosts, chips/host, pod type, TPU_ACCELERATOR_TYPE,
#  GKE accelerator label, GKE machine type, Ray accelerator type)
# Written out from GKE's "Plan TPUs in GKE" tables, not computed.
GKE_TABLE = [
    ("v4", "2x2x1", 4, 1, 4, "v4-8", "v4-8", "tpu-v4-podslice", "ct4p-hightpu-4t", "TPU-V4"),
    ("v4", "2x2x2", 8, 2, 4, "v4-16", "v4-16", "tpu-v4-podslice", "ct4p-hightpu-4t", "TPU-V4"),
    ("v4", "2x2x4", 16, 4, 4, "v4-32", "v4-32", "tpu-v4-podslice", "ct4p-hightpu-4t", "TPU-V4"),
    ("v4", "2x4x4", 32, 8, 4, "v4-64", "v4-64", "tpu-v4-podslice", "ct4p-hightpu-4t", "TPU-V4"),
    ("v4", "4x4x4", 64, 16, 4, "v4-128", "v4-128", "tpu-v4-podslice", "ct4p-hightpu-4t",
     "TPU-V4"),
    ("v4", "8x8x16", 1024, 256, 4, "v4-2048", "v4-2048", "tpu-v4-podslice", "ct4p-hightpu-4t",
     "TPU-V4"),
    ("v5e", "1x1", 1, 1, 1, "v5litepod-1", "v5litepod-1", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-1t", "TPU-V5LITEPOD"),
    ("v5e", "2x2", 4, 1, 4, "v5litepod-4", "v5litepod-4", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-4t", "TPU-V5LITEPOD"),
    ("v5e", "2x4", 8, 1, 8, "v5litepod-8", "v5litepod-8", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-8t", "TPU-V5LITEPOD"),
    ("v5e", "4x4", 16, 4, 4, "v5litepod-16", "v5litepod-16", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-4t", "TPU-V5LITEPOD"),
    ("v5e", "4x8", 32, 8, 4, "v5litepod-32", "v5litepod-32", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-4t", "TPU-V5LITEPOD"),
    ("v5e", "8x8", 64, 16, 4, "v5litepod-64", "v5litepod-64", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-4t", "TPU-V5LITEPOD"),
    ("v5e", "8x16", 128, 32, 4, "v5litepod-128", "v5litepod-128", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-4t", "TPU-V5LITEPOD"),
    ("v5e", "16x16", 256, 64, 4, "v5litepod-256", "v5litepod-256", "tpu-v5-lite-podslice",
     "ct5lp-hightpu-4t", "TPU-V5LITEPOD"),
    ("v5p", "2x2x1", 4, 1, 4, "v5p-8", "v5p-8", "tpu-v5p-slice", "ct5p-hightpu-4t", "TPU-V5P"),
    ("v5p", "2x2x2", 8, 2, 4, "v5p-16", "v5p-16", "tpu-v5p-slice", "ct5p-hightpu-4t",
     "TPU-V5P"),
    ("v5p", "4x4x4", 64, 16, 4, "v5p-128", "v5p-128", "tpu-v5p-slice", "ct5p-hightpu-4t",
     "TPU-V5P"),
    ("v5p", "16x16x24", 6144, 1536, 4, "v5p-12288", "v5p-12288", "tpu-v5p-slice",
     "ct5p-hightpu-4t", "TPU-V5P"),
    ("v6e", "1x1", 1, 1, 1, "v6e-1", "v6e-1", "tpu-v6e-slice", "ct6e-standard-1t", "TPU-V6E"),
    ("v6e", "2x2", 4, 1, 4, "v6e-4", "v6e-4", "tpu-v6e-slice", "ct6e-standard-4t", "TPU-V6E"),
    ("v6e", "2x4", 8, 1, 8, "v6e-8", "v6e-8", "tpu-v6e-slice", "ct6e-standard-8t", "TPU-V6E"),
    ("v6e", "4x4", 16, 4, 4, "v6e-16", "v6e-16", "tpu-v6e-slice", "ct6e-standard-4t",
     "TPU-V6E"),
    ("v6e", "4x8", 32, 8, 4, "v6e-32", "v6e-32", "tpu-v6e-slice", "ct6e-standard-4t",
     "TPU-V6E"),
    ("v6e", "8x8", 64, 16, 4, "v6e-64", "v6e-64", "tpu-v6e-slice", "ct6e-standard-4t",
     "TPU-V6E"),
    ("v6e", "8x16", 128, 32, 4, "v6e-128", "v6e-128", "tpu-v6e-slice", "ct6e-standard-4t",
     "TPU-V6E"),
    ("v6e", "16x16", 256, 64, 4, "v6e-256", "v6e-256", "tpu-v6e-slice", "ct6e-standard-4t",
     "TPU-V6E"),
    ("tpu7x", "2x2x1", 4, 1, 4, "v7x-8", "tpu7x-8", "tpu7x", "tpu7x-standard-4t", "TPU-V7X"),
    ("tpu7x", "2x2x2", 8, 2, 4, "v7x-16", "tpu7x-16", "tpu7x", "tpu7x-standard-4t", "TPU-V7X"),
    ("tpu7x", "4x4x4", 64, 16, 4, "v7x-128", "tpu7x-128", "tpu7x", "tpu7x-standard-4t",
     "TPU-V7X"),
    ("tpu7x", "8x16x16", 2048, 512, 4, "v7x-4096", "tpu7x-4096", "tpu7x",
     "tpu7x-standard-4t", "TPU-V7X"),
]


@pytest.mark.parametrize("row", GKE_TABLE, ids=lambda r: f"{r[0]}-{r[1]}")
def test_gke_table(row):
    """Every published shape has the chips, hosts and names GKE and Ray use."""
    acc, shape, chips, hosts, per_host, pod, api, label, machine, ray_type = row
    t = Topology.parse(acc, shape)
    assert t.chips == chips
    assert t.num_hosts == hosts
    assert t.chips_per_host == per_host
    assert t.pod_type == pod
    assert t.api_accelerator_type == api
    assert t.gke_accelerator == label
    assert t.machine_type == machine
    assert t.accelerator_type == ray_type
    assert t.head_resource == f"TPU-{pod}-head"
    assert t.is_single_host == (hosts == 1)


def test_v6e_2x4_as_two_hosts():
    """v5e/v6e 2x4 is one 8-chip host by default, two 4-chip hosts on request."""
    for acc in ("v6e", "v5e"):
        assert Topology.parse(acc, "2x4").num_hosts == 1
        t = Topology.parse(acc, "2x4", chips_per_host=4)
        assert (t.num_hosts, t.chips_per_host, t.machine_type.endswith("-4t")) == (2, 4, True)


ALL_SHAPES = [(g.name, t) for g in GENERATIONS.values() for t in g.topologies]


@pytest.mark.parametrize("acc,shape", ALL_SHAPES)
def test_every_shape_is_consistent_and_agrees_with_ray(acc, shape):
    """For every valid shape: hosts x chips/host = chips, pod type counts cores, the
    pod type parses back to the same shape, and Ray's own TPU tables agree."""
    from ray._private.accelerators.tpu import (
        VALID_TPU_TOPOLOGY,
        get_chips_per_host,
        infer_tpu_pod_type_from_topology,
    )

    t = Topology.parse(acc, shape)
    assert t.num_hosts * t.chips_per_host == t.chips
    assert t.cores == t.chips * t.generation.cores_per_chip
    assert Topology.parse(t.pod_type).chips == t.chips
    assert Topology.parse(t.api_accelerator_type).chips == t.chips
    assert shape in VALID_TPU_TOPOLOGY[t.generation.ray_version]
    assert get_chips_per_host(shape, t.generation.ray_version) == t.chips_per_host
    assert infer_tpu_pod_type_from_topology(shape, t.accelerator_type) == t.pod_type


@pytest.mark.parametrize(
    "name,expected",
    [
        ("v6e", "v6e"), ("V6E", "v6e"), ("TPU-V6E", "v6e"), ("tpu-v6e-slice", "v6e"),
        ("v5e", "v5e"), ("v5litepod", "v5e"), ("TPU-V5LITEPOD", "v5e"),
        ("tpu-v5-lite-podslice", "v5e"), ("v5p", "v5p"), ("tpu-v5p-slice", "v5p"),
        ("v4", "v4"), ("tpu-v4-podslice", "v4"), ("tpu7x", "tpu7x"), ("v7x", "tpu7x"),
        ("TPU-V7X", "tpu7x"),
    ],
)
def test_generation_aliases(name, expected):
    """Ray's names, GKE labels and our names all find the same generation."""
    assert generation(name).name == expected


@pytest.mark.parametrize(
    "pod,shape",
    [("v6e-16", "4x4"), ("v6e-256", "16x16"), ("v5litepod-8", "2x4"), ("v4-8", "2x2x1"),
     ("v4-32", "2x2x4"), ("v5p-128", "4x4x4"), ("tpu7x-8", "2x2x1"), ("v7x-16", "2x2x2")],
)
def test_pod_type_gives_default_shape(pod, shape):
    """A pod type alone picks the shape the TPU API uses for it."""
    assert Topology.parse(pod).name == shape


@pytest.mark.parametrize(
    "args,kwargs,must_mention",
    [
        (("v6e", "3x3"), {}, ["'3x3'", "v6e", "4x4", "16x16"]),
        (("v6e", "4x4x"), {}, ["'4x4x'", "AxB"]),
        (("v6e", "4x4x4"), {}, ["'4x4x4'", "2D", "4x4"]),
        (("v5p", "4x4"), {}, ["'4x4'", "3D", "2x2x2"]),
        (("v9", "4x4"), {}, ["'v9'", "v4, v5e, v5p, v6e, tpu7x"]),
        (("", "4x4"), {}, ["''", "v6e"]),
        (("v6e", None), {}, ["topology is required", "v6e-16"]),
        (("v6e-24", None), {}, ["'v6e-24'", "v6e-16"]),
        (("v4-7", None), {}, ["'v4-7'", "TensorCores"]),
        (("v6e-16", "2x4"), {}, ["16 chips", "'2x4'", "8"]),
        (("v6e", "4x4"), {"chips_per_host": 8}, ["chips_per_host=8", "[4]"]),
        (("v6e", "2x4"), {"chips_per_host": 2}, ["chips_per_host=2", "[8, 4]"]),
        (("v6e", "0x4"), {}, ["'0x4'"]),
        (("v6e", 44), {}, ["44"]),
    ],
)
def test_bad_input_names_value_and_valid_choices(args, kwargs, must_mention):
    """Bad input raises ValueError naming the value and what would be valid."""
    with pytest.raises(ValueError) as exc:
        Topology.parse(*args, **kwargs)
    for text in must_mention:
        assert text in str(exc.value), (text, str(exc.value))


def test_parse_shape():
    """Shapes parse to tuples; whitespace and case are forgiven."""
    assert parse_shape("4x4") == (4, 4)
    assert parse_shape(" 2X2x1 ") == (2, 2, 1)


def test_host_env_is_what_gke_sets():
    """The env of a host is GKE's TPU webhook env for that pod."""
    t = Topology.parse("v6e", "4x4")
    env = t.host_env("my-slice", 3)
    assert env["TPU_NAME"] == "my-slice"
    assert env["TPU_WORKER_ID"] == "3"
    assert env["TPU_ACCELERATOR_TYPE"] == "v6e-16"
    assert env["TPU_TOPOLOGY"] == "4x4"
    assert env["TPU_WORKER_HOSTNAMES"].count(",") == 3
    with pytest.raises(ValueError, match="worker_id=4"):
        t.host_env("my-slice", 4)


def test_topology_is_a_frozen_value():
    """Topologies compare by value and cannot be mutated (safe across actors)."""
    a, b = Topology.parse("v6e", "4x4"), Topology.parse("TPU-V6E", "4x4")
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.chips_per_host = 8  # type: ignore[misc]


def test_of_accepts_topologies_names_and_pod_types():
    """Topology.of reads what str(topology) writes, pod types, and checks chips_per_host."""
    t = Topology.parse("v6e", "2x4", chips_per_host=4)
    assert Topology.of(t) is t
    assert Topology.of(str(t), chips_per_host=4) == t
    assert Topology.of("v5p-2x2x2").num_hosts == 2
    assert Topology.of("v6e-16").name == "4x4"
    with pytest.raises(ValueError, match="chips_per_host=8 contradicts"):
        Topology.of(t, chips_per_host=8)
    with pytest.raises(TypeError, match="topology=3"):
        Topology.of(3)
