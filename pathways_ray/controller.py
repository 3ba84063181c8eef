"""The single controller: a Ray actor that owns the slices and forwards work to them.

It reserves slices (``Slice.reserve``), keeps the program registry (each
program's bytes arrive once and are loaded onto a slice the first time that
slice runs it) and the array registry (which buffer ids live on which slice),
and forwards command batches to every chip worker of a slice over its command
stream (``channel.py``). It never holds array bytes: device_put data, fetched
shards and cross-slice transfers move between the client and the workers, or
worker to worker, as object refs it only passes along (by Ray call, which
tracks their ownership).

Order: the controller is the only writer of each worker's stream, and a
worker runs its stream in order, so every worker of a slice sees the same
command sequence. A query (fetch, ready) carries the number of batches sent
before it, and the worker answers only once it has run that many, so a fetch
follows the commands that produced its buffer.
"""

from __future__ import annotations

import logging

from pathways_ray.channel import CommandChannel, dumps
from pathways_ray.sharding import MeshShape, shard_slices, unique_shards
from pathways_ray.slice import Slice

logger = logging.getLogger(__name__)

__all__ = ["Controller"]


class Controller:
    """Create with ``ray.remote(Controller)``; the client talks to it."""

    def __init__(self, slices: list | None = None, reserve_timeout_s: float = 120.0,
                 max_inflight: int = 8, compilation_cache_dir: str | None = None):
        import ray
        from ray._private.state import available_resources_per_node

        from pathways_ray.cluster import slices_from_nodes

        if slices is None:
            free = [v for v in slices_from_nodes(ray.nodes(), available_resources_per_node())
                    if v.idle and v.topology is not None]
            slices = [v.topology for v in free]
            if not slices:
                raise RuntimeError("no free TPU slice in the cluster to reserve")
        self.slices: dict[str, Slice] = {}
        self._channels: dict[str, list[CommandChannel]] = {}
        try:
            for spec in slices:
                s = Slice.reserve(spec, timeout_s=reserve_timeout_s,
                                  compilation_cache_dir=compilation_cache_dir)
                self.slices[s.name] = s
                ends = ray.get([w.handle.open_channel.remote() for w in s.workers], timeout=120)
                self._channels[s.name] = [CommandChannel(address, token)
                                          for address, token in ends]
        except BaseException:
            self.shutdown()
            raise
        self.programs: dict[str, bytes] = {}
        self.loaded: dict[str, set[str]] = {name: set() for name in self.slices}
        self.arrays: dict[str, set[int]] = {name: set() for name in self.slices}
        self.loads_sent: dict[str, int] = {name: 0 for name in self.slices}
        self.max_inflight = max_inflight

    # ---- what the client asks ------------------------------------------------
    def describe(self) -> list[dict]:
        return [{"name": s.name, "topology": str(s.topology), "chips": s.num_chips,
                 "chips_per_host": s.topology.chips_per_host,
                 "workers": [(w.rank, w.info.worker_id, w.info.chip) for w in s.workers]}
                for s in self.slices.values()]

    def register_program(self, fingerprint: str, blob: bytes) -> None:
        self.programs.setdefault(fingerprint, blob)

    def submit(self, slice_name: str, commands: list[tuple]) -> None:
        """Forward a batch of commands to every chip of a slice (one message per worker)."""
        s = self._slice(slice_name)
        batch = []
        live = self.arrays[slice_name]
        for cmd in commands:
            op = cmd[0]
            if op == "run":
                fp = cmd[1]
                if fp not in self.loaded[slice_name]:
                    batch.append(("load", fp, self.programs[fp]))
                    self.loaded[slice_name].add(fp)
                    self.loads_sent[slice_name] += 1
                live.update(cmd[3])
            elif op == "put":
                live.add(cmd[1])
                pieces = cmd[6]
                for w in s.workers:  # each chip gets the refs of its own block only
                    w.handle.stage.remote(cmd[1], pieces[w.rank])
                cmd = cmd[:6]
            elif op == "reshard":
                live.add(cmd[2])
            elif op == "free":
                live.difference_update(cmd[1])
            batch.append(cmd)
        payload = dumps(batch)
        # Backpressure: a client that issues work faster than the slice runs it waits here.
        for ch in self._channels[slice_name]:
            ch.send(payload, self.max_inflight)

    def _sent(self, slice_name: str) -> list[int]:
        """Batches sent to each worker of a slice: what a query must wait for."""
        return [ch.sent for ch in self._channels[slice_name]]

    def shard_refs(self, slice_name: str, buffer_id: int, ranks: list[int]) -> list:
        """Object refs of the given ranks' shards (fetched by the client, not by us)."""
        s, sent = self._slice(slice_name), self._sent(slice_name)
        return [s.workers[r].handle.shard.remote(buffer_id, sent[r]) for r in ranks]

    def ready(self, slice_name: str, buffer_ids: list[int]) -> list:
        s, sent = self._slice(slice_name), self._sent(slice_name)
        return [w.handle.ready.remote(buffer_ids, n) for w, n in zip(s.workers, sent, strict=True)]

    def transfer(self, src: str, src_id: int, shape, dtype: str, src_mesh: MeshShape, src_spec,
                 dst: str, dst_id: int, dst_mesh: MeshShape, dst_spec,
                 via_controller: bool = False) -> None:
        """Copy an array to another slice, shard by shard, worker to worker.

        Each unique source shard becomes one object ref (the source worker's
        ``shard`` result); each destination chip gets the refs that overlap its
        block and assembles it. Only refs pass through here. ``via_controller``
        instead pulls the bytes into this process and puts them again — the
        design we do not use, kept to measure against (benchmarks/reshard.py).
        """
        import ray

        src_slice = self._slice(src)
        self._slice(dst)
        src_index = shard_slices(shape, src_mesh, src_spec)
        firsts = sorted(set(unique_shards(src_index)))
        sent = self._sent(src)
        src_refs = {r: src_slice.workers[r].handle.shard.remote(src_id, sent[r]) for r in firsts}
        if via_controller:
            values = ray.get([src_refs[r] for r in firsts], timeout=600)
            src_refs = {r: ray.put(v) for r, v in zip(firsts, values, strict=True)}
            del values
        else:
            # Wait until the shards exist, without pulling them here (fetch_local=False):
            # destination chips that ask for a ref not yet created wait much longer for
            # its location than for the bytes themselves.
            pending = list(src_refs.values())
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=600,
                                fetch_local=False)
            if len(ready) < len(pending):
                raise TimeoutError(f"source shards of buffer {src_id} on {src} were not ready "
                                   f"within 600 s")
        pieces = []
        for index in shard_slices(shape, dst_mesh, dst_spec):
            mine = [(src_refs[r], src_index[r]) for r in firsts
                    if all(a.start < b.stop and b.start < a.stop
                           for a, b in zip(index, src_index[r], strict=True))]
            pieces.append(mine)
        self.submit(dst, [("put", dst_id, tuple(shape), dtype, dst_spec, dst_mesh, pieces)])

    def repeat(self, slice_name: str, fingerprint: str, buffer_id: int, k: int) -> list:
        """Every worker runs the program k times itself (multi-controller baseline)."""
        s, sent = self._slice(slice_name), self._sent(slice_name)
        return [w.handle.repeat.remote(fingerprint, buffer_id, k, n)
                for w, n in zip(s.workers, sent, strict=True)]

    def pid(self) -> int:
        import os

        return os.getpid()

    def stats(self) -> dict:
        import ray

        out = {}
        for name, s in self.slices.items():
            workers = ray.get([w.handle.stats.remote() for w in s.workers], timeout=60)
            out[name] = {"live_arrays": len(self.arrays[name]), "programs_loaded":
                         len(self.loaded[name]), "loads_sent": self.loads_sent[name],
                         "workers": workers}
        return out

    def drain(self) -> None:
        """Wait until every forwarded batch has run (each wait bounded by the channel's
        timeout)."""
        for channels in self._channels.values():
            for ch in channels:
                ch.wait_acked(ch.sent)

    def shutdown(self) -> None:
        for channels in self._channels.values():
            for ch in channels:
                ch.close()
        self._channels.clear()
        for s in self.slices.values():
            s.shutdown()
        self.slices.clear()

    def _slice(self, name: str) -> Slice:
        try:
            return self.slices[name]
        except KeyError:
            raise ValueError(f"slice={name!r} is not held by this controller; it holds "
                             f"{sorted(self.slices)}") from None
