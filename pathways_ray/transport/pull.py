"""Chip-to-chip copies over JAX's transfer server (``jax.experimental.transfer``).

A cross-slice reshard (``Controller.transfer``, the RL loop's weight sync) has
each destination chip pull, from each source chip it needs, the parts of its
blocks that chip holds (``sharding.pull_transfer``). The source chip offers
them under a random 63-bit id (``await_pull``); the destination pulls them
straight into its own device buffers. Either side may go first: a pull waits
for its offer. This is the transfer JAX ships for
moving arrays between TPU slices over DCN, so the same code runs on TPUs; on
the emulated fleet it is a TCP stream between two chip processes, with no copy
through a store (Ray's objects cost a copy into the source host's store, a
copy between the stores and one into the device: ``benchmarks/weight_sync.py``).

What JAX's server does not give, and this module adds:

- an offer that nobody pulls is dropped after ``$PATHWAYS_RAY_STREAM_TIMEOUT_S``
  (its destination died), so a lost transfer does not pin its arrays forever;
- a pull is waited on with a deadline: one whose offer expired, or whose
  source froze, never completes, and JAX would wait for ever; a pull from a
  slice the controller has lost ends at once (``ChipWorker.abandon``);
- the server has no authentication; the ids are the capability. Only the
  controller makes them, one per (source chip, destination chip) pair and
  transfer, valid once, and hands them out only by authenticated channels: Ray's
  calls to the sources, the command stream (its secret) to the destinations.
"""

from __future__ import annotations

import datetime
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Pull", "PullFailed", "Transfers", "new_id", "wait"]

# How JAX's transfer client says the other end went away (its process or host died).
_GONE = ("connection closed", "connection refused", "connection reset", "broken pipe",
         "failed to connect")


class PullFailed(RuntimeError):
    """A pull failed with its source still there (JAX's reason in the message)."""


@dataclass(frozen=True)
class Pull:
    """What a destination chip pulls from one source chip in one transfer: the source
    chip's server, the id of the offer, each piece's ``(shape, dtype)``, and the
    slice it comes from (for errors, and for ``ChipWorker.abandon``)."""

    address: str
    uuid: int
    pieces: tuple[tuple[tuple[int, ...], str], ...]
    source: str = ""

    def __hash__(self) -> int:  # a dict key per put: not every piece's layout each time
        return hash(self.uuid)


def new_id() -> int:
    return secrets.randbits(63)


class Transfers:
    """One chip's end of chip-to-chip copies: a transfer server, started on first use,
    that offers this chip's pieces, and cached connections to other chips' servers."""

    def __init__(self, ip: str):
        self._ip = ip
        self._server = None
        self._connections: dict[str, object] = {}
        self._specs: dict[tuple, list] = {}  # Pull.pieces -> what conn.pull is asked for
        self._lock = threading.Lock()

    def _started(self):
        import jax
        from jax.experimental import transfer

        with self._lock:
            if self._server is None:
                client = jax.local_devices()[0].client
                self._server = transfer.start_transfer_server(
                    client, f"{self._ip}:0", [f"{self._ip}:0"])
            return self._server

    def offer(self, uuid: int, arrays: list, timeout_s: float) -> None:
        """Offer ``arrays`` (on this chip) to one pull under ``uuid``, for ``timeout_s``
        (a pull that started earlier waits for it)."""
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        self._started().await_pull(uuid, arrays, timeout=deadline)

    def address(self) -> str:
        """This chip's transfer server address (started now if need be)."""
        return self._started().address()

    def start(self, pull: Pull) -> list:
        """Start pulling (returns at once): arrays on this chip that fill in as the
        bytes arrive. Wait on them with ``wait``, never with JAX's own blocking calls."""
        import jax

        server = self._started()
        with self._lock:
            conn = self._connections.get(pull.address)
            if conn is None:
                conn = self._connections[pull.address] = server.connect(pull.address)
        specs = self._specs.get(pull.pieces)
        if specs is None:  # a weight sync pulls the same layouts every iteration
            sharding = jax.sharding.make_single_device_sharding(jax.local_devices()[0])
            specs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                     for shape, dtype in pull.pieces]
            if len(self._specs) < 256:
                self._specs[pull.pieces] = specs
        return conn.pull(pull.uuid, specs)

    def forget(self, address: str) -> None:
        """Drop the connection to a server whose chip is gone (a new one reconnects)."""
        with self._lock:
            self._connections.pop(address, None)


def wait(arrays: list, timeout_s: float, what: str,
         stopped: Callable[[], BaseException | None] = lambda: None) -> None:
    """Wait until pulled ``arrays`` have arrived. Raises ``ConnectionError`` with JAX's
    reason if the source went away, ``PullFailed`` with it if the pull failed for
    another reason, ``TimeoutError`` naming ``what`` after
    ``timeout_s`` (its offer expired, or its chip froze). ``stopped()`` returning an
    exception ends the wait with it: the controller lost the source slice (a host
    gone without closing its connections, as a VM does), or the source could not
    offer (its buffer failed)."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0005
    while not all(a.is_ready() for a in arrays):
        error = stopped()
        if error is not None:
            raise error
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not arrive within {timeout_s:g} s "
                               f"($PATHWAYS_RAY_STREAM_TIMEOUT_S)")
        time.sleep(pause)
        pause = min(2 * pause, 0.002)
    try:
        for a in arrays:
            a.block_until_ready()
    except Exception as e:  # noqa: BLE001 - JaxRuntimeError
        text = str(e)
        if any(sign in text.lower() for sign in _GONE):
            raise ConnectionError(f"{what}: {text}") from None
        raise PullFailed(f"{what}: {text}") from None
