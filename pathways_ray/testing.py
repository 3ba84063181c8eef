"""Hooks for tests and benchmarks, kept out of the runtime actors.

``DebugController`` and ``DebugChipWorker`` add what measuring needs and users
do not: the multi-controller baseline (every chip loops over a program by
itself), a cross-slice copy routed through the controller (the design we do
not use, to measure against), and the controller's pid. Use them with
``pathways_ray.connect(controller_cls=DebugController)``.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace

from pathways_ray import boundary
from pathways_ray.chips.chip_worker import ChipWorker
from pathways_ray.controller.controller import Controller

__all__ = ["DebugChipWorker", "DebugController", "reshard_via_controller"]


class DebugChipWorker(ChipWorker):
    def repeat(self, fingerprint: str, buffer_id: int, k: int, after: int = 0) -> float:
        """Run ``z = program(z)`` k times from this process alone (every worker of the
        slice does the same: multi-controller JAX); returns the seconds it took."""
        self._after(after)
        ex = self.executor
        prog = ex.programs[fingerprint]
        z = ex._ok(buffer_id)
        t0 = time.perf_counter()
        for _ in range(k):
            z = prog(z)
        z.block_until_ready()
        return time.perf_counter() - t0


class DebugController(Controller):
    worker_cls = DebugChipWorker

    def pid(self) -> int:
        return os.getpid()

    def worker_pids(self, slice_name: str) -> list[int]:
        """The process ids of a slice's chip workers, in rank order."""
        return [w.info.pid for w in self._place(slice_name).workers]

    def repeat(self, slice_name: str, fingerprint: str, buffer_id: int, k: int) -> list:
        """Refs of every worker running the program k times itself."""
        p = self._place(slice_name)
        return [w.handle.repeat.remote(fingerprint, buffer_id, k, n)
                for w, n in zip(p.workers, self._sent(p), strict=True)]

    def transfer_via_controller(self, src: str, src_id: int, src_mesh, src_spec, dst: str,
                                put) -> None:
        """``transfer``, but the bytes come into this process and are put again."""
        import ray

        from pathways_ray.programs.sharding import transfer_plan

        sp = self._place(src)
        src_index, sources, needs = transfer_plan(put.shape, src_mesh, src_spec, put.mesh,
                                                  put.spec)
        sent = self._sent(sp)
        values = boundary.get([sp.workers[r].handle.shard.remote(src_id, sent[r])
                               for r in sources], timeout="fetch", what="shards")
        refs = {r: ray.put(v) for r, v in zip(sources, values, strict=True)}
        del values
        pieces = [[(refs[r], src_index[r]) for r in rs] for rs in needs]
        self.submit(dst, [replace(put, pieces=pieces)], source=src)


def reshard_via_controller(client, x, sharding, slice):
    """``client.reshard(x, sharding, slice)`` with the bytes routed through a
    ``DebugController`` (for benchmarks/reshard.py)."""
    from pathways_ray.client.arrays import RemoteArray, spec_of
    from pathways_ray.transport.commands import Put

    target = client.slice(slice)
    mesh, spec = spec_of(sharding, x.ndim)
    out = RemoteArray(client, next(client._ids), target.name, x.shape, x.dtype, mesh, spec)
    client._sync(x.slice)
    client._sync(target.name)
    client._call("transfer_via_controller", x.slice, x._id, x.mesh, x.spec, target.name,
                 Put(out._id, tuple(x.shape), x.dtype.name, spec, mesh), timeout="fetch")
    return out
