"""Training input read on the TPU hosts by sidecars, a few steps ahead.

``HostFeed`` tells ``DataParallelTrainer`` how to make its input where it is used:
``cls(host, *args, **kwargs)`` is built once on every host of each slice, and
``obj.batch(host, step, micro)`` returns that host's block (``host.box``) of
micro-batch ``micro`` of step ``step`` (``micro`` counts every micro-batch of the
step: starting slices x the trainer's ``microbatches``). Input that is a pure function of
``(step, micro)`` (an index into the data, as Grain and tf.data's deterministic
modes do) is what makes elastic training exact: a survivor reads a lost
slice's share, and a rerun after a restore reads the same rows again.

``Prefetcher`` is the sidecar object that wraps ``cls``: each call returns the
block asked for and starts reading the next ``ahead`` steps of the same
micro-batch in a background thread, so a step finds its input ready.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HostFeed", "Prefetcher"]


@dataclass(frozen=True)
class HostFeed:
    """Input made on the hosts (see the module doc). ``shape`` and ``dtype`` are one
    micro-batch's (the global batch over the starting slices and ``microbatches``);
    ``prefetch`` is how many steps ahead each host reads."""

    cls: type
    shape: tuple[int, ...]
    dtype: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    prefetch: int = 2

    def __post_init__(self) -> None:
        if not callable(getattr(self.cls, "batch", None)):
            raise TypeError(f"HostFeed(cls={self.cls!r}): the class needs a method "
                            f"batch(self, host, step, micro) returning host.box of a micro-batch")
        if not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch!r} must be a whole number of steps >= 0")


class Prefetcher:
    """On one host: ``cls``'s batches, read ``ahead`` steps before they are asked for."""

    def __init__(self, host, cls: type, args: tuple, kwargs: dict, ahead: int):
        self.inner = cls(host, *args, **kwargs)
        self.ahead = ahead
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pathways-ray-prefetch")
        self._ready: dict[tuple[int, int], Future] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def _start(self, host, step: int, micro: int) -> Future:
        key = (step, micro)
        fut = self._ready.get(key)
        if fut is None:
            fut = self._ready[key] = self._pool.submit(self.inner.batch, host, step, micro)
        return fut

    def get(self, host, step: int, micro: int):
        with self._lock:
            fut = self._ready.get((step, micro))
            if fut is not None and fut.done():
                self.hits += 1
            else:
                self.misses += 1
            fut = self._start(host, step, micro)
            for k in range(1, self.ahead + 1):
                self._start(host, step + k, micro)
            for key in [k for k in self._ready if k[0] < step]:  # steps gone by
                self._ready.pop(key).cancel()
            self._ready.pop((step, micro))
        return fut.result()

    def group(self, host, step: int, group: int, k: int):
        """Micro-batches ``group * k`` .. ``group * k + k - 1`` of ``step``, stacked on a
        new leading axis (a trainer with ``microbatches=k``); each is read as ``get``
        reads one, with this host's block of one micro-batch as its box."""
        import dataclasses

        import numpy as np

        one = dataclasses.replace(host, boxes=(host.box[1:],))
        return np.stack([self.get(one, step, group * k + j) for j in range(k)])

    def stats(self, host) -> dict:
        return {"hits": self.hits, "misses": self.misses}

    def close(self) -> dict:
        self._pool.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()
        return {"hits": self.hits, "misses": self.misses}
