"""Results on the client: fetching an array's bytes, waiting until arrays are ready,
and what a dead worker met while waiting means."""

from __future__ import annotations

import time

import numpy as np

from pathways_ray import boundary
from pathways_ray.chips.executor import assemble
from pathways_ray.client.arrays import RemoteArray
from pathways_ray.errors import PathwaysError, RemoteError, SliceLost, WaitTimeout
from pathways_ray.programs.sharding import shard_slices, unique_shards

# A read on a joint world polls the controller this often while it waits, and gives up
# this long after the controller said the world lost a slice (Results._unless_stuck).
POLL_S = 0.5
STUCK_S = 1.0


class Results:
    """Mixin of ``Client``: the waits for chip workers' results."""

    def _worker_results(self, where: str, refs, timeout_s: float | None, what: str):
        """Wait for chip workers' results; a dead worker means its slice is lost."""
        def died(e: BaseException) -> PathwaysError:
            try:
                err = self._call("report_lost", where, boundary.death_summary(e))
            except PathwaysError as known:  # already lost, or the controller is gone
                err = known
            return self._queue.record(where, err) if isinstance(err, SliceLost) else err

        timeout = "fetch" if timeout_s is None else timeout_s
        if self._joint and isinstance(refs, list) and refs:
            self._unless_stuck(where, refs, timeout, what)
        try:
            return boundary.get(refs, timeout=timeout, what=what, died=died)
        except RemoteError as e:
            if where not in self._groups:
                raise
            # A program over several slices fails on the survivors' chips when a member
            # dies under it (its collectives break): that is the member's loss.
            try:
                lost = self._call("lost_member", where, str(e).splitlines()[0][:300])
            except PathwaysError as known:
                lost = known
            if not isinstance(lost, SliceLost):
                raise
            raise self._queue.record(where, lost) from None

    def _unless_stuck(self, where: str, refs: list, timeout: str | float, what: str) -> None:
        """Wait for ``refs`` (or their timeout, or a failure among them) unless the
        placement's world lost a slice meanwhile: a program over it and the survivors
        may never end on the survivors' chips (a collective waits on the dead), so a
        read of what it computes would wait out its whole timeout. Once the controller
        says the world is broken, ``STUCK_S`` more and the read is lost with the slice
        (``SliceLost``); the controller re-forms the survivors on their next use."""
        import ray

        seconds, setting = boundary.deadline(timeout)
        end = time.monotonic() + seconds
        broken_at = None
        while True:
            ready, _ = ray.wait(refs, num_returns=len(refs), fetch_local=False,
                                timeout=min(POLL_S, max(0.0, end - time.monotonic())))
            if len(ready) == len(refs) or boundary.failed_now(ready)[1]:
                return  # (boundary.get reads them, or raises what failed)
            if time.monotonic() >= end:  # (not a second wait of the same length after)
                raise WaitTimeout(f"{what} did not finish within {seconds:g} s; a slower "
                                  f"machine may need a longer {setting}")
            lost = self._call("broken", where)
            if lost is None:
                broken_at = None
            elif broken_at is None:
                broken_at = time.monotonic()
            elif time.monotonic() - broken_at >= STUCK_S:
                raise lost

    def _fetch(self, arr: RemoteArray, timeout_s: float | None) -> np.ndarray:
        self._sync(arr.slice)
        index = shard_slices(arr.shape, arr.mesh, arr.spec)
        firsts = sorted(set(unique_shards(index)))
        refs = self._call("shard_refs", arr.slice, arr._id, firsts, where=arr.slice)
        self.counters["fetches"] += 1
        values = self._worker_results(arr.slice, refs, timeout_s, f"fetching {arr!r}")
        return self._assembled(arr, index, firsts, values)

    def _assembled(self, arr: RemoteArray, index, firsts: list[int], values) -> np.ndarray:
        self.counters["fetched_bytes"] += sum(getattr(v, "nbytes", 0) for v in values)
        full = tuple(slice(0, n) for n in arr.shape)
        return assemble(full, arr.dtype.name,
                        [(index[r], v) for r, v in zip(firsts, values, strict=True)])

    def fetch_all(self, arrays: list[RemoteArray], timeout_s: float | None = None, *,
                  missing_ok: bool = False) -> list[np.ndarray | None]:
        """Bring several arrays to the client at once: per slice, one call to the
        controller and one to each chip holding a shard they need (``fetch`` takes two
        round trips per array). Raises the first failure among them; ``missing_ok``:
        an array that cannot be read (freed or donated on the chips, or failed) is None."""
        by_slice: dict[str, list[int]] = {}
        for i, a in enumerate(arrays):
            self._own(a)
            by_slice.setdefault(a.slice, []).append(i)
        out: list = [None] * len(arrays)
        for name, members in by_slice.items():
            self._sync(name)
            plan: dict[int, list[int]] = {}  # rank -> buffers whose shard there is read
            wants = []
            for i in members:
                index = shard_slices(arrays[i].shape, arrays[i].mesh, arrays[i].spec)
                firsts = sorted(set(unique_shards(index)))
                wants.append((i, index, firsts))
                for r in firsts:
                    plan.setdefault(r, []).append(arrays[i]._id)
            refs = self._call("snapshot_refs", name, plan, missing_ok, where=name)
            self.counters["fetches"] += 1
            ranks = list(refs)
            values = self._worker_results(name, [refs[r] for r in ranks], timeout_s,
                                          f"fetching {len(members)} arrays of {name}")
            shards = {r: iter(v) for r, v in zip(ranks, values, strict=True)}
            for i, index, firsts in wants:
                got = [next(shards[r]) for r in firsts]
                if all(v is not None for v in got):
                    out[i] = self._assembled(arrays[i], index, firsts, got)
        return out

    def _fetch_local(self, arr: RemoteArray, rank: int = 0,
                     timeout_s: float | None = None) -> np.ndarray:
        """One chip's buffer as that chip holds it (a compile's status, whose size only
        the chips know)."""
        self._sync(arr.slice)
        refs = self._call("shard_refs", arr.slice, arr._id, [rank], where=arr.slice)
        return np.asarray(self._worker_results(arr.slice, refs, timeout_s,
                                               f"fetching {arr!r}")[0])

    def _ready(self, slice_name: str, ids: list[int], timeout_s: float | None) -> None:
        self._sync(slice_name)
        refs = self._call("ready", slice_name, ids, where=slice_name)
        self._worker_results(slice_name, refs, timeout_s, f"buffers {ids} on {slice_name}")

    def block_until_ready(self, arrays: list[RemoteArray],
                          timeout_s: float | None = None) -> None:
        """Wait until every array is computed (one query per slice); raises the first
        failure (``SliceLost``, ``RemoteError``)."""
        by_slice: dict[str, list[int]] = {}
        for a in arrays:
            self._own(a)
            by_slice.setdefault(a.slice, []).append(a._id)
        for name, ids in by_slice.items():
            self._ready(name, ids, timeout_s)

    def _is_ready(self, slice_name: str, buffer_id: int) -> bool:
        """Poll one buffer without waiting. The first poll sends the query; later polls
        look at that same query's answers, so a buffer that is done reads as done (a
        fresh query per poll, looked at after 0 s, would read "running" every time)."""
        key = (slice_name, buffer_id)
        refs = self._ready_polls.get(key)
        if refs is None:
            self._sync(slice_name)
            refs = self._ready_polls[key] = self._call("ready", slice_name, [buffer_id],
                                                       where=slice_name)
        running, failed = boundary.failed_now(refs)
        if failed or not running:
            del self._ready_polls[key]
        if failed:
            self._worker_results(slice_name, [failed[0][0]], 1.0, f"buffer {buffer_id}")
        return not running

