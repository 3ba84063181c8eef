"""The single controller: a Ray actor that owns the slices and forwards work to them.

It reserves slices (``Slice.reserve``), keeps the program registry (each
program's bytes arrive once and are loaded onto a slice the first time that
slice runs it) and the array registry (which buffer ids live on which slice),
and forwards command batches (``commands.py``) to every chip worker of a
slice over its command stream (``channel.py``). It never holds array bytes:
device_put data, fetched shards and cross-slice transfers move between the
client and the workers, or worker to worker, as object refs it only passes
along (by Ray call, which tracks their ownership).

Order: the controller is the only writer of each worker's stream, and a
worker runs its stream in order, so every worker of a slice sees the same
command sequence. A query (fetch, ready) carries the number of batches sent
before it, and the worker answers only once it has run that many, so a fetch
follows the commands that produced its buffer.

Failure: a slice is the failure unit. The health monitor (``health.py``)
notices a dead worker within a second and a silent (frozen) one at the step deadline;
a broken stream or the client's report of a dead worker does the same. The
controller then marks the slice lost, names the hosts it found dead or
unresponsive, and releases what is left of it; from then on every call that
touches it raises that ``SliceLost``, and the other slices carry on. (In a
multislice world all slices share one JAX world, so they are lost together.)
State that the monitor thread and the call thread share is guarded by
``_lock``, which is never held across a blocking send or wait.

This module is the actor: its state and its life (start, describe, stats,
shutdown). Each other job is a piece of its own, mixed in: ``streams`` (batches
and queries), ``sidecars``, ``transfers`` (cross-slice copies), ``profiles``,
``losses`` (a lost slice and growing back); ``placement`` says where arrays live.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import weakref
from collections import OrderedDict

from pathways_ray import boundary
from pathways_ray.chips.slice import Slice
from pathways_ray.config import timeout_s
from pathways_ray.controller.health import HealthMonitor, Regrower
from pathways_ray.controller.losses import LossesAndGrowth
from pathways_ray.controller.placement import Placement, reserve_all
from pathways_ray.controller.profiles import Profiles
from pathways_ray.controller.reform import WorldReform
from pathways_ray.controller.sidecars import SidecarCalls
from pathways_ray.controller.streams import Streams
from pathways_ray.controller.transfers import Transfers
from pathways_ray.controller.worlds import reserve_joint
from pathways_ray.errors import SliceLost
from pathways_ray.transport.channel import CommandChannel
from pathways_ray.transport.fanout import default_fanout

logger = logging.getLogger(__name__)

__all__ = ["Controller"]


class Controller(Streams, SidecarCalls, Transfers, Profiles, LossesAndGrowth, WorldReform):
    """Create with ``ray.remote(Controller)`` (``pathways_ray.connect()`` does)."""

    worker_cls = None  # the chip worker actor class; None: ChipWorker (tests may subclass)

    def __init__(self, slices: list | None = None, reserve_timeout_s: float | None = None,
                 max_inflight: int = 8, compilation_cache_dir: str | None = None,
                 multislice: bool = False, lease: dict | None = None,
                 fanout: int | None = None, settings: dict | None = None):
        self._args = (slices, reserve_timeout_s, compilation_cache_dir, multislice)
        # A lease of a shared service (service.py): its slices are lent, already running,
        # and every call to their chips presents the lease's token.
        self._lease = lease
        self._token = lease["token"] if lease else None
        os.environ.update(settings or {})  # the client's (config.settings_env), for its chips
        self.max_inflight = max_inflight
        # Hosts each host relays a slice's command stream to (fanout.py); 0: one stream
        # per chip from here.
        self.fanout = default_fanout() if fanout is None else fanout
        self.slices: dict[str, Slice] = {}
        self.lost: dict[str, SliceLost] = {}
        self._channels: dict[str, list[CommandChannel]] = {}
        self.placements: dict[str, Placement] = {}
        self.loaded, self.arrays, self.loads_sent = {}, {}, {}
        self.programs: dict[str, bytes] = {}
        self.multislice = False
        self._world_service = None  # a multislice world's coordination service (elastic)
        self._reforming: set[str] = set()  # slices whose world is being re-formed
        self._broken: dict[str, SliceLost] = {}  # slice -> the loss its world had
        self._compiles: dict[str, dict] = {}  # placement -> program -> its Compile
        self._closed = False
        self._lock = threading.RLock()
        self._last_load: dict[str, int] = {}  # slice -> number of its last batch with a Load
        # slice -> its chips' transfer server addresses (chip-to-chip pulls), asked once
        self._transfer_at: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._monitor: HealthMonitor | None = None
        self._shapes: dict = {}  # slice -> Topology, of every slice ever held
        self._regrower = Regrower(self._reserve_replacement, self._add_replacement)
        self._replacement_pgs: list = []  # placement groups the regrower made
        self._tokens = itertools.count(1)  # Hold tokens
        self._obj_seq: dict[int, int] = {}  # sidecar object -> number of calls sent to it
        self._replies: OrderedDict[int, list] = OrderedDict()  # sidecar call -> host results
        self._sidecar_pings: dict[str, tuple[float, list]] = {}  # slice -> (sent, refs)
        self._sidecars_used = False
        self._spans: list | None = None  # dispatch spans while a profile runs
        self.dispatched = {"batches": 0, "cpu_ns": 0}  # submit()'s own CPU (dispatch_stats)

    def start(self) -> list[dict]:
        """Reserve the slices (or take a lease's lent ones), start their workers, open
        the command streams; returns ``describe()``. (Not in ``__init__``: an error
        raised there reaches the caller as Ray's ActorDiedError, losing its type;
        raised here it stays ours.)"""
        from pathways_ray.clusters.cluster import cluster_slices

        slices, reserve_timeout_s, compilation_cache_dir, multislice = self._args
        if self._lease is None and slices is None:
            slices = [v.topology for v in cluster_slices() if v.idle and v.topology is not None]
            if not slices:
                raise RuntimeError("no free TPU slice in the cluster to reserve")
        self.multislice = self._lease is None and multislice and len(slices) > 1
        opts = dict(timeout_s=reserve_timeout_s, compilation_cache_dir=compilation_cache_dir,
                    worker_cls=self.worker_cls)
        try:
            if self._lease is not None:  # lent by a shared service, already running
                got = [Slice.borrowed(lent) for lent in self._lease["slices"]]
            elif self.multislice:
                got = reserve_joint(slices, **opts)
                self._world_service = got[0].world_service
            else:
                got = reserve_all(slices, opts)
            self.slices.update((s.name, s) for s in got)
            for s in self.slices.values():
                self._channels[s.name] = self._open_streams(s)
        except BaseException:
            self.shutdown()
            raise
        for s in self.slices.values():
            self._add_placement(Placement(s.name, (s,)))
        self._shapes.update((name, s.topology) for name, s in self.slices.items())
        self._monitor = HealthMonitor(self._streams, self._condemn,
                                      step_timeout_s=timeout_s("step"),
                                      compile_timeout_s=timeout_s("compile"),
                                      also=self._sidecar_verdicts)
        return self.describe()

    def _add_placement(self, p: Placement) -> None:
        self.placements[p.name] = p
        self.loaded[p.name] = set()
        self.arrays[p.name] = set()
        self.loads_sent[p.name] = 0

    # ---- what the client asks ------------------------------------------------
    def describe(self) -> list[dict]:
        with self._lock:
            live = list(self.slices.values())
        return [{"name": s.name, "topology": str(s.topology), "chips": s.num_chips,
                 "chips_per_host": s.topology.chips_per_host,
                 "workers": [(w.rank, w.info.worker_id, w.info.chip) for w in s.workers],
                 "platform": s.workers[0].info.platform,
                 "joint": self.multislice,  # the slices are one JAX world (a mesh spans them)
                 "placement_groups": s.placement_group_ids}
                for s in live]

    def group(self, slice_names: list[str]) -> dict:
        """A placement spanning several slices of this controller's one JAX world, in the
        order given (any of them: the survivors of a lost slice need not be side by
        side in the world)."""
        if not self.multislice:
            raise ValueError(f"slices={slice_names} are separate JAX worlds; a mesh across "
                             f"slices needs them joined: pathways_ray.connect(multislice=True)")
        members = tuple(self._place(n).slices[0] for n in slice_names)
        if len(set(slice_names)) != len(slice_names) or len(members) < 2:
            raise ValueError(f"slices={slice_names} must name two or more different slices")
        if not self._one_world(members):
            # A replacement joined in a world of its own: one world over all again.
            if self._world_service is None:
                raise ValueError(f"slices={slice_names} are not one JAX world, and this "
                                 f"world's chips cannot be re-formed")
            self._reform()
        name = "+".join(slice_names)
        if name not in self.placements:
            self._add_placement(Placement(name, members))
        return {"name": name, "chips": self.placements[name].chips,
                "topology": " + ".join(str(m.topology) for m in members)}

    def register_program(self, fingerprint: str, blob: bytes) -> None:
        self.programs.setdefault(fingerprint, blob)

    # ---- sidecars (sidecar.py, sidecar_host.py) -------------------------------------

    # ---- profiling (client.profile) ----------------------------------------------

    # ---- growing back -------------------------------------------------------------

    # ---- failures ---------------------------------------------------------------

    # ---- bookkeeping ------------------------------------------------------------
    def health(self) -> dict[str, str]:
        """Every slice this controller took: ``"ok"``, or why it was lost."""
        with self._lock:
            return {**{name: "ok" for name in self.slices},
                    **{name: str(err) for name, err in self.lost.items()}}

    def stats(self) -> dict:
        out = {}
        for name, p in list(self.placements.items()):
            if any(s.name in self.lost for s in p.slices):
                continue
            workers = boundary.get([w.handle.stats.remote() for w in p.workers],
                                   timeout="control", what=f"stats of {name}",
                                   died=lambda e, name=name: self.report_lost(
                                       name, boundary.death_summary(e)))
            out[name] = {"live_arrays": len(self.arrays[name]), "programs_loaded":
                         len(self.loaded[name]), "loads_sent": self.loads_sent[name],
                         "workers": workers}
        return out

    def shutdown(self) -> None:
        """Release every slice within ``$PATHWAYS_RAY_SHUTDOWN_TIMEOUT_S`` in all (the
        client waits that long, then kills this actor; a slice not released by then
        would stay held until the driver exits)."""
        self._closed = True
        budget = timeout_s("shutdown")
        # A replacement being reserved must be released here: placement groups outlive
        # the actor that made them (they belong to the job), and the client kills this
        # actor once shutdown returns. Seen: a slice held until the driver exited.
        if not self._regrower.stop(wait_s=budget / 3):
            for spg in self._replacement_pgs:
                try:
                    spg.shutdown()
                except Exception:  # noqa: BLE001 - released already
                    pass
        if getattr(self, "_monitor", None) is not None:
            self._monitor.stop()
        with self._lock:
            for channels in self._channels.values():
                for ch in channels:
                    ch.close()
            self._channels.clear()
        if self._lease is not None:  # lent: the service cleans the chips and keeps them
            for s in list(self.slices.values()):
                s.shutdown()
            self.slices.clear()
            return
        # Every world is left together first (killing a coordinator's rank while others
        # poll it makes them abort), all slices at once and bounded: a slice still
        # compiling a warm-up answers late. Seen: three slices waited on one by one
        # outlasted the client's wait, and a replacement stayed held.
        slices = list(self.slices.values())
        late = boundary.settle([w.handle.shutdown_world.remote() for s in slices
                                for w in s.workers], budget / 3)
        if late:
            logger.info("%d chip workers did not leave their JAX world in time", late)
        for s in slices:
            s.shutdown(lost=True)  # kill the workers and release: the worlds are left
        self.slices.clear()
        if self._world_service is not None:  # after its chips left it
            self._world_service.shutdown()
            self._world_service = None

    def _place(self, name: str) -> Placement:
        try:
            p = self.placements[name]
        except KeyError:
            raise ValueError(f"slice={name!r} is not held by this controller; it holds "
                             f"{sorted(self.placements)}") from None
        if self.lost:
            for s in p.slices:
                if s.name in self.lost:
                    raise self.lost[s.name]
        if self._broken and any(s.name in self._broken for s in p.slices):
            self._reform(after_loss=True)  # its chips may be stuck with the lost ones
        return p
