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
from dataclasses import dataclass

from pathways_ray.channel import CommandChannel, dumps
from pathways_ray.sharding import MeshShape, shard_slices, unique_shards
from pathways_ray.slice import Slice

logger = logging.getLogger(__name__)

__all__ = ["Controller"]


@dataclass(frozen=True)
class Placement:
    """Where an array lives: one slice, or several slices of one JAX world (a
    multislice mesh). ``workers`` are in device order; ``start`` is the first
    device in the world."""

    name: str
    slices: tuple[Slice, ...]

    @property
    def workers(self) -> list:
        return [w for s in self.slices for w in s.workers]

    @property
    def start(self) -> int:
        return self.slices[0].world_offset

    @property
    def chips(self) -> int:
        return sum(s.num_chips for s in self.slices)


class Controller:
    """Create with ``ray.remote(Controller)``; the client talks to it."""

    def __init__(self, slices: list | None = None, reserve_timeout_s: float = 120.0,
                 max_inflight: int = 8, compilation_cache_dir: str | None = None,
                 multislice: bool = False):
        import ray
        from ray._private.state import available_resources_per_node

        from pathways_ray.cluster import slices_from_nodes

        if slices is None:
            free = [v for v in slices_from_nodes(ray.nodes(), available_resources_per_node())
                    if v.idle and v.topology is not None]
            slices = [v.topology for v in free]
            if not slices:
                raise RuntimeError("no free TPU slice in the cluster to reserve")
        self.multislice = multislice and len(slices) > 1
        self.slices: dict[str, Slice] = {}
        self._channels: dict[str, list[CommandChannel]] = {}
        try:
            if self.multislice:
                reserved = Slice.reserve_joint(slices, timeout_s=reserve_timeout_s,
                                               compilation_cache_dir=compilation_cache_dir)
                self.slices.update((s.name, s) for s in reserved)
            else:
                for spec in slices:
                    s = Slice.reserve(spec, timeout_s=reserve_timeout_s,
                                      compilation_cache_dir=compilation_cache_dir)
                    self.slices[s.name] = s
            for s in self.slices.values():
                ends = ray.get([w.handle.open_channel.remote() for w in s.workers], timeout=120)
                self._channels[s.name] = [
                    CommandChannel(address, token,
                                   what=f"chip worker rank {w.rank} of slice {s.name}")
                    for w, (address, token) in zip(s.workers, ends, strict=True)]
        except BaseException:
            self.shutdown()
            raise
        self.placements: dict[str, Placement] = {}
        self.loaded, self.arrays, self.loads_sent = {}, {}, {}
        for s in self.slices.values():
            self._add_placement(Placement(s.name, (s,)))
        self.programs: dict[str, bytes] = {}
        self.max_inflight = max_inflight

    def _add_placement(self, p: Placement) -> None:
        self.placements[p.name] = p
        self.loaded[p.name] = set()
        self.arrays[p.name] = set()
        self.loads_sent[p.name] = 0

    # ---- what the client asks ------------------------------------------------
    def describe(self) -> list[dict]:
        return [{"name": s.name, "topology": str(s.topology), "chips": s.num_chips,
                 "chips_per_host": s.topology.chips_per_host,
                 "workers": [(w.rank, w.info.worker_id, w.info.chip) for w in s.workers]}
                for s in self.slices.values()]

    def group(self, slice_names: list[str]) -> dict:
        """A placement spanning several slices of this controller's one JAX world."""
        if not self.multislice:
            raise ValueError(f"slices={slice_names} are separate JAX worlds; a mesh across "
                             f"slices needs them joined: pathways_ray.connect(multislice=True)")
        members = tuple(self._place(n).slices[0] for n in slice_names)
        if len(set(slice_names)) != len(slice_names) or len(members) < 2:
            raise ValueError(f"slices={slice_names} must name two or more different slices")
        ordered = sorted(members, key=lambda m: m.world_offset)
        contiguous = all(a.world_offset + a.num_chips == b.world_offset
                         for a, b in zip(ordered, ordered[1:], strict=False))
        if list(members) != ordered or not contiguous:
            order = [s.name for s in sorted(self.slices.values(), key=lambda m: m.world_offset)]
            raise ValueError(f"slices={slice_names} must be consecutive slices in world order "
                             f"{order}")
        name = "+".join(slice_names)
        if name not in self.placements:
            self._add_placement(Placement(name, members))
        return {"name": name, "chips": self.placements[name].chips,
                "topology": " + ".join(str(m.topology) for m in members)}

    def register_program(self, fingerprint: str, blob: bytes) -> None:
        self.programs.setdefault(fingerprint, blob)

    def submit(self, where: str, commands: list[tuple]) -> None:
        """Forward a batch of commands to every chip of a placement (one message per
        worker)."""
        p = self._place(where)
        batch = []
        live = self.arrays[where]
        for cmd in commands:
            op = cmd[0]
            if op == "run":
                fp = cmd[1]
                if fp not in self.loaded[where]:
                    batch.append(("load", fp, self.programs[fp]))
                    self.loaded[where].add(fp)
                    self.loads_sent[where] += 1
                live.update(cmd[3])
            elif op == "put":
                live.add(cmd[1])
                pieces = cmd[6]
                for i, w in enumerate(p.workers):  # each chip gets the refs of its block only
                    w.handle.stage.remote(cmd[1], pieces[i])
                cmd = (*cmd[:6], p.start)
            elif op == "reshard":
                live.add(cmd[2])
                cmd = (*cmd, p.start)
            elif op == "free":
                live.difference_update(cmd[1])
            batch.append(cmd)
        payload = dumps(batch)
        # Backpressure: a client that issues work faster than the slice runs it waits here.
        for s in p.slices:
            for ch in self._channels[s.name]:
                ch.send(payload, self.max_inflight)

    def _sent(self, where: str) -> list[int]:
        """Batches sent to each worker of a placement: what a query must wait for."""
        return [ch.sent for s in self._place(where).slices for ch in self._channels[s.name]]

    def shard_refs(self, where: str, buffer_id: int, ranks: list[int]) -> list:
        """Object refs of the given ranks' shards (fetched by the client, not by us)."""
        workers, sent = self._place(where).workers, self._sent(where)
        return [workers[r].handle.shard.remote(buffer_id, sent[r]) for r in ranks]

    def ready(self, where: str, buffer_ids: list[int]) -> list:
        workers, sent = self._place(where).workers, self._sent(where)
        return [w.handle.ready.remote(buffer_ids, n) for w, n in zip(workers, sent, strict=True)]

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

        src_workers = self._place(src).workers
        self._place(dst)
        src_index = shard_slices(shape, src_mesh, src_spec)
        firsts = sorted(set(unique_shards(src_index)))
        sent = self._sent(src)
        src_refs = {r: src_workers[r].handle.shard.remote(src_id, sent[r]) for r in firsts}
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
        workers, sent = self._place(slice_name).workers, self._sent(slice_name)
        return [w.handle.repeat.remote(fingerprint, buffer_id, k, n)
                for w, n in zip(workers, sent, strict=True)]

    def pid(self) -> int:
        import os

        return os.getpid()

    def stats(self) -> dict:
        import ray

        out = {}
        for name, p in self.placements.items():
            workers = ray.get([w.handle.stats.remote() for w in p.workers], timeout=60)
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
        import ray

        for channels in self._channels.values():
            for ch in channels:
                ch.close()
        self._channels.clear()
        if getattr(self, "multislice", False) and self.slices:
            # One world: every member leaves it together, or the others wait for it.
            refs = [w.handle.shutdown_world.remote() for s in self.slices.values()
                    for w in s.workers]
            ray.wait(refs, num_returns=len(refs), timeout=30)
        for s in self.slices.values():
            s.shutdown()
        self.slices.clear()

    def _place(self, name: str) -> Placement:
        try:
            return self.placements[name]
        except KeyError:
            raise ValueError(f"slice={name!r} is not held by this controller; it holds "
                             f"{sorted(self.placements)}") from None
