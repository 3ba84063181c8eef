"""Simulated chips: the controller's dispatch at pod scale on one machine.

Thousands of JAX chip workers do not fit on a laptop. A ``SimFleet`` runs
lightweight stand-ins instead, many per process (``SimHost`` actors spread over
the Ray nodes): each simulated chip has a real command stream server
(``server.ChannelServer``: the same protocol, secret, acks, heartbeats,
backpressure and relaying as a chip worker) and a ``SimExecutor`` that keeps
the buffer table and program cache as bookkeeping and executes no XLA. The
controller gets them the way a lease of a shared service hands over running
chips (``Slice.borrowed``); nothing else in the runtime changes::

    with SimFleet(["v5p-16x16x16"], processes=8) as sim:
        client = sim.connect()          # a Client, as from pathways_ray.connect()
        z = client.device_put(x, sharding)
        for _ in range(100):
            z = step(z)

Arrays have no bytes on simulated chips: ``fetch`` raises, ``block_until_ready``
works. ``benchmarks/dispatch_scale.py`` measures with it.
"""

from __future__ import annotations

import os
import threading

import ray

from pathways_ray import boundary
from pathways_ray.chips.worker_env import ChipInfo
from pathways_ray.clusters.topology import Topology
from pathways_ray.config import timeout_s
from pathways_ray.transport.commands import Free, Load
from pathways_ray.transport.server import ChannelServer

__all__ = ["SimExecutor", "SimFleet", "SimHost"]

# Simulated chips run nothing, but the client exports programs for a slice's platform
# (and checks it): they take what the emulated fleet's CPU chips take.
PLATFORM = "cpu"


class SimExecutor:
    """A chip's command stream run as bookkeeping: programs loaded, buffers written and
    freed, reads of buffers that do not exist counted (a dispatch bug would show)."""

    def __init__(self):
        self.buffers: set[int] = set()
        self.programs: set[str] = set()
        self.commands_run = self.batches_run = self.missing_reads = 0

    def run(self, batch: list) -> None:
        for cmd in batch:
            if isinstance(cmd, Load):
                self.programs.add(cmd.fingerprint)
            elif isinstance(cmd, Free):
                self.buffers.difference_update(cmd.buffers)
            else:
                self.missing_reads += sum(b not in self.buffers for b in cmd.reads)
                self.buffers.update(cmd.writes)
        self.commands_run += len(batch)
        self.batches_run += 1


class _SimChip:
    def __init__(self, info: ChipInfo, rank: int):
        self.info, self.rank = info, rank
        self.executor = SimExecutor()
        self.channel: ChannelServer | None = None

    # the ChipWorker calls the controller makes, as far as dispatch needs them
    def open_channel(self, lease=None):
        if self.channel is None:
            self.channel = ChannelServer(self.info.ip, self.executor.run)
        return self.channel.address, self.channel.token

    def relay(self, children, lease=None):
        self.channel.relay(children, f"simulated slice {self.info.slice_name}",
                           timeout_s("stream"))

    def ping(self):
        return self.rank

    def stage(self, refs, buffers, source=None, lease=None):
        return None  # the pieces' bytes stay where they are: nothing is computed here

    def ready(self, buffer_ids, after=0, lease=None):
        if after:
            self.channel.wait_for(after, timeout_s("stream"))
        missing = [b for b in buffer_ids if b not in self.executor.buffers]
        if missing:
            raise KeyError(f"simulated chip rank {self.rank} has no buffers {missing}")
        return True

    def stats(self):
        ex = self.executor
        return {"buffers": len(ex.buffers), "programs": len(ex.programs),
                "commands": ex.commands_run, "batches": ex.batches_run,
                "missing_reads": ex.missing_reads}

    def shard(self, *args, **kwargs):
        raise NotImplementedError("simulated chips hold no array bytes: fetch() needs a "
                                  "real fleet (pathways_ray.connect on a LocalFleet)")

    shards = put_shards = held = offer = transfer_address = shard

    def abandon(self, slice_name, lease=None):
        return None  # simulated chips pull nothing

    def cancel(self, pulls, error, lease=None):
        return None

    def bind(self, lease=None):
        return None

    def shutdown_world(self):
        if self.channel is not None:
            self.channel.close()
            self.channel = None


class SimHost:
    """One process holding many simulated chips (create with ``ray.remote``)."""

    def __init__(self, chips: list[tuple[str, int, int, int]]):
        ctx = ray.get_runtime_context()
        ip = ray.util.get_node_ip_address()
        self._chips = [_SimChip(ChipInfo(slice_name=name, worker_id=host, chip=chip,
                                         node_id=ctx.get_node_id(), ip=ip, pid=os.getpid(),
                                         platform=PLATFORM), rank)
                       for name, host, chip, rank in chips]

    def infos(self) -> list[ChipInfo]:
        return [c.info for c in self._chips]

    def call(self, index: int, method: str, *args, **kwargs):
        return getattr(self._chips[index], method)(*args, **kwargs)

    def close(self) -> None:
        for c in self._chips:
            c.shutdown_world()


class _SimHandle:
    """Stands where a chip worker's actor handle stands: ``handle.method.remote(...)``
    calls the chip's method inside its ``SimHost``."""

    def __init__(self, host, index: int):
        self._host, self._index = host, index

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        return _SimMethod(self._host, self._index, method)


class _SimMethod:
    def __init__(self, host, index: int, method: str):
        self._host, self._index, self._method = host, index, method

    def remote(self, *args, **kwargs):
        return self._host.call.remote(self._index, self._method, *args, **kwargs)


class SimFleet:
    """Simulated slices (``Topology`` or ``"v5p-16x16x16"``), their chips spread over
    ``processes`` ``SimHost`` actors, round-robin over the cluster's alive nodes.
    Needs a connected Ray cluster (``LocalFleet``)."""

    def __init__(self, slices: list, processes: int = 4):
        if not ray.is_initialized():
            raise RuntimeError("not connected to a Ray cluster; start a pathways_ray."
                               "LocalFleet first")
        if not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes={processes!r} must be a positive number of "
                             f"SimHost processes")
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from pathways_ray.chips.handles import SliceWorker

        self.topologies = [Topology.of(s) for s in slices]
        chips = []  # (slice, host, chip, rank) in slice then rank order
        for i, topo in enumerate(self.topologies):
            name = f"sim{i}-{topo.generation.name}-{topo.name}"
            chips += [(name, r // topo.chips_per_host, r % topo.chips_per_host, r)
                      for r in range(topo.chips)]
        per = -(-len(chips) // processes)
        parts = [chips[k:k + per] for k in range(0, len(chips), per)]
        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
        self._hosts = [ray.remote(SimHost).options(
            num_cpus=0, max_concurrency=64, name=None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[k % len(nodes)],
                                                               soft=True)).remote(part)
            for k, part in enumerate(parts)]
        try:
            got = boundary.get([h.infos.remote() for h in self._hosts], timeout="worker_start",
                               what="starting the simulated hosts")
        except BaseException:
            for h in self._hosts:
                ray.kill(h)
            raise
        infos = [i for part in got for i in part]
        handles = [_SimHandle(h, k) for h, part in zip(self._hosts, parts, strict=True)
                   for k in range(len(part))]
        self._lent, start = [], 0
        for topo in self.topologies:
            workers = [SliceWorker(rank=r, info=infos[start + r], actor_name="",
                                   handle=handles[start + r]) for r in range(topo.chips)]
            self._lent.append({"topology": topo, "workers": workers, "world": [],
                               "world_offset": 0, "pg": None})
            start += topo.chips
        self._closed = threading.Event()

    @property
    def chips(self) -> int:
        return sum(t.chips for t in self.topologies)

    def lend(self) -> list[dict]:
        """What ``Controller(lease=...)`` takes: the slices, already running."""
        return self._lent

    def pids(self) -> list[int]:
        return sorted({i.info.pid for lent in self._lent for i in lent["workers"]})

    def stats(self) -> list[dict]:
        """Every simulated chip's counters, in slice then rank order."""
        return boundary.get([w.handle.stats.remote() for lent in self._lent
                             for w in lent["workers"]], timeout="control",
                            what="the simulated chips' counters")

    def connect(self, **kwargs):
        """A client whose controller dispatches to these chips (``connect`` arguments:
        ``max_batch``, ``fanout``, ``controller_cls``)."""
        from pathways_ray.client.connect import connect

        return connect(simulated=self, compilation_cache_dir=None, **kwargs)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        # Close the servers first (a process that died already has nothing to close).
        boundary.settle([h.close.remote() for h in self._hosts], "control")
        for h in self._hosts:
            ray.kill(h)

    def __enter__(self) -> SimFleet:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
