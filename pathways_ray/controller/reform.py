"""Re-forming a multislice JAX world to take a slice back (a mixin of ``Controller``).

An emulated multislice world outlives a lost slice (``controller/worlds.py``): the
survivors keep running, alone or together. A slice that comes back (a replacement
reserved by ``grow``) starts in a world of its own; the survivors' world cannot take
its processes in (they keep the gloo cliques they had with the lost ones, under the
same names). So the first placement that needs the replacement and the survivors
together re-forms the world: every chip of the live slices gets a new process, in
the same bundle, and all of them one new world; each chip's buffers are carried
from its old process to its new one (``chips/shards.CarriedBuffers``) with the sharding's device
ids renamed; programs are loaded again (compiled ones from the persistent
compilation cache). The client's arrays keep their handles: nothing it holds on a
live slice is lost (one that also lived on the lost slice stays failed).

A lost slice breaks its world's survivors in another way: a program over it and them
may never end on their chips (a gloo collective waits on the dead, and everything
queued behind it waits too), so the next use of a survivor re-forms them first
(``after_loss``): their buffers computed by then are carried, the rest are lost with
the slice (``SliceLost``), and the stuck processes are replaced.

Measured on the emulated fleet (2 cores): re-forming 2 x v6e 2x2 slices took 8.3 s,
most of it 8 new processes importing JAX.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from pathways_ray import boundary
from pathways_ray.chips.world import form_world
from pathways_ray.clusters.cluster import slice_order
from pathways_ray.config import TIMEOUTS
from pathways_ray.errors import WorkerDied

logger = logging.getLogger("pathways_ray.controller.controller")

__all__ = ["WorldReform"]

# After a loss, how long a chip's buffers may take to be computed before they count
# as lost with the slice (a program over it may never end on the survivors).
SETTLE_S = 1.0


class WorldReform:
    """Mixin of ``Controller``: ``_one_world`` and ``_reform``."""

    @staticmethod
    def _one_world(members) -> bool:
        """Whether ``members`` (slices) are in one JAX world whose service is off the
        chips (the ones a re-form can put together)."""
        services = {id(m.world_service) for m in members}
        return len(services) == 1 and members[0].world_service is not None

    def _reform(self, after_loss: bool = False) -> None:
        """One new JAX world over every live slice, their buffers carried over.
        ``after_loss``: their world lost a slice, and a program over it may be stuck
        on their chips for good (a collective waiting on the dead); what it and the
        batches behind it would have computed is lost with the slice."""
        t0 = time.monotonic()
        with self._lock:
            slices = sorted(self.slices.values(), key=lambda s: slice_order(s.name))
            self._reforming.update(s.name for s in slices)  # the monitor leaves them be
            channels = {s.name: self._channels.pop(s.name, []) for s in slices}
            lost = ", ".join(sorted(self.lost))
            expected = {s.name: tuple(set().union(*(self.arrays[n] for n, pl in
                                                    self.placements.items()
                                                    if s in pl.slices)))
                        if after_loss and s.name in self._broken else () for s in slices}
        worker_timeout_s = TIMEOUTS["worker_start"].seconds()
        old_services = {id(s.world_service): s.world_service for s in slices
                        if s.world_service is not None}
        try:
            # 1. Each chip's buffers, once it has run every batch sent to it (after a
            #    loss: the ones computed within SETTLE_S). The bytes wait in their
            #    host's object store, owned by this process.
            carried = {s.name: [w.handle.export_buffers.remote(
                                    0 if stuck else (chs[0].sent if chs else 0),
                                    lease=self._token, lost=lost,
                                    settle_s=SETTLE_S if stuck else None)
                                for w in s.workers]
                       for s in slices for chs in [channels[s.name]]
                       for stuck in [after_loss and s.name in self._broken]}
            boundary.wait([r for refs in carried.values() for r in refs], timeout="fetch",
                          what="handing the chips' buffers over to a new JAX world",
                          fetch_local=False)  # (a failed one fails its import below)
            # Each chip's device id in its old world, per world (a slice that came back
            # ran a world of its own, whose ids repeat the others').
            before = {s.name: (id(s.world_service) if s.world_service is not None
                               else ("own", s.name), [i["device_id"] for i in s.world])
                      for s in slices}
            # 2. The old processes go; new ones start in the same bundles, side by side.
            for chs in channels.values():
                for ch in chs:
                    ch.abort()
                    ch.close()
            with ThreadPoolExecutor(len(slices), thread_name_prefix="pathways-ray-reform"
                                    ) as pool:
                for f in [pool.submit(s.restart_workers, worker_timeout_s,
                                      worker_cls=self.worker_cls) for s in slices]:
                    f.result()
            for s in slices:
                self._transfer_at.pop(s, None)
            # 3. One new world over all of them, its service here (it takes slices in).
            for s in slices:
                s.world_service = None
            form_world(slices, worker_timeout_s, self._args[2], elastic=True)
            for service in old_services.values():
                service.shutdown()
            self._world_service = slices[0].world_service
            # 4. Each chip's buffers into its new process, ids renamed world by world.
            renamed: dict = {}
            for s in slices:
                world, old_ids = before[s.name]
                renamed.setdefault(world, {}).update(
                    zip(old_ids, [i["device_id"] for i in s.world], strict=True))
            boundary.get([w.handle.import_buffers.remote(ref, renamed[before[s.name][0]],
                                                         lost, lease=self._token,
                                                         expected=expected[s.name])
                          for s in slices
                          for w, ref in zip(s.workers, carried[s.name], strict=True)],
                         timeout="fetch", what="rebuilding the chips' buffers in the new "
                         "JAX world", died=lambda e: WorkerDied(f"a chip died as its "
                                                                f"buffers came back: {e}"))
            # 5. New streams; programs are loaded (and compiled) again on first use.
            with self._lock:
                for s in slices:
                    self._channels[s.name] = self._open_streams(s)
                for name in self.placements:
                    self.loaded[name] = set()
                self._last_load.clear()
                for s in slices:
                    self._broken.pop(s.name, None)
        finally:
            with self._lock:
                self._reforming.difference_update(s.name for s in slices)
        logger.warning("re-formed one JAX world over %s in %.1f s%s",
                       ", ".join(s.name for s in slices), time.monotonic() - t0,
                       f" (after losing {lost})" if after_loss else "")
