"""A chip worker's shards in and out: staged pieces of coming puts, shards handed to
the client, a sidecar or a snapshot, and chip-to-chip pulls (``transport/pull.py``)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

from pathways_ray import boundary
from pathways_ray.config import timeout_s
from pathways_ray.errors import RemoteError, SliceLost, WaitTimeout, WorkerDied
from pathways_ray.transport.pull import Pull, PullFailed
from pathways_ray.transport.pull import wait as wait_pulled

logger = logging.getLogger(__name__)


class Shards:
    """Mixin of ``ChipWorker``: the calls that move shards."""

    @ray.method(concurrency_group="control")
    def stage(self, refs: list, buffers: dict[int, list], source: str | tuple | None = None,
              lease: str | None = None) -> None:
        """Hand over, per buffer id, the pieces a later ``put`` in the stream assembles
        this chip's shard from: ``(k, index)`` or ``(k, index, position)`` with ``k``
        the position in ``refs`` of the object holding it: a Ray object ref (refs
        travel by Ray call so Ray tracks who holds them; each once, however many
        pieces it holds: the borrowing bookkeeping is per ref) or a ``Pull`` from
        another chip. ``source`` names the slice they come from
        (a cross-slice reshard), or the ``(slice, host)`` of the sidecar that returns
        them."""
        self._check_lease(lease)
        self._stage({b: [(refs[p[0]], *p[1:]) for p in pieces] for b, pieces in buffers.items()},
                    source)

    def _stage(self, buffers: dict[int, list], source: str | tuple | None) -> None:
        # Start every copy now, all at once, while the stream runs what comes before
        # their puts (one by one, each put would wait for its own). Pulls from another
        # chip's transfer server (``pull.py``) land in this chip's memory, started before
        # their puts can look for them; Ray objects come to this host's store, on a
        # daemon thread: a pull from a host that died waits out its timeout without
        # holding up later pulls or this process's exit.
        refs = list(dict.fromkeys(p[0] for pieces in buffers.values() for p in pieces))
        started = {}
        for p in refs:
            if isinstance(p, Pull):
                try:
                    started[p] = self._transfers.start(p)
                except Exception as e:  # noqa: BLE001 - its put raises it, naming the source
                    started[p] = ConnectionError(f"pulling from {p.address}: {e}")
        with self._staged_cond:
            for buffer_id, pieces in buffers.items():
                self._staged[buffer_id] = (pieces, source)
                for r in {p[0] for p in pieces}:
                    self._packets.setdefault(r, [None, 0])[1] += 1
            for p, arrays in started.items():
                self._packets[p][0] = arrays
            self._staged_cond.notify_all()
        objects = [r for r in refs if not isinstance(r, Pull)]
        if objects:
            threading.Thread(target=ray.wait, args=(objects,), daemon=True, name="prefetch",
                             kwargs={"num_returns": len(objects),
                                     "timeout": timeout_s("stream"),
                                     "fetch_local": True}).start()

    @ray.method(concurrency_group="control")
    def abandon(self, slice_name: str, lease: str | None = None) -> None:
        """The controller lost slice ``slice_name``: a put waiting on a pull from it
        fails now (``SliceLost``) instead of at its deadline."""
        self._check_lease(lease)
        self._lost_sources.add(slice_name)

    @ray.method(concurrency_group="control")
    def cancel(self, pulls: list[int], error: BaseException, lease: str | None = None) -> None:
        """The offers ``pulls`` will never come (their source could not make them): a
        put waiting on one fails now, with ``error``, instead of at its deadline."""
        self._check_lease(lease)
        self._cancelled.update(dict.fromkeys(pulls, error))

    def _take_pieces(self, buffer_id: int) -> list:
        with self._staged_cond:
            if buffer_id not in self._staged and not self._staged_cond.wait_for(
                    lambda: buffer_id in self._staged, timeout=(wait_s := timeout_s("stream"))):
                raise WaitTimeout(f"the pieces of buffer {buffer_id} did not arrive within "
                                  f"{wait_s:g} s ($PATHWAYS_RAY_STREAM_TIMEOUT_S)")
            pieces, source = self._staged.pop(buffer_id)

        def died(e: BaseException):
            if isinstance(source, tuple):  # (slice, host) of the sidecar that made them
                return SliceLost(source[0], (source[1],), reason=f"its sidecar on host "
                                 f"{source[1]} died before chip rank {self.rank} read buffer "
                                 f"{buffer_id} from it ({type(e).__name__})")
            if source is None:
                return WorkerDied(f"the data of buffer {buffer_id} was lost before this chip "
                                  f"read it: {e}")
            return SliceLost(source, reason=f"it died before this chip copied buffer "
                                            f"{buffer_id} from it ({type(e).__name__})")

        # A piece is (ref, index), or (ref, index, position) in a packet of several
        # buffers' shards (a cross-slice transfer), a packet being a Ray object or the
        # arrays of a pull: each is read once, by the first put that needs it, and
        # dropped after the last.
        refs = list(dict.fromkeys(p[0] for p in pieces))
        with self._staged_cond:
            values = {r: self._packets[r][0] for r in refs
                      if self._packets.get(r, (None,))[0] is not None}
        unread = [r for r in refs if r not in values]
        try:
            for r in refs:
                if isinstance(r, Pull) and r not in self._arrived:
                    arrays = values.get(r)
                    what = f"the pieces of buffer {buffer_id} from chip {r.address}"
                    try:
                        if not isinstance(arrays, list):
                            raise arrays or ConnectionError(f"{what} were never pulled")
                        wait_pulled(arrays, timeout_s("stream"), what,
                                    stopped=lambda r=r: self._stopped(r))
                        self._arrived.add(r)
                    except TimeoutError as e:
                        raise WaitTimeout(str(e)) from None
                    except ConnectionError as e:
                        self._transfers.forget(r.address)
                        raise died(e) from None
                    except PullFailed as e:
                        raise RemoteError(f"copying buffer {buffer_id} from slice {source}",
                                          str(e)) from None
            unread = [r for r in unread if not isinstance(r, Pull)]
            if unread:
                got = boundary.get(unread, timeout="stream", died=died,
                                   what=f"the pieces of buffer {buffer_id}")
                values.update(zip(unread, got, strict=True))
                with self._staged_cond:
                    for r in unread:
                        if r in self._packets:
                            self._packets[r][0] = values[r]
            return [(p[1], values[p[0]] if len(p) == 2 else values[p[0]][p[2]])
                    for p in pieces]
        finally:
            with self._staged_cond:
                for r in refs:
                    held = self._packets.get(r)
                    if held is not None:
                        held[1] -= 1
                        if held[1] <= 0:
                            del self._packets[r]
                            self._arrived.discard(r)

    def _stopped(self, pull: Pull) -> BaseException | None:
        """Why ``pull`` will never arrive, if the controller has said so."""
        if pull.source in self._lost_sources:
            return ConnectionError(f"the controller lost slice {pull.source}")
        return self._cancelled.get(pull.uuid)

    def _give(self, token: int, value) -> None:
        with self._staged_cond:
            self._held[token] = value
            self._staged_cond.notify_all()

    @ray.method(concurrency_group="host")
    def held(self, token: int, lease: str | None = None) -> list[np.ndarray]:
        """This chip's shards that a ``Hold`` in the stream copied for a sidecar call
        (once; raises why they could not be read)."""
        self._check_lease(lease)
        wait_s = timeout_s("stream")
        with self._staged_cond:
            if not self._staged_cond.wait_for(lambda: token in self._held, timeout=wait_s):
                raise WaitTimeout(f"shards held for sidecar call {token} did not appear within "
                                  f"{wait_s:g} s ($PATHWAYS_RAY_STREAM_TIMEOUT_S)")
            value = self._held.pop(token)
        if isinstance(value, BaseException):
            raise value
        return value

    def _after(self, batches: int) -> None:
        """Wait until the first ``batches`` batches of the stream have run: a query
        sent after them must see their results."""
        if batches:
            if self._channel is None:
                raise RuntimeError("no command stream is open on this chip worker")
            self._channel.wait_for(batches, timeout_s("stream"))

    def shard(self, buffer_id: int, after: int = 0, lease: str | None = None) -> np.ndarray:
        """This chip's shard of a buffer (raises the remote error of a failed buffer)."""
        self._check_lease(lease)
        self._after(after)
        return self.executor.local_shard(buffer_id)

    def shards(self, buffer_ids: list[int], after: int = 0, lease: str | None = None,
               missing_ok: bool = False) -> list[np.ndarray | None]:
        """This chip's shards of several buffers, in one object (a snapshot's share).
        ``missing_ok``: a buffer that cannot be read (freed, donated, failed) is None."""
        self._check_lease(lease)
        self._after(after)
        out = []
        for i in buffer_ids:
            try:
                out.append(self.executor.local_shard(i))
            except RemoteError:
                if not missing_ok:
                    raise
                out.append(None)
        return out

    def put_shards(self, packets: list[list[int]], after: int = 0,
                   lease: str | None = None) -> tuple:
        """Per packet, the list of this chip's shards of the packet's buffers, then
        ``True``: called with ``num_returns=len(packets) + 1``, so the caller holds
        the refs (and can hand them on) before this runs, each packet becomes one
        object in this host's store, and the last, tiny return tells the caller
        that every packet was made, or raises why not (a failed buffer).

        For a transfer to another slice, one packet per destination host: the caller
        passes the refs on and never holds the bytes."""
        self._check_lease(lease)
        self._after(after)
        return (*([self.executor.local_shard(i) for i in packet] for packet in packets),
                True)

    def offer(self, pulls: dict[int, list[tuple[int, tuple | None, tuple]]], after: int = 0,
              lease: str | None = None) -> bool:
        """Offer, per pull id, this chip's shards of buffers (or the parts named) to
        one pull by another chip (``pull.py``), for ``$PATHWAYS_RAY_STREAM_TIMEOUT_S``:
        ``(buffer id, part as (start, stop) per axis or None, (shape, dtype) the puller
        expects)`` each. Raises if a buffer failed, or is not what the puller expects:
        nothing is offered then."""
        self._check_lease(lease)
        self._after(after)
        wanted = [(b, part) for pieces in pulls.values() for b, part, _ in pieces]
        arrays = self.executor.local_pieces(wanted)
        for (b, _, (shape, dtype)), a in zip((p for ps in pulls.values() for p in ps), arrays,
                                             strict=True):
            if (tuple(a.shape), str(a.dtype)) != (tuple(shape), dtype):
                raise RemoteError(f"offering buffer {b} to another slice",
                                  f"its piece here is {a.dtype}{list(a.shape)}, the copy "
                                  f"expects {dtype}{list(shape)} (does the client's JAX "
                                  f"config, jax_enable_x64, differ from the chips'?)")
        arrays = iter(arrays)
        for uuid, pieces in pulls.items():
            self._transfers.offer(uuid, [next(arrays) for _ in pieces], timeout_s("stream"))
        return True

    @ray.method(concurrency_group="control")
    def transfer_address(self, lease: str | None = None) -> str:
        """Where this chip's transfer server listens (started now if it has not been)."""
        self._check_lease(lease)
        return self._transfers.address()

    def ready(self, buffer_ids: list[int], after: int = 0, lease: str | None = None) -> bool:
        """True once the buffers are computed; raises the remote error if one failed."""
        self._check_lease(lease)
        self._after(after)
        self.executor.ready(buffer_ids)
        return True


# ---- carrying a chip's buffers into the next JAX world (controller/reform.py) ----------
# A world of several slices cannot take a slice back in place (the survivors keep the
# gloo cliques they had with the lost slice's processes), so the controller re-forms
# it: every chip of the live slices gets a new process in a new world. Before the old
# processes go, each chip hands over its buffers (``export_buffers``: its own shard of
# each, with the array's shape, dtype and sharding) as the return value of a Ray call,
# so the bytes wait in the host's object store, owned by the controller; the new
# process on the same chip builds the same arrays from them (``import_buffers``), the
# sharding's devices renamed from the old world's ids to the new ones. A buffer that
# had failed is carried as its failure.

@dataclass(frozen=True)
class Carried:
    """One buffer as one chip holds it: its global shape and dtype, its sharding (its
    devices' world ids, and the mesh's axis names and sizes and the spec for a
    ``NamedSharding``, or the XLA ``OpSharding`` bytes for any other), and this chip's
    shard; or, for a failed buffer, its failure."""

    shape: tuple[int, ...]
    dtype: str
    devices: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    axis_sizes: tuple[int, ...] = ()
    spec: tuple = ()
    op_sharding: bytes | None = None
    shard: np.ndarray | None = None
    failed: Any = None


def _carry(value) -> Carried:
    from jax.sharding import NamedSharding

    sharding = value.sharding
    common = dict(shape=tuple(value.shape), dtype=np.dtype(value.dtype).name,
                  shard=np.asarray(value.addressable_data(0)))
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh
        return Carried(devices=tuple(int(d.id) for d in mesh.devices.flat),
                       axis_names=tuple(mesh.axis_names),
                       axis_sizes=tuple(int(n) for n in mesh.devices.shape),
                       spec=tuple(sharding.spec), **common)
    hlo = sharding._to_xla_hlo_sharding(value.ndim)
    return Carried(devices=tuple(int(d.id) for d in sharding._device_assignment),
                   op_sharding=hlo.to_proto().SerializeToString(), **common)


_GONE = "the array was deleted (donated to a program) before the world was re-formed"


def _deleted(value) -> bool:
    """A buffer a program took as a donated input: deleted here, and forgotten by its
    client once the delete it sends next arrives."""
    return hasattr(value, "is_deleted") and value.is_deleted()


def _settled(value) -> bool:
    """Nothing more will happen to ``value``: computed, failed, deleted or gone."""
    return (value is None or not hasattr(value, "is_ready") or _deleted(value)
            or value.is_ready())


class CarriedBuffers:
    """Mixin of ``ChipWorker``: hand a chip's buffers over to the next world."""

    # (Not in the default group: a read stuck on a lost world's buffer holds its thread.)
    @ray.method(concurrency_group="control")
    def export_buffers(self, after: int = 0, lease: str | None = None,
                       settle_s: float | None = None, lost: str = "") -> dict[int, Carried]:
        """Every buffer of this chip, once the first ``after`` batches of its stream
        have run. ``settle_s``: this chip's world lost slice ``lost``, and a program
        over it may never end here (its collectives wait on the dead): a buffer not
        computed within ``settle_s`` is handed over as lost with it."""
        from pathways_ray.chips.executor import Failed

        self._check_lease(lease)
        self._after(after)
        values = list(self.executor.buffers.items())
        pending = {i for i, v in values if settle_s is not None and not _settled(v)}
        deadline = time.monotonic() + (settle_s or 0.0)
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            pending = {i for i in pending if not _settled(self.executor.buffers.get(i))}
        gone = Failed("carry", "", SliceLost(lost or "?", reason="the program computing "
                                             "it was still running when the slice was lost"))
        out: dict[int, Carried] = {}
        for buffer_id, value in values:
            if buffer_id in pending:
                value = gone
            elif not isinstance(value, Failed):
                try:
                    out[buffer_id] = _carry(value)
                    continue
                except Exception as e:  # noqa: BLE001 - its program failed on the chips
                    if _deleted(value):  # a program took it as a donated input
                        out[buffer_id] = Carried((), "", (), failed=Failed("carry", _GONE))
                        continue
                    if settle_s is None:
                        raise
                    value = Failed("carry", "", SliceLost(lost or "?", reason=(
                        f"its program failed on the chips as the slice was lost: "
                        f"{str(e).splitlines()[0][:200]}")))
            out[buffer_id] = Carried((), "", (), failed=value)
        logger.info("chip rank %s: %d buffers handed over", self.rank, len(out))
        return out

    def import_buffers(self, carried: dict[int, Carried], renamed: dict[int, int],
                       lost: str = "", lease: str | None = None,
                       expected: tuple[int, ...] = ()) -> int:
        """Rebuild the buffers another process of this chip handed over (``renamed``:
        old world device id -> this world's). A buffer that also lived on devices no
        longer in the world (a lost slice's, named by ``lost``), or one ``expected``
        that never came (the batch writing it had not run in the old process), comes
        back failed with ``SliceLost``. Returns how many were carried."""
        import jax
        from jax._src.lib import xla_client
        from jax._src.sharding_impls import GSPMDSharding
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from pathways_ray.chips.executor import Failed

        self._check_lease(lease)
        world = {d.id: d for d in jax.devices()}
        local = jax.local_devices()[0]
        shardings: dict[tuple, Any] = {}
        for buffer_id, c in carried.items():
            if c.failed is not None:
                self.executor.buffers[buffer_id] = c.failed
                continue
            if any(d not in renamed for d in c.devices):
                self.executor.buffers[buffer_id] = Failed(
                    "carry", "", SliceLost(lost or "?", reason="the array also lived on "
                                           "a slice that was lost"))
                continue
            key = (c.devices, c.axis_names, c.axis_sizes, c.spec, c.op_sharding)
            sharding = shardings.get(key)
            if sharding is None:
                devices = [world[renamed[d]] for d in c.devices]
                if c.op_sharding is None:
                    mesh = Mesh(np.array(devices).reshape(c.axis_sizes), c.axis_names)
                    sharding = NamedSharding(mesh, PartitionSpec(*c.spec))
                else:
                    proto = xla_client.OpSharding()
                    proto.ParseFromString(c.op_sharding)
                    sharding = GSPMDSharding(devices, proto)
                shardings[key] = sharding
            self.executor.buffers[buffer_id] = jax.make_array_from_single_device_arrays(
                c.shape, sharding, [jax.device_put(c.shard, local)])
        never = Failed("carry", "", SliceLost(lost or "?", reason="the batch writing it "
                                              "had not run when the slice was lost"))
        for buffer_id in expected:
            self.executor.buffers.setdefault(buffer_id, never)
        return len(carried)
