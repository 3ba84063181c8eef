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
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace

from pathways_ray import boundary
from pathways_ray.chips.sidecar_host import _Out
from pathways_ray.chips.slice import Slice, ping_all
from pathways_ray.config import timeout_s
from pathways_ray.controller.health import HealthMonitor, Regrower
from pathways_ray.errors import SliceLost, WorkerDied
from pathways_ray.observability.profile_trace import Event
from pathways_ray.programs.sharding import MeshShape, host_blocks, pack_transfer, pull_transfer
from pathways_ray.transport.channel import CommandChannel, dumps
from pathways_ray.transport.commands import (
    Command,
    Compile,
    Free,
    Hold,
    HostCall,
    Load,
    Put,
    Run,
    placed,
)
from pathways_ray.transport.fanout import default_fanout, relay_tree
from pathways_ray.transport.pull import Pull
from pathways_ray.transport.pull import new_id as new_pull_id

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


def _bounds(part: tuple[slice, ...] | None) -> tuple[tuple[int, int], ...] | None:
    """A part of a shard as plain ints, ``(start, stop)`` per axis: a Ray call's
    arguments in msgpack, with no pickling of a slice object each."""
    return None if part is None else tuple((s.start, s.stop) for s in part)


class Controller:
    """Create with ``ray.remote(Controller)`` (``pathways_ray.connect()`` does)."""

    worker_cls = None  # the chip worker actor class; None: ChipWorker (tests may subclass)

    def __init__(self, slices: list | None = None, reserve_timeout_s: float | None = None,
                 max_inflight: int = 8, compilation_cache_dir: str | None = None,
                 multislice: bool = False, lease: dict | None = None,
                 fanout: int | None = None):
        self._args = (slices, reserve_timeout_s, compilation_cache_dir, multislice)
        # A lease of a shared service (service.py): its slices are lent, already running,
        # and every call to their chips presents the lease's token.
        self._lease = lease
        self._token = lease["token"] if lease else None
        if lease is not None:  # the client's settings (a private controller's come as its
            os.environ.update(lease.get("env", {}))  # runtime_env, inherited by its chips)
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
                got = Slice.reserve_joint(slices, **opts)
            else:
                got = _reserve_all(slices, opts)
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

    def _open_streams(self, s: Slice) -> list[CommandChannel]:
        """The command streams of a slice: one to its root, which relays to the rest
        (``fanout.py``), or, with ``fanout=0``, one to every chip."""
        def died(e):
            return WorkerDied(f"a chip worker of {s.name} died before it started: {e}")

        ends = boundary.get(
            [w.handle.open_channel.remote(lease=self._token) for w in s.workers],
            timeout="control", what=f"opening the command streams of {s.name}", died=died)
        targets = list(zip(s.workers, ends, strict=True))
        if self.fanout and len(s.workers) > 1:
            hosts: dict[int, list[int]] = {}
            for w in s.workers:
                hosts.setdefault(w.info.worker_id, []).append(w.rank)
            tree = relay_tree(list(hosts.values()), self.fanout)
            boundary.get([s.workers[r].handle.relay.remote(
                              [(c, *ends[c]) for c in children], lease=self._token)
                          for r, children in tree.items()],
                         timeout="control", what=f"setting up the relays of {s.name}",
                         died=died)
            root = next(iter(hosts.values()))[0]
            targets = [targets[root]]
        relayed = f" (relaying to {len(s.workers) - 1} more)" if len(targets) == 1 < len(
            s.workers) else ""
        return [CommandChannel(address, token, timeout_s=timeout_s("stream"),
                               what=f"chip worker rank {w.rank} of slice {s.name}{relayed}",
                               rank=w.rank)
                for w, (address, token) in targets]

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
                 "placement_groups": s.placement_group_ids}
                for s in live]

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

    def submit(self, where: str, commands: list[Command], source: str | None = None) -> None:
        """Forward a batch of commands to every chip of a placement (one message per
        worker). ``source`` names the slice a put's pieces come from, if another.
        After ``shutdown`` (a batch still on its way when the client closed) it does
        nothing: the client that sent it is gone."""
        if self._closed:
            return
        t0, cpu0 = time.time_ns(), time.thread_time_ns()
        p = self._place(where)
        batch: list[Command] = []
        live, loaded = self.arrays[where], self.loaded[where]
        # Per worker, buffer -> its pieces; made only for a batch with puts (a step's batch
        # has none, and a list per chip costs O(chips) per step at pod scale).
        staged: list[dict[int, list]] | None = None
        for cmd in commands:
            match cmd:
                case Run(fingerprint=fp) | Compile(fingerprint=fp) if fp not in loaded:
                    batch.append(Load(fp, self.programs[fp]))
                    loaded.add(fp)
                    self.loads_sent[where] += 1
                case Put(pieces=[[(Pull(), *_), *_], *_]):
                    # Pulls travel in the command: each chip starts its own on reading
                    # the batch (ChipWorker._run_batch), with no Ray call of their own.
                    batch.append(replace(cmd, start=p.start))
                    live.update(cmd.writes)
                    continue
                case Put(pieces=pieces) if pieces is not None:
                    if staged is None:
                        staged = [{} for _ in range(p.chips)]
                    for to_worker, mine in zip(staged, pieces, strict=True):  # own blocks
                        to_worker[cmd.buffer] = mine
                case Free():
                    live.difference_update(cmd.buffers)
                case HostCall():
                    batch.extend(self._host_call(p, cmd))
                    live.update(cmd.writes)
                    continue
            live.update(cmd.writes)
            batch.append(placed(cmd, p.start))
        if staged is not None:
            for w, buffers in zip(p.workers, staged, strict=True):  # one call per chip
                if buffers:
                    self._stage(w, buffers, source)
        payload = dumps(batch)
        loads = any(isinstance(c, (Load, Compile)) for c in batch)  # compile deadline
        # Backpressure: a client that issues work faster than the slice runs it waits here.
        for s in p.slices:
            for ch in self._stream_of(s.name):
                try:
                    ch.send(payload, self.max_inflight)
                except WorkerDied as e:
                    raise self._lose(s.name, str(e)) from None
                if loads:
                    self._last_load[s.name] = ch.sent
        self.dispatched["batches"] += 1
        self.dispatched["cpu_ns"] += time.thread_time_ns() - cpu0
        if self._spans is not None:
            self._spans.append(Event("dispatch", f"submit {where}", t0, time.time_ns() - t0,
                                     {"commands": len(batch), "bytes": len(payload),
                                      "batch": self._stream_of(p.slices[0].name)[0].sent}))

    def _stage(self, w, buffers: dict[int, list], source) -> None:
        """Give a chip the pieces of its coming puts, each distinct ref once (a transfer
        packs many buffers' shards in one object: 35 arrays' pieces were 140 refs per
        chip to serialize, register and report back, for 4 objects)."""
        slot: dict = {}
        numbered = {b: [(slot.setdefault(p[0], len(slot)), *p[1:]) for p in pieces]
                    for b, pieces in buffers.items()}
        w.handle.stage.remote(list(slot), numbered, source, lease=self._token)

    # ---- sidecars (sidecar.py, sidecar_host.py) -------------------------------------
    def sidecars(self, where: str) -> int:
        """Start the sidecars of a slice (once); returns how many hosts it has."""
        p = self._place(where)
        if len(p.slices) != 1:
            raise ValueError(f"slice={where!r} spans several slices; a sidecar runs on the "
                             f"hosts of one slice")
        self._sidecars_used = True  # replacements start theirs before they join
        return len(p.slices[0].sidecars())

    def _host_call(self, p: Placement, call: HostCall) -> list[Command]:
        """Start a sidecar call on every host of the slice without waiting for it: the
        chips hold their shards of its array arguments (``Hold``, at this point of the
        stream), each host's sidecar reads its own and returns its chips' blocks of the
        outputs as objects in its node's store, and each chip gets the refs of its
        block (``stage``) before the outputs' puts reach it. Returns the commands for
        the chips' streams."""
        (sl,) = p.slices
        hosts = sl.sidecars()
        out: list[Command] = []
        spec = dict(call.spec)
        obj = spec.get("obj")
        if obj is not None:
            spec["seq"] = self._obj_seq.get(obj, 0)
            self._obj_seq[obj] = spec["seq"] + 1
        host_ranks = [h.ranks for h in hosts]
        holders: list[list[int]] = [[] for _ in hosts]  # per host, chips that hand shards
        token = next(self._tokens)
        if call.inputs:
            for _, shape, _, mesh, in_spec in call.inputs:
                for mine, blocks in zip(holders, host_blocks(shape, mesh, in_spec, host_ranks),
                                        strict=True):
                    for k in range(len(blocks.pieces)):
                        first = min(r for r, piece in blocks.chip_piece.items() if piece == k)
                        if first not in mine:
                            mine.append(first)
            out.append(Hold(token, tuple(c[0] for c in call.inputs),
                            tuple(sorted(r for mine in holders for r in mine))))
        out_blocks = [host_blocks(put.shape, put.mesh, put.spec, host_ranks)
                      for put in call.outputs]
        pieces: list[list[list]] = [[[] for _ in sl.workers] for _ in call.outputs]
        replies = []
        for h, host in enumerate(hosts):
            layout = []
            for _, shape, dtype, mesh, in_spec in call.inputs:
                index = host_blocks(shape, mesh, in_spec, [holders[h]])[0]
                layout.append((shape, dtype, [index.pieces[index.chip_piece[r]]
                                              for r in holders[h]]))
            spec["in_layout"] = layout
            spec["outs"] = [_Out(put.shape, put.dtype, b[h].box, b[h].pieces)
                            for put, b in zip(call.outputs, out_blocks, strict=True)]
            n = sum(len(b[h].pieces) for b in out_blocks) + bool(call.reply)
            inputs = [sl.workers[r].handle.held.remote(token, lease=self._token)
                      for r in holders[h]]
            refs = host.handle.call.options(num_returns=max(n, 1)).remote(spec, inputs)
            refs = refs if isinstance(refs, list) else [refs]
            if call.reply:
                replies.append(refs.pop())
            for i, b in enumerate(out_blocks):
                mine, refs = refs[:len(b[h].pieces)], refs[len(b[h].pieces):]
                for r, k in b[h].chip_piece.items():
                    pieces[i][r].append((mine[k], b[h].pieces[k]))
        if call.reply:
            self._replies[call.reply] = replies
            while len(self._replies) > 4096:  # results nobody asked for
                self._replies.popitem(last=False)
        for put, per_chip in zip(call.outputs, pieces, strict=True):
            for w, mine in zip(sl.workers, per_chip, strict=True):
                host = next(h for h in hosts if w.rank in h.ranks)
                self._stage(w, {put.buffer: mine}, (sl.name, f"{sl.name}/{host.worker_id}"))
            out.append(placed(put, p.start))
        return out

    def host_results(self, reply: int) -> list:
        """The refs of each host's return value of a sidecar call (once)."""
        refs = self._replies.pop(reply, None)
        if refs is None:
            raise ValueError(f"no sidecar call {reply} is waiting to be read (read once, and "
                             f"only the latest 4096 are kept)")
        return refs

    def _sidecar_verdicts(self) -> dict[str, str]:
        """For the health monitor: slices whose sidecar died or froze (a sidecar is part
        of its host: losing it loses the slice, as losing the host would)."""
        import ray

        verdicts = {}
        now = time.monotonic()
        with self._lock:
            live = [(n, s) for n, s in self.slices.items() if s._sidecars]
        for name, s in live:
            sent, refs = self._sidecar_pings.get(name, (now, []))
            if refs:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
                done = set(ready)
                for sc, ref in zip(s._sidecars, refs, strict=True):
                    if ref in done:
                        try:
                            ray.get(ref, timeout=0)
                        except ray.exceptions.RayError as e:
                            verdicts[name] = (f"the sidecar on host {name}/{sc.worker_id} "
                                              f"died ({type(e).__name__})")
                    elif now - sent > timeout_s("step"):
                        verdicts[name] = (f"the sidecar on host {name}/{sc.worker_id} did not "
                                          f"answer for {now - sent:.0f} s (limit "
                                          f"$PATHWAYS_RAY_STEP_TIMEOUT_S): frozen")
                if len(done) < len(refs) or name in verdicts:
                    continue
                if now - sent < 1.0:
                    continue
            self._sidecar_pings[name] = (now, [sc.handle.ping.remote() for sc in s._sidecars])
        return verdicts

    def _sent(self, p: Placement) -> list[int]:
        """Batches sent to each worker of a placement: what a query must wait for (every
        stream of a slice carries every batch, relayed or not)."""
        return [n for s in p.slices for n in [self._stream_of(s.name)[0].sent] * s.num_chips]

    def _stream_of(self, name: str) -> list[CommandChannel]:
        """The command streams of a live slice; ``SliceLost`` once it is lost."""
        channels = self._channels.get(name)
        if channels is None:
            with self._lock:
                raise self.lost.get(name) or SliceLost(name, reason="it was released")
        return channels

    def shard_refs(self, where: str, buffer_id: int, ranks: list[int]) -> list:
        """Object refs of the given ranks' shards (fetched by the client, not by us)."""
        p = self._place(where)
        workers, sent = p.workers, self._sent(p)
        return [workers[r].handle.shard.remote(buffer_id, sent[r], lease=self._token)
                for r in ranks]

    def snapshot_refs(self, where: str, plan: dict[int, list[int]]) -> dict:
        """Per rank, the object ref of its shards of the buffers ``plan`` names (one
        call per chip; the snapshot keeper pulls them, not us)."""
        p = self._place(where)
        workers, sent = p.workers, self._sent(p)
        return {r: workers[r].handle.shards.remote(ids, sent[r], lease=self._token)
                for r, ids in plan.items()}

    def ready(self, where: str, buffer_ids: list[int]) -> list:
        p = self._place(where)
        return [w.handle.ready.remote(buffer_ids, n, lease=self._token)
                for w, n in zip(p.workers, self._sent(p), strict=True)]

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

    def dispatch_stats(self) -> dict:
        """Batches forwarded so far and the CPU their forwarding took on this actor's
        thread (not the Ray call that brought each; ``benchmarks/dispatch_scale.py``)."""
        return dict(self.dispatched)

    # ---- profiling (client.profile) ----------------------------------------------
    def _live_workers(self) -> list:
        with self._lock:
            return [(s, w) for s in self.slices.values() for w in s.workers]

    def profile_start(self) -> None:
        """Start JAX's profiler on every chip of every live slice, and record this
        controller's dispatch spans."""
        workers = self._live_workers()
        boundary.get([w.handle.profile.remote("start", lease=self._token) for _, w in workers],
                     timeout="control", what="starting the profiler on every chip")
        self._spans = []

    def profile_stop(self) -> dict:
        """Stop the profilers; returns the dispatch spans and, per chip, its events with
        its clock's measured offset from this one (``profile_trace.clock_offset``)."""
        from pathways_ray.observability.profile_trace import clock_offset

        spans, self._spans = self._spans or [], None
        workers = self._live_workers()
        events = boundary.get([w.handle.profile.remote("stop", lease=self._token)
                               for _, w in workers],
                              timeout="fetch", what="the chips' profiles")
        # One clock per host (its chips share it): a few round trips each, one at a time;
        # the one with the least queueing is the best estimate.
        offsets: dict[str, tuple[int, int]] = {}
        for _, w in workers:
            if w.info.node_id in offsets:
                continue
            samples = []
            for _ in range(3):
                sent = time.time_ns()
                remote = boundary.get(w.handle.clock.remote(), timeout="control",
                                      what="a chip's clock")
                samples.append((sent, remote, time.time_ns()))
            offsets[w.info.node_id] = clock_offset(samples)
        chips = []
        for (s, w), evs in zip(workers, events, strict=True):
            offset, error = offsets[w.info.node_id]
            chips.append({"slice": s.name, "rank": w.rank, "host": w.info.worker_id,
                          "events": evs, "offset_ns": offset, "uncertainty_ns": error})
        return {"controller": spans, "chips": chips}

    # ---- growing back -------------------------------------------------------------
    def grow(self, count: int) -> None:
        """Have ``count`` replacements on their way: slices shaped like the ones lost,
        reserved in the background as soon as the cluster has them free. Each joins
        ``describe()`` when ready, under a name of its own (a slice that comes back
        under an old name is a new slice). Idempotent: ``grow(0)`` cancels."""
        if self.multislice and count:
            raise ValueError("a multislice world cannot take in a new slice; connect without "
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

    # ---- failures ---------------------------------------------------------------
    def report_lost(self, where: str, reason: str) -> SliceLost:
        """The client saw a chip worker of ``where`` die: mark the slice(s) of that
        placement whose workers are not all healthy lost. Returns the error to raise."""
        p = self._place(where)
        members = list(p.slices)
        sick = [s for s in members if any(h != "ok" for _, h in ping_all(s.workers, 2.0))]
        errors = [self._lose(s.name, reason) for s in (sick or members)]
        return errors[0]

    def _streams(self):
        """For the health monitor: (slice, stream, its last batch with a Load)."""
        with self._lock:
            return [(name, ch, self._last_load.get(name, 0))
                    for name, channels in self._channels.items() for ch in channels]

    def _condemn(self, name: str, reason: str) -> None:
        """The monitor found slice ``name`` dead or frozen: break its streams first (a
        send or wait blocked on them returns at once), then mark it lost."""
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
        health = dict((w.rank, h) for w, h in ping_all(s.workers, 2.0))
        hosts = {f"{name}/{w.info.worker_id}" for w in s.workers
                 if w.info.node_id not in alive or health[w.rank] != "ok"}
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
        if self.multislice:  # one JAX world: the other slices cannot run a collective now
            for other in list(self.slices):
                self._lose_locked(other, f"it shared one JAX world with slice {name}, which "
                                         f"was lost")
        return err

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

    def drain(self) -> None:
        """Wait until every forwarded batch has run (each wait bounded by the stream
        timeout)."""
        for name in list(self._channels):
            try:
                for ch in list(self._channels.get(name, [])):
                    ch.wait_acked(ch.sent)
            except WorkerDied as e:
                raise self._lose(name, str(e)) from None

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
        return p


def _reserve_all(specs: list, opts: dict) -> list[Slice]:
    """Reserve separate slices side by side (their chip workers start and import JAX at
    the same time; one after another took 5 s a slice here). If any fails, the others
    are released and its error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    if len(specs) == 1:
        return [Slice.reserve(specs[0], **opts)]
    with ThreadPoolExecutor(len(specs), thread_name_prefix="pathways-ray-reserve") as pool:
        futures = [pool.submit(Slice.reserve, spec, **opts) for spec in specs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for f in futures:
            if f.exception() is None:
                f.result().shutdown()
        raise errors[0]
    return [f.result() for f in futures]
