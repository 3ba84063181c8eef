"""Plugin programs as pathwaysutils sends them, parsed (pure, no Ray): the requests it
builds are read back field for field; malformed ones fail by name."""

from __future__ import annotations

import base64
import json

import pytest

from pathways_ray.proxy.errors import InvalidArgument, Unimplemented
from pathways_ray.proxy.plugins.requests import (
    PREFIX,
    Persistence,
    Profile,
    Reshard,
    Target,
    parse,
)


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _write(location="/ckpt/step_1", name="params.w", **over) -> dict:
    return {"b64_location": _b64(location), "b64_name": _b64(name),
            "b64_hlo_sharding_string": base64.b64encode(b"\x08\x03").decode(),
            "shape": [8, 16], "devices": {"device_ids": [0, 1, 2, 3]},
            "timeout": {"seconds": 60, "nanos": 500_000_000}, **over}


def _program(body: dict) -> bytes:
    return PREFIX + json.dumps(body).encode()


def test_a_bulk_write_and_a_bulk_read_read_back_as_pathwaysutils_builds_them():
    got = parse(_program({"bulk_persistence_write_request": {"write_requests": [
        _write(), _write(name="opt.mu")]}}))
    assert isinstance(got, Persistence) and got.write and len(got.arrays) == 2
    one = got.arrays[0]
    assert (one.location, one.name, one.shape, one.device_ids) == (
        "/ckpt/step_1", "params.w", (8, 16), (0, 1, 2, 3))
    assert one.op == b"\x08\x03" and one.dtype is None and got.timeout_s == 60.5
    read = dict(_write(location="gs://bucket/run/7"),
                shape={"xla_primitive_type_str": "BF16", "dimensions": [4]})
    got = parse(_program({"bulk_persistence_read_request": {"read_requests": [read]}}))
    assert not got.write and got.arrays[0].dtype == "bfloat16"
    assert got.arrays[0].location == "gs://bucket/run/7" and got.arrays[0].shape == (4,)


def test_a_profile_request_names_its_location():
    got = parse(_program({"profileRequest": {"traceLocation": "/tmp/trace",
                                             "maxNumHosts": 1}}))
    assert got == Profile("/tmp/trace")


def test_a_sidechannel_reshard_request_names_sources_and_targets():
    one = {"devices": {"device_ids": [4, 5]}, "xla_hlo_sharding": "CAM=",
           "memory_kind": "device"}
    got = parse(_program({"reshardRequest": {"donateInput": True, "inSharding": [one],
                                             "outSharding": [dict(one, memory_kind="")]}}))
    assert got == Reshard((Target((4, 5), b"\x08\x03", "device"),),
                          (Target((4, 5), b"\x08\x03", ""),), True)


@pytest.mark.parametrize("body,words", [
    ({"reshardRequest": {"inSharding": [], "outSharding": []}}, "same length"),
    ({"persistenceWriteRequest": _write(location="relative/dir")}, "b64_location"),
    ({"persistenceWriteRequest": _write(location="/a/../etc")}, "without '..'"),
    ({"persistenceWriteRequest": _write(name="../../etc/passwd")}, "b64_name"),
    ({"persistenceWriteRequest": _write(name="/abs")}, "b64_name"),
    ({"persistenceWriteRequest": _write(b64_name="%%%")}, "not base64"),
    ({"persistenceWriteRequest": _write(shape=[-1])}, "shape"),
    ({"persistenceWriteRequest": _write(devices={"device_ids": []})}, "device_ids"),
    ({"persistenceWriteRequest": _write(timeout={"seconds": "soon"})}, "timeout"),
    ({"persistenceReadRequest": _write()}, "xla_primitive_type_str"),
    ({"bulk_persistence_write_request": {"write_requests": []}}, "write_requests"),
    ({"profileRequest": {}}, "traceLocation"),
    ({"a": {}, "b": {}}, "one key"),
])
def test_a_malformed_request_is_invalid_naming_the_field(body, words):
    with pytest.raises(InvalidArgument) as e:
        parse(_program(body))
    assert words in str(e.value)


def test_not_json_no_prefix_and_an_unknown_kind_fail_by_name():
    with pytest.raises(InvalidArgument, match="not JSON"):
        parse(PREFIX + b"{nope")
    with pytest.raises(InvalidArgument, match="__serialized_plugin_program"):
        parse(b'{"profileRequest": {}}')
    with pytest.raises(Unimplemented, match="'sidechannelReshard'"):
        parse(_program({"sidechannelReshard": {}}))


def test_locations_are_allowed_under_the_servers_storage_roots_only():
    from pathways_ray.proxy.plugins.run import allowed

    roots = ("gs://", "/data/ckpt")
    assert allowed("gs://bucket/run/1", roots) and allowed("/data/ckpt/run/1", roots)
    assert allowed("/data/ckpt", roots)
    assert not allowed("/data/ckpt2/run", roots)  # a sibling whose name starts the same
    assert not allowed("/etc/cron.d", roots) and not allowed("s3://bucket/x", roots)
    assert not allowed("/data/ckpt/x", ("gs://",))  # the default: buckets only
    assert allowed("gs://team/run", ("gs://team",)) and allowed("gs://team", ("gs://team/",))
    assert not allowed("gs://team-other/run", ("gs://team",))  # a bucket, not a prefix
