"""Rank order and per-chip JAX/libtpu environment (pure)."""

from __future__ import annotations

import os
import random
import socket
import threading
import time

import pytest

from pathways_ray.chips.worker_env import (
    ChipInfo,
    cpu_env,
    one_cpu_while,
    rank_order,
    tpu_multiprocess_env,
    wait_listening,
)


def info(worker_id, chip, pid=0):
    return ChipInfo("s", worker_id, chip, f"n{worker_id}", "10.0.0.1", pid, "cpu")


def test_rank_is_worker_id_then_chip_not_bundle_order():
    """Ranks follow (TPU worker id, chip index) whatever order the bundles came in."""
    infos = [info(w, c) for w in range(2) for c in range(4)]
    random.Random(0).shuffle(infos)
    ordered = [infos[i] for i in rank_order(infos)]
    assert [(i.worker_id, i.chip) for i in ordered] == [(w, c) for w in range(2) for c in range(4)]


def test_two_workers_on_one_chip_is_an_error():
    """Two workers claiming the same chip is reported with both pids."""
    with pytest.raises(ValueError, match="pids 1 and 2"):
        rank_order([info(0, 0, pid=1), info(0, 0, pid=2)])


def test_cpu_env_replaces_inherited_device_count():
    """An inherited --xla_force_host_platform_device_count=8 becomes 1; other flags stay."""
    env = cpu_env({"XLA_FLAGS": "--xla_dump_to=/x --xla_force_host_platform_device_count=8"})
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/x",
                                        "--xla_force_host_platform_device_count=1",
                                        "--xla_cpu_multi_thread_eigen=false"]
    assert "--xla_force_host_platform_device_count=1" in cpu_env({})["XLA_FLAGS"]


def test_tpu_multiprocess_env():
    """One process per chip: 1,1,1 chips per process in a process grid shaped like the slice."""
    addrs = [f"10.0.0.{i // 4}:{8470 + i}" for i in range(16)]
    env = tpu_multiprocess_env(rank=5, chip=1, process_addresses=addrs, slice_shape=(4, 4))
    assert env["TPU_PROCESS_BOUNDS"] == "4,4,1"
    assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
    assert env["CLOUD_TPU_TASK_ID"] == "5"
    assert env["TPU_PROCESS_PORT"] == "8475"
    assert env["TPU_VISIBLE_CHIPS"] == "1"
    assert env["TPU_PROCESS_ADDRESSES"].split(",") == addrs
    # Ray's 1-chip host bounds must be unset (empty means unset).
    assert env["TPU_HOST_BOUNDS"] == "" and env["TPU_CHIPS_PER_HOST_BOUNDS"] == ""
    env3 = tpu_multiprocess_env(rank=0, chip=0, process_addresses=addrs[:8],
                                slice_shape=(2, 2, 2))
    assert env3["TPU_PROCESS_BOUNDS"] == "2,2,2"
    with pytest.raises(ValueError, match="rank=8"):
        tpu_multiprocess_env(rank=8, chip=0, process_addresses=addrs[:8], slice_shape=(2, 4))


def test_tpu_multiprocess_env_multislice():
    """Slices joined in one world keep their own ICI grid and add the DCN (MEGASCALE) vars."""
    addrs = [f"10.0.1.{i // 4}:{8470 + i}" for i in range(4)]
    env = tpu_multiprocess_env(rank=2, chip=2, process_addresses=addrs, slice_shape=(2, 2),
                               multislice=(1, 2, "10.0.0.0"))
    assert env["CLOUD_TPU_TASK_ID"] == "2" and env["TPU_PROCESS_BOUNDS"] == "2,2,1"
    assert env["MEGASCALE_SLICE_ID"] == "1" and env["MEGASCALE_NUM_SLICES"] == "2"
    assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.0"
    assert "MEGASCALE_SLICE_ID" not in tpu_multiprocess_env(
        rank=0, chip=0, process_addresses=addrs, slice_shape=(2, 2))
    with pytest.raises(ValueError, match="slice_id=2"):
        tpu_multiprocess_env(rank=0, chip=0, process_addresses=addrs, slice_shape=(2, 2),
                             multislice=(2, 2, "10.0.0.0"))


def test_wait_listening_returns_once_the_coordinator_listens():
    """Ranks other than the coordinator's wait for its port (not for gRPC's 1 s
    reconnect backoff): they go on as soon as it listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = socket.socket()

    def listen_later():
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    t0 = time.monotonic()
    try:
        wait_listening(f"127.0.0.1:{port}", t0 + 10)
        took = time.monotonic() - t0
    finally:
        server.close()
    assert 0.25 < took < 5


def test_wait_listening_gives_up_at_its_deadline():
    """Nobody listens: it returns at the deadline (JAX's own timeout then reports it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    t0 = time.monotonic()
    wait_listening(f"[127.0.0.1]:{port}", t0 + 0.3)
    assert 0.25 < time.monotonic() - t0 < 2


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_one_cpu_while_gives_every_thread_its_cpus_back():
    """Threads started inside inherit the one CPU (that is how XLA's pool gets one
    thread); afterwards they, and the caller, have every CPU they had before."""
    before = os.sched_getaffinity(0)
    stop = threading.Event()
    with one_cpu_while():
        assert len(os.sched_getaffinity(0)) == 1
        inside = threading.Thread(target=stop.wait, daemon=True)
        inside.start()
        assert len(os.sched_getaffinity(inside.native_id)) == 1
    try:
        assert os.sched_getaffinity(0) == before
        assert os.sched_getaffinity(inside.native_id) == before
    finally:
        stop.set()


def test_network_proxy_vars_leave_out_ray_serves_settings():
    from pathways_ray.chips.worker_env import network_proxy_vars

    assert network_proxy_vars({"RAY_SERVE_PROXY_USE_GRPC": "1", "PATH": "/bin"}) == []
    assert network_proxy_vars({"https_proxy": "http://p:3128", "NO_PROXY": "x",
                               "RAY_SERVE_PROXY_USE_GRPC": "1"}) == ["https_proxy"]


_GLOO_WORLD = """
import os, sys
from pathways_ray.chips.worker_env import drop_stdout_lines
if sys.argv[3] == "filtered":
    drop_stdout_lines()
os.environ.update(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
rank = int(sys.argv[1])
jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", num_processes=2, process_id=rank)
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.make_array_from_callback((2,), NamedSharding(mesh, P("x")),
                                 lambda i: np.ones(1, np.float32))
print(f"rank {rank} sum", float(jax.jit(lambda a: a.sum())(x)))
print("no newline at the end", end="")
sys.stdout.flush()
jax.distributed.shutdown()
"""


@pytest.mark.parametrize("mode", ["filtered", "plain"])
def test_a_cpu_world_prints_no_gloo_connection_lines(mode):
    """Gloo's "[Gloo] Rank N is connected to ..." (C++ std::cout, no log level) is
    dropped from a chip process's stdout; everything else it prints passes, a last
    partial line too. Without the filter the lines are there (the test can fail)."""
    import subprocess
    import sys

    from pathways_ray._procs import free_ports

    (port,) = free_ports(1)
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_WORLD, str(r), str(port), mode],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "XLA_FLAGS": "", "TF_CPP_MIN_LOG_LEVEL": "2"})
             for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    for rank, (out, _) in enumerate(outs):
        assert f"rank {rank} sum 2.0" in out and out.endswith("no newline at the end"), out
        assert ("[Gloo]" in out) == (mode == "plain"), out
