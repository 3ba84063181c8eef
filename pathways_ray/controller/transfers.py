"""Cross-slice copies, worker to worker: only ids and refs pass through the controller."""

from __future__ import annotations

from dataclasses import replace

from pathways_ray import boundary
from pathways_ray.chips.slice import Slice
from pathways_ray.programs.sharding import MeshShape, pack_transfer, pull_transfer
from pathways_ray.transport.commands import (
    Put,
)
from pathways_ray.transport.pull import Pull
from pathways_ray.transport.pull import new_id as new_pull_id


def _bounds(part: tuple[slice, ...] | None) -> tuple[tuple[int, int], ...] | None:
    """A part of a shard as plain ints, ``(start, stop)`` per axis: a Ray call's
    arguments in msgpack, with no pickling of a slice object each."""
    return None if part is None else tuple((s.start, s.stop) for s in part)


class Transfers:
    """Mixin of ``Controller``: ``transfer`` between two placements."""

    def transfer(self, src: str, dst: str, items: list[tuple[int, MeshShape, tuple, Put]],
                 mode: str = "pull") -> None:
        """Copy arrays to another slice, each ``(source buffer id, its mesh, its spec,
        put)`` becoming ``put`` (a new buffer there), worker to worker; only ids and
        refs pass through here, whatever the size. ``mode`` (``$PATHWAYS_RAY_TRANSFER``
        on the client):

        - ``pull``: every destination chip pulls, from each source chip it needs, just
          the parts of its blocks that chip holds, over JAX's transfer server, into
          its own memory (``pull.py``, ``sharding.pull_transfer``). The pulls travel
          in the puts, down the destination's command stream, and start when its
          chips read the batch, while the sources offer their parts: nothing waits
          for a round trip between the two. A source slice that died, or a source
          buffer whose program failed, raises here (``SliceLost``, ``RemoteError``),
          and the destination's buffers hold the same error.
        - ``objects``: each source chip makes, in its host's store, one Ray object per
          destination host holding its shards of every array that host needs
          (``sharding.pack_transfer``), and each destination chip gets the refs that
          overlap its blocks as soon as they exist (task returns, before the objects
          are made), pulls them to its host and assembles its blocks. A failure at
          the source raises here, and the destination's buffers hold the same error.
        """
        import numpy as np

        sp, dp = self._place(src), self._place(dst)
        arrays = tuple((tuple(put.shape), np.dtype(put.dtype).itemsize, mesh, spec, put.mesh,
                        put.spec) for _, mesh, spec, put in items)
        workers, sent = sp.workers, self._sent(sp)
        what = f"the shards of {len(items)} buffers on {src}"

        def lost(e):
            return self.report_lost(src, boundary.death_summary(e))

        if mode == "pull":
            plan = pull_transfer(arrays)
            at = [a for sl in sp.slices for a in self._transfer_addresses(sl, lost)]
            pulls = {(r, d): Pull(at[r], new_pull_id(),
                                  tuple((tuple(b.stop - b.start for b in block), items[i][3].dtype)
                                        for i, block, _ in pull), src)
                     for r, per in plan.sends.items() for d, pull in per.items()}
            offers = [workers[r].handle.offer.remote(
                          {pulls[r, d].uuid: [(items[i][0], _bounds(rel), layout)
                                              for (i, _, rel), layout
                                              in zip(pull, pulls[r, d].pieces, strict=True)]
                           for d, pull in per.items()}, sent[r], lease=self._token)
                      for r, per in plan.sends.items()]
            puts = [replace(put, pieces=[[(pulls[r, d], part, k) for r, k, part in mine]
                                         for d, mine in enumerate(per_dst)])
                    for (*_, put), per_dst in zip(items, plan.pieces, strict=True)]
            self.submit(dst, puts, source=src)
            try:
                boundary.get(offers, timeout="fetch", what=what, died=lost)
            except Exception as e:
                # Nothing will come: the destination's puts fail with this error now.
                ids = [p.uuid for p in pulls.values()]
                for w in dp.workers:
                    w.handle.cancel.remote(ids, e, lease=self._token)
                raise
            return
        if mode != "objects":
            raise ValueError(f"transfer mode {mode!r} is not one of 'pull', 'objects'")
        plan = pack_transfer(arrays, [w.info.node_id for w in dp.workers])
        refs, made = {}, []  # source rank -> a ref per packet; the sources' "all made"
        for r, packets in plan.sends.items():
            *refs[r], done = workers[r].handle.put_shards.options(
                num_returns=len(packets) + 1).remote(
                    [[items[i][0] for i in packet] for packet in packets], sent[r],
                    lease=self._token)
            made.append(done)
        # The destination chips have the refs (and start pulling each packet the moment
        # its source has made it) before the sources are done: no round trip between.
        puts = [replace(put, pieces=[[(refs[r][k], block, pos) for r, k, pos, block in mine]
                                     for mine in per_dst])
                for (*_, put), per_dst in zip(items, plan.pieces, strict=True)]
        self.submit(dst, puts, source=src)
        boundary.get(made, timeout="fetch", what=what, died=lost)

    def _transfer_addresses(self, sl: Slice, lost) -> list[str]:
        """Where each chip of ``sl`` serves pulls (asked once per slice)."""
        at = self._transfer_at.get(sl)
        if at is None:
            at = self._transfer_at[sl] = boundary.get(
                [w.handle.transfer_address.remote(lease=self._token) for w in sl.workers],
                timeout="control", what=f"the transfer servers of slice {sl.name}", died=lost)
        return at

