"""The controller's half of sidecars (``client/sidecar.py``, ``chips/sidecar_host.py``):
starting a slice's sidecars, fanning a call out to every host without waiting for it,
and watching them for the health monitor."""

from __future__ import annotations

import time

from pathways_ray.chips.sidecar_host import _Out
from pathways_ray.config import timeout_s
from pathways_ray.controller.placement import Placement
from pathways_ray.programs.sharding import host_blocks
from pathways_ray.transport.commands import (
    Command,
    Hold,
    HostCall,
    placed,
)


class SidecarCalls:
    """Mixin of ``Controller``: a sidecar call becomes commands on the chips' streams."""

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
            # (ranks within the slice; ``start``: where it begins in its JAX world)
            out.append(placed(Hold(token, tuple(c[0] for c in call.inputs),
                                   tuple(sorted(r for mine in holders for r in mine))),
                              p.start))
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

