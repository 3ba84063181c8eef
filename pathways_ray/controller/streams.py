"""Batches and queries over the slices' command streams: the controller is the only
writer of each stream, and a query waits for the batches sent before it."""

from __future__ import annotations

import time
from dataclasses import replace

from pathways_ray import boundary
from pathways_ray.chips.slice import Slice
from pathways_ray.config import timeout_s
from pathways_ray.controller.placement import Placement
from pathways_ray.errors import SliceLost, WorkerDied
from pathways_ray.observability.profile_trace import Event
from pathways_ray.transport.channel import CommandChannel, dumps
from pathways_ray.transport.commands import (
    Command,
    Compile,
    Free,
    HostCall,
    Inline,
    Load,
    Put,
    Run,
    placed,
)
from pathways_ray.transport.fanout import relay_tree
from pathways_ray.transport.pull import Pull


class Streams:
    """Mixin of ``Controller``: ``submit`` and the queries that follow it."""

    def _open_streams(self, s: Slice) -> list[CommandChannel]:
        """The command streams of a slice: one to its root, which relays to the rest
        (``fanout.py``), or, with ``fanout=0``, one to every chip."""
        def died(e):
            return WorkerDied(f"a chip worker of {s.name} died before it started: {e}")

        ends = boundary.get(
            [w.handle.open_channel.remote(lease=self._token) for w in s.workers],
            timeout="control", what=f"opening the command streams of {s.name}", died=died)
        s.listeners = [address for address, _ in ends]  # Slice.health probes them
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
            if isinstance(cmd, Compile):  # to compile again in a re-formed world
                self._compiles.setdefault(where, {})[cmd.fingerprint] = cmd
            match cmd:
                case Run(fingerprint=fp) | Compile(fingerprint=fp) if fp not in loaded:
                    batch.append(Load(fp, self.programs[fp]))
                    loaded.add(fp)
                    self.loads_sent[where] += 1
                    again = self._compiles.get(where, {}).get(fp)
                    if isinstance(cmd, Run) and again is not None:
                        # Compiled ahead in the chips' previous processes (reform.py):
                        # a compiled program (the proxy's) runs only once compiled.
                        batch.append(placed(again, p.start))
                        if again.status not in live:
                            batch.append(Free((again.status,)))
                case Put(pieces=[[(Pull(), *_), *_], *_]) | Put(pieces=Inline()):
                    # Pulls and small puts' data travel in the command: each chip takes
                    # its own on reading the batch, with no Ray call of their own.
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

    def snapshot_refs(self, where: str, plan: dict[int, list[int]],
                      missing_ok: bool = False) -> dict:
        """Per rank, the object ref of its shards of the buffers ``plan`` names (one
        call per chip; the snapshot keeper, or ``Client.fetch_all``, pulls them, not us)."""
        p = self._place(where)
        workers, sent = p.workers, self._sent(p)
        return {r: workers[r].handle.shards.remote(ids, sent[r], lease=self._token,
                                                    missing_ok=missing_ok)
                for r, ids in plan.items()}

    def ready(self, where: str, buffer_ids: list[int]) -> list:
        p = self._place(where)
        return [w.handle.ready.remote(buffer_ids, n, lease=self._token)
                for w, n in zip(p.workers, self._sent(p), strict=True)]

    def dispatch_stats(self) -> dict:
        """Batches forwarded so far and the CPU their forwarding took on this actor's
        thread (not the Ray call that brought each; ``benchmarks/dispatch_scale.py``)."""
        return dict(self.dispatched)

    def drain(self) -> None:
        """Wait until every forwarded batch has run (each wait bounded by the stream
        timeout)."""
        for name in list(self._channels):
            try:
                for ch in list(self._channels.get(name, [])):
                    ch.wait_acked(ch.sent)
            except WorkerDied as e:
                raise self._lose(name, str(e)) from None

