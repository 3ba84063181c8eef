"""A lost slice and its replacement: marking a slice lost (once, naming its hosts) and
releasing it, and growing back to the slices held before (``health.Regrower``)."""

from __future__ import annotations

import logging

from pathways_ray import boundary
from pathways_ray.chips.slice import Slice
from pathways_ray.controller.placement import Placement
from pathways_ray.errors import SliceLost
from pathways_ray.transport.channel import CommandChannel

logger = logging.getLogger("pathways_ray.controller.controller")


class LossesAndGrowth:
    """Mixin of ``Controller``: ``report_lost``, ``grow`` and what the health monitor calls."""

    def grow(self, count: int) -> None:
        """Have ``count`` replacements on their way: slices shaped like the ones lost,
        reserved in the background as soon as the cluster has them free. Each joins
        ``describe()`` when ready, under a name of its own (a slice that comes back
        under an old name is a new slice). Idempotent: ``grow(0)`` cancels."""
        if self.multislice and count and self._world_service is None:
            raise ValueError("this multislice world (its coordination service on a chip, as "
                             "on TPUs) cannot take in a new slice; connect without "
                             "multislice=True to grow back")
        if self._lease is not None and count:
            raise ValueError("a lease of a shared service holds only the slices it was "
                             "granted; close it and connect again for a full set")
        with self._lock:
            shapes = [self._shapes[n] for n in self.lost if n in self._shapes]
        self._regrower.want(shapes[:count])

    def _reserve_replacement(self, topo) -> tuple[Slice, list[CommandChannel]]:
        _, reserve_timeout_s, cache_dir, _ = self._args
        s = Slice.reserve(topo, timeout_s=reserve_timeout_s, compilation_cache_dir=cache_dir,
                          worker_cls=self.worker_cls, track=self._replacement_pgs)
        try:
            channels = self._open_streams(s)
            if self._sidecars_used:  # off the step path: the trainer's feed opens at once
                s.sidecars()
            return s, channels
        except BaseException:
            s.shutdown()
            raise

    def _add_replacement(self, got: tuple[Slice, list[CommandChannel]]) -> None:
        s, channels = got
        with self._lock:
            taken = set(self.slices) | set(self.lost) | set(self.placements)
            base, n = s.name, 2
            while s.name in taken:
                s.name, n = f"{base}.{n}", n + 1
            self.slices[s.name] = s
            self._shapes[s.name] = s.topology
            self._channels[s.name] = channels
            self._add_placement(Placement(s.name, (s,)))
        logger.warning("slice %s joined (%s)", s.name, s.topology.describe())

    def report_lost(self, where: str, reason: str) -> SliceLost:
        """The client saw a chip worker of ``where`` die: mark the slice(s) of that
        placement whose workers are not all healthy lost. Returns the error to raise."""
        p = self._place(where)
        members = list(p.slices)
        sick = [s for s in members if any(h != "ok" for _, h in s.health(2.0))]
        errors = [self._lose(s.name, reason) for s in (sick or members)]
        return errors[0]

    def lost_member(self, where: str, reason: str) -> SliceLost | None:
        """A program over several slices failed on the chips: if one of them is dead or
        frozen (its collectives with the others broke), mark it lost and return that;
        None when every member is healthy (the program's own error stands)."""
        with self._lock:
            p = self.placements.get(where)
            if p is None:
                return None
            known = self._loss_of(p)
            if known is not None:
                return known
        sick = [s for s in p.slices if any(h != "ok" for _, h in s.health(2.0))]
        return self._lose(sick[0].name, f"a program over {where} failed on the chips "
                                        f"({reason})") if sick else None

    def broken(self, where: str) -> SliceLost | None:
        """The loss that broke the JAX world of placement ``where`` (a member's, or a
        slice of the world its members were in: their chips may be stuck in a program
        over it until they are re-formed), or None."""
        with self._lock:
            p = self.placements.get(where)
            if p is None:
                return None
            return self._loss_of(p) or next(
                (self._broken[s.name] for s in p.slices if s.name in self._broken), None)

    def _loss_of(self, p: Placement) -> SliceLost | None:
        """A lost member's ``SliceLost`` (under the lock)."""
        return next((self.lost[s.name] for s in p.slices if s.name in self.lost), None)

    def _streams(self):
        """For the health monitor: (slice, stream, its last batch with a Load)."""
        with self._lock:
            return [(name, ch, self._last_load.get(name, 0))
                    for name, channels in self._channels.items() for ch in channels]

    def _condemn(self, name: str, reason: str) -> None:
        """The monitor found slice ``name`` dead or frozen: break its streams first (a
        send or wait blocked on them returns at once), then mark it lost. (Not while its
        world is re-formed: its old processes are stopped on purpose.)"""
        if name in self._reforming:
            return
        for ch in self._channels.get(name, []):
            ch.abort()
        self._lose(name, reason)

    def _lose(self, name: str, reason: str) -> SliceLost:
        """Mark slice ``name`` lost (once), say which hosts, and release what is left."""
        with self._lock:
            return self._lose_locked(name, reason)

    def _lose_locked(self, name: str, reason: str) -> SliceLost:
        if name in self.lost:
            return self.lost[name]
        import ray

        s = self.slices.pop(name)
        self._sidecar_pings.pop(name, None)
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        health = {w.rank: h for w, h in s.health(2.0)}
        hosts = {f"{name}/{w.info.worker_id}" for w in s.workers
                 if w.info.node_id not in alive or health[w.rank] != "ok"}
        if all(h != "dead" for h in health.values()):  # (a dead chip names its host)
            hosts.update(f"{name}/{sc.worker_id}" for sc, h in boundary.health(
                [(sc, sc.handle) for sc in s._sidecars or []], 2.0) if h != "ok")
        hosts = tuple(sorted(hosts))
        silent = [w.rank for w in s.workers if health[w.rank] != "ok"]
        if silent and len(silent) < len(s.workers):  # which chip, when the stream's end
            shown = ", ".join(map(str, silent[:8])) + ("..." if len(silent) > 8 else "")
            reason += f" (not answering: chip worker rank {shown})"  # was a relay's
        err = self.lost[name] = SliceLost(name, hosts, reason)
        logger.warning("%s", err)
        for ch in self._channels.pop(name, []):
            ch.abort()  # a send or wait still blocked on it returns now
            ch.close()
        s.shutdown(lost=True)
        for other in self.slices.values():  # their puts stop waiting on pulls from it
            for w in other.workers:
                w.handle.abandon.remote(name, lease=self._token)
        if self.multislice and s.world_service is not None:
            # An emulated world outlives it, but a program over it and the others may
            # never end on theirs (a collective waiting on the dead): their next use
            # re-forms them first (reform.py).
            self._broken.update((o.name, err) for o in self.slices.values()
                                if o.world_service is s.world_service)
        if self.multislice and s.world_service is None:
            # One JAX world whose service was on a chip (TPU, over DCN): the others
            # cannot run a collective now. (An emulated world's service is off the chips:
            # the survivors keep running, and programs over them alone still run.)
            for other in list(self.slices):
                self._lose_locked(other, f"it shared one JAX world with slice {name}, which "
                                         f"was lost")
        return err

